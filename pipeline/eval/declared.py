"""The evaluators' machinery (the types themselves are the modules of pipeline/eval/evaluators/, which
re-exports what a type or a caller needs from here): :class:`Evaluator`, the base of every type, and
:class:`Context`, what each is built with; the registry (:func:`type_of`: a module of that package or
``package.module:Class``); :func:`declare`, each entry's type and options checked before any data is
read; the old keys as entries (:func:`run_entries`, :func:`eval_entries`, :func:`flag_entries`);
:func:`run_all` and :func:`score_model`. What an entry says: pipeline/eval/evaluators/__init__.py.
"""

from __future__ import annotations

import importlib
import itertools
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import create_model

from pipeline.config import ConfigError, DataCfg, EvalEntry, Section, build, fewshot_sets
from pipeline.data import check_splits, source_for
from pipeline.eval.task import Task

TYPES = "pipeline.eval.evaluators"  # the package whose modules are the types (by name, not imported here)
TYPES_DIR = Path(__file__).resolve().parent / "evaluators"

__all__ = ["Context", "Declared", "Evaluator", "NoOptions", "Results", "check_data", "declare", "eval_entries",
           "flag_entries", "prelogits", "run_all", "run_entries", "score_model", "type_of"]


class NoOptions(Section):
    """A type without options of its own."""


@dataclass
class Context:
    """What evaluators are built with, the same in a run and in `vitp eval`: the run's ``data``
    section (its path is an entry's default data), the run's ``task`` (its dataset's kind and loss),
    the eval transform (``img_size``, ``batch``), where the model runs (``device``; ``dtype``: its
    input; ``autocast``) and the ranks. ``report``: also write the full report (per-class tables,
    the confusion matrix) into ``out_dir`` (`vitp eval`, a fine-tune's final evaluation).
    ``cache_bytes``: what is left of the budget for decoded images kept between runs (an evaluator
    that keeps some takes its share off it)."""

    data: DataCfg
    task: Task
    img_size: int
    batch: int
    device: torch.device
    rank: int
    world: int
    dtype: torch.dtype = torch.float32
    autocast: torch.dtype | None = None
    report: bool = False
    out_dir: Path | None = None
    cache_bytes: int = 1 << 30  # decoded images evaluators may keep between runs, all together, per rank

    def data_of(self, entry: EvalEntry) -> DataCfg:
        """The data section an entry reads: the run's, at the entry's address when it has one."""
        return self.data if not entry.data else self.data.model_copy(update={"path": entry.data})

    def task_of(self, entry: EvalEntry, info) -> Task:
        """The run's task on its own data; another dataset's kind (with the run's loss) elsewhere."""
        return self.task if not entry.data or entry.data == self.data.path else Task.of(info, self.task.loss)


class Evaluator:
    """The base of every type; see the module docstring."""

    splits: tuple[str, ...] = ()
    after_checkpoint = False
    Options: type[Section] = NoOptions

    def __init__(self, entry: EvalEntry, options: Section, ctx: Context):
        self.entry, self.options, self.ctx = entry, options, ctx
        self.name = entry.name
        self.prefix = entry.prefix if entry.prefix is not None else self.default_prefix(entry.name)
        self.data = ctx.data_of(entry)
        self.source = source_for(self.data.path)
        self.info = self.source.read_info()
        self.task = ctx.task_of(entry, self.info)
        self.artifacts: list[Path] = []  # what the last run wrote (rank 0, with ctx.report)
        self.text: str | None = None  # the last run's result in words, when the type has more to say

    @staticmethod
    def default_prefix(name: str) -> str:
        return f"{name}/"

    def loader(self, split: str, **kw):
        """This rank's share of ``split`` of the entry's data, through its DataSource."""
        c = self.ctx
        return self.source.eval_loader(self.data, img_size=c.img_size, batch=c.batch, rank=c.rank, world_size=c.world,
                                       split=split, **kw)

    def run(self, model, step: int) -> dict:
        """Collective: evaluate ``model`` (a module or the training engine) -> metrics (rank 0)."""
        raise NotImplementedError


@torch.no_grad()
def prelogits(model, batches, ctx: Context, normalize, on_batch=lambda b: None,
              max_images: int | None = None) -> list[torch.Tensor]:
    """Pre-logit features (the head's input, read by a hook: ``model`` may be the training engine,
    whose forward ZeRO-3 needs) of ``batches`` of (uint8 images, labels, valid, *more [B]) ->
    [features [n, D] float32, labels [n], *more [n]] on the host, valid rows only. The features stay
    on the device until the last batch: one copy back, no sync per batch. ``max_images``: only this
    rank's first that many; it reads the ``ctx.batch``-sized batches that hold them, as many on every
    rank (the cap is the same everywhere and the ranks' batch counts are equal)."""
    head = getattr(getattr(model, "module", model), "head", None)
    got: list[torch.Tensor] = []
    hook = head.register_forward_pre_hook(lambda _m, a: got.append(a[0])) if head is not None else None
    feats, cols = [], []
    if max_images is not None:
        batches = itertools.islice(batches, min(len(batches), -(-max_images // ctx.batch)))
    try:
        for b, (x, *rest) in enumerate(batches):
            x = normalize(x.to(ctx.device, non_blocking=True)).to(ctx.dtype)
            on = ctx.autocast is not None
            with torch.autocast(ctx.device.type, dtype=ctx.autocast or torch.bfloat16, enabled=on):
                out = model(x)
            feats.append((got.pop() if hook is not None else out).float())
            cols.append(rest)
            on_batch(b)
    finally:
        if hook is not None:
            hook.remove()
    if not feats:
        return [torch.zeros(0, 0), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)]
    labels, valid, *more = (torch.cat(c) for c in zip(*cols))
    return [t[:max_images] for t in (torch.cat(feats).cpu()[valid], labels[valid], *(m[valid] for m in more))]


@dataclass
class Declared:
    """An entry with its type and its parsed options; ``key`` names it in errors: ``evals[i]``, or
    the shorthand key it came from (``data.val_split``, ``eval.fewshot_data``, ``eval.top1``...)."""

    entry: EvalEntry
    cls: type[Evaluator]
    options: Section
    key: str

    def build(self, ctx: Context) -> Evaluator:
        return self.cls(self.entry, self.options, ctx)

    def split_key(self, split_field: str) -> str:
        return f"{self.key}.{split_field}" if self.key.startswith("evals[") else self.key


def known_types() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules([str(TYPES_DIR)]) if not m.name.startswith("_"))


def type_of(spec: str, key: str = "type") -> type[Evaluator]:
    """The class of a type: a module of this package (``fewshot``) or ``package.module:Class``."""
    hint = f"(known: {', '.join(known_types())}; or package.module:Class)"
    if ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"{key}: cannot load evaluator {spec!r}: {type(e).__name__}: {e}") from None
    elif re.fullmatch(r"[a-z][a-z0-9_]*", spec) and spec in known_types():
        cls = getattr(importlib.import_module(f"{TYPES}.{spec}"), "EVALUATOR", None)
    else:
        raise ConfigError(f"{key}: unknown evaluator type {spec!r} {hint}")
    if not (isinstance(cls, type) and issubclass(cls, Evaluator)):
        raise ConfigError(f"{key}: {spec!r} is not an evaluator (a subclass of pipeline.eval.evaluators.Evaluator)")
    return cls


def declare(entries: list[tuple[str, EvalEntry]]) -> list[Declared]:
    """Each (key, entry)'s type, the split keys it needs and its options: one line naming the key on
    the first mistake (no data is read)."""
    out = []
    for key, e in entries:
        cls = type_of(e.type, f"{key}.type")
        for s in cls.splits:
            if not getattr(e, s):
                raise ConfigError(f"{key}.{s}: missing; a {e.type} evaluator reads the split it names")
        try:
            options = build_options(cls.Options, e.options)
        except ConfigError as err:
            raise ConfigError(f"{key}.{err}") from None
        out.append(Declared(e, cls, options, key))
    return out


def build_options(schema: type[Section], values: dict) -> Section:
    """``values`` as the type's ``Options`` section; the first mistake worded as the config loader
    words it ("shots: expected a list, got 5")."""
    try:
        return build(_wrap(schema), {"o": values}).o
    except ConfigError as e:
        line = str(e).removeprefix("o.").replace("'o.", "'").replace("(valid: )", "(the type has no options)")
        raise ConfigError(line) from None


_WRAPPED: dict[type, type] = {}


def _wrap(schema: type[Section]) -> type[Section]:
    """A root holding ``schema`` as its section ``o``."""
    if schema not in _WRAPPED:
        _WRAPPED[schema] = create_model(f"Options{schema.__name__}", __base__=Section, o=(schema, ...))
    return _WRAPPED[schema]


def check_data(declared: list[Declared], path: str, minival_from: str | None = None) -> None:
    """Every split each entry reads is in its dataset (``path`` unless the entry names one; split
    ``minival`` is held out of ``minival_from``, :func:`pipeline.data.minival_source` of the run's data
    section): one line naming the key, the file and the splits it has. Reads only the datasets'
    descriptions."""
    for d in declared:
        for s in d.cls.splits:
            check_splits(d.entry.data or path, {d.split_key(s): getattr(d.entry, s)}, minival_from=minival_from)


def run_entries(cfg) -> list[tuple[str, EvalEntry]]:
    """A training run's evaluators, each with the key that declared it: the shorthand ones
    (validation on data.val_split when it is set, few-shot on each eval.fewshot_data set), then
    ``evals:`` in declared order; an entry of ``evals:`` named like a shorthand one replaces it."""
    t, e = cfg.train, cfg.eval
    short = []
    if cfg.data.val_split:
        short.append(("data.val_split", EvalEntry(name="val", type="classify", split=cfg.data.val_split,
                                                  every=t.eval_every, prefix="val_")))
    for name, path in fewshot_sets(e.fewshot_data):
        short.append(("eval.fewshot_data", EvalEntry(
            name=name, type="fewshot", data=path, train_split="train", test_split="test", every=t.fewshot_every,
            prefix="fewshot/", shots=list(e.fewshot_shots), seeds=e.fewshot_seeds, l2=e.fewshot_l2)))
    declared = {x.name for x in cfg.evals}
    return [x for x in short if x[1].name not in declared] + [(f"evals[{i}]", x) for i, x in enumerate(cfg.evals)]


def eval_entries(cfg) -> list[tuple[str, EvalEntry]]:
    """`vitp eval`'s evaluators: ``evals:`` (``--evals FILE``) when given, else its flags as entries
    (:func:`flag_entries`)."""
    if cfg.evals:
        return [(f"evals[{i}]", x) for i, x in enumerate(cfg.evals)]
    e = cfg.eval
    out = flag_entries(e.split, cfg.data.train_split, top1=e.top1, fewshot=e if e.fewshot else None,
                       linear_probe=e.linear_probe, max_train_images=e.max_train_images)
    if not out:
        raise ConfigError("eval: nothing to do (top1, fewshot and linear_probe are all off, and no evals:)")
    return out


def flag_entries(split: str, train_split: str, *, top1: bool = True, fewshot=None, linear_probe: bool = False,
                 max_train_images: int | None = None) -> list[tuple[str, EvalEntry]]:
    """`vitp eval`'s flags as entries on ``split``: the head's top-1 (``<split>/top1``...), few-shot
    (``fewshot/<k>shot``; ``fewshot``: the eval section whose fewshot_shots/_seeds/_l2 it takes) and
    the linear probe (``linear_probe/top1``), the last two fitted on ``train_split``."""
    out = []
    if top1:
        out.append(("eval.split", EvalEntry(name=split, type="classify", split=split)))
    if fewshot is not None:
        out.append(("eval.fewshot", EvalEntry(name="fewshot", type="fewshot", train_split=train_split, test_split=split,
                                              prefix="", shots=list(fewshot.fewshot_shots), seeds=fewshot.fewshot_seeds,
                                              l2=fewshot.fewshot_l2)))
    if linear_probe:
        out.append(("eval.linear_probe", EvalEntry(name="linear_probe", type="linear_probe", train_split=train_split,
                                                   test_split=split, max_train_images=max_train_images)))
    return out


@dataclass
class Results:
    """What a list of evaluators returned in one pass: metrics (rank 0), artifacts, texts."""

    metrics: dict = field(default_factory=dict)
    artifacts: list[Path] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


def run_all(evaluators: list[Evaluator], model, step: int) -> Results:
    """Collective: every evaluator once, in order."""
    out = Results()
    for ev in evaluators:
        out.metrics.update(ev.run(model, step))
        out.artifacts += ev.artifacts
        if ev.text:
            out.texts.append(ev.text)
    return out


def score_model(model, data_cfg, *, split: str = "val", batch: int = 64, device="cpu", classify_split: bool = True,
                fewshot_cfg=None, linear_probe: bool = False, out_dir=None, autocast: torch.dtype | None = None,
                train_split: str = "train", max_train_images: int | None = None, loss: str | None = None) -> dict:
    """`vitp eval`'s flags' evaluators on ``model`` over the dataset of ``data_cfg`` (a library
    shorthand): flat metrics, plus "artifacts" (paths, written into ``out_dir`` by rank 0) and
    "fewshot_text". Collective when distributed."""
    from pipeline.distributed import rank_world

    rank, world = rank_world()
    img = model.img_size[0] if isinstance(model.img_size, tuple) else int(model.img_size)
    entries = flag_entries(split, train_split, top1=classify_split, fewshot=fewshot_cfg, linear_probe=linear_probe,
                           max_train_images=max_train_images)
    info = source_for(data_cfg.path).read_info()
    ctx = Context(data_cfg, Task.of(info, loss), img_size=img, batch=batch, device=torch.device(device), rank=rank,
                  world=world, autocast=autocast, report=out_dir is not None, out_dir=out_dir)
    res = run_all([d.build(ctx) for d in declare(entries)], model, 0)
    return {**res.metrics, "artifacts": [str(p) for p in res.artifacts], "fewshot_text": "\n".join(res.texts) or None}
