"""What saving checkpoints costs a run, on paper: bytes, the time a save holds training, its share of the run.

    inline (checkpoint.async=false)  a save holds every rank until the whole checkpoint is written:
                                     its bytes over the job's write bandwidth (hardware.storage_write_gbps)
    async (the default)              a save holds training while each rank copies its states to host
                                     memory (the largest rank's bytes at hardware.host_copy_gbps); the
                                     write goes on in the background, and the next save waits for it
                                     only if it is still running (a write longer than the interval)

The interval between saves is checkpoint.every steps at the planned step time, or
checkpoint.every_minutes (the shorter where both are set); the share is the blocking time over the
interval plus it. Bytes per rank: :func:`pipeline.plan.memory.checkpoint_bytes`.
"""

from __future__ import annotations

from pipeline.plan.memory import checkpoint_bytes


def checkpoint_cost(cfg, params: float, step_s: float) -> dict:
    """{"bytes", "snapshot_bytes" (per rank, host), "write_s", "copy_s", "blocking_s", "interval_s",
    "share", "inline_share", "async"}; interval and shares None when the run saves only at its end."""
    e, hw, k = cfg.engine, cfg.hardware, cfg.checkpoint
    b = checkpoint_bytes(params, precision=e.precision, zero_stage=e.zero_stage, world_size=cfg.world_size_planned)
    write_s = b["total"] / (hw.storage_write_gbps * 1e9)
    copy_s = b["rank0"] / (hw.host_copy_gbps * 1e9)
    intervals = [s for s in (k.every * step_s if k.every else None, k.every_minutes * 60 or None) if s]
    interval = min(intervals) if intervals else None
    # a write longer than the interval: the next save waits for the rest of it
    blocking = copy_s + max(0.0, write_s - (interval or write_s)) if k.async_ else write_s

    def share(held: float) -> float | None:
        return held / (interval + held) if interval else None

    return {"bytes": b["total"], "snapshot_bytes": b["rank0"] if k.async_ else 0.0, "write_s": write_s,
            "copy_s": copy_s, "blocking_s": blocking, "interval_s": interval, "share": share(blocking),
            "inline_share": share(write_s), "async": k.async_}


def report_lines(ck: dict, dur) -> list[str]:
    """The plan's checkpoint section; ``dur`` formats seconds."""
    how = (f"async: each save holds training {dur(ck['blocking_s'])} (the largest rank's "
           f"{ck['snapshot_bytes'] / 1e9:.2f} GB copied to host memory, hardware.host_copy_gbps); the write goes on "
           f"in the background" if ck["async"] else f"inline: each save holds training {dur(ck['blocking_s'])}")
    L = ["", "== checkpoints (checkpoint.*)",
         f"   {ck['bytes'] / 1e9:.2f} GB per checkpoint, written in {dur(ck['write_s'])} "
         f"(hardware.storage_write_gbps)", f"   {how}"]
    if ck["interval_s"] is None:
        L.append("   saved at the end of the run only (and on preemption): see checkpoint.every, .every_minutes")
    else:
        inline = f"; inline saves would cost {ck['inline_share']:.2%}" if ck["async"] else ""
        L.append(f"   one save every {dur(ck['interval_s'])}: {ck['share']:.2%} of the run{inline}")
    return L
