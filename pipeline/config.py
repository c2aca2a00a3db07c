"""Typed, strict configuration: one source of truth for defaults and checks.

A config is a YAML file (``yaml.safe_load`` only) merged with dotted command-line overrides
(``optim.lr=3e-4``), validated against the dataclasses below. Every mistake raises
:class:`ConfigError` with one line naming the key and the reason, before anything starts.

Recipes may name a parent with ``base: other.yaml`` (path relative to the file); the child's keys
win, section by section.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pipeline.secrets import has_secret, redact, restore


class ConfigError(ValueError):
    """A configuration mistake; the message is one line naming the key."""


def _range(lo=None, hi=None, *, lo_open=False, positive=False):
    """Field metadata: numeric range (``lo``/``hi`` inclusive unless ``lo_open``)."""
    if positive:
        lo, lo_open = 0, True
    return {"lo": lo, "hi": hi, "lo_open": lo_open}


def _f(default, **check):
    """A field with a default and optional range metadata."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=_range(**check))
    return field(default=default, metadata=_range(**check))


# --------------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------------
@dataclass
class RunCfg:
    dir: str = "runs/default"  # checkpoints, resolved config, metrics.jsonl, logs
    name: str = ""  # MLflow run name; defaults to the run dir's name
    fresh: bool = False  # start over even if run.dir holds a checkpoint (explicit, never implied)


@dataclass
class ModelCfg:
    name: str | None = None  # a variant such as "vit_b16"; explicit dims below override it
    width: int | None = _f(None, lo=1)
    depth: int | None = _f(None, lo=1)
    heads: int | None = _f(None, lo=1)
    mlp_dim: int | None = _f(None, lo=1)
    patch: int | None = _f(None, lo=1)
    img_size: int = _f(224, lo=1)
    num_classes: int = _f(0, lo=0)  # 0: take it from the dataset's classes.json
    pool: Literal["token", "gap"] = "token"
    class_token: bool = True
    representation_size: int | None = _f(None, lo=1)  # the paper's pre-training tanh layer
    dropout: float = _f(0.0, lo=0.0, hi=1.0)
    attn_dropout: float = _f(0.0, lo=0.0, hi=1.0)
    drop_path: float = _f(0.0, lo=0.0, hi=1.0)
    grad_checkpointing: bool = False
    patch_drop: float = _f(0.0, lo=0.0)  # fraction of patch tokens dropped per training image (< 1); 0: off


@dataclass
class DataCfg:
    path: str = ""  # a `vitp prep` output folder (holds _info.json)
    train_split: str = "train"
    val_split: str | None = "val"
    workers: int = _f(2, lo=0)
    shuffle_buffer: int = _f(1000, lo=0)
    resampled: bool = False  # sample shards with replacement (pre-training at scale)
    crop_scale: list[float] = _f([0.08, 1.0])
    hflip: bool = True
    randaugment: str | None = None  # timm string, e.g. "rand-m9-mstd0.5"
    mixup: float = _f(0.0, lo=0.0)
    cutmix: float = _f(0.0, lo=0.0)
    label_smoothing: float = _f(0.0, lo=0.0, hi=1.0)
    eval_crop_pct: float = _f(1.0, lo=0.0, hi=1.0, lo_open=True)


@dataclass
class OptimCfg:
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = _f(1e-3, positive=True)
    weight_decay: float = _f(0.1, lo=0.0)
    betas: list[float] = _f([0.9, 0.999])
    eps: float = _f(1e-8, positive=True)
    momentum: float = _f(0.9, lo=0.0, hi=1.0)
    clip_grad: float = _f(1.0, lo=0.0)  # global-norm clipping; 0 disables
    layer_decay: float | None = _f(None, lo=0.0, hi=1.0, lo_open=True)
    ema: float | None = _f(None, lo=0.0, hi=1.0, lo_open=True)


@dataclass
class ScheduleCfg:
    warmup_steps: int = _f(0, lo=0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    end_lr: float = _f(0.0, lo=0.0)


@dataclass
class TrainCfg:
    steps: int = _f(100, lo=1)
    global_batch: int = _f(64, lo=1)
    micro_batch: int = _f(32, lo=1)  # per rank; accumulation = global / (world * micro)
    loss: Literal["softmax", "sigmoid"] = "softmax"
    log_every: int = _f(10, lo=1)
    eval_every: int = _f(0, lo=0)  # 0: only at the end
    fewshot_every: int = _f(0, lo=0)  # few-shot evaluators (eval.fewshot_data); 0: only at the end
    compile: bool | None = None  # torch.compile each block; None: on GPUs, off on CPU (it does not pay there)
    patch_drop_until: int | None = _f(None, lo=0)  # steps after this one see every patch; None: drop to the end


@dataclass
class EngineCfg:
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    zero_stage: int = _f(1, lo=0, hi=3)
    offload_optimizer: bool = False
    offload_params: bool = False
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    dist_timeout_s: int = _f(300, lo=1)  # a rank that never arrives fails after this
    # The rendezvous of a SLURM job: by default the allocation's first node and a port derived from
    # the job id. MASTER_ADDR/MASTER_PORT in the environment are ignored there (sbatch exports the
    # submitting shell's, stale for this allocation): set these to choose.
    master_addr: str = ""
    master_port: int = _f(0, lo=0, hi=65535)  # 0: derived from the job id


@dataclass
class CheckpointCfg:
    every: int = _f(0, lo=0)  # 0: only at the end (and on preemption)
    keep: int = _f(2, lo=1)


@dataclass
class TrackingCfg:
    enabled: bool = True
    uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else a SQLite store under run.dir
    experiment: str = "vitp"
    register_name: str | None = None  # Model Registry name for the final model
    flush_every_s: float = _f(2.0, positive=True)
    # at the end of a run, how long to wait for an unreachable server before spooling what is left
    # (then `vitp sync RUN_DIR` delivers it); a stopped (requeued) job waits at most 10 s
    close_timeout_s: float = _f(120.0, lo=0.0)
    system_metrics: bool = True  # CPU, memory, disk, network, GPU (NVML) as system/... on rank 0
    system_metrics_every_s: float = _f(10.0, positive=True)
    # more places for rank 0's records, besides metrics.jsonl and MLflow: "package.module:Class", a
    # pipeline.tracking.Sink subclass built as Class(run_dir)
    sinks: list[str] = _f([])


@dataclass
class HardwareCfg:
    peak_tflops: float = _f(989.0, positive=True)  # per device, for MFU (H100 SXM bf16 dense)
    device_mem_gb: float = _f(80.0, positive=True)
    intra_node_gbps: float = _f(450.0, positive=True)  # GB/s per GPU (NVLink)
    inter_node_gbps: float = _f(50.0, positive=True)  # GB/s per GPU (InfiniBand 400 Gb/s)
    assumed_mfu: float = _f(0.5, lo=0.0, hi=1.0, lo_open=True)


@dataclass
class ClusterCfg:
    nodes: int = _f(1, lo=1)
    tasks_per_node: int = _f(1, lo=1)  # one task per GPU
    gpus_per_node: int = _f(0, lo=0)
    cpus_per_task: int = _f(1, lo=1)
    mem_gb: float | None = _f(None, positive=True)
    time_min: int = _f(60, lo=1)
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    extra_sbatch: dict[str, str] = _f({})
    job_name: str = "vitp"
    log_dir: str = "runs/jobs"
    signal_delay_s: int = _f(120, lo=0)  # SIGUSR2 this long before the time limit
    max_requeues: int = _f(3, lo=0)  # time-limit requeues (USR2); preemptions are not counted
    max_failures: int = _f(2, lo=0)  # attempts that failed (a rank died or raised) requeued before giving up


@dataclass
class InitCfg:
    from_: str | None = None  # transfer source: checkpoint dir, safetensors, timm .pth, JAX .npz
    posemb_mode: Literal["bicubic", "bilinear"] = "bicubic"
    keep_representation: bool = False


@dataclass
class EvalCfg:
    fewshot_shots: list[int] = _f([1, 5, 10, 25])
    fewshot_seeds: int = _f(3, lo=1)
    fewshot_l2: float = _f(1.0, positive=True)  # ridge regulariser (the paper searches it)
    linear_probe: bool = False
    batch: int = _f(64, lo=1)
    fewshot_data: list[str] = _f([])  # [NAME=]`vitp prep` folders (train + test splits) scored while training
    # the evaluation stage (`vitp eval`, `vitp submit eval`); data.path names the dataset
    checkpoint: str | None = None  # run dir, checkpoint folder or weights file
    split: str = "val"  # the split scored; few-shot and the probe fit on data.train_split
    top1: bool = True  # score the model's own head
    fewshot: bool = False
    variant: str | None = None  # architecture of a weights file that does not say it, e.g. vit_b16
    img_size: int | None = _f(None, lo=1)  # evaluate at this resolution (pos-emb resampled)
    max_train_images: int | None = _f(None, lo=1)  # per rank, for few-shot / probe features
    out: str | None = None  # results.json and artifacts; default: the run dir, else ./eval_<name>


@dataclass
class Config:
    seed: int = 0
    run: RunCfg = field(default_factory=RunCfg)
    model: ModelCfg = field(default_factory=ModelCfg)
    data: DataCfg = field(default_factory=DataCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    schedule: ScheduleCfg = field(default_factory=ScheduleCfg)
    train: TrainCfg = field(default_factory=TrainCfg)
    engine: EngineCfg = field(default_factory=EngineCfg)
    checkpoint: CheckpointCfg = field(default_factory=CheckpointCfg)
    tracking: TrackingCfg = field(default_factory=TrackingCfg)
    hardware: HardwareCfg = field(default_factory=HardwareCfg)
    cluster: ClusterCfg = field(default_factory=ClusterCfg)
    init: InitCfg = field(default_factory=InitCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)

    @property
    def world_size_planned(self) -> int:
        return self.cluster.nodes * self.cluster.tasks_per_node


# Python names that YAML spells differently ("from" is a keyword).
_ALIASES = {"from_": "from"}


def _yaml_name(f: dataclasses.Field) -> str:
    return _ALIASES.get(f.name, f.name)


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------
def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.constructor.ConstructorError as e:
        line = e.problem_mark.line + 1 if e.problem_mark else "?"
        raise ConfigError(f"{path}:{line}: YAML tag not allowed ({e.problem}); plain values only") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is not None:
        parent = _read_yaml((path.parent / str(base)).resolve())
        data = _deep_merge(parent, data)
    return data


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. optim.lr=3e-4")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # a plain string that YAML can't parse, e.g. "a: b"
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = _deep_merge({}, data)
    for item in overrides:
        parts, value = _parse_override(item)
        node = data
        for p in parts[:-1]:
            nxt = node.get(p)
            if not isinstance(nxt, dict):
                nxt = {} if nxt is None else nxt
                node[p] = nxt
            node = nxt
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(parts)}: cannot set a key under a non-section value")
        node[parts[-1]] = value
    return data


RESOURCE_SECTIONS = ("cluster", "hardware")


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple = (),
                *, resources: str | os.PathLike | None = None, world_size: int | None = None) -> Config:
    """YAML recipe [+ a resources file] + dotted overrides → a validated :class:`Config`.

    ``resources``: a file holding only ``cluster:``/``hardware:`` (configs/cluster/*.yaml), merged
    over the recipe and under the overrides.
    ``world_size``: check batch divisibility against it (default: the cluster section's
    nodes × tasks_per_node, or $WORLD_SIZE when set by a launcher).
    """
    data = _read_yaml(Path(path)) if path else {}
    if resources:
        res = _read_yaml(Path(resources))
        extra = sorted(set(res) - set(RESOURCE_SECTIONS))
        if extra:
            raise ConfigError(f"{resources}: {extra[0]}: a resources file holds only cluster: and hardware:")
        data = _deep_merge(data, res)
    data = apply_overrides(data, list(overrides))
    cfg = _build(Config, data, "")
    validate(cfg, world_size=world_size)
    return cfg


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: must be one of {', '.join(map(str, args))}; got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {str(k): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads "3e-4" as a string (YAML 1.1)
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")  # schema bug, not user error


def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a section (mapping), got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {_yaml_name(f): f for f in dataclasses.fields(cls)}
    for k in data:
        if k not in fields:
            close = difflib.get_close_matches(str(k), list(fields), n=1, cutoff=0.6)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f" (valid: {', '.join(fields)})"
            raise ConfigError(f"{prefix}{k}: unknown key{hint}")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            continue
        tp = hints[f.name]
        key = prefix + name
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[name], key + ".")
            continue
        value = _coerce(data[name], tp, key)
        _check_range(value, f.metadata, key)
        kwargs[f.name] = value
    return cls(**kwargs)


def _check_range(value, meta, key):
    if value is None or not meta or isinstance(value, (list, dict, str, bool)):
        return
    lo, hi, lo_open = meta.get("lo"), meta.get("hi"), meta.get("lo_open")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ConfigError(f"{key}: must be {'>' if lo_open else '>='} {lo}; got {value}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key}: must be <= {hi}; got {value}")


def world_size_from_env(cfg: Config) -> int:
    env = os.environ.get("WORLD_SIZE")
    return int(env) if env else cfg.world_size_planned


def validate(cfg: Config, *, world_size: int | None = None) -> None:
    """Cross-field checks that no single field can make."""
    ws = world_size if world_size is not None else world_size_from_env(cfg)
    if ws < 1:
        raise ConfigError(f"world size must be >= 1; got {ws}")
    t = cfg.train
    if t.micro_batch > t.global_batch:
        raise ConfigError(f"train.micro_batch: {t.micro_batch} is larger than train.global_batch {t.global_batch}")
    if t.global_batch % (ws * t.micro_batch):
        raise ConfigError(
            f"train.global_batch: {t.global_batch} is not divisible by world size {ws} x "
            f"train.micro_batch {t.micro_batch}")
    m = cfg.model
    if m.name is None and None in (m.width, m.depth, m.heads, m.mlp_dim, m.patch):
        raise ConfigError("model: give model.name (e.g. vit_b16) or all of width, depth, heads, mlp_dim, patch")
    patch = m.patch if m.patch is not None else _variant_patch(m.name)
    if patch and m.img_size % patch:
        raise ConfigError(f"model.img_size: {m.img_size} is not divisible by the patch size {patch}")
    if m.width and m.heads and m.width % m.heads:
        raise ConfigError(f"model.heads: width {m.width} is not divisible by {m.heads} heads")
    if not m.class_token and m.pool == "token":
        raise ConfigError("model.pool: 'token' pooling needs model.class_token=true (use pool=gap)")
    if m.patch_drop >= 1:
        raise ConfigError(f"model.patch_drop: a fraction of patches in [0, 1) (0 = off); got {m.patch_drop}")
    if len(cfg.data.crop_scale) != 2 or not 0 < cfg.data.crop_scale[0] <= cfg.data.crop_scale[1] <= 1:
        raise ConfigError(f"data.crop_scale: need [lo, hi] with 0 < lo <= hi <= 1; got {cfg.data.crop_scale}")
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ConfigError(f"optim.betas: need two values in [0, 1); got {cfg.optim.betas}")
    e = cfg.engine
    if any(c.isspace() or c in "/@" for c in e.master_addr):  # a host name or an IPv4/IPv6 address
        raise ConfigError(f"engine.master_addr: expected a host name or address, got {e.master_addr!r}")
    if 0 < e.master_port < 1024:
        raise ConfigError(f"engine.master_port: must be 0 (derived) or 1024-65535; got {e.master_port}")
    if e.offload_params and e.zero_stage != 3:
        raise ConfigError(f"engine.offload_params: needs engine.zero_stage=3; got {e.zero_stage}")
    if e.offload_optimizer and e.zero_stage == 0:
        raise ConfigError("engine.offload_optimizer: needs engine.zero_stage >= 1")
    if cfg.optim.ema is not None and e.zero_stage == 3:
        raise ConfigError("optim.ema: needs engine.zero_stage <= 2 (ZeRO-3 partitions the parameters)")
    if any(s < 1 for s in cfg.eval.fewshot_shots):
        raise ConfigError(f"eval.fewshot_shots: shots must be >= 1; got {cfg.eval.fewshot_shots}")
    names = [n for n, _ in fewshot_sets(cfg.eval.fewshot_data)]
    if not all(re.fullmatch(r"[\w.-]+", n) for n in names) or len(set(names)) != len(names):
        raise ConfigError(f"eval.fewshot_data: each set needs its own name of [A-Za-z0-9_.-] (metrics are "
                          f"fewshot/<name>/...: the folder's, or NAME=PATH); got {cfg.eval.fewshot_data}")


def fewshot_sets(entries: list[str]) -> list[tuple[str, str]]:
    """eval.fewshot_data entries -> (name, folder): ``NAME=PATH``, or the folder's own name."""
    return [tuple(e.split("=", 1)) if "=" in e else (Path(e.rstrip("/")).name, e) for e in entries]


def _variant_patch(name: str | None) -> int | None:
    """Patch size encoded in a variant name ("vit_b16" → 16, "vit_h14" → 14)."""
    if not name:
        return None
    digits = "".join(ch for ch in name.split("_")[-1] if ch.isdigit())
    return int(digits) if digits else None


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------
def to_dict(cfg, *, secrets: bool = False) -> dict:
    """Config → plain nested dict, with YAML key names. Every string is redacted (pipeline/secrets.py:
    URI userinfo and token-like query values masked) unless ``secrets=True``: what this returns gets
    written (config.yaml, manifests, MLflow params, the job's pickle), the secret stays in memory."""
    if dataclasses.is_dataclass(cfg):
        return {_yaml_name(f): to_dict(getattr(cfg, f.name), secrets=secrets) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, list):
        return [to_dict(v, secrets=secrets) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v, secrets=secrets) for k, v in cfg.items()}
    return cfg if secrets else redact(cfg)


def secret_values(cfg) -> list[str]:
    """The config's secret-bearing strings, in clear (for pipeline.secrets.remember)."""
    def walk(v):
        if isinstance(v, dict):
            return [x for w in v.values() for x in walk(w)]
        if isinstance(v, list):
            return [x for w in v for x in walk(w)]
        return [v] if isinstance(v, str) and has_secret(v) else []

    return walk(to_dict(cfg, secrets=True))


def _restored(data):
    if isinstance(data, dict):
        return {k: _restored(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_restored(v) for v in data]
    return restore(data)


def from_dict(data: dict, *, world_size: int | None = None) -> Config:
    """A config from :func:`to_dict`'s output; redacted values get their secret back where this
    process knows it (pipeline.secrets.restore)."""
    cfg = _build(Config, _restored(data), "")
    validate(cfg, world_size=world_size)
    return cfg


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def flatten(cfg: Config) -> dict[str, Any]:
    """Dotted keys → values, e.g. for MLflow params."""
    out: dict[str, Any] = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict) and v:
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk(to_dict(cfg), "")
    return out


def write_resolved(cfg: Config, run_dir: str | os.PathLike) -> Path:
    """Write ``config.yaml`` (the resolved config) into ``run_dir``, atomically."""
    from pipeline.files import atomic_write

    return atomic_write(Path(run_dir) / "config.yaml", to_yaml(cfg))
