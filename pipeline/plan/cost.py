"""`vitp plan`: memory, step time and cost of a pre-training run, on paper, in seconds.

    vitp plan --config configs/pretrain/vit_l16.yaml cluster.nodes=4 --sweep zero=1,2,3 ckpt=on,off

Memory per GPU comes from pipeline/plan/memory.py. Time per step is the compute plus the part of the
communication that does not overlap it (:func:`comm_volume`, :func:`link_seconds`):
- compute: `train_step_flops` (3x forward, 4x with activation checkpointing) of the rank's share of the
  global batch, at hardware.peak_tflops x hardware.assumed_mfu; backward (with its recomputed forward)
  is 2/3 of it (3/4 with checkpointing);
- communication: the bytes each rank sends per optimizer step, as deepspeed 0.19.8 sends them with vitp's
  settings (ring collectives: an all-reduce sends 2 (n-1)/n of its buffer, a reduce-scatter or an
  all-gather (n-1)/n). Gradients travel in REDUCE_DTYPE (fp32, the engine's `communication_data_type`:
  Gr = P x 4 bytes), parameters in the model dtype (Gw = P x 2 bytes in bf16/fp16), a = accumulation:
  stage 0 all-reduces the gradients after backward (engine.allreduce_bucket casts to fp32): 2 Gr, exposed;
  stage 1 all-reduces them after backward and all-gathers the updated parameters: 2 Gr + Gw, exposed
  (BF16_Optimizer all-reduces its fp32 buffer; stage_1_and_2's reduce_gradients goes through
  average_tensor, whose buckets are all-reduced: `use_multi_rank_bucket_allreduce` defaults to true);
  stage 2 all-reduces every bucket of every micro step during backward (average_tensor again, on the
  side stream under overlap_comm): 2 a Gr, hidden behind backward as far as it lasts, then the parameter
  all-gather after the step: Gw, exposed;
  stage 3 reduce-scatters every micro step (stage3.py's reduce_scatter_coalesced) and all-gathers the
  parameters in forward and backward (prefetched): a (Gr + 2 Gw), hidden behind the compute as far as it lasts.
- links: a ring over n ranks moves a rank's bytes over NVLink inside a node (hardware.intra_node_gbps per
  GPU) and, across nodes, its node's share of them over the node's NIC rails: NCCL runs one ring per
  rail, each leaves the node once, so a node sends as many bytes as one rank, over
  hardware.nics_per_node x hardware.inter_node_gbps (GB/s per NIC). A collective takes the slower of
  the two; :func:`bus_gbps` is that rate as nccl-tests' bus bandwidth, which `vitp preflight` measures.
Cost is given in GPU-hours and in the paper's unit, TPUv3-core-days, at the same MFU.
With model.patch_drop the steps up to train.patch_drop_until (all, if unset) compute the kept tokens
only (`train_step_flops(patch_drop=...)`); the rest of the schedule computes every patch. The report
shows both step times and what the schedule saves against patch_drop=0.
"""

from __future__ import annotations

from pipeline.config.batch import BatchLayout
from pipeline.config.sections import REDUCE_DTYPE
from pipeline.plan.checkpoint import checkpoint_cost, report_lines
from pipeline.plan.memory import BYTES, GiB, ModelShape, memory_per_rank

TPU_V3_CORE_TFLOPS = 61.5  # 123 TFLOP/s bf16 per TPUv3 chip, 2 cores per chip
PAPER_TPU_CORE_DAYS = {"vit_l16": 680.0, "vit_h14": 2500.0}  # Dosovitskiy et al. 2020, Table 2, JFT-300M
DEFAULT_DATASET = 300_000_000  # JFT-300M, when the data folder doesn't say
DEFAULT_CLASSES = 18_291  # JFT-300M's label set, when neither the config nor the data folder says
SWEEP_KEYS = {"zero": "engine.zero_stage", "micro_batch": "train.micro_batch", "ckpt": "model.grad_checkpointing",
              "nodes": "cluster.nodes", "offload": "engine.offload_optimizer", "precision": "engine.precision",
              "patch_drop": "model.patch_drop"}


class PlanError(ValueError):
    """Impossible planning input; the message is one line."""


def _data_info(cfg):
    """(the dataset's Info, where it is described) when data.path names one here, else (None, "")
    (planning works without data)."""
    from pipeline.data import DataError, local_source

    src = local_source(cfg.data.path)
    if src is None:
        return None, ""
    try:
        return src.read_info(), src.where()
    except DataError as e:
        raise PlanError(str(e)) from None


def model_shape(cfg, num_classes: int | None = None) -> tuple[ModelShape, str]:
    """The config's ViT as a ModelShape, and where its class count came from."""
    from pipeline.model.vit import VARIANTS

    m = cfg.model
    dims = dict(VARIANTS.get(m.name, {})) if m.name else {}
    if m.name and m.name not in VARIANTS:
        raise PlanError(f"model.name: unknown variant {m.name!r}; known: {', '.join(VARIANTS)}")
    for k in ("width", "depth", "heads", "mlp_dim", "patch"):
        if getattr(m, k) is not None:
            dims[k] = getattr(m, k)
    k, src = num_classes, "--num-classes"
    if k is None and m.num_classes:
        k, src = m.num_classes, "model.num_classes"
    if k is None:
        info, where = _data_info(cfg)
        if info is not None:
            k, src = info.num_classes, where
    if k is None:
        k, src = DEFAULT_CLASSES, "assumed JFT-300M (set model.num_classes)"
    shape = ModelShape.from_dims(**dims, img_size=m.img_size, num_classes=k, pool=m.pool,
                                 class_token=m.class_token, representation_size=m.representation_size)
    return shape, f"{k} classes ({src})"


def dataset_size(cfg, override: int | None) -> tuple[int, str]:
    if override is not None:
        if override < 1:
            raise PlanError(f"--dataset-size: must be >= 1; got {override}")
        return override, "--dataset-size"
    info, where = _data_info(cfg)
    split = info.splits.get(cfg.data.train_split) if info is not None else None
    if split is not None and split.num_samples:
        return split.num_samples, where
    return DEFAULT_DATASET, "assumed JFT-300M"


def _largest_micro_batch(shape, mem_kw, budget: float, upper: int) -> int:
    """Largest micro batch whose peak fits `budget` bytes (0 if not even 1 fits); memory grows with it."""
    fits = lambda b: memory_per_rank(shape, micro_batch=b, **mem_kw)["total"] <= budget
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= upper and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, upper + 1)
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi) (or hi beyond upper)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def comm_volume(params: int, precision: str, zero_stage: int, world_size: int, accumulation: int = 1, *,
                offload_optimizer: bool = False) -> dict:
    """Bytes one rank sends per optimizer step (see the module docstring), by collective and by whether
    they overlap compute. -> {"grad_reduce", "param_gather", "overlapped", "exposed", "total",
    "reduce_op" ("all-reduce" or "reduce-scatter"), "overlaps" ("backward", "compute" or None)}."""
    del offload_optimizer  # the same collectives: the optimizer step moves to the host, not the bytes
    Gw = params * BYTES[precision]  # parameters, in the model dtype
    Gr = params * BYTES[REDUCE_DTYPE]  # gradients, in the reduction dtype
    ring, a = (world_size - 1) / world_size, accumulation
    if zero_stage == 0:
        grads, gather, overlapped, overlaps = 2 * ring * Gr, 0.0, 0.0, None
    elif zero_stage == 1:
        grads, gather, overlapped, overlaps = 2 * ring * Gr, ring * Gw, 0.0, None
    elif zero_stage == 2:
        grads, gather, overlaps = 2 * ring * Gr * a, ring * Gw, "backward"
        overlapped = grads
    else:
        grads, gather, overlaps = ring * Gr * a, 2 * ring * Gw * a, "compute"
        overlapped = grads + gather
    total = grads + gather
    return {"grad_reduce": grads, "param_gather": gather, "overlapped": overlapped, "exposed": total - overlapped,
            "total": total, "reduce_op": "reduce-scatter" if zero_stage == 3 else "all-reduce", "overlaps": overlaps}


def comm_bytes(params: int, precision: str, zero_stage: int, world_size: int, accumulation: int = 1, *,
               offload_optimizer: bool = False) -> float:
    """Bytes one rank sends per optimizer step (:func:`comm_volume`'s total)."""
    return comm_volume(params, precision, zero_stage, world_size, accumulation,
                       offload_optimizer=offload_optimizer)["total"]


def bus_gbps(hardware, nodes: int) -> float:
    """GB/s a ring collective moves one rank's bytes at (nccl-tests' bus bandwidth): NVLink on one node;
    across nodes the slower of NVLink and the node's NIC rails together (one ring per rail)."""
    if nodes <= 1:
        return hardware.intra_node_gbps
    return min(hardware.intra_node_gbps, hardware.nics_per_node * hardware.inter_node_gbps)


def bus_assumption(hardware, nodes: int) -> str:
    """:func:`bus_gbps` and where it comes from, in words (what `vitp preflight` compares NCCL with)."""
    if nodes <= 1:
        return f"vitp plan's bus {bus_gbps(hardware, nodes):g} GB/s (hardware.intra_node_gbps, NVLink)"
    return (f"vitp plan's bus {bus_gbps(hardware, nodes):g} GB/s (the slower of hardware.nics_per_node "
            f"{hardware.nics_per_node} x inter_node_gbps {hardware.inter_node_gbps:g} and intra_node_gbps "
            f"{hardware.intra_node_gbps:g})")


def link_seconds(nbytes: float, hardware, nodes: int) -> float:
    """Seconds a rank's ``nbytes`` of ring traffic take at :func:`bus_gbps`."""
    return nbytes / (bus_gbps(hardware, nodes) * 1e9)


def step_time(cfg, shape: ModelShape, patch_drop: float | None = None) -> dict:
    """Seconds per optimizer step: compute, communication (what overlaps and what does not) and the
    step; ``patch_drop``: of a step that drops this fraction of patches (default model.patch_drop)."""
    from pipeline.model.flops import train_step_flops

    c, e, t, hw = cfg.cluster, cfg.engine, cfg.train, cfg.hardware
    n = cfg.world_size_planned
    layout = BatchLayout.planned(t, n)
    per_rank, accum = layout.per_rank, layout.accumulation
    # time counts what the GPU executes (checkpointing runs the forward again); model FLOPs (MFU,
    # total work, TPUv3-core-days) count the model's work once: recomputation is a cost in time
    pd = cfg.model.patch_drop if patch_drop is None else patch_drop
    ckpt = cfg.model.grad_checkpointing
    flops_rank = train_step_flops(shape.config, batch=per_rank, grad_checkpointing=ckpt, patch_drop=pd)
    model_flops_rank = train_step_flops(shape.config, batch=per_rank, grad_checkpointing=False, patch_drop=pd)
    compute = flops_rank / (hw.peak_tflops * 1e12 * hw.assumed_mfu)
    vol = comm_volume(shape.params, e.precision, e.zero_stage, n, accum, offload_optimizer=e.offload_optimizer)
    window = {"backward": compute * (3 / 4 if ckpt else 2 / 3), "compute": compute, None: 0.0}[vol["overlaps"]]
    hidden_s = link_seconds(vol["overlapped"], hw, c.nodes)
    exposed = link_seconds(vol["exposed"], hw, c.nodes) + max(0.0, hidden_s - window)
    comm = link_seconds(vol["total"], hw, c.nodes)
    return {"flops_per_rank": flops_rank, "flops_per_step": flops_rank * n, "compute_s": compute,
            "model_flops_per_rank": model_flops_rank, "model_flops_per_step": model_flops_rank * n,
            "recompute_flops_per_rank": flops_rank - model_flops_rank,
            "comm_bytes": vol["total"], "comm": vol, "comm_s": comm, "exposed_comm_s": exposed,
            "step_s": compute + exposed, "bound": "compute" if compute >= comm else "communication",
            "accumulation": accum, "link": "inter-node" if c.nodes > 1 else "intra-node",
            "link_gbps": bus_gbps(hw, c.nodes)}


def patch_drop_phases(cfg, shape: ModelShape, st: dict) -> dict:
    """The schedule in its two phases: ``drop_steps`` at model.patch_drop (``st``), the rest on every patch.
    -> fraction, kept/all patches, step_s of each phase, total seconds and model FLOPs, and the saving
    against the same schedule at patch_drop=0 (fractions of time and of model FLOPs)."""
    from pipeline.model.vit import kept_patches

    t, frac = cfg.train, cfg.model.patch_drop
    full = step_time(cfg, shape, patch_drop=0.0) if frac else st
    drop_steps = (t.steps if t.patch_drop_until is None else min(t.patch_drop_until, t.steps)) if frac else 0
    rest = t.steps - drop_steps
    total_s = drop_steps * st["step_s"] + rest * full["step_s"]
    total_flops = drop_steps * st["model_flops_per_step"] + rest * full["model_flops_per_step"]
    n = shape.tokens - (1 if cfg.model.class_token else 0)
    return {"fraction": frac, "patches": n, "kept": kept_patches(n, frac) if frac else n,
            "drop_steps": drop_steps, "steps": t.steps, "step_s": st["step_s"], "full_step_s": full["step_s"],
            "total_s": total_s, "total_flops": total_flops,
            "time_saving": 1 - total_s / (t.steps * full["step_s"]),
            "flops_saving": 1 - total_flops / (t.steps * full["model_flops_per_step"])}


def plan(cfg, *, dataset: int | None = None, num_classes: int | None = None, backend: str = "cuda",
         headroom: float = 0.0, shape: ModelShape | None = None) -> dict:
    """Everything `vitp plan` reports, as plain numbers (bytes, seconds)."""
    c, e, t, hw = cfg.cluster, cfg.engine, cfg.train, cfg.hardware
    n = cfg.world_size_planned
    if n < 1:
        raise PlanError(f"world size must be >= 1; got {n}")
    if t.micro_batch > t.global_batch:
        raise PlanError(f"train.micro_batch: {t.micro_batch} is larger than train.global_batch {t.global_batch}")
    layout = BatchLayout.planned(t, n)
    shape_note = ""
    if shape is None:
        shape, shape_note = model_shape(cfg, num_classes)
    m = cfg.model
    mem_kw = dict(precision=e.precision, zero_stage=e.zero_stage, world_size=n,
                  checkpointing=m.grad_checkpointing, dropout=max(m.dropout, m.attn_dropout) > 0,
                  offload_optimizer=e.offload_optimizer, offload_params=e.offload_params, backend=backend,
                  accumulation=max(layout.accumulation, 1))
    mem = memory_per_rank(shape, micro_batch=t.micro_batch, **mem_kw)
    budget = hw.device_mem_gb * GiB * (1 - headroom)
    per_rank = layout.per_rank
    upper = max(per_rank, 1) * 64  # searching further says nothing a user can act on
    max_mb = _largest_micro_batch(shape, mem_kw, budget, upper=upper)
    valid = [b for b in range(1, per_rank + 1) if per_rank % b == 0 and b <= max_mb]
    st = step_time(cfg, shape)
    pd = patch_drop_phases(cfg, shape, st)
    ds_n, ds_src = dataset_size(cfg, dataset)
    total_s = pd["total_s"]
    imgs_job = t.global_batch * t.steps / total_s  # over the whole schedule (both patch-drop phases)
    total_flops = pd["total_flops"]
    tpu_days = total_flops / (TPU_V3_CORE_TFLOPS * 1e12 * hw.assumed_mfu) / 86400
    paper = PAPER_TPU_CORE_DAYS.get(m.name) if m.img_size == 224 else None
    ckpt = checkpoint_cost(cfg, shape.params, total_s / max(t.steps, 1))
    fewest = _at_fewest_nodes(cfg, shape, mem_kw, budget) if c.fewest_nodes < c.nodes else None
    return {
        "model": {"name": m.name or "custom", "params": shape.params, "width": shape.width, "depth": shape.depth,
                  "heads": shape.heads, "mlp_dim": shape.mlp_dim, "tokens": shape.tokens,
                  "img_size": shape.img_size, "classes": shape_note or f"{shape.num_classes} classes",
                  "largest_layer": shape.largest_layer},
        "setup": {"world_size": n, "nodes": c.nodes, "tasks_per_node": c.tasks_per_node,
                  "precision": e.precision, "zero_stage": e.zero_stage, "offload_optimizer": e.offload_optimizer,
                  "offload_params": e.offload_params, "micro_batch": t.micro_batch, "global_batch": t.global_batch,
                  "accumulation": st["accumulation"], "grad_checkpointing": m.grad_checkpointing,
                  "backend": backend},
        "memory": mem,
        "verdict": {"fits": mem["total"] <= budget, "device_bytes": hw.device_mem_gb * GiB, "budget_bytes": budget,
                    "max_micro_batch": max_mb, "max_micro_batch_capped": max_mb >= upper,
                    "max_valid_micro_batch": max(valid) if valid else 0},
        "time": st,
        "patch_drop": pd,
        "throughput": {"images_per_s_per_gpu": imgs_job / n, "images_per_s": imgs_job,
                       "epoch_s": ds_n / imgs_job, "dataset_size": ds_n, "dataset_source": ds_src,
                       "epochs": t.steps * t.global_batch / ds_n},
        "cost": {"total_s": total_s, "gpu_hours": total_s * n / 3600, "total_flops": total_flops,
                 "tpuv3_core_days": tpu_days, "paper_tpuv3_core_days": paper},
        "checkpoint": ckpt,
        "fewest_nodes": fewest,
    }


def _at_fewest_nodes(cfg, shape: ModelShape, mem_kw: dict, budget: float) -> dict:
    """An attempt on cluster.min_nodes nodes (a requeue that got fewer): its step (more accumulation, the
    same global batch) and its memory per GPU (ZeRO shards the states over fewer ranks)."""
    c, t = cfg.cluster, cfg.train
    few = cfg.model_copy(update={"cluster": c.model_copy(update={"nodes": c.fewest_nodes})})
    n = few.world_size_planned
    st = step_time(few, shape)
    mem = memory_per_rank(shape, micro_batch=t.micro_batch,
                          **{**mem_kw, "world_size": n, "accumulation": st["accumulation"]})
    return {"nodes": c.fewest_nodes, "world_size": n, "accumulation": st["accumulation"], "step_s": st["step_s"],
            "bound": st["bound"], "images_per_s": t.global_batch / st["step_s"], "memory_total": mem["total"],
            "fits": mem["total"] <= budget}


# --------------------------------------------------------------------------------------------------
# Sweep
# --------------------------------------------------------------------------------------------------
def parse_sweep(items: list[str]) -> list[tuple[str, list[str]]]:
    """["zero=1,2,3", "ckpt=on,off"] → [("engine.zero_stage", ["1","2","3"]), ...]."""
    out = []
    for item in items:
        key, _, vals = item.partition("=")
        if key not in SWEEP_KEYS or not vals:
            raise PlanError(f"--sweep {item!r}: expected KEY=V1,V2 with KEY one of {', '.join(SWEEP_KEYS)}")
        conv = {"on": "true", "off": "false", "yes": "true", "no": "false"}
        out.append((SWEEP_KEYS[key], [conv.get(v.strip().lower(), v.strip()) for v in vals.split(",")]))
    return out


# --------------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------------
def _gib(b: float) -> str:
    return f"{b / GiB:8.2f}"


def _dur(s: float) -> str:
    if s >= 86400:
        return f"{s / 86400:.1f} d"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.3f} s"


def format_report(p: dict) -> str:
    m, s, mem, v, t, th, c = (p[k] for k in ("model", "setup", "memory", "verdict", "time", "throughput", "cost"))
    L = [f"== model: {m['name']}  {m['params'] / 1e6:.1f}M parameters  (width {m['width']}, depth {m['depth']}, "
         f"heads {m['heads']}, MLP {m['mlp_dim']}, {m['tokens']} tokens at {m['img_size']} px, {m['classes']})",
         f"   {s['world_size']} ranks ({s['nodes']} nodes x {s['tasks_per_node']}), {s['precision']}, "
         f"ZeRO-{s['zero_stage']}{', optimizer offload' if s['offload_optimizer'] else ''}"
         f"{', param offload' if s['offload_params'] else ''}, micro batch {s['micro_batch']} x accumulation "
         f"{s['accumulation']} x {s['world_size']} = {s['global_batch']}, activation checkpointing "
         f"{'on' if s['grad_checkpointing'] else 'off'}, backend {s['backend']}",
         "", "== memory per GPU (GiB)", f"   {'item':<34}{'device':>8}{'host':>10}"]
    names = {"params": "parameters", "grads": "gradients", "master": "fp32 master weights",
             "fp32_grads": "fp32 gradient partition", "optimizer": "Adam m, v"}
    for k, val in mem["states"].items():
        L.append(f"   {names[k]:<34}{_gib(val['device'])}  {_gib(val['host'])}")
    a, b = mem["activations"], mem["buffers"]
    L += [f"   {'activations (peak in backward)':<34}{_gib(a['peak'])}",
          f"   {'  of which one block':<34}{_gib(a['per_block'])}",
          f"   {'gradient buckets':<34}{_gib(b['grad_bucket'])}",
          f"   {'parameter gather / prefetch':<34}{_gib(b['param_gather'])}",
          f"   {'optimizer temporaries':<34}{_gib(b['optimizer_temp'])}",
          f"   {'CUDA context + NCCL':<34}{_gib(b['context'])}",
          f"   {'checkpoint snapshot (async)':<34}{_gib(0)}  {_gib(p['checkpoint']['snapshot_bytes'])}",
          f"   {'peak total':<34}{_gib(mem['total'])}  {_gib(mem['host'] + p['checkpoint']['snapshot_bytes'])}",
          "", "== verdict",
          f"   {'FITS' if v['fits'] else 'DOES NOT FIT'}: {mem['total'] / GiB:.1f} GiB of "
          f"{v['budget_bytes'] / GiB:.1f} GiB usable ({v['device_bytes'] / GiB:.0f} GiB device)",
          f"   largest micro batch that fits: {'>= ' if v['max_micro_batch_capped'] else ''}{v['max_micro_batch']}"
          f" (largest dividing the per-rank batch {s['global_batch'] // s['world_size']}: "
          f"{v['max_valid_micro_batch']})",
          "", "== step time and throughput (step = compute + the communication that does not overlap it)",
          f"   compute {t['flops_per_rank'] / 1e12:.1f} TFLOP per rank per step"
          + (f" ({t['recompute_flops_per_rank'] / 1e12:.1f} of them recomputed forwards)"
             if t["recompute_flops_per_rank"] else "") + f" -> {_dur(t['compute_s'])}",
          f"   communication {t['comm_bytes'] / 1e9:.2f} GB per rank per step ({_comm_parts(t['comm'])}) at "
          f"{t['link_gbps']:.0f} GB/s {t['link']} bus bandwidth -> {_dur(t['comm_s'])}, "
          f"{_dur(t['exposed_comm_s'])} of it not hidden behind compute",
          f"   step {_dur(t['step_s'])} ({t['bound']}-bound); {th['images_per_s_per_gpu']:.0f} images/s per GPU, "
          f"{th['images_per_s']:.0f} images/s for the job",
          *_fewest_lines(p["fewest_nodes"], t["step_s"]),
          *_patch_drop_lines(p["patch_drop"]),
          *report_lines(p["checkpoint"], _dur),
          "", "== cost",
          f"   epoch of {th['dataset_size']:,} images ({th['dataset_source']}): {_dur(th['epoch_s'])}",
          f"   whole schedule ({th['epochs']:.1f} epochs): {_dur(c['total_s'])}, {c['gpu_hours']:,.0f} GPU-hours, "
          f"{c['total_flops'] / 1e21:.2f} ZFLOP of model work",
          "", "== comparison with the paper (TPUv3 core at 61.5 TFLOP/s bf16, same MFU)",
          f"   this plan: {c['tpuv3_core_days']:,.0f} TPUv3-core-days"]
    if c["paper_tpuv3_core_days"]:
        L.append(f"   paper (Dosovitskiy et al. 2020, Table 2, JFT-300M): {c['paper_tpuv3_core_days']:,.0f} "
                 f"TPUv3-core-days; ratio {c['tpuv3_core_days'] / c['paper_tpuv3_core_days']:.2f}")
    else:
        L.append("   (the paper reports TPUv3-core-days for ViT-L/16 and ViT-H/14 at 224 px only)")
    return "\n".join(L)


def _comm_parts(v: dict) -> str:
    """ "2.58 gradient all-reduce + 0.65 parameter all-gather" (GB), and what overlaps."""
    parts = [f"{v['grad_reduce'] / 1e9:.2f} gradient {v['reduce_op']}"]
    if v["param_gather"]:
        parts.append(f"{v['param_gather'] / 1e9:.2f} parameter all-gather")
    hidden = {"backward": "; the gradients' during backward", "compute": "; all of it during compute", None: ""}
    return " + ".join(parts) + hidden[v["overlaps"]]


def _fewest_lines(f: dict | None, step_s: float) -> list[str]:
    if f is None:
        return []
    return [f"   at cluster.min_nodes={f['nodes']} ({f['world_size']} ranks, accumulation {f['accumulation']}): step "
            f"{_dur(f['step_s'])} ({f['step_s'] / step_s:.2f}x, {f['bound']}-bound), {f['images_per_s']:.0f} images/s "
            f"for the job; {f['memory_total'] / GiB:.1f} GiB per GPU, "
            f"{'fits' if f['fits'] else 'DOES NOT FIT: a requeue on that few nodes would run out of memory'}"]


def _patch_drop_lines(pd: dict) -> list[str]:
    if not pd["fraction"]:
        return []
    until = "every step" if pd["drop_steps"] == pd["steps"] else f"steps 1-{pd['drop_steps']:,} of {pd['steps']:,}"
    return [f"   patch drop {pd['fraction']:g} ({pd['kept']} of {pd['patches']} patches) for {until}: "
            f"step {_dur(pd['step_s'])} instead of {_dur(pd['full_step_s'])} on every patch; the schedule "
            f"takes {pd['time_saving']:.0%} less time and {pd['flops_saving']:.0%} fewer FLOPs than at patch_drop=0"]


def format_sweep(rows: list[dict]) -> str:
    keys = list(rows[0]["set"]) if rows else []
    short = {v: k for k, v in SWEEP_KEYS.items()}
    head = "".join(f"{short[k]:>12}" for k in keys)
    L = [f"{head}{'GiB/GPU':>10}{'fits':>6}{'max mb':>8}{'step s':>9}{'img/s':>10}{'GPU-h':>10}  bound"]
    for r in rows:
        cells = "".join(f"{ {'true': 'on', 'false': 'off'}.get(r['set'][k], r['set'][k]):>12}" for k in keys)
        if "invalid" in r:
            L.append(f"{cells}  invalid: {r['invalid']}")
            continue
        L.append(f"{cells}{r['gib']:10.1f}{'yes' if r['fits'] else 'NO':>6}{r['max_mb']:8d}{r['step_s']:9.3f}"
                 f"{r['img_s']:10.0f}{r['gpu_hours']:10.0f}  {r['bound']}")
    return "\n".join(L)
