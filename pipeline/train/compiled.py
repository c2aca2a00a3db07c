"""Transformer blocks compiled in place (train.compile): how many variants a run compiles, Dynamo's
limit raised to hold them, and one line when a block runs uncompiled all the same.

Dynamo keeps the graphs it compiles for a function on the function's code object, each behind guards:
every block of every model in the process shares the one cache of ``Block.forward`` (the blocks'
parameters are graph inputs, not guarded by identity, so one graph serves all depth blocks). A call
that no entry's guards accept compiles another entry, until ``torch._dynamo.config.recompile_limit``
(8) entries exist; past it, a call that fits none runs eagerly, said only in a log record.

What one run's blocks see, measured with TORCH_LOGS=recompiles (the tiny recipe on one rank: 2
blocks, validation, few-shot evaluators, patch dropping until step 4; the README's GPU section has
the counts), each a separate entry for each of the two block roles (the last block computes token 0
alone with a class-token head, ``first_token_only`` is guarded):

    training on the kept tokens (model.patch_drop)         [micro_batch, 1 + K, D], grad on
    training on every token                                 [micro_batch, 1 + N, D]: a changed size,
        (no patch dropping, or past train.patch_drop_until)    the entry made dynamic in it
    evaluation (validation, few-shot features, final score) [eval.batch, 1 + N, D], grad off

A batch of one (a rank whose evaluation batches ran out feeds dummies) would be one more entry per
role (Dynamo specialises a size of 1): the dummies are full eval batches (pipeline/eval/loop.py).
:func:`block_variants` is that count; :func:`compile_blocks` raises the limit to what every compiled
model of the process together may make.
"""

from __future__ import annotations

import logging
import re
import threading
import warnings

import torch

_LOGGER = "torch._dynamo.convert_frame"  # where Dynamo says it hit a recompile limit (torch 2.11-2.14)
_HIT = "torch._dynamo hit config."
_process_variants = 0  # entries the compiled blocks of this process may make, summed over its models
_current = threading.local()  # .name: the compiled block being called ("blocks.3"), else None
_warned: set[str] = set()


def block_variants(model: torch.nn.Module, cfg) -> int:
    """Dynamo cache entries a run of ``cfg`` makes for its blocks (see the module docstring): per
    block role, one training entry per token count and one evaluation entry."""
    roles = 2 if getattr(model, "pool", None) == "token" else 1  # the last block's token-0 path
    training = 2 if cfg.model.patch_drop else 1  # kept tokens, then every token
    return roles * (training + 1)


def compile_blocks(model: torch.nn.Module, cfg, **compile_kw) -> int:
    """torch.compile each of ``model.blocks`` in place (``compile_kw``: torch.compile's, e.g. a backend),
    the recompile limit raised to hold this run's variants (on top of any other compiled model's in
    this process); returns how many blocks."""
    global _process_variants
    blocks = list(model.blocks)
    _process_variants += block_variants(model, cfg)
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, _process_variants)
    _warned.clear()  # a fallback is said once per compiled model
    _watch_fallbacks()
    for i, blk in enumerate(blocks):
        blk.compile(**compile_kw)
        blk._compiled_call_impl = _named(f"blocks.{i}", blk._compiled_call_impl)
    return len(blocks)


def _named(name: str, compiled):
    """``compiled``, with ``name`` the block being called while it runs (for :class:`_Fallback`)."""

    def call(*args, **kwargs):
        outer, _current.name = getattr(_current, "name", None), name
        try:
            return compiled(*args, **kwargs)
        finally:
            _current.name = outer

    return call


class _Fallback(logging.Filter):
    """Dynamo's multi-line record of a spent recompile limit, met inside a compiled block, becomes one
    warning naming the block (once per function); records from anything else pass unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = getattr(_current, "name", None)
        if name is None or not str(record.msg).startswith(_HIT):
            return True
        limit, value, function, reason = (list(record.args or ()) + [None] * 4)[:4]
        if function not in _warned:
            _warned.add(function)
            why = _guard(reason)
            # warn_explicit at a place with no source line: the warning prints as one line
            warnings.warn_explicit(
                f"{name} runs uncompiled: Dynamo's {limit} ({value}) is spent on {function}; its calls that "
                f"fit no compiled variant now run eagerly (last recompile: {why}); raise "
                f"torch._dynamo.config.{limit}", RuntimeWarning, "train.compile", 0)
        return False


def _guard(reason) -> str:
    """The failed guard of Dynamo's recompile reason, '0/0: first_token_only == False   # if ...'."""
    first = (str(reason or "").strip().splitlines() or [""])[0]
    return " ".join(re.sub(r"^\d+/\d+: ", "", first).split("#")[0].split()) or "unknown"


_FILTER = _Fallback()


def _watch_fallbacks() -> None:
    logger = logging.getLogger(_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
