"""Exponential moving average of the weights (``optim.ema``: the decay, e.g. 0.9999).

The average is kept in fp32 on its parameters' device, on every rank (ZeRO 0-2 hold full parameters
on each rank; ZeRO-3 partitions them, so the config refuses EMA there), and updated after every
optimizer step: ``ema = decay * ema + (1 - decay) * param``. Being equal on every rank it is saved
once per checkpoint (``checkpoint_scope = "shared"``: rank 0 writes it, every rank loads it), so a
checkpoint does not grow with the rank count; a resumed run continues it exactly, on the device it
trains on. It becomes the run's exported ``model.safetensors``.

The update allocates nothing: fp32 parameters are averaged in directly; lower-precision ones (bf16
under DeepSpeed) are widened group by group into one scratch buffer made at construction, at most
``SCRATCH_BYTES`` or the largest parameter, whichever is larger.
"""

from __future__ import annotations

import contextlib

import torch

SCRATCH_BYTES = 64 << 20  # bounds the widening buffer: ~20 groups for ViT-L's 1.2 GB of fp32


def _groups(sizes: list[int], limit: int) -> list[list[int]]:
    """Runs of consecutive indices of ``sizes`` that sum to at most ``limit`` (a larger size is a run
    of its own)."""
    groups, total = [], 0
    for i, n in enumerate(sizes):
        if not groups or total + n > limit:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


class Ema:
    checkpoint_scope = "shared"  # identical on every rank: saved once, not once per rank

    def __init__(self, module: torch.nn.Module, decay: float, *, scratch_bytes: int = SCRATCH_BYTES):
        self.decay = decay
        named = list(module.named_parameters())
        self.names = [n for n, _ in named]
        params = [p.detach() for _, p in named]
        self.values = [p.float().clone() for p in params]  # same device as each parameter
        self.wide = [i for i, p in enumerate(params) if p.dtype == torch.float32]
        narrow = [i for i, p in enumerate(params) if p.dtype != torch.float32]
        self.groups = [[narrow[j] for j in g] for g in _groups([params[i].numel() for i in narrow], scratch_bytes // 4)]
        self._views: list[list[torch.Tensor]] = []
        if narrow:
            scratch = torch.empty(max(sum(params[i].numel() for i in g) for g in self.groups),
                                  dtype=torch.float32, device=params[narrow[0]].device)
            for g in self.groups:  # each group's parameters, widened, side by side in the scratch
                offsets = [0]
                for i in g:
                    offsets.append(offsets[-1] + params[i].numel())
                self._views.append([scratch[a:b].view(params[i].shape) for i, a, b in zip(g, offsets, offsets[1:])])

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        params = [p.detach() for p in module.parameters()]
        w = 1.0 - self.decay
        if self.wide:
            torch._foreach_lerp_([self.values[i] for i in self.wide], [params[i] for i in self.wide], w)
        for g, views in zip(self.groups, self._views):
            torch._foreach_copy_(views, [params[i] for i in g])  # bf16 -> fp32, exact
            torch._foreach_lerp_([self.values[i] for i in g], views, w)

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

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copies ``sd`` (read onto the CPU) into the averages in place: they stay on the parameters'
        device, in fp32, bit for bit what was saved."""
        missing = [n for n in self.names if n not in sd]
        if missing:
            raise ValueError(f"checkpoint EMA lacks {missing[:3]}; was it saved by another model?")
        for n, v in zip(self.names, self.values):
            if tuple(sd[n].shape) != tuple(v.shape):
                raise ValueError(f"checkpoint EMA {n!r} has shape {tuple(sd[n].shape)}, the model {tuple(v.shape)}")
        for n, v in zip(self.names, self.values):
            v.copy_(sd[n])
