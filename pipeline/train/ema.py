"""Exponential moving average of the weights (``optim.ema``: the decay, e.g. 0.9999).

The average is kept in fp32 on every rank (ZeRO 0-2 hold full parameters on each rank; ZeRO-3
partitions them, so the config refuses EMA there) and updated after every optimizer step:
``ema = decay * ema + (1 - decay) * param``. It is saved with the checkpoint (so a resumed run
continues it exactly) and becomes the run's exported ``model.safetensors``.
"""

from __future__ import annotations

import torch


class Ema:
    def __init__(self, module: torch.nn.Module, decay: float):
        self.decay = decay
        self.names = [n for n, p in module.named_parameters()]
        self.values = [p.detach().float().clone() for p in module.parameters()]

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        params = [p.detach().float() for p in module.parameters()]
        torch._foreach_lerp_(self.values, params, 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.values))

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in sd]
        if missing:
            raise ValueError(f"checkpoint EMA lacks {missing[:3]}; was it saved by another model?")
        self.values = [sd[n].float().clone() for n in self.names]
