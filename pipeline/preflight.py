"""`vitp preflight`, what runs on every rank: prove the cluster before the big job.

A stage like the others (``preflight(cfg, **want) -> dict``) started by launch/preflight.py through
the same submit machinery, on the target partition and node count, in a process group that is
always gloo (so the report reaches rank 0 even where NCCL is broken). Each rank measures, rank 0
gathers and judges:

    driver      torch's CUDA build vs the node's NVIDIA driver (pipeline.driver's table)
    gpus        GPUs visible per task, the device each rank takes, LOCAL_RANK vs that device
    all-reduce  bus bandwidth over every rank: NCCL on GPUs (vs the bus bandwidth vitp plan assumes), gloo on CPU
    side group  a barrier on the gloo side group (the one rank-0-only waits use), its interface
    run.dir     write + fsync throughput per node; a checkpoint must fit in cluster.signal_delay_s
    shards      read throughput per node (page cache dropped) vs what `vitp plan`'s step rate needs

Bus bandwidth is nccl-tests' (``all_reduce_perf``): algbw = bytes / time, busbw = algbw x 2(n-1)/n,
the per-rank link rate a ring all-reduce achieved, the rate `vitp plan` moves a rank's bytes at.
A check never raises out of a rank (the others would wait in the next collective): its failure is a
row; rank 0's verdict names the first failed row in one line.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

OK, FAIL, WARN, SKIP = "ok", "FAIL", "warn", "skip"
MB = 1e6


@dataclass
class Row:
    check: str
    where: str  # a node name, or "all"
    status: str  # ok | FAIL | warn | skip
    value: str  # what was measured
    need: str = ""  # what the run needs (or the reference it is compared with)


# --------------------------------------------------------------------------------------------------
# Pure parts (unit-tested)
# --------------------------------------------------------------------------------------------------
def bus_bandwidth(nbytes: float, seconds: float, world: int) -> float:
    """All-reduce bus bandwidth in GB/s (nccl-tests): bytes/time x 2(n-1)/n; 0 for one rank."""
    if world < 2 or seconds <= 0:
        return 0.0
    return nbytes / seconds * 2 * (world - 1) / world / 1e9


def fabric_gbps(hardware, nodes: int) -> tuple[float, str]:
    """The bus bandwidth `vitp plan` assumes a ring over the job's ranks runs at, and that assumption
    in words (pipeline/plan/cost.py: NVLink on one node, the NIC rails across nodes)."""
    from pipeline.plan.cost import bus_assumption, bus_gbps

    return bus_gbps(hardware, nodes), bus_assumption(hardware, nodes)


def checkpoint_bytes(params: int, precision: str) -> int:
    """Bytes of one checkpoint: the weights in the model dtype plus fp32 master weights and Adam's m, v
    (fp32 runs: the weights are the master copy)."""
    w = {"fp32": 4, "bf16": 2, "fp16": 2}[precision]
    return params * (w + (8 if precision == "fp32" else 12))


def binding_rows(reports: list[dict], want_gpus: bool) -> list[Row]:
    """One row per node: GPUs each task sees, the device it takes, and what would break.

    A report: {rank, host, local_rank, env_local_rank, visible (CUDA_VISIBLE_DEVICES or None),
    count (torch.cuda.device_count()), device (index taken, or None), uuid (of that device)}.
    """
    rows = []
    for host in sorted({r["host"] for r in reports}, key=_node_key):
        mine = sorted((r for r in reports if r["host"] == host), key=lambda r: r["rank"])
        desc = ", ".join(f"r{r['rank']}: {r['count']} visible" + (f" -> cuda:{r['device']}" if r["device"] is not None
                                                                 else "") for r in mine)
        if not want_gpus:
            rows.append(Row("gpus", host, SKIP, desc, "no GPU asked for"))
            continue
        bad = _binding_problem(mine)
        rows.append(Row("gpus", host, FAIL if bad else OK, bad or desc, "one GPU per task"))
    return rows


def _binding_problem(mine: list[dict]) -> str | None:
    for r in mine:
        if r["count"] == 0:
            return f"rank {r['rank']} sees no GPU (CUDA_VISIBLE_DEVICES={r['visible']!r})"
        if r["device"] is None:
            return f"rank {r['rank']}: {r.get('error') or 'no device chosen'}"
        if r["env_local_rank"] >= r["count"]:
            # DeepSpeed allocates on cuda:{LOCAL_RANK} (ZeRO-3's coordinator): invalid ordinal there
            return (f"rank {r['rank']}: LOCAL_RANK={r['env_local_rank']} but {r['count']} GPU(s) visible to the task "
                    f"(per-task binding): DeepSpeed would allocate on cuda:{r['env_local_rank']}")
    seen: dict[str, int] = {}
    for r in mine:
        key = r.get("uuid") or f"{r['visible']}:{r['device']}"
        if key in seen:
            return f"ranks {seen[key]} and {r['rank']} share one GPU ({key})"
        seen[key] = r["rank"]
    return None


def _node_key(host: str):
    digits = "".join(ch for ch in host if ch.isdigit())
    return (host.rstrip("0123456789"), int(digits) if digits else 0, host)


def format_table(rows: list[Row]) -> str:
    head = ("check", "node", "status", "measured", "needs / compared with")
    cells = [head] + [(r.check, r.where, r.status, r.value, r.need) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(4)) + "  " + c[4] for c in cells]
    return "\n".join(x.rstrip() for x in [lines[0], "  ".join("-" * w for w in widths) + "  " + "-" * 21, *lines[1:]])


def verdict(rows: list[Row]) -> tuple[bool, str]:
    """(passed, one line): the first failed check names itself, where, what and what was needed."""
    failed = [r for r in rows if r.status == FAIL]
    if not failed:
        nodes = {r.where for r in rows if r.where != "all"}
        return True, f"preflight PASSED: {len(rows)} checks on {len(nodes)} node(s)"
    r = failed[0]
    more = f" (+{len(failed) - 1} more failed)" if len(failed) > 1 else ""
    need = f"; needs {r.need}" if r.need else ""
    return False, f"preflight FAILED: {r.check} on {r.where}: {r.value}{need}{more}"


# --------------------------------------------------------------------------------------------------
# What each rank measures
# --------------------------------------------------------------------------------------------------
def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _gpu_report(rank: int, want_gpus: bool) -> dict:
    import torch

    env_lr = int(os.environ.get("LOCAL_RANK", "0") or 0)
    rep = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "env_local_rank": env_lr, "count": 0,
           "device": None, "uuid": None}
    if not want_gpus or not torch.cuda.is_available():
        return rep
    from pipeline.distributed import AcceleratorError, dist_env, local_device_index

    rep["count"] = torch.cuda.device_count()
    try:
        rep["device"] = local_device_index(dist_env())
        rep["uuid"] = str(getattr(torch.cuda.get_device_properties(rep["device"]), "uuid", "") or "") or None
    except AcceleratorError as e:
        rep["error"] = str(e)
    return rep


def write_throughput(run_dir: str, mb: int, tag: str) -> dict:
    """Write ``mb`` MiB to run_dir, fsync, remove the file; MB/s including the fsync (what a checkpoint
    pays). The folders it makes stay until every node is done (:func:`remove_probe`, rank 0)."""
    base = Path(run_dir)
    probe = base / ".preflight"
    f = probe / f"{tag}.bin"
    try:
        probe.mkdir(parents=True, exist_ok=True)
        chunk = os.urandom(4 << 20)
        todo = mb << 20
        t = time.perf_counter()
        with open(f, "wb") as fh:
            while todo > 0:
                todo -= fh.write(chunk[: min(len(chunk), todo)])
            fh.flush()
            os.fsync(fh.fileno())
        dt = time.perf_counter() - t
        return {"mb_s": (mb << 20) / dt / MB, "bytes": mb << 20, "seconds": dt}
    except OSError as e:
        return {"error": f"run.dir {run_dir}: not writable ({type(e).__name__}: {e.strerror or e})"}
    finally:
        with contextlib.suppress(OSError):  # an unwritable run.dir has no file to remove
            f.unlink()


def remove_probe(run_dir: str, made: bool) -> None:
    """After every node has written (rank 0): the probe folder, and run_dir itself when the preflight
    made it and it is empty. Deciding this per node raced: a node that saw run_dir made by another
    node's write kept it, and the other could not remove it while the first was still writing."""
    for p in (Path(run_dir) / ".preflight", *([Path(run_dir)] if made else [])):
        try:
            p.rmdir()
        except OSError:
            pass


def read_throughput(data_path: str, split: str, node_index: int, budget_mb: int) -> dict:
    """Read whole shards of ``split`` (this node starts at its own shard) up to ``budget_mb``, with the
    page cache dropped first; MB/s, and the split's mean bytes per sample."""
    from pipeline.data import DataError, read_info

    if not data_path:
        return {"skip": "data.path is empty"}
    try:
        sp = read_info(data_path).split(split)
    except (DataError, OSError) as e:
        return {"error": f"data.path {data_path}: {str(e).splitlines()[0]} (seen from this node)"}
    if not sp.urls:
        return {"skip": "no shard files (synthetic data or an image folder)"}
    if any("://" in u or u.startswith("pipe:") for u in sp.urls):
        return {"skip": "remote shards (not measured)"}
    try:
        sizes = [os.path.getsize(u) for u in sp.urls]
    except OSError as e:
        return {"error": f"data.path {data_path}: shard not readable from this node ({e})"}
    order = [sp.urls[(node_index + i) % len(sp.urls)] for i in range(len(sp.urls))]
    done, n, t = 0, 0, time.perf_counter()
    for url in order:
        with open(url, "rb", buffering=0) as fh:
            if hasattr(os, "posix_fadvise"):  # read from the file system, not this node's page cache
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            while block := fh.read(8 << 20):
                done += len(block)
        n += 1
        if done >= budget_mb << 20:
            break
    dt = max(time.perf_counter() - t, 1e-9)
    return {"mb_s": done / dt / MB, "bytes": done, "shards": n,
            "sample_bytes": sum(sizes) / max(sp.num_samples, 1)}


def _timed_all_reduce(t, group, iters: int, sync) -> float:
    """Median seconds of one all-reduce of ``t`` over ``group`` after two warm-up ones."""
    import torch.distributed as dist

    times = []
    for i in range(iters + 2):
        dist.barrier(group=group)
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(t, group=group)
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def route_address(master: str) -> str:
    """The local address this node uses to reach ``master`` (the interface gloo should bind)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))  # UDP: no packet is sent, the kernel only picks the route
            return s.getsockname()[0]
    except OSError as e:
        return f"? ({e.strerror or e})"


def _leader_report(cfg, host: str, rank: int, node_index: int, io_mb: int, read_mb: int) -> dict:
    """What one task per node measures for its node: driver, run.dir, shards."""
    from pipeline.driver import node_driver, torch_cuda

    return {"torch_cuda": torch_cuda(), "driver": node_driver(),
            "io": write_throughput(cfg.run.dir, io_mb, f"{host}-{rank}"),
            "read": read_throughput(cfg.data.path, cfg.data.train_split, node_index, read_mb)}


def _collectives(want_nccl: bool, gpu: dict, mb: float, world: int) -> dict:
    """Every rank, in the same order: gloo all-reduce (default group), side-group barrier, NCCL all-reduce."""
    import torch
    import torch.distributed as dist

    from pipeline.distributed import wait_for_rank0

    out: dict = {}
    n = max(1, int(mb * (1 << 20)) // 4)
    check = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(check)  # every rank must hold 1 + 2 + ... + world
    out["gloo_sum_ok"] = bool(torch.all(check == world * (world + 1) / 2))
    out["gloo_s"] = _timed_all_reduce(torch.zeros(n), None, 5, lambda: None)
    out["bytes"] = n * 4
    t0 = time.perf_counter()
    wait_for_rank0()
    out["side_s"] = time.perf_counter() - t0
    ready = torch.tensor([1.0 if (want_nccl and gpu["device"] is not None) else 0.0])
    dist.all_reduce(ready, op=dist.ReduceOp.MIN)  # NCCL only where every rank has its GPU
    if want_nccl and ready.item() == 1.0:
        torch.cuda.set_device(gpu["device"])
        group = dist.new_group(backend="nccl")
        try:
            t = torch.zeros(n, device="cuda")
            out["nccl_s"] = _timed_all_reduce(t, group, 5, torch.cuda.synchronize)
        finally:
            dist.destroy_process_group(group)
    return out


def preflight(cfg, *, want_gpus: bool = False, want_nccl: bool = False, io_mb: int = 256, read_mb: int = 1024,
              allreduce_mb: float = 64, min_fabric: float = 0.5) -> dict:
    """Every rank measures; rank 0 returns {"status": "completed", "passed", "verdict", "table", "rows"}.

    ``want_gpus``/``want_nccl``: what the real run asks for (its cluster.gpus_per_node and
    engine.backend; this job's own group is gloo). Sizes in MiB; ``min_fabric``: the fraction of the
    resources file's fabric figure NCCL's bus bandwidth must reach.
    """
    from pipeline.distributed import broadcast_from_rank0, dist_env, gather_object, rank_world

    d = dist_env()
    rank, world = rank_world()
    made = broadcast_from_rank0(not Path(cfg.run.dir).exists())  # looked at before any node writes there
    host = node_name()
    node_index = rank // max(1, d.local_world_size)
    rep = {"rank": rank, "host": host, "local_rank": d.local_rank, **_gpu_report(rank, want_gpus),
           "route": route_address(d.master_addr), "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
    if d.local_rank == 0:
        rep["node"] = _leader_report(cfg, host, rank, node_index, io_mb, read_mb)
    coll = _collectives(want_nccl, rep, allreduce_mb, world)
    reports = gather_object(rep)  # every node's write is done
    if rank != 0:
        return {"status": "completed"}
    remove_probe(cfg.run.dir, made)
    rows = judge(cfg, reports, coll, want_gpus=want_gpus, want_nccl=want_nccl, min_fabric=min_fabric)
    passed, line = verdict(rows)
    table = format_table(rows)
    print(table + "\n" + line, flush=True)
    return {"status": "completed", "passed": passed, "verdict": line, "table": table,
            "rows": [asdict(r) for r in rows]}


# --------------------------------------------------------------------------------------------------
# Rank 0: the rows
# --------------------------------------------------------------------------------------------------
def planned(cfg) -> dict:
    """`vitp plan`'s numbers the checks compare with: images/s for the job, parameters."""
    from pipeline.config import ConfigError
    from pipeline.plan.cost import PlanError, plan

    try:
        p = plan(cfg)
    except (ConfigError, PlanError) as e:
        return {"error": str(e)}
    return {"images_per_s": p["throughput"]["images_per_s"], "params": p["model"]["params"]}


def judge(cfg, reports: list[dict], coll: dict, *, want_gpus: bool, want_nccl: bool, min_fabric: float,
          plan: dict | None = None) -> list[Row]:
    """The table's rows, from every rank's report (rank order) and rank 0's collective timings."""
    plan = planned(cfg) if plan is None else plan
    leaders = sorted((r for r in reports if "node" in r), key=lambda r: _node_key(r["host"]))
    nodes = max(1, len(leaders))
    world = len(reports)
    rows = [_driver_row(r, want_gpus) for r in leaders]
    rows += binding_rows(reports, want_gpus)
    rows += _collective_rows(cfg, coll, reports, world, nodes, want_gpus, want_nccl, min_fabric)
    rows += [_io_row(cfg, r, plan, nodes) for r in leaders]
    rows += [_read_row(r, plan, nodes) for r in leaders]
    return rows


def _driver_row(r: dict, want_gpus: bool) -> Row:
    from pipeline.driver import driver_problem, min_driver, parse_version

    cuda, drv = r["node"]["torch_cuda"], r["node"]["driver"]
    value = f"torch CUDA {cuda or 'none (CPU build)'}, driver {drv or 'none'}"
    need = ""
    if cuda:
        try:
            low = min_driver(cuda)
            need = f"driver >= {'.'.join(map(str, low))} for CUDA {parse_version(cuda)[0]}.x" if low else ""
        except ValueError:
            pass
    if not want_gpus:
        return Row("driver", r["host"], SKIP, value, "no GPU asked for")
    problem = driver_problem(cuda, drv, where=r["host"])
    return Row("driver", r["host"], FAIL, problem) if problem else Row("driver", r["host"], OK, value, need)


def _collective_rows(cfg, coll, reports, world, nodes, want_gpus, want_nccl, min_fabric) -> list[Row]:
    size = f"{coll['bytes'] / (1 << 20):g} MiB x {world} ranks"
    rows = []
    if world < 2:
        rows.append(Row("all-reduce", "all", SKIP, f"1 rank ({size}): no link to measure"))
    else:
        bus = bus_bandwidth(coll["bytes"], coll["gloo_s"], world)
        value = f"gloo {size}: bus {bus:.2f} GB/s ({coll['gloo_s'] * 1e3:.1f} ms)"
        ok = coll["gloo_sum_ok"]
        rows.append(Row("all-reduce", "all", OK if ok else FAIL,
                        value if ok else "gloo all-reduce returned a wrong sum",
                        "the CPU run's collective" if not want_nccl else "the side channel (training uses NCCL)"))
    if want_nccl:
        fabric, key = fabric_gbps(cfg.hardware, nodes)
        if "nccl_s" not in coll:
            bad = next((f"{r['host']} rank {r['rank']}" for r in reports if r["device"] is None), "a rank")
            rows.append(Row("nccl", "all", FAIL, f"not run: no usable GPU on {bad}", key))
        elif world >= 2:
            bus = bus_bandwidth(coll["bytes"], coll["nccl_s"], world)
            need = f">= {min_fabric:g} x {key}"
            rows.append(Row("nccl", "all", OK if bus >= min_fabric * fabric else FAIL,
                            f"NCCL {size}: bus {bus:.1f} GB/s ({coll['nccl_s'] * 1e3:.2f} ms)", need))
    routes = ", ".join(f"{r['host']} via {r['route']}" + (f" ({r['ifname']})" if r["ifname"] else "")
                       for r in reports if "node" in r)
    if world >= 2:
        rows.append(Row("side group", "all", OK, f"gloo barrier over {world} ranks in {coll['side_s'] * 1e3:.1f} ms",
                        f"routes to MASTER_ADDR: {routes}"))
    return rows


def _io_row(cfg, r: dict, plan: dict, nodes: int) -> Row:
    io = r["node"]["io"]
    if "error" in io:
        return Row("run.dir write", r["host"], FAIL, io["error"])
    value = f"{io['mb_s']:.0f} MB/s ({io['bytes'] >> 20} MiB + fsync)"
    if "params" not in plan:
        return Row("run.dir write", r["host"], OK, value, f"plan: {plan.get('error')}")
    per_node = checkpoint_bytes(plan["params"], cfg.engine.precision) / nodes
    secs = per_node / (io["mb_s"] * MB)
    limit = cfg.cluster.signal_delay_s
    need = f"checkpoint {per_node / 1e9:.2f} GB/node in {secs:.1f} s <= cluster.signal_delay_s {limit}"
    return Row("run.dir write", r["host"], OK if secs <= limit else FAIL, value, need)


def _read_row(r: dict, plan: dict, nodes: int) -> Row:
    rd = r["node"]["read"]
    if "error" in rd:
        return Row("shards read", r["host"], FAIL, rd["error"])
    if "skip" in rd:
        return Row("shards read", r["host"], SKIP, rd["skip"])
    value = f"{rd['mb_s']:.0f} MB/s ({rd['shards']} shards, {rd['bytes'] / MB:.1f} MB)"
    if "images_per_s" not in plan:
        return Row("shards read", r["host"], OK, value, f"plan: {plan.get('error')}")
    img_s = plan["images_per_s"] / nodes
    need_mb = img_s * rd["sample_bytes"] / MB
    need = f">= {need_mb:.1f} MB/s: {img_s:,.0f} img/s per node (vitp plan) x {rd['sample_bytes'] / 1e3:.1f} kB/sample"
    return Row("shards read", r["host"], OK if rd["mb_s"] >= need_mb else FAIL, value, need)
