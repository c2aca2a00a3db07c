"""Exponential moving average of the weights (``optim.ema``: the decay, e.g. 0.9999).

The average is kept in fp32 on every rank (ZeRO 0-2 hold full parameters on each rank; ZeRO-3
partitions them, so the config refuses EMA there) and updated after every optimizer step:
``ema = decay * ema + (1 - decay) * param``. It is saved with the checkpoint (so a resumed run
continues it exactly) and becomes the run's exported ``model.safetensors``.
"""

from __future__ import annotations

import contextlib

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

    @contextlib.contextmanager
    def applied(self, module: torch.nn.Module):
        """Within the block ``module`` holds the averaged weights (in its own dtype: what an evaluator
        of the exported model sees); after it, its own values again, bit for bit, so training goes on
        as if nothing happened."""
        params = list(module.parameters())
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, v in zip(params, self.values):
                p.copy_(v)
        try:
            yield module
        finally:
            with torch.no_grad():
                for p, v in zip(params, saved):
                    p.copy_(v)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.values))

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in sd]
        if missing:
            raise ValueError(f"checkpoint EMA lacks {missing[:3]}; was it saved by another model?")
        self.values = [sd[n].float().clone() for n in self.names]
