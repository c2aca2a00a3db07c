"""Which ZeRO stage a model should train with on a cluster, and why (`vitp plan`'s recommendation).

For ZeRO-1, -2 and -3, with and without activation checkpointing, at the recipe's micro batch and
accumulation on the cluster's GPUs: memory per GPU (pipeline/plan/memory.py, as vitp's engine
configures DeepSpeed: bf16, fp32 gradient accumulation) and bytes each rank sends per optimizer step
(pipeline/plan/cost.py). The rule:

1. activation checkpointing only if no stage fits without it (it recomputes every forward: 4/3 of
   the compute);
2. among the stages that fit, the shortest step (max of compute and communication, as the plan
   counts it), then the fewest bytes moved, then the lower stage (fewer collectives per step).

What it weighs, per optimizer step (n ranks, G = one bf16 copy of the gradients, accumulation a):
ZeRO-1 with fp32 accumulation is DeepSpeed's BF16_Optimizer: one all-reduce after backward plus one
parameter all-gather, 3 G (n-1)/n, whatever a is, and a whole fp32 gradient buffer per GPU. ZeRO-2
reduce-scatters every micro step while backward runs and all-gathers once, (a + 1) G (n-1)/n, with
one host sync per micro step. ZeRO-3 gathers parameters in forward and backward of every micro
step, 3 a G (n-1)/n. So ZeRO-2 moves fewer bytes at accumulation 1, ZeRO-1 from accumulation 3 on,
and ZeRO-3 is for models whose states do not fit otherwise. Stage 0 is not offered: ZeRO-1 keeps the
same collectives' shape and shards the optimizer.
"""

from __future__ import annotations

from pipeline.plan.cost import step_time
from pipeline.plan.memory import GiB, ModelShape, memory_per_rank

STAGES = (1, 2, 3)


def _variant(cfg, stage: int, checkpointing: bool):
    engine = cfg.engine.model_copy(update={"zero_stage": stage, "offload_optimizer": False, "offload_params": False})
    model = cfg.model.model_copy(update={"grad_checkpointing": checkpointing})
    return cfg.model_copy(update={"engine": engine, "model": model})


def options(cfg, shape: ModelShape, *, backend: str = "cuda", headroom: float = 0.0) -> list[dict]:
    """One row per (stage, checkpointing): GiB per GPU, fits, bytes sent per rank per step, step seconds."""
    n = cfg.world_size_planned
    accum = max(cfg.train.global_batch // (n * cfg.train.micro_batch), 1)
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
    pool = plain or [r for r in rows if r["checkpointing"] and r["fits"]]
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
