"""The config schema: each section a pydantic model that checks its fields (YAML's types as they are,
ranges) and its own combinations; each stage's root (pipeline/config/stages.py's ``Config`` and
``EvalConfig``, pipeline/config/prep.py's ``PrepConfig``) holds the sections that stage reads and
checks what spans them (``validate``).
A refused value raises a pydantic ValidationError whose first error pipeline/config/loading.py turns
into the one :class:`ConfigError` line naming the key.
"""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from pipeline.errors import Classified


class ConfigError(Classified, ValueError):
    """A configuration mistake; the message is one line naming the key."""

    retry = False


# --------------------------------------------------------------------------------------------------
# Field types: YAML's values, taken as they are (no "3" for 3, no 1 for true)
# --------------------------------------------------------------------------------------------------
def _refuse(what: str, value: Any):
    return PydanticCustomError("vitp_type", "expected {what}, got {got}", {"what": what, "got": repr(value)})


def _int(v):
    if isinstance(v, bool) or not isinstance(v, int):
        raise _refuse("an integer", v)
    return v


def _float(v):
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str):  # PyYAML reads "3e-4" as a string (YAML 1.1)
        try:
            return float(v)
        except ValueError:
            pass
    raise _refuse("a number", v)


def _bool(v):
    if not isinstance(v, bool):
        raise _refuse("true or false", v)
    return v


def _str(v):
    if isinstance(v, (str, int, float)) and not isinstance(v, bool):
        return str(v)
    raise _refuse("a string", v)


def _list(v):
    if not isinstance(v, (list, tuple)):
        raise _refuse("a list", v)
    return list(v)


def _mapping(v):
    if not isinstance(v, dict):
        raise _refuse("a mapping", v)
    return {str(k): x for k, x in v.items()}


def _zero_stage(v):
    if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 3):
        return v
    raise _refuse("0, 1, 2, 3 or auto", v)


Int = Annotated[int, BeforeValidator(_int)]
# "auto": `vitp plan`'s recommendation, taken when the run is submitted (pipeline/plan/recommend.py)
ZeroStage = Annotated[int | str, BeforeValidator(_zero_stage)]
Float = Annotated[float, BeforeValidator(_float)]
Bool = Annotated[bool, BeforeValidator(_bool)]
Str = Annotated[str, BeforeValidator(_str)]


def one_of(*choices: str):
    """A string field that takes one of ``choices``."""
    def check(v):
        if v not in choices:
            raise PydanticCustomError("vitp_choice", "must be one of {choices}; got {got}",
                                      {"choices": ", ".join(choices), "got": repr(v)})
        return v

    return Annotated[Literal[choices], BeforeValidator(check)]


def List(item):  # noqa: N802 (a type)
    return Annotated[list[item], BeforeValidator(_list)]


def problem(message: str) -> PydanticCustomError:
    """A combination a validator refuses; ``message`` already names the key."""
    return PydanticCustomError("vitp_check", "{message}", {"message": message})


class Section(BaseModel):
    """A config section: unknown keys refused, fields addressed by their YAML names."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------
class RunCfg(Section):
    dir: Str = "runs/default"  # checkpoints, resolved config, metrics.jsonl, logs
    name: Str = ""  # MLflow run name; defaults to the run dir's name
    fresh: Bool = False  # start over even if run.dir holds a checkpoint (explicit, never implied)


def _variant_patch(name: str | None) -> int | None:
    """Patch size encoded in a variant name ("vit_b16" → 16, "vit_h14" → 14)."""
    if not name:
        return None
    digits = "".join(ch for ch in name.split("_")[-1] if ch.isdigit())
    return int(digits) if digits else None


class ModelCfg(Section):
    name: Str | None = None  # a variant such as "vit_b16"; explicit dims below override it
    width: Int | None = Field(None, ge=1)
    depth: Int | None = Field(None, ge=1)
    heads: Int | None = Field(None, ge=1)
    mlp_dim: Int | None = Field(None, ge=1)
    patch: Int | None = Field(None, ge=1)
    img_size: Int = Field(224, ge=1)
    num_classes: Int = Field(0, ge=0)  # 0: take it from the dataset's classes.json
    pool: one_of("token", "gap") = "token"
    class_token: Bool = True
    representation_size: Int | None = Field(None, ge=1)  # the paper's pre-training tanh layer
    dropout: Float = Field(0.0, ge=0.0, le=1.0)
    attn_dropout: Float = Field(0.0, ge=0.0, le=1.0)
    drop_path: Float = Field(0.0, ge=0.0, le=1.0)
    grad_checkpointing: Bool = False
    patch_drop: Float = Field(0.0, ge=0.0)  # fraction of patch tokens dropped per training image (< 1); 0: off

    @model_validator(mode="after")
    def _shape(self):
        if self.name is None and None in (self.width, self.depth, self.heads, self.mlp_dim, self.patch):
            raise problem("model: give model.name (e.g. vit_b16) or all of width, depth, heads, mlp_dim, patch")
        patch = self.patch if self.patch is not None else _variant_patch(self.name)
        if patch and self.img_size % patch:
            raise problem(f"model.img_size: {self.img_size} is not divisible by the patch size {patch}")
        if self.width and self.heads and self.width % self.heads:
            raise problem(f"model.heads: width {self.width} is not divisible by {self.heads} heads")
        if not self.class_token and self.pool == "token":
            raise problem("model.pool: 'token' pooling needs model.class_token=true (use pool=gap)")
        if self.patch_drop >= 1:
            raise problem(f"model.patch_drop: a fraction of patches in [0, 1) (0 = off); got {self.patch_drop}")
        return self


class DataCfg(Section):
    path: Str = ""  # a `vitp prep` output (holds _info.json): a folder, s3://, gs:// or https:// address
    train_split: Str = "train"
    val_split: Str | None = "val"
    workers: Int = Field(2, ge=0)
    shuffle_buffer: Int = Field(1000, ge=0)
    resampled: Bool = False  # sample shards with replacement (pre-training at scale; implies order: rank)
    # the epoch's sample order (pipeline/data/order.py): "global", one order of (seed, epoch, dataset),
    # cut into global batches, so a resume at another world size continues inside the epoch; "rank",
    # each rank and worker reads its own contiguous range (long sequential reads, layout-bound order)
    order: one_of("global", "rank") = "global"
    lanes: Int = Field(64, ge=1)  # global order: places in the dataset each global batch draws from
    crop_scale: List(Float) = Field(default_factory=lambda: [0.08, 1.0])
    hflip: Bool = True
    random_crop: Bool = True  # false: no inception crop, the whole image resized (VTAB counts, distances)
    randaugment: Str | None = None  # timm string, e.g. "rand-m9-mstd0.5"
    mixup: Float = Field(0.0, ge=0.0)
    cutmix: Float = Field(0.0, ge=0.0)
    label_smoothing: Float = Field(0.0, ge=0.0, le=1.0)
    eval_crop_pct: Float = Field(1.0, gt=0.0, le=1.0)
    # remote shards (s3://, gs://, https://): a read that gets no bytes this long is retried; after
    # read_retries failed tries in a row the shard's rest is skipped and counted, or the run stops
    read_timeout_s: Float = Field(60.0, gt=0.0, le=3600.0)
    read_retries: Int = Field(5, ge=0, le=100)
    on_read_error: one_of("skip", "stop") = "skip"
    # minival (pipeline/data/minival.py): a per-class stratified part of data.train_split held out of
    # training and read as split `minival`, chosen by a hash of each sample's key seeded minival_seed;
    # either a fraction of every class (at least one each) or fixed counts (VTAB-1k's 800 + 200)
    minival_fraction: Float = Field(0.0, ge=0.0, lt=1.0)
    minival_seed: Int = 0
    train_limit: Int | None = Field(None, ge=1)  # train on this many (allotted to classes in proportion)
    minival_limit: Int | None = Field(None, ge=0)  # hold out this many as minival (the same hash order)

    @model_validator(mode="after")
    def _crop(self):
        s = self.crop_scale
        if len(s) != 2 or not 0 < s[0] <= s[1] <= 1:
            raise problem(f"data.crop_scale: need [lo, hi] with 0 < lo <= hi <= 1; got {s}")
        return self

    @model_validator(mode="after")
    def _minival(self):
        if self.minival_fraction and (self.train_limit is not None or self.minival_limit is not None):
            raise problem("data.minival_fraction: set it or data.train_limit/data.minival_limit, not both")
        if self.minival_limit and self.train_limit is None:
            raise problem("data.minival_limit: needs data.train_limit (the examples kept to train on)")
        return self


class OptimCfg(Section):
    name: one_of("adamw", "sgd") = "adamw"
    lr: Float = Field(1e-3, gt=0)
    weight_decay: Float = Field(0.1, ge=0.0)
    betas: List(Float) = Field(default_factory=lambda: [0.9, 0.999])
    eps: Float = Field(1e-8, gt=0)
    momentum: Float = Field(0.9, ge=0.0, le=1.0)
    clip_grad: Float = Field(1.0, ge=0.0)  # global-norm clipping; 0 disables
    layer_decay: Float | None = Field(None, gt=0.0, le=1.0)
    ema: Float | None = Field(None, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _betas(self):
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise problem(f"optim.betas: need two values in [0, 1); got {self.betas}")
        return self


class ScheduleCfg(Section):
    warmup_steps: Int = Field(0, ge=0)
    decay: one_of("cosine", "linear", "constant") = "cosine"
    end_lr: Float = Field(0.0, ge=0.0)


class TrainCfg(Section):
    steps: Int = Field(100, ge=1)
    global_batch: Int = Field(64, ge=1)
    micro_batch: Int = Field(32, ge=1)  # per rank; accumulation = global / (world * micro)
    loss: one_of("softmax", "sigmoid") = "softmax"
    log_every: Int = Field(10, ge=1)
    eval_every: Int = Field(0, ge=0)  # 0: only at the end
    fewshot_every: Int = Field(0, ge=0)  # few-shot evaluators (eval.fewshot_data); 0: only at the end
    compile: Bool | None = None  # torch.compile each block; None: on GPUs, off on CPU (it does not pay there)
    patch_drop_until: Int | None = Field(None, ge=0)  # steps after this one see every patch; None: drop to the end

    @model_validator(mode="after")
    def _batch(self):
        if self.micro_batch > self.global_batch:
            raise problem(f"train.micro_batch: {self.micro_batch} is larger than train.global_batch "
                           f"{self.global_batch}")
        return self



# The dtype DeepSpeed reduces gradients over the ranks in, whatever engine.precision is: the generated
# config's `communication_data_type` (pipeline/train/engine.py) and the traffic `vitp plan` counts
# (pipeline/plan/cost.py, memory.py) both read it, so they cannot drift apart.
REDUCE_DTYPE = "fp32"


class EngineCfg(Section):
    precision: one_of("fp32", "bf16", "fp16") = "fp32"
    zero_stage: ZeroStage = 1  # 0-3, or "auto": the stage `vitp plan` recommends, chosen at submission
    offload_optimizer: Bool = False
    offload_params: Bool = False
    backend: one_of("auto", "nccl", "gloo") = "auto"
    # Two bounds, because joining and working fail differently: a rank that never arrives should fail
    # the job in minutes, but a collective may legitimately wait much longer for a slow peer (the first
    # step's uneven compile over hundreds of ranks, a resume reading the model inside DeepSpeed's
    # barriers, slow shard start-up).
    rendezvous_timeout_s: Int = Field(300, ge=1)  # joining: the rendezvous store and forming the groups
    collective_timeout_s: Int = Field(1800, ge=1)  # every collective after that (NCCL's watchdog), every group
    # The rendezvous of a SLURM job: by default the allocation's first node and a port derived from
    # the job id. MASTER_ADDR/MASTER_PORT in the environment are ignored there (sbatch exports the
    # submitting shell's, stale for this allocation): set these to choose.
    master_addr: Str = ""
    master_port: Int = Field(0, ge=0, le=65535)  # 0: derived from the job id

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        if isinstance(data, dict) and "dist_timeout_s" in data:
            raise problem("engine.dist_timeout_s: replaced by engine.rendezvous_timeout_s (joining the group, "
                           "default 300) and engine.collective_timeout_s (each collective, default 1800)")
        return data

    @model_validator(mode="after")
    def _engine(self):
        if any(c.isspace() or c in "/@" for c in self.master_addr):  # a host name or an IPv4/IPv6 address
            raise problem(f"engine.master_addr: expected a host name or address, got {self.master_addr!r}")
        if 0 < self.master_port < 1024:
            raise problem(f"engine.master_port: must be 0 (derived) or 1024-65535; got {self.master_port}")
        if self.offload_params and self.zero_stage != 3:
            raise problem(f"engine.offload_params: needs engine.zero_stage=3; got {self.zero_stage}")
        if self.offload_optimizer and self.zero_stage == 0:
            raise problem("engine.offload_optimizer: needs engine.zero_stage >= 1")
        return self


class CheckpointCfg(Section):
    every: Int = Field(0, ge=0)  # steps; 0: only at the end (and on preemption), unless every_minutes
    # minutes of training between saves (beside every): rank 0 times the steps and picks the step
    every_minutes: Float = Field(0.0, ge=0.0)
    keep: Int = Field(2, ge=1)
    # write in the background: a save holds training only to copy the states to host memory
    # (falls back to writing inline, with a warning at start-up, where the node has no room for the copy)
    async_: Bool = Field(True, alias="async")


class TrackingCfg(Section):
    enabled: Bool = True
    uri: Str | None = None  # None: $MLFLOW_TRACKING_URI, else a SQLite store under run.dir
    experiment: Str = "vitp"
    register_name: Str | None = None  # Model Registry name for the final model
    parent_run: Str | None = None  # nest this run under that MLflow run id (a transfer suite's cells)
    log_model: Bool = True  # transfer: the final model as an MLflow model (a suite's grid cells keep no weights)
    flush_every_s: Float = Field(2.0, gt=0)
    # at the end of a run, how long to wait for an unreachable server before spooling what is left
    # (then `vitp sync RUN_DIR` delivers it); a stopped (requeued) job waits at most 10 s
    close_timeout_s: Float = Field(120.0, ge=0.0)
    system_metrics: Bool = True  # CPU, memory, disk, network, GPU (NVML) as system/... on rank 0
    system_metrics_every_s: Float = Field(10.0, gt=0)
    # more places for rank 0's records, besides metrics.jsonl and MLflow: "package.module:Class", a
    # pipeline.tracking.Sink subclass built as Class(run_dir)
    sinks: List(Str) = Field(default_factory=list)

    @model_validator(mode="after")
    def _store(self):
        # MLflow opens a file: URI or a bare path (`./mlruns`, `none`) as its file store, which it keeps
        # in maintenance mode and refuses after start-up in a multi-line exception: refuse it here
        if self.enabled and self.uri and _file_store(self.uri):
            raise problem(f"tracking.uri: {self.uri!r} is MLflow's file store (a file: URI or a folder), which "
                           "MLflow keeps in maintenance mode and vitp does not support; use a database "
                           "(sqlite:///PATH/mlflow.db) or a server (http://HOST:PORT), or set tracking.enabled=false "
                           "to turn tracking off")
        return self


def _file_store(uri: str) -> bool:
    """Whether MLflow reads ``uri`` as its file store: scheme ``file`` or none (a one-letter scheme is a
    Windows drive), except its bare names of remote stores (mlflow/tracking/registry.py)."""
    if uri in ("databricks", "databricks-uc", "uc"):
        return False
    scheme = urllib.parse.urlparse(uri).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and scheme.isalpha())


class HardwareCfg(Section):
    peak_tflops: Float = Field(989.0, gt=0)  # per device, for MFU (H100 SXM bf16 dense)
    device_mem_gb: Float = Field(80.0, gt=0)
    intra_node_gbps: Float = Field(450.0, gt=0)  # GB/s per GPU (NVLink)
    inter_node_gbps: Float = Field(50.0, gt=0)  # GB/s per NIC (InfiniBand 400 Gb/s)
    nics_per_node: Int = Field(8, ge=1)  # NIC rails between nodes (NCCL runs a ring per rail)
    assumed_mfu: Float = Field(0.5, gt=0.0, le=1.0)
    storage_write_gbps: Float = Field(5.0, gt=0)  # GB/s the job's checkpoint writes reach, all ranks together
    host_copy_gbps: Float = Field(20.0, gt=0)  # GB/s per rank copying its states to host memory (pinned, PCIe)


class ClusterCfg(Section):
    nodes: Int = Field(1, ge=1)
    # fewest nodes an attempt may run on (None: cluster.nodes); each requeue vitp makes asks for the nodes the
    # partition has up, between the two, and the accumulation adapts (launch/attempts.py Elastic)
    min_nodes: Int | None = Field(None, ge=1)
    tasks_per_node: Int = Field(1, ge=1)  # one task per GPU
    gpus_per_node: Int = Field(0, ge=0)
    cpus_per_task: Int = Field(1, ge=1)
    mem_gb: Float | None = Field(None, gt=0)
    time_min: Int = Field(60, ge=1)
    partition: Str | None = None
    account: Str | None = None
    qos: Str | None = None
    constraint: Str | None = None
    exclusive: Bool = False
    extra_sbatch: Annotated[dict[str, Str], BeforeValidator(_mapping)] = Field(default_factory=dict)
    job_name: Str = "vitp"
    log_dir: Str = "runs/jobs"
    signal_delay_s: Int = Field(120, ge=0)  # SIGUSR2 this long before the time limit
    max_requeues: Int = Field(3, ge=0)  # time-limit requeues (USR2); preemptions are not counted
    hang_dump_s: Float = Field(600.0, ge=0)  # no step this long: stacks to hang.<rank>.txt, requeued (0: off)
    max_failures: Int = Field(2, ge=0)  # attempts that failed (a rank died or raised) requeued before giving up
    # nodes the job leaves out (sbatch --exclude); None: those the run dir's earlier jobs left out, [] none
    exclude_nodes: List(Str) | None = None
    max_excluded_nodes: Int = Field(2, ge=0)  # nodes a job leaves out after a failure that points at them

    @property
    def fewest_nodes(self) -> int:
        """The fewest nodes an attempt may run on: cluster.min_nodes, else cluster.nodes."""
        return self.nodes if self.min_nodes is None else self.min_nodes

    @model_validator(mode="after")
    def _min_nodes(self):
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise problem(f"cluster.min_nodes: {self.min_nodes} is more than cluster.nodes {self.nodes} "
                          "(an attempt runs on min_nodes..nodes nodes)")
        return self

    @model_validator(mode="after")
    def _node_names(self):
        bad = [n for n in self.exclude_nodes or [] if not re.fullmatch(r"[\w.-]+", n)]
        if bad:
            raise problem(f"cluster.exclude_nodes: {bad[0]!r}: one node name per entry ([A-Za-z0-9_.-])")
        return self


class InitCfg(Section):
    from_: Str | None = Field(None, alias="from")  # transfer source: checkpoint dir, safetensors, timm .pth, JAX .npz
    posemb_mode: one_of("bicubic", "bilinear") = "bicubic"
    keep_representation: Bool = False


def fewshot_sets(entries: list[str]) -> list[tuple[str, str]]:
    """eval.fewshot_data entries -> (name, folder): ``NAME=PATH``, or the folder's own name."""
    return [tuple(e.split("=", 1)) if "=" in e else (Path(e.rstrip("/")).name, e) for e in entries]


class EvalCfg(Section):
    fewshot_shots: List(Int) = Field(default_factory=lambda: [1, 5, 10, 25])
    fewshot_seeds: Int = Field(3, ge=1)
    fewshot_l2: Float = Field(1024.0, gt=0)  # ridge regulariser: big_vision's 2^10 (pipeline/eval/linear.py)
    linear_probe: Bool = False
    batch: Int = Field(64, ge=1)
    # [NAME=]`vitp prep` folders (train + test splits) scored while training
    fewshot_data: List(Str) = Field(default_factory=list)
    # the evaluation stage (`vitp eval`, `vitp submit eval`); data.path names the dataset
    checkpoint: Str | None = None  # run dir, checkpoint folder or weights file
    split: Str = "val"  # the split scored; few-shot and the probe fit on data.train_split
    top1: Bool = True  # score the model's own head
    fewshot: Bool = False
    variant: Str | None = None  # architecture of a weights file that does not say it, e.g. vit_b16
    img_size: Int | None = Field(None, ge=1)  # evaluate at this resolution (pos-emb resampled)
    max_train_images: Int | None = Field(None, ge=1)  # the linear probe's training images, in all (seeded draw)
    out: Str | None = None  # results.json and artifacts; default: the run dir, else ./eval_<name>

    @model_validator(mode="after")
    def _sets(self):
        if any(s < 1 for s in self.fewshot_shots):
            raise problem(f"eval.fewshot_shots: shots must be >= 1; got {self.fewshot_shots}")
        names = [n for n, _ in fewshot_sets(self.fewshot_data)]
        if not all(re.fullmatch(r"[\w.-]+", n) for n in names) or len(set(names)) != len(names):
            raise problem(f"eval.fewshot_data: each set needs its own name of [A-Za-z0-9_.-] (metrics are "
                           f"fewshot/<name>/...: the folder's, or NAME=PATH); got {self.fewshot_data}")
        return self


class EvalEntry(Section):
    """One declared evaluator (``evals:``): the common keys; the keys of its type's own options (a
    fewshot's ``shots``, ``seeds``, ``l2``) are kept as given and checked against its type by
    pipeline/eval/evaluators (the config layer knows no types)."""

    model_config = ConfigDict(extra="allow", validate_by_name=True, validate_by_alias=True)

    name: Str  # names its metrics and its checkpointed progress
    type: Str  # a registered type (classify, fewshot, linear_probe) or package.module:Class
    data: Str | None = None  # a `vitp prep` output at any address vitp reads; None: data.path
    split: Str | None = None  # the split(s) the type reads: classify's
    train_split: Str | None = None  # few-shot's and the linear probe's
    test_split: Str | None = None
    every: Int = Field(0, ge=0)  # steps between runs inside a training run; 0: only at the end
    prefix: Str | None = None  # the metrics' prefix; None: the type's default

    @model_validator(mode="after")
    def _name(self):
        if not re.fullmatch(r"[\w.-]+", self.name):
            raise problem(f"evals: name {self.name!r}: use [A-Za-z0-9_.-] (it names metrics and state)")
        return self

    @property
    def options(self) -> dict:
        """The type's own keys, as given."""
        return dict(self.model_extra or {})


def EvalList():  # noqa: N802 (a type)
    def unique(v):
        names = [e.name for e in v]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise problem(f"evals: two evaluators named {dup!r}; each needs its own name")
        return v

    return Annotated[list[EvalEntry], BeforeValidator(_list), AfterValidator(unique)]
