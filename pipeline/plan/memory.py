"""Per-rank memory of ViT training under DeepSpeed ZeRO, on paper.

Model states follow what DeepSpeed allocates (P parameters, N data-parallel ranks, w = 2 bytes for
bf16/fp16 models, 4 for fp32; "step" = exists during the optimizer step only):

  stage  params          grads                          fp32 master  fp32 grads       Adam m, v
  0      w P             w P (freed after each step)    4P (mixed)   4P (mixed)       8P
  1      w P             w P/N (w P with accumulation)  4P/N         4P/N step, mixed 8P/N
  2      w P             w P/N                          4P/N         4P/N step, mixed 8P/N
  3      w P/N + small   w P/N                          4P/N         4P/N step, mixed 8P/N

That table is for gradients accumulated in the model's dtype (DeepSpeed's default): in bf16 stage 2
is then 2 + 18/N bytes per parameter, exactly DeepSpeed's own estimator; at stage 3 we count 20/N
where DeepSpeed's estimator says 18/N (+ 4 bytes x the largest layer). Stage 1 under this DeepSpeed
reduces gradients bucket by bucket into the owned partition, so without accumulation it needs what
stage 2 needs (they differ in communication).

vitp's engine accumulates in fp32 (`data_types.grad_accum_dtype`, see :func:`grad_accum_dtype`),
which changes the mixed-precision rows: stage 1 runs DeepSpeed's BF16_Optimizer, a whole fp32
gradient buffer (4P; each bf16 gradient is added to it and freed as backward produces it) that it
all-reduces through a temporary fp32 copy and its bf16 cast (6P, after backward); stages 2 and 3
keep the owned gradient partition in fp32 (4P/N) and the step reads it in place (no fp32 copy).

ZeRO-3 keeps tensors below `param_persistence_threshold` elements ("small") whole on every rank;
CPU offload moves master, fp32 grads and Adam states to the host.

Activations are counted from what autograd saves in a vitp Block (checked against
`torch.autograd.graph.saved_tensors_hooks` in the tests). Per token of one block, in elements:
8 D + 2 M (LN1 in, qkv in, q/k/v = 3 D, attention out, LN2 in, fc1 in, fc1 out, GELU out), two
LayerNorm mean/rstd and the attention log-sum-exp in fp32. torch SDPA (flash / memory-efficient,
on CUDA and on CPU alike) never stores the T x T matrix; `attention="math"` adds it. Dropout keeps
a mask per dropped element (2 D + M more): 1 byte on CUDA, the element size on CPU. With activation
checkpointing a block keeps only its input. With a class-token head the last block runs token 0
alone past attention: the other tokens keep only LN1 in/out and the qkv output (5 D).

`backend="cuda"` counts buffers as allocated (the caching allocator holds all of a bucket);
`backend="cpu"` counts touched pages only (a bucket larger than the gradients it holds is never
written past them), no CUDA context, and the temporaries of torch's foreach AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config.sections import REDUCE_DTYPE

GiB = 2**30
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CUDA_CONTEXT = int(1.0 * GiB)  # CUDA context + NCCL communicators, outside torch's allocator


@dataclass(frozen=True)
class ModelShape:
    """What the memory and time models need of a ViT: dims, tokens and exact parameter counts."""

    width: int
    depth: int
    heads: int
    mlp_dim: int
    tokens: int  # sequence length T = prefix tokens + patches
    img_size: int
    in_chans: int
    num_classes: int
    params: int  # exact count of the built model
    largest_layer: int  # elements of the largest module's own parameters
    small_params: int  # elements in tensors below ZeRO-3's persistence threshold
    config: dict = field(default_factory=dict, compare=False)  # kwargs for build_vit / flops

    @classmethod
    def from_dims(cls, persistence_threshold: int = 100_000, **kwargs) -> ModelShape:
        """Build the model on the meta device (no memory, exact counts). kwargs: build_vit's."""
        import torch

        from pipeline.model.vit import build_vit

        with torch.device("meta"):
            m = build_vit(**kwargs)
        params = sum(p.numel() for p in m.parameters())
        largest = max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules())
        small = sum(p.numel() for p in m.parameters() if p.numel() < persistence_threshold)
        c = m.config
        img = c["img_size"][0] if isinstance(c["img_size"], (tuple, list)) else c["img_size"]
        tokens = m.num_prefix_tokens + m.patch_grid[0] * m.patch_grid[1]
        return cls(width=c["width"], depth=c["depth"], heads=c["heads"], mlp_dim=c["mlp_dim"], tokens=tokens,
                   img_size=int(img), in_chans=c["in_chans"], num_classes=c["num_classes"], params=params,
                   largest_layer=largest, small_params=small, config=dict(c))


def grad_accum_dtype(precision: str, zero_stage: int) -> str:
    """The dtype gradients accumulate in under vitp's engine (pipeline/train/engine.py writes the same
    into DeepSpeed's JSON; a test keeps the two equal): fp32, except stage 0 with a bf16/fp16 model,
    which DeepSpeed runs only in the model's dtype."""
    return "fp32" if zero_stage >= 1 or precision == "fp32" else precision


def fp32_accumulation_path(precision: str, zero_stage: int, grad_accum: str | None = None,
                           offload_optimizer: bool = False) -> bool:
    """True where a bf16/fp16 model accumulates its gradients in fp32 (the rows of the module docstring's
    second paragraph); at stage 1 with bf16 and no offload that is DeepSpeed's BF16_Optimizer."""
    accum = grad_accum or grad_accum_dtype(precision, zero_stage)
    return BYTES[precision] != 4 and accum == "fp32" and zero_stage >= 1 and not (
        zero_stage == 1 and offload_optimizer)


def model_states(shape: ModelShape, *, precision: str, zero_stage: int, world_size: int,
                 offload_optimizer: bool = False, offload_params: bool = False,
                 accumulation: int = 1, grad_accum: str | None = None) -> dict[str, dict[str, float]]:
    """Bytes per rank of each model state, split into {"device": ..., "host": ...}.

    Keys: params, grads, master (fp32 copy), fp32_grads (exist during the optimizer step only),
    optimizer (Adam m and v). ``grad_accum``: the dtype gradients accumulate in (default: what vitp's
    engine sets, :func:`grad_accum_dtype`; pass the model's dtype for DeepSpeed's default).
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1; got {world_size}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0-3; got {zero_stage}")
    w, P, n = BYTES[precision], shape.params, world_size
    mixed = w != 4
    part = P / n
    fp32_path = fp32_accumulation_path(precision, zero_stage, grad_accum, offload_optimizer)
    if fp32_path and zero_stage == 1:  # BF16_Optimizer: whole fp32 gradient buffer, the step reads its slice
        s = dict(params=w * P, grads=4 * P, master=4 * part, fp32_grads=0, optimizer=8 * part)
    elif fp32_path:  # stages 2-3: the owned gradient partition is fp32 from the first micro step
        params = w * P if zero_stage == 2 else w * ((P - shape.small_params) / n + shape.small_params)
        s = dict(params=params, grads=4 * part, master=4 * part, fp32_grads=0, optimizer=8 * part)
    elif zero_stage == 0:
        s = dict(params=w * P, grads=w * P, master=4 * P if mixed else 0,
                 fp32_grads=4 * P if mixed else 0, optimizer=8 * P)
    elif zero_stage in (1, 2):
        # DeepSpeed reduces stage-1 grads bucket by bucket into the owned partition too; only with
        # accumulation do they stay whole until the last micro step
        grads = w * P if zero_stage == 1 and accumulation > 1 else w * part
        s = dict(params=w * P, grads=grads, master=4 * part, fp32_grads=4 * part if mixed else 0,
                 optimizer=8 * part)
    else:
        sharded = P - shape.small_params
        s = dict(params=w * (sharded / n + shape.small_params), grads=w * part, master=4 * part,
                 fp32_grads=4 * part if mixed else 0, optimizer=8 * part)
    out = {k: {"device": float(v), "host": 0.0} for k, v in s.items()}
    if offload_optimizer and zero_stage >= 1:
        for k in ("master", "fp32_grads", "optimizer"):
            out[k] = {"device": 0.0, "host": 4.0 * part if k != "optimizer" else 8.0 * part}
        if zero_stage >= 2:  # reduced gradient partitions are copied straight into the host fp32 buffer
            out["grads"] = {"device": 0.0, "host": 0.0}
    if offload_params and zero_stage == 3:
        out["params"] = {"device": 0.0, "host": out["params"]["device"]}
    return out


def activation_bytes(shape: ModelShape, *, micro_batch: int, precision: str, checkpointing: bool = False,
                     dropout: bool = False, attention: str = "sdpa", backend: str = "cuda") -> dict[str, float]:
    """Bytes autograd keeps for one micro batch: {"stored": during forward, "peak": at the worst
    point of backward}. Per block (T tokens, D width, M hidden) see the module docstring."""
    a, B, T, D, M = BYTES[precision], micro_batch, shape.tokens, shape.width, shape.mlp_dim
    h = shape.heads
    mask = 1 if backend == "cuda" else a
    per_token = a * B * (8 * D + 2 * M) + 4 * B * (4 + h)  # + LN stats, log-sum-exp (fp32)
    if dropout:  # masks after proj, GELU and fc2 (fc2 then keeps the dropped hidden instead of GELU's output)
        per_token += mask * B * (2 * D + M)
    if attention == "math":  # softmax(QK^T) kept for backward: a row of T per head
        per_token += a * B * h * T
    per_block = T * per_token
    # the image (the patch conv's input) and the head (final LN in: token 0, or every token for GAP; logits)
    head_tokens = 1 if shape.config.get("pool", "token") == "token" else T
    ends = a * B * (shape.in_chans * shape.img_size**2 + head_tokens * D) + 4 * B * max(shape.num_classes, 1) * 2
    block_input = a * B * T * D
    if head_tokens == 1:  # the last block computes token 0 only: all tokens keep LN1 in/out and the qkv
        # GEMM's output (q, k, v: token 0's query is a slice of it, counted in per_token)
        last_block = a * B * (T * 5 - 1) * D + 4 * B * T * 2 + per_token
    else:
        last_block = per_block
    if checkpointing:
        stored = shape.depth * block_input + ends
        # one block recomputed in backward, plus the gradient flowing through it
        peak = stored + per_block + 2 * block_input + a * B * T * M
    else:
        stored = (shape.depth - 1) * per_block + last_block + ends
        # backward of a block holds the grads of its widest tensors next to what is still stored
        peak = stored + 2 * block_input + a * B * T * M
    return {"per_block": float(per_block), "stored": float(stored), "peak": float(peak)}


def buffer_bytes(shape: ModelShape, *, precision: str, zero_stage: int, world_size: int, backend: str = "cuda",
                 reduce_bucket_size: int = 50_000_000, allreduce_bucket_size: int = 500_000_000,
                 max_live_parameters: int = 1_000_000_000, overlap_comm: bool | None = None,
                 offload_optimizer: bool = False, offload_params: bool = False,
                 grad_accum: str | None = None) -> dict[str, float]:
    """Framework buffers per rank in bytes: gradient buckets, ZeRO-3 gathered parameters, optimizer
    temporaries, CUDA context.

    Bucket sizes are elements, defaults as pipeline/train/engine.py sets them (stage 0 uses DeepSpeed's own
    allreduce_bucket_size; ZeRO-3 keeps two reduce-bucket buffers). `overlap_comm` defaults as the
    engine sets it (on with CUDA) and doubles the stage 1-2 bucket. ZeRO-3 with DeepSpeed's default
    stage3_max_live_parameters / max_reuse_distance (1e9) keeps every gathered layer alive through
    forward and backward, so a model under 1e9 parameters is whole on each rank while it runs.
    On CPU torch's AdamW (single-tensor) makes a temporary the size of the tensor it updates.
    Stage 1 on the fp32-accumulation path (BF16_Optimizer) has no reduce buckets: after backward it
    all-reduces its fp32 gradient buffer through a flat fp32 copy and its bf16 cast (6P, counted with
    the optimizer temporaries: it lives after backward, before the step).
    Gradients are reduced in REDUCE_DTYPE (the engine's `communication_data_type`): stages 0 and 2 stage
    a bucket in the model dtype (stage 1 in the accumulation dtype) and cast it to a reduction-dtype
    copy for the collective (engine.allreduce_bucket, stage_1_and_2.allreduce_bucket and
    _gradient_reduction_buffer_dtype); ZeRO-3's buckets are in the reduction dtype already.
    """
    w, P, r = BYTES[precision], shape.params, BYTES[REDUCE_DTYPE]
    stage = BYTES[grad_accum or grad_accum_dtype(precision, zero_stage)] if zero_stage == 1 else w
    cast = r if r != stage else 0  # the reduction-dtype copy of a bucket in flight
    touched = (lambda k: min(k, P)) if backend == "cpu" else (lambda k: k)
    if overlap_comm is None:
        overlap_comm = backend == "cuda"
    out = {"grad_bucket": 0.0, "param_gather": 0.0, "optimizer_temp": 0.0, "context": 0.0}
    if zero_stage == 0:
        out["grad_bucket"] = (w + cast) * touched(allreduce_bucket_size)  # flattened all-reduce bucket
    elif zero_stage == 1 and fp32_accumulation_path(precision, 1, grad_accum, offload_optimizer):
        out["optimizer_temp"] = 6.0 * P
    elif zero_stage in (1, 2):
        out["grad_bucket"] = ((2 if overlap_comm else 1) * stage + cast) * touched(reduce_bucket_size)
    else:
        out["grad_bucket"] = 2 * r * touched(reduce_bucket_size)
        out["param_gather"] = w * min(max_live_parameters, P)
        if offload_params:
            out["param_gather"] = 2 * w * shape.largest_layer
    if backend == "cpu":
        out["optimizer_temp"] += 4.0 * (shape.largest_layer if zero_stage == 0 else P / world_size)
    else:
        out["context"] = float(CUDA_CONTEXT)
    if offload_optimizer:
        out["optimizer_temp"] = 0.0
    return out


def memory_per_rank(shape: ModelShape, *, precision: str = "bf16", zero_stage: int = 1, world_size: int = 1,
                    micro_batch: int = 32, checkpointing: bool = False, dropout: bool = False,
                    offload_optimizer: bool = False, offload_params: bool = False, backend: str = "cuda",
                    attention: str = "sdpa", accumulation: int = 1, grad_accum: str | None = None,
                    **buffer_kw) -> dict:
    """The whole breakdown for one rank, in bytes.

    Returns {"states": {...}, "activations": {...}, "buffers": {...}, "model_states": device bytes,
    "host": host bytes per rank, "total": peak device bytes}. Peak = persistent states + context + the
    larger of the backward phase (activations, buckets, gathered ZeRO-3 parameters) and the optimizer
    step (fp32 grads, temporaries). On CUDA the caching allocator holds a bucket whole next to the
    activations; on CPU (stages 0-2) the bucket's pages fill as backward frees activations, so the
    phase costs the larger of the two.
    """
    if micro_batch < 1:
        raise ValueError(f"micro batch must be >= 1; got {micro_batch}")
    states = model_states(shape, precision=precision, zero_stage=zero_stage, world_size=world_size,
                          offload_optimizer=offload_optimizer, offload_params=offload_params,
                          accumulation=accumulation, grad_accum=grad_accum)
    acts = activation_bytes(shape, micro_batch=micro_batch, precision=precision, checkpointing=checkpointing,
                            dropout=dropout, attention=attention, backend=backend)
    bufs = buffer_bytes(shape, precision=precision, zero_stage=zero_stage, world_size=world_size,
                        backend=backend, offload_optimizer=offload_optimizer, offload_params=offload_params,
                        grad_accum=grad_accum, **buffer_kw)
    dev = sum(v["device"] for v in states.values())
    host = sum(v["host"] for v in states.values())
    step_only = states["fp32_grads"]["device"]
    persistent = dev - step_only + bufs["context"]
    bucket = bufs["grad_bucket"]
    if zero_stage == 0:  # grads are freed after each step: they fill in as backward frees activations,
        persistent -= states["grads"]["device"]  # then the flattened all-reduce bucket copies them
        backward = max(acts["peak"], states["grads"]["device"] + bucket)
        step = states["grads"]["device"] + step_only + bufs["optimizer_temp"]
    elif zero_stage == 3:  # both buckets stay resident; gathered parameters live through the pass
        persistent += bucket
        backward = acts["peak"] + bufs["param_gather"]
        step = step_only + bufs["optimizer_temp"]
    elif backend == "cuda":
        persistent += bucket
        backward = acts["peak"]
        step = step_only + bufs["optimizer_temp"]
    else:
        backward = max(acts["peak"], bucket)
        step = step_only + bufs["optimizer_temp"]
    total = persistent + max(backward, step)
    return {"states": states, "activations": acts, "buffers": bufs, "model_states": dev, "host": host,
            "total": total}


def checkpoint_bytes(params: float, *, precision: str, zero_stage: int, world_size: int) -> dict[str, float]:
    """Bytes of one checkpoint's files: ``total`` over the ranks, and ``rank0``'s share, the largest
    (its host snapshot under checkpoint.async, one per rank at most). P parameters, N ranks, w bytes a
    parameter: the module file (rank 0; w P, with the whole optimizer at stage 0: 8P Adam m, v and 4P
    fp32 master when mixed) and at stages 1-3 each rank's optimizer partition (4P/N master + 8P/N Adam;
    stage 3's module file holds the partition's parameters, w P/N)."""
    w, P, n = BYTES[precision], float(params), world_size
    if zero_stage == 0:
        rank0 = w * P + 8 * P + (4 * P if w != 4 else 0)
        return {"total": rank0, "rank0": rank0}
    module = w * P / n if zero_stage == 3 else w * P
    part = 12 * P / n
    return {"total": (module * n if zero_stage == 3 else module) + 12 * P, "rank0": module + part}
