"""Compiled blocks under activation checkpointing (model.grad_checkpointing with train.compile, which
`vitp plan` may recommend at ZeRO-1/2): the model wraps each compiled block in non-reentrant
checkpointing; the compiled graph's saved tensors pass through checkpoint's hooks, so the block keeps
nothing for backward but its input and runs its compiled graph again there."""

from __future__ import annotations

import torch
from torch._dynamo.backends.registry import lookup_backend

from pipeline.config import load_config
from pipeline.model import build_vit
from pipeline.train import compiled

KW = dict(width=32, depth=2, heads=2, mlp_dim=64, patch=4, img_size=16, num_classes=5)


class _Runs:
    """aot_eager (AOTAutograd's forward/backward split, as inductor has, without inductor's compile
    time), counting each run of a compiled forward graph."""

    def __init__(self):
        self.runs = 0

    def __call__(self, gm, example_inputs):
        graph = lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args):
            self.runs += 1
            return graph(*args)
        return run


def _saved_bytes(model, x) -> int:
    """Bytes autograd keeps for backward outside checkpointed regions, over one forward and backward."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.logsumexp(-1).sum().backward()
    return total


def test_compiled_blocks_under_checkpointing_keep_only_their_inputs_and_the_numbers():
    torch.manual_seed(0)
    plain, eager_ckpt, compiled_ckpt = build_vit(**KW), build_vit(**KW), build_vit(**KW)
    for m in (eager_ckpt, compiled_ckpt):
        m.load_state_dict(plain.state_dict())
        m.set_grad_checkpointing(True)
    runs = _Runs()
    torch._dynamo.reset()
    try:
        compiled.compile_blocks(compiled_ckpt, load_config("configs/pretrain/tiny_cpu.yaml", ["train.compile=true"]),
                                backend=runs)
        x = torch.randn(3, 3, 16, 16)
        kept = {name: _saved_bytes(m, x) for name, m in
                (("plain", plain), ("eager", eager_ckpt), ("compiled", compiled_ckpt))}
        assert runs.runs == 2 * 2  # each block's compiled graph: in forward, and again in backward
        assert kept["compiled"] == kept["eager"] < kept["plain"] / 3, kept
        for a, b in zip(plain.parameters(), compiled_ckpt.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6)
    finally:
        torch._dynamo.reset()
