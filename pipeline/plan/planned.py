"""A config as `vitp plan` plans it (its world size the cluster section's, ``engine.zero_stage: auto``
taken as the stage it recommends) and the plan over a sweep of options."""

from __future__ import annotations

import itertools

from pipeline.plan.cost import PlanError, model_shape, plan
from pipeline.plan.memory import GiB
from pipeline.plan.recommend import resolve_zero_stage


def sweep(config_path, overrides: list[str], axes: list[tuple[str, list[str]]], *, resources=None,
          **plan_kw) -> list[dict]:
    """One row per combination: its overrides, and the plan's numbers (or why the combination is invalid)."""
    from pipeline.config import ConfigError

    rows, shape_cache = [], {}
    for combo in itertools.product(*[[(k, v) for v in vals] for k, vals in axes]):
        extra = [f"{k}={v}" for k, v in combo]
        row = {"set": dict(combo)}
        try:
            cfg = load_planned(config_path, overrides + extra, resources)
            if combo and any(k == "engine.offload_optimizer" and v == "true" for k, v in combo) \
                    and cfg.engine.zero_stage == 0:
                raise PlanError("offload needs zero >= 1")
            key = (cfg.model.name, cfg.model.img_size)
            if key not in shape_cache:
                shape_cache[key] = model_shape(cfg, plan_kw.get("num_classes"))
            p = plan(cfg, shape=shape_cache[key][0], **plan_kw)
            row.update(gib=p["memory"]["total"] / GiB, fits=p["verdict"]["fits"],
                       max_mb=p["verdict"]["max_micro_batch"], step_s=p["time"]["step_s"],
                       bound=p["time"]["bound"], img_s=p["throughput"]["images_per_s"],
                       gpu_hours=p["cost"]["gpu_hours"])
        except (ConfigError, PlanError) as err:
            row["invalid"] = str(err)
        rows.append(row)
    return rows


def load_planned(config_path, overrides: list[str], resources=None):
    """Load a config [+ a resources file] and validate it for the planned world size (cluster.nodes x
    tasks_per_node)."""
    from pipeline.config import load_config, validate

    # every other check, before the world size
    cfg = load_config(config_path, overrides, world_size=1, resources=resources)
    cfg, _ = resolve_zero_stage(cfg)  # the plan of "auto" is the plan of the stage it recommends
    validate(cfg, world_size=cfg.world_size_planned)
    return cfg
