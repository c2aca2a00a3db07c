"""DeepSpeed, behind a small surface: the only module that imports deepspeed.

The typed config is the one source of batch size, accumulation, precision and ZeRO stage;
:func:`deepspeed_config` turns it into DeepSpeed's JSON. The optimizer is a plain torch one (AdamW,
fused on CUDA; or SGD with momentum for transfer) built from param groups, so the transfer stage
can pass its own groups (layer-wise lr decay via a per-group ``lr_scale``). The learning rate is set
by the caller every step (:func:`set_lr`), so a schedule's whole state is the step number.

Checkpoint files are DeepSpeed's own (every rank writes its ZeRO partition); publishing them
atomically is pipeline/train/checkpoint.py's job.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import importlib
import io
import math
import os
import re
import sys

import torch

from pipeline.config.sections import REDUCE_DTYPE
from pipeline.distributed import bound_collectives, comm_device, rank_world
from pipeline.train import compiled, device_norm


@functools.cache
def _deepspeed():
    """DeepSpeed, imported (and set up, once) only when this process needs it, without what a run
    never uses of it.

    DeepSpeed picks its accelerator when it is first imported, from DS_ACCELERATOR: importing it at
    module level would fix the accelerator wherever a stage module is merely imported (the login
    node that submits), and sbatch would carry that choice to the GPU nodes. The stage decides it on
    the node (:func:`pipeline.distributed.setup`) before the first import here.

    ``import deepspeed`` also imports mlflow where it is installed (its autotuner, which vitp never
    runs, logs to it): mlflow and what it pulls in (pandas, scipy, ...) were most of DeepSpeed's
    import time, in every rank. It is imported with mlflow hidden; pipeline/tracking imports mlflow
    itself where a run tracks to it.
    """
    with _hidden("mlflow"):
        import deepspeed

    deepspeed.utils.logger.setLevel("WARNING")  # it logs every checkpoint file at INFO
    # DeepSpeed's torch backend compiles (first use: minutes on 2 cores, per torch and source path)
    # and loads a shared-memory C++ op on the CPU accelerator; only inference_all_reduce (AutoTP
    # inference) calls it, never training, whose collectives are the process group's (gloo, NCCL).
    # On CUDA the lookup finds no such op and returns None, as this does.
    sys.modules["deepspeed.comm.torch"].build_shm_op = _no_shm_op
    _import_muon()
    _norm_and_clip_on_device()
    return deepspeed


def _norm_and_clip_on_device() -> None:
    """DeepSpeed's gradient norm and clip without host reads (pipeline/train/device_norm.py says which
    and why); the functions are replaced where ZeRO-1/2/3 and BF16_Optimizer look them up."""
    utils = importlib.import_module("deepspeed.runtime.utils")
    zero12 = importlib.import_module("deepspeed.runtime.zero.stage_1_and_2")
    zero3 = importlib.import_module("deepspeed.runtime.zero.stage3")
    bf16 = importlib.import_module("deepspeed.runtime.bf16_optimizer")
    for module in (utils, zero12, zero3):
        module.mask_nan_or_inf_with_val_inplace = device_norm.mask_nonfinite
    bf16.clip_tensors_by_global_norm = functools.partial(device_norm.clip_by_global_norm,
                                                         norm_of=utils.get_global_norm_of_tensors)
    opt = zero12.DeepSpeedZeroOptimizer
    opt.unscale_and_clip_grads = device_norm.clip_on_device(opt.unscale_and_clip_grads, zero12)
    opt3 = zero3.DeepSpeedZeroOptimizer_Stage3
    if not getattr(opt3.get_grad_norm_direct, "fills_on_device", False):  # once per process
        opt3.get_grad_norm_direct = device_norm.fill_on_device(opt3.get_grad_norm_direct, zero3)


def _no_shm_op():
    return None


def _import_muon() -> None:
    """DeepSpeed's Muon optimizer module, with its kernels compiled when first called, not when imported.

    ZeRO imports it in every run (the optimizer check; ZeRO-1/2's gradient reduction, every step),
    to ask whether the optimizer is a Muon one, and its import wraps three kernels in torch.compile,
    which loads inductor: seconds of every rank's start, for kernels that only DeepSpeed's Muon runs
    (vitp's optimizers are torch's AdamW and SGD). torch.compile compiles nothing before a call either;
    only the wrapping moves to the first call."""
    compiler = importlib.import_module("deepspeed.runtime.compiler")
    eager = compiler.compile
    compiler.compile = lambda: _compile_when_called
    try:
        importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")
    except ImportError:  # a DeepSpeed without Muon
        pass
    finally:
        compiler.compile = eager


def _compile_when_called(fn):
    """``torch.compile(fn)``, made at the first call."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return call


@contextlib.contextmanager
def _hidden(*modules: str):
    """Inside the block, importing one of ``modules`` (not yet loaded) raises ImportError, which
    DeepSpeed's optional imports catch; afterwards they import as usual."""
    hide = [m for m in modules if m not in sys.modules]
    for m in hide:
        sys.modules[m] = None
    try:
        yield
    finally:
        for m in hide:
            if m in sys.modules and sys.modules[m] is None:
                del sys.modules[m]


def _on_gpu() -> bool:
    """This run trains on a GPU: the accelerator the node chose, not merely one that exists."""
    return comm_device().type == "cuda"


def grad_accumulation(cfg, world_size: int) -> int:
    from pipeline.config.batch import BatchLayout

    t = cfg.train  # read here: the builder hands the engine its sections once (tests/cfg_walk.py)
    return BatchLayout(t.global_batch, t.micro_batch, world_size).accumulation


def deepspeed_config(cfg, world_size: int, *, load_universal: bool = False) -> dict:
    """The DeepSpeed JSON for ``cfg`` on ``world_size`` ranks.

    train_batch_size = micro_batch x gradient_accumulation_steps x world_size, by construction.
    """
    e, t = cfg.engine, cfg.train
    zero: dict = {"stage": e.zero_stage}
    if e.zero_stage >= 1:
        # overlap_comm runs ZeRO-2/3's gradient reduction on a side stream during backward (one host
        # sync per micro step, at the end of backward); ZeRO-1 under bf16 runs DeepSpeed's
        # BF16_Optimizer (below), which does not read it
        zero.update(contiguous_gradients=True, overlap_comm=_on_gpu(),
                    reduce_bucket_size=int(5e7), allgather_bucket_size=int(5e7))
    if e.zero_stage == 3:
        zero.update(stage3_param_persistence_threshold=int(1e5), stage3_prefetch_bucket_size=int(5e7),
                    stage3_gather_16bit_weights_on_model_save=False)
    if e.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": _on_gpu()}
    if e.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": _on_gpu()}
    return {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": grad_accumulation(cfg, world_size),
        "gradient_clipping": float(cfg.optim.clip_grad),
        "zero_optimization": zero,
        **_precision(e.precision, e.zero_stage),
        # our optimizer is torch's (DeepSpeed's CPU Adam needs a compiled op)
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "checkpoint": {"load_universal": load_universal},
        **_quiet_step(),
    }


def _quiet_step() -> dict:
    """What keeps DeepSpeed's own bookkeeping from waiting for the device in a step (deepspeed 0.19.8).

    - ``timers.throughput``: on by default, it calls the accelerator's ``synchronize()`` in every
      forward and every ``step()`` from the third step on (utils/timer.py, ThroughputTimer.start/stop):
      two host syncs per micro batch. vitp measures throughput itself, on host clocks, at the log
      interval (pipeline/train/periodic.py).
    - ``wall_clock_breakdown``, ``memory_breakdown``, ``flops_profiler``: their timers, memory reports and
      profiles synchronise too; all are off (DeepSpeed's defaults, said here so the generated JSON shows
      it). No ``comms_logger`` section at all: its mere presence turns the logger on, whatever its
      ``enabled`` says (comm/config.py), and it synchronises after every collective (comm/comm.py).
    - ``steps_per_print``: DeepSpeed's progress line (lr and skipped steps) never comes.
    The norm and the clip wait no more either (:func:`_norm_and_clip_on_device`); what is left (ZeRO's
    reduction, BF16_Optimizer's skip) the README's GPU section lists with its source lines.
    """
    return {"timers": {"throughput": {"enabled": False, "synchronized": False}}, "wall_clock_breakdown": False,
            "memory_breakdown": False, "flops_profiler": {"enabled": False},
            "steps_per_print": 10**9}


def _precision(precision: str, zero_stage: int) -> dict:
    """DeepSpeed's precision keys (checked against deepspeed 0.19.8's runtime/engine.py,
    precision_config.py and zero/stage_1_and_2.py).

    - ``data_types.grad_accum_dtype: fp32``: gradients accumulate over micro steps in fp32, not in
      the model's bf16/fp16 (DeepSpeed's default is the model dtype). With bf16 at ZeRO-1 this makes
      DeepSpeed use its BF16_Optimizer (a whole fp32 gradient buffer per rank, one all-reduce and one
      parameter all-gather per optimizer step); at ZeRO-2/3 the owned gradient partition is fp32.
      Stage 0 takes no mix of bf16 model and fp32 accumulation (DeepSpeed raises): it keeps the model dtype.
    - ``bf16.check_grad_overflow: false``: bf16 has fp32's exponent range, so no loss scale and no
      overflow to detect; the check costs an all-reduce and a ``.item()`` (host sync) every step at
      ZeRO-1/2. (``check_overflow``, also in deepspeed's constants.py, is read nowhere, and the bf16
      section forbids unknown keys.) A non-finite loss still stops the run (pipeline/train/loop.py).
    - ``communication_data_type: fp32``: gradients are reduced over the ranks in fp32 (DeepSpeed's
      default is the model dtype: a bf16 all-reduce or reduce-scatter rounds each partial sum to 8
      bits of mantissa at every hop of the ring, 127-255 times over 128-256 ranks), as Megatron-LM and
      torchtitan do for bf16 training. Accepted with a bf16 model at stages 0-2 (run on 2 gloo ranks; 0:
      cast around the all-reduce; 1: BF16_Optimizer's fp32 buffer goes as it is; 2: the buckets) and
      read in zero/stage3.py for 3 (the reduce-scatter casts to it and back to the accumulation dtype).
    - ``bf16.immediate_grad_update: true``: BF16_Optimizer adds each gradient into the fp32 buffer
      from a hook as soon as it is produced and frees the bf16 one, instead of one pass over every
      parameter after backward with both copies alive.
    """
    out: dict = {
        "communication_data_type": REDUCE_DTYPE,
        "bf16": {"enabled": precision == "bf16", "immediate_grad_update": True, "check_grad_overflow": False},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    }
    if zero_stage >= 1 or precision == "fp32":
        out["data_types"] = {"grad_accum_dtype": "fp32"}
    return out


def default_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only; biases, norms, the class token and position embeddings are not decayed."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name.endswith(("pos_embed", "cls_token")) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def param_groups_layer_decay(model: torch.nn.Module, lr_decay: float | None, weight_decay: float = 0.0) -> list[dict]:
    """Layer-wise lr decay (BEiT / DeiT III): block i gets lr_scale = decay^(depth - i).

    Patch embedding, class token and pos-emb count as layer 0 (scale decay^(depth + 1)), the final
    norm / pre-logits / head as layer depth + 1 (scale 1). lr_decay None: one group, scale 1.
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if lr_decay is None:
        return [{"params": [p for _, p in params], "weight_decay": weight_decay, "lr_scale": 1.0}]
    depth = len(model.blocks)
    groups: dict[int, dict] = {}
    for name, p in params:
        m = re.match(r"blocks\.(\d+)\.", name)
        if m:
            layer = int(m.group(1)) + 1
        elif name.startswith(("patch_embed.", "cls_token", "pos_embed")):
            layer = 0
        else:
            layer = depth + 1
        g = groups.setdefault(layer, {"params": [], "weight_decay": weight_decay,
                                      "lr_scale": lr_decay ** (depth + 1 - layer)})
        g["params"].append(p)
    return [groups[k] for k in sorted(groups)]


def compile_blocks(model: torch.nn.Module, cfg) -> int:
    """torch.compile each transformer block in place (train.compile; None: on GPUs only); returns
    how many. Per block, not the whole model: one graph reused depth times compiles fast, and
    DeepSpeed's hooks and activation checkpointing stay outside the compiled regions. How many
    variants a run compiles, and the recompile limit set for them: pipeline/train/compiled.py."""
    want = cfg.train.compile if cfg.train.compile is not None else _on_gpu()
    if not want or not list(getattr(model, "blocks", [])):
        return 0
    if cfg.engine.zero_stage == 3:
        import warnings

        warnings.warn("train.compile: skipped under ZeRO-3 (its parameter hooks break the block graphs)",
                      stacklevel=2)
        return 0
    return compiled.compile_blocks(model, cfg)


def make_optimizer(param_groups: list[dict], cfg) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.name == "sgd":
        return torch.optim.SGD(param_groups, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    fused = _on_gpu() and not cfg.engine.offload_optimizer
    return torch.optim.AdamW(param_groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                             weight_decay=o.weight_decay, fused=fused or None)


def build_engine(model: torch.nn.Module, cfg, param_groups: list[dict] | None = None, *,
                 load_universal: bool = False):
    """Wrap ``model`` in a DeepSpeed engine with a torch optimizer over ``param_groups``.

    param_groups: torch-style groups; an optional ``lr_scale`` key multiplies the lr that
    :func:`set_lr` sets (layer-wise lr decay). Default: AdamW-style decay / no-decay groups.
    The stage has set up the process group (:func:`pipeline.distributed.setup`).
    """
    if cfg.model.grad_checkpointing and hasattr(model, "set_grad_checkpointing"):
        model.set_grad_checkpointing(True)
    compile_blocks(model, cfg)
    groups = param_groups if param_groups is not None else default_param_groups(model, cfg.optim.weight_decay)
    ds_cfg = deepspeed_config(cfg, rank_world()[1], load_universal=load_universal)
    # device_rank: the GPU this rank chose (pipeline.distributed.local_device_index), not LOCAL_RANK,
    # which is no device index where each task sees only its own GPU
    args = argparse.Namespace(device_rank=comm_device().index or 0) if _on_gpu() else None
    engine, _, _, _ = _deepspeed().initialize(args=args, model=model, optimizer=make_optimizer(groups, cfg),
                                           config=ds_cfg, dist_init_required=False)
    bound_collectives()  # DeepSpeed's data-parallel group was made with torch's default timeout
    return engine


def for_training(model: torch.nn.Module, cfg, param_groups: list[dict] | None = None, *,
                 load_universal: bool = False) -> tuple[object, torch.dtype, int]:
    """What the training step drives, from the ``engine``, ``optim``, ``train`` and ``model`` sections:
    (the DeepSpeed engine of :func:`build_engine`, the model's input dtype, micro batches per
    optimizer step on each rank)."""
    engine = build_engine(model, cfg, param_groups, load_universal=load_universal)
    return engine, input_dtype(cfg), grad_accumulation(cfg, rank_world()[1])


def set_lr(engine, lr: float) -> None:
    for g in engine.optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)


def grad_norm(engine) -> float:
    """Global grad norm of the last optimizer step (before clipping); nan if unknown."""
    n = engine.get_global_grad_norm()
    return float(n) if n is not None else float("nan")


def nonfinite_grad_norm(engine, device) -> torch.Tensor:
    """1.0 (a float32 scalar on ``device``) if the last optimizer step's gradient norm was not finite,
    else 0.0, without a host sync: the loop all-reduces it with the next step's flags.

    deepspeed 0.19.8 keeps the norm as a device tensor at ZeRO-1..3 (inf, or its -1 sentinel, when not
    finite), as the Python float inf where it skipped the step (fp32/fp16 overflow, bf16 ZeRO-1), and
    has none at stage 0 (never flagged)."""
    n = engine.get_global_grad_norm()
    if torch.is_tensor(n):
        return (~torch.isfinite(n) | (n < 0)).to(device=device, dtype=torch.float32).reshape(())
    bad = n is not None and not (math.isfinite(n) and n >= 0)
    return torch.full((), float(bad), dtype=torch.float32, device=device)


def input_dtype(cfg) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.engine.precision, torch.float32)


# --------------------------------------------------------------------------------------------------
# Checkpoint files
# --------------------------------------------------------------------------------------------------
def save_checkpoint(engine, save_dir: str, tag: str, client_state: dict | None = None) -> None:
    """Collective: every rank writes its part of ``save_dir/tag``. No `latest` file is written."""
    from deepspeed.checkpoint import constants as ds_constants

    state = dict(client_state or {})
    # lets deepspeed.checkpoint.ds_to_universal convert it later (world-size changes)
    state[ds_constants.UNIVERSAL_CHECKPOINT_INFO] = {
        ds_constants.UNIVERSAL_CHECKPOINT_VERSION_KEY: ds_constants.UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    with _quiet():
        engine.save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=False)


def snapshot_checkpoint(engine, save_dir: str, tag: str, copy, client_state: dict | None = None) -> list:
    """Collective: :func:`save_checkpoint` with DeepSpeed's file writes held back. Each file this rank
    would write comes back as ``(path, copy(state), write)``, ``write(state, path)`` being DeepSpeed's
    own engine's save (torch.save in its format), to call later from any thread.

    DeepSpeed writes every checkpoint file through ``engine.checkpoint_engine.save`` (0.19.8,
    runtime/engine.py ``_save_checkpoint``, ``_save_zero_checkpoint``); for this call that slot holds an
    engine that copies instead. Folders are still made and rank 0's recovery script copied, here. (Its
    decoupled engine needs the FastCheckpointEngine writer and a process per rank fed the live state
    through a queue; a host copy written by a thread is what vitp needs.)"""
    _deepspeed()
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    own, files = engine.checkpoint_engine, []

    class Capturing(CheckpointEngine):
        def create(self, info):
            own.create(info)

        def save(self, state_dict, path: str):
            files.append((path, copy(state_dict), own.save))

        def makedirs(self, path, exist_ok=False):
            own.makedirs(path, exist_ok=exist_ok)

        def load(self, path: str, map_location=None):
            return own.load(path, map_location)

        def commit(self, info):
            return True  # vitp publishes the checkpoint once every rank's files are durable

        def is_data_parallel_writer(self, dp_rank):
            return own.is_data_parallel_writer(dp_rank)

        def preserves_storage_sharing(self):
            return False  # no clone first: the host copy is one compact tensor per entry

    engine.checkpoint_engine = Capturing()
    try:
        save_checkpoint(engine, save_dir, tag, client_state)
    finally:
        engine.checkpoint_engine = own
    return files


def load_checkpoint(engine, load_dir: str, tag: str) -> dict:
    """Collective: load model + optimizer from ``load_dir/tag``; returns DeepSpeed's client state.

    Note: DeepSpeed reads its files with torch.load(weights_only=False); only load our own.
    """
    with _quiet():
        path, client = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
    if path is None:
        raise RuntimeError(f"{os.path.join(load_dir, tag)}: DeepSpeed could not load this checkpoint")
    _own_step_counts(engine)
    return client or {}


def _own_step_counts(engine) -> None:
    """deepspeed 0.19.8's ZeRO-3 universal load gives every sub-group's Adam state one and the same
    ``step`` tensor, which torch's Adam increments in place once per sub-group: the count then runs
    ahead by the number of sub-groups each step and the bias correction is wrong from the first step
    after the resume (a 2-rank run resumed on 1 at step 2 counted 6 at step 4). Each gets its own."""
    inner = getattr(engine.optimizer, "optimizer", None)
    seen: set[int] = set()
    for st in (inner.state.values() if inner is not None and hasattr(inner, "state") else ()):
        step = st.get("step")
        if torch.is_tensor(step):
            if id(step) in seen:
                st["step"] = step.clone()
            seen.add(id(step))


def full_optimizer_state(engine) -> dict:
    """Collective (ZeRO-3 gathers): the optimizer state as world-size-independent tensors, so states
    saved and resumed at different rank counts can be compared: {param name: {"fp32", "exp_avg",
    "exp_avg_sq"}} (each the parameter's full shape, on the CPU) plus "_steps" (Adam's step count per
    partition, a sorted list) and "_lr" (each param group's lr)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2 link the moments' views lazily
        opt._hp_optimizer_states_linked = False  # (at a step; none has run right after a load)
        opt._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in engine.module.named_parameters():
        got = {"fp32": safe_get_full_fp32_param(p), **{k: safe_get_full_optimizer_state(p, k)
                                                       for k in ("exp_avg", "exp_avg_sq")}}
        out[name] = {k: v.detach().float().cpu().clone() for k, v in got.items() if v is not None}
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    out["_steps"] = sorted({int(st["step"]) for st in inner.state.values() if "step" in st})
    out["_lr"] = [float(g["lr"]) for g in inner.param_groups]
    return out


def saved_world_size(ckpt_dir: str) -> int:
    """Data-parallel ranks that wrote ``ckpt_dir`` (one ZeRO optimizer file each; 1 without ZeRO)."""
    return max(1, len(glob.glob(os.path.join(ckpt_dir, "*_optim_states.pt"))))


def conversion_workers() -> int:
    """Processes for a universal-checkpoint conversion: the cores this task may run on (its CPU
    affinity, which SLURM's binding sets), at most SLURM_CPUS_PER_TASK where SLURM says it."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    return max(1, min(n, int(slurm)) if slurm.isdigit() and int(slurm) > 0 else n)


def scratch_dir(fallback: str | os.PathLike) -> str:
    """Node-local scratch for intermediate files: $SLURM_TMPDIR, else $TMPDIR (where they name a
    writable folder), else ``fallback``."""
    for var in ("SLURM_TMPDIR", "TMPDIR"):
        d = os.environ.get(var)
        if d and os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK):
            return d
    return str(fallback)


# (mlflow hidden as in _deepspeed: the conversion never tracks)
_CONVERT = ("import sys; sys.modules['mlflow'] = None; from deepspeed.checkpoint import ds_to_universal as u; "
            "sys.argv = ['ds_to_universal', *sys.argv[1:]]; u.main(u.parse_arguments())")


def to_universal(ckpt_dir: str, out_dir: str, *, workers: int | None = None) -> dict:
    """Convert a DeepSpeed checkpoint to the world-size-independent universal format in ``out_dir``,
    which appears whole (with a ``done`` marker) or not at all. Returns {"workers", "scratch"}.

    A ViT-H checkpoint of 64 ranks is ~75k fragment files: they are written to node-local scratch
    (:func:`scratch_dir`) by one process per core (:func:`conversion_workers`). The conversion runs
    in a child process, so its process pool forks a plain interpreter, not a trainer holding process
    groups and threads. The result is moved beside ``out_dir`` (a copy when scratch is another file
    system) and renamed into place.
    """
    import shutil
    import subprocess
    import sys
    import tempfile

    from pipeline.files import fsync_path

    workers = workers or conversion_workers()
    out = os.path.abspath(out_dir)
    staging = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="vitp-universal-", dir=scratch_dir(os.path.dirname(out))) as work:
        result = os.path.join(work, "out")
        argv = [sys.executable, "-c", _CONVERT, "--input_folder", os.path.abspath(ckpt_dir), "--output_folder",
                result, "--num_extract_workers", str(workers), "--num_merge_workers", str(workers),
                "--inject_missing_state"]
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0 or os.environ.get("VITP_DS_VERBOSE"):
            print(proc.stdout + proc.stderr, file=sys.stderr, flush=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{ckpt_dir}: universal checkpoint conversion failed (exit {proc.returncode}); "
                               "its output is above")
        with open(os.path.join(result, "done"), "w") as f:
            f.write("ok\n")
        shutil.move(result, staging)  # a rename on one file system, else a copy
    for dirpath, _, names in os.walk(staging):  # the copy is on stable storage before it is published
        for n in names:
            fsync_path(os.path.join(dirpath, n))
        fsync_path(dirpath)
    os.replace(staging, out)
    fsync_path(os.path.dirname(out))
    return {"workers": workers, "scratch": os.path.dirname(work)}


def fp32_state_dict(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Consolidated fp32 weights from a DeepSpeed checkpoint folder (any ZeRO stage), no engine needed.

    ZeRO 1-3 keep the fp32 master weights in the optimizer partitions: zero_to_fp32 joins them.
    Stage 0 has no partitions: the module state in the model file is the weights.
    """
    parent, tag = os.path.split(os.path.normpath(ckpt_dir))
    if glob.glob(os.path.join(ckpt_dir, "*_optim_states.pt")):
        _deepspeed()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            with _quiet():  # lazy: shards are memory-mapped, a tensor is joined when asked for
                lazy = get_fp32_state_dict_from_zero_checkpoint(parent, tag=tag, lazy_mode=True)
                return {k: v.contiguous().float() for k, v in lazy.items()}
        except ValueError as e:  # BF16_Optimizer's files (bf16 ZeRO-1): "... is not a zero checkpoint"
            if "is not a zero checkpoint" not in str(e):
                raise
        return _fp32_via_universal(ckpt_dir)
    else:
        files = sorted(glob.glob(os.path.join(ckpt_dir, "mp_rank_*_model_states.pt")))
        if not files:
            raise FileNotFoundError(f"{ckpt_dir}: no DeepSpeed model states in this folder")
        sd = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
    return {k: v.detach().float().contiguous() for k, v in sd.items()}


def _fp32_via_universal(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a BF16_Optimizer checkpoint (bf16 ZeRO-1 with fp32 accumulation),
    which deepspeed 0.19.8's zero_to_fp32 refuses ("is not a zero checkpoint"): its universal
    conversion writes each parameter whole (``zero/<name>/fp32.pt``), in node-local scratch."""
    import tempfile

    files = sorted(glob.glob(os.path.join(ckpt_dir, "mp_rank_*_model_states.pt")))
    names = list(torch.load(files[0], map_location="cpu", weights_only=False)["module"])
    with tempfile.TemporaryDirectory(prefix="vitp-fp32-", dir=scratch_dir(os.path.dirname(ckpt_dir))) as work:
        out = os.path.join(work, "universal")
        to_universal(ckpt_dir, out)
        return {n: torch.load(os.path.join(out, "zero", n, "fp32.pt"), map_location="cpu",
                              weights_only=False)["param"].float().contiguous() for n in names}


@contextlib.contextmanager
def _quiet():
    """DeepSpeed prints per-file progress (and tqdm bars); keep our console readable."""
    if os.environ.get("VITP_DS_VERBOSE"):
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield
