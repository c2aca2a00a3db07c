"""Which ZeRO stage a model should train with on a cluster, and why (`vitp plan`'s recommendation).

For ZeRO-1, -2 and -3, with and without activation checkpointing, at the recipe's micro batch and
accumulation on the cluster's GPUs: memory per GPU (pipeline/plan/memory.py, as vitp's engine
configures DeepSpeed: bf16, fp32 gradient accumulation) and the step time with the bytes each rank
sends per optimizer step (pipeline/plan/cost.py). The rule:

1. the first tier in which something fits: ZeRO-1/2 without activation checkpointing, ZeRO-3 without,
   ZeRO-1/2 with, ZeRO-3 with. Checkpointing recomputes every forward (4/3 of the compute); ZeRO-3 is
   for models whose states do not fit otherwise: vitp compiles no blocks and keeps no EMA under it, and
   its per-layer gathers are latency the byte count does not see;
2. within the tier, the shortest step (compute + the communication it does not hide), then the fewest
   bytes moved, then the lower stage (fewer collectives per step).

What it weighs, per optimizer step (n ranks, G = one bf16 copy of the gradients, accumulation a), as
deepspeed 0.19.8 sends it: ZeRO-1 (BF16_Optimizer under bf16) all-reduces its fp32 gradients after
backward and all-gathers the parameters, 5 G (n-1)/n, whatever a is, none of it hidden, and keeps a
whole fp32 gradient buffer per GPU. ZeRO-2 all-reduces (not reduce-scatters: each bucket goes to
every rank) its fp32 buckets during every micro step's backward, 4 a G (n-1)/n, hidden behind it as
far as the link allows, then gathers the parameters, G (n-1)/n. ZeRO-3 reduce-scatters and gathers the
parameters twice per micro step, 4 a G (n-1)/n, overlapping compute.
"""

from __future__ import annotations

from pipeline.config.batch import BatchLayout
from pipeline.plan.cost import PlanError, model_shape, step_time
from pipeline.plan.memory import GiB, ModelShape, memory_per_rank

STAGES = (1, 2, 3)


def _variant(cfg, stage: int, checkpointing: bool):
    engine = cfg.engine.model_copy(update={"zero_stage": stage, "offload_optimizer": False, "offload_params": False})
    model = cfg.model.model_copy(update={"grad_checkpointing": checkpointing})
    return cfg.model_copy(update={"engine": engine, "model": model})


def options(cfg, shape: ModelShape, *, backend: str = "cuda", headroom: float = 0.0) -> list[dict]:
    """One row per (stage, checkpointing): GiB per GPU, fits, bytes sent per rank per step, step seconds."""
    n = cfg.world_size_planned
    accum = max(BatchLayout.planned(cfg.train, n).accumulation, 1)
    budget = cfg.hardware.device_mem_gb * GiB * (1 - headroom)
    rows = []
    for ckpt in (False, True):
        for stage in STAGES:
            v = _variant(cfg, stage, ckpt)
            mem = memory_per_rank(shape, precision=v.engine.precision, zero_stage=stage, world_size=n,
                                  micro_batch=v.train.micro_batch, checkpointing=ckpt,
                                  dropout=max(v.model.dropout, v.model.attn_dropout) > 0, backend=backend,
                                  accumulation=accum)
            st = step_time(v, shape)
            rows.append({"stage": stage, "checkpointing": ckpt, "gib": mem["total"] / GiB,
                         "model_states_gib": mem["model_states"] / GiB, "fits": mem["total"] <= budget,
                         "comm_bytes": st["comm_bytes"], "step_s": st["step_s"], "bound": st["bound"],
                         "accumulation": accum})
    return rows


def recommend(cfg, shape: ModelShape, *, backend: str = "cuda", headroom: float = 0.0) -> dict:
    """{"stage", "checkpointing", "reason", "options"}; stage None when nothing fits (then the reason
    says what to change)."""
    rows = options(cfg, shape, backend=backend, headroom=headroom)
    n = cfg.world_size_planned
    plain = [r for r in rows if not r["checkpointing"] and r["fits"]]
    tiers = [[r for r in rows if r["fits"] and r["checkpointing"] == ckpt and (r["stage"] == 3) == z3]
             for ckpt in (False, True) for z3 in (False, True)]
    pool = next((tier for tier in tiers if tier), [])
    where = f"{n} GPUs of {cfg.hardware.device_mem_gb:g} GB, micro batch {cfg.train.micro_batch} x accumulation " \
            f"{rows[0]['accumulation']}"
    if not pool:
        return {"stage": None, "checkpointing": None, "options": rows,
                "reason": f"no ZeRO stage fits on {where}, even with activation checkpointing: lower "
                          "train.micro_batch, add nodes, or offload (engine.offload_optimizer=true)"}
    best = min(pool, key=lambda r: (r["step_s"], r["comm_bytes"], r["stage"]))
    rivals = [r for r in pool if r["checkpointing"] == best["checkpointing"] and r is not best]
    mem = ", ".join(f"ZeRO-{r['stage']} {r['gib']:.1f}" for r in rows if r["checkpointing"] == best["checkpointing"])
    fit = ("every stage fits without it" if len(plain) == len(STAGES) else "it fits without it"
           if not best["checkpointing"] else "no stage fits without it")
    if best["stage"] != 3 and any(r["stage"] == 3 and r["checkpointing"] == best["checkpointing"] for r in pool + rows
                                  if r["fits"]):
        fit += "; ZeRO-3 only where ZeRO-1/2 do not fit"
    vs = lambda key, fmt: ", ".join(f"ZeRO-{r['stage']} {fmt(r[key])}" for r in rivals)
    tie = [r for r in rivals if r["step_s"] == best["step_s"]]
    reason = (f"ZeRO-{best['stage']} {'with' if best['checkpointing'] else 'without'} activation checkpointing: "
              f"{fit} (GiB per GPU: {mem}); it sends {best['comm_bytes'] / 1e9:.2f} GB per rank per step "
              f"({vs('comm_bytes', lambda b: f'{b / 1e9:.2f}')}), step {best['step_s'] * 1e3:.0f} ms "
              f"({vs('step_s', lambda t: f'{t * 1e3:.0f}')}; {best['bound']}-bound"
              + (f", a tie with {', '.join('ZeRO-' + str(r['stage']) for r in tie)} broken by fewer bytes"
                 if tie else "") + f"), on {where}")
    return {"stage": best["stage"], "checkpointing": best["checkpointing"], "reason": reason, "options": rows}


def format_recommendation(rec: dict) -> str:
    L = ["== ZeRO stage for this model and cluster (bf16 model, fp32 gradient accumulation, no offload)",
         f"   {'stage':<8}{'ckpt':>6}{'GiB/GPU':>9}{'fits':>6}{'GB sent/step':>14}{'step s':>9}  bound"]
    for r in rec["options"]:
        mark = " <-" if (r["stage"], r["checkpointing"]) == (rec["stage"], rec["checkpointing"]) else ""
        L.append(f"   {'ZeRO-' + str(r['stage']):<8}{'on' if r['checkpointing'] else 'off':>6}{r['gib']:9.1f}"
                 f"{'yes' if r['fits'] else 'NO':>6}{r['comm_bytes'] / 1e9:14.2f}{r['step_s']:9.3f}  "
                 f"{r['bound']}{mark}")
    L.append(f"   recommended: {rec['reason']}")
    return "\n".join(L)


def resolve_zero_stage(cfg, *, backend: str = "cuda"):
    """``engine.zero_stage: auto`` made the recommended stage: -> (the config with it, one line saying so),
    or (``cfg``, None) when the stage is given. Raises PlanError when no stage fits."""
    if cfg.engine.zero_stage != "auto":
        return cfg, None
    rec = recommend(cfg, model_shape(cfg)[0], backend=backend)
    if rec["stage"] is None:
        raise PlanError(f"engine.zero_stage: auto: {rec['reason']}")
    engine = cfg.engine.model_copy(update={"zero_stage": rec["stage"]})
    note = (f"engine.zero_stage: auto -> {rec['stage']} (vitp plan: {rec['reason']})"
            + ("" if rec["checkpointing"] == cfg.model.grad_checkpointing else
               f"; it would also set model.grad_checkpointing={str(rec['checkpointing']).lower()}"))
    return cfg.model_copy(update={"engine": engine}), note
