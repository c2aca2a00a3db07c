"""Rank, world, rendezvous and the accelerator, from the environment of the process that trains:
a launcher's (torchrun, deepspeed, vitp local) or SLURM's. Stages call :func:`dist_env` and never
care which one started them.

- Rank-0 side effects (printing, progress) go through :func:`rank0_print`; code asks for its place
  in the group through :func:`rank_world` (the live group if there is one, else the environment).
- The accelerator is decided here, on the node that trains (:func:`choose_accelerator`), never
  inherited from the host that submitted: asking for GPUs where CUDA is not usable is a one-line
  error, not a silent CPU run.
- Every collective on training data goes through :func:`all_reduce`, which refuses a tensor that
  is not on the group's device (:func:`comm_device`): NCCL would reject a CPU tensor at step 1 on
  the cluster, gloo on a CPU test would accept it silently.
- Rank-0-only work that others must wait for (checkpoint conversion, consolidation) is awaited with
  :func:`wait_for_rank0`, a wait on the rendezvous store with a long timeout, so the NCCL watchdog
  never sees a rank parked inside a collective. Joining (the rendezvous store, the groups, the
  gloo side group) fails within engine.rendezvous_timeout_s; every collective after that, on every
  group (DeepSpeed's own too: :func:`bound_collectives`), within engine.collective_timeout_s.
- A stage sets its process up with one call, :func:`setup` (accelerator, rendezvous, group, device).
- Gloo binds to the interface that routes to MASTER_ADDR (:func:`pipeline.network.choose_gloo_interface`),
  not to whatever the hostname resolves to on a multi-NIC node, and never to loopback on the master
  node of a job that spans nodes.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass

from pipeline import slurm, world
from pipeline.errors import Classified
from pipeline.network import free_port, port_free, rendezvous_port
from pipeline.threads import steady_allocator, use_cpu_threads


@dataclass(frozen=True)
class DistEnv(world.Place):
    """A process's place (pipeline.world) and the master its ranks meet at."""

    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def _first_slurm_host(nodelist: str) -> str:
    """First hostname of a SLURM nodelist ("node[1-2]" → "node1")."""
    from pipeline.network import slurm_hostnames

    return (slurm_hostnames(nodelist) or [nodelist])[0]


def dist_env(environ: dict | None = None, *, master_addr: str = "", master_port: int = 0) -> DistEnv:
    """Rank/world (:func:`pipeline.world.place`: a launcher's variables, else SLURM's, else a single
    process) and the master to meet at.

    Under SLURM alone (no launcher), the master is the allocation's first node and a port derived
    from the job id, or ``master_addr``/``master_port`` (engine.master_addr/master_port) when set:
    never MASTER_ADDR/MASTER_PORT from the environment, which sbatch and srun copy from the
    submitting shell, stale for this allocation.
    """
    env = os.environ if environ is None else environ
    p = world.place(env)
    if p.source == world.LAUNCHER:
        addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500))
    elif p.source == world.SLURM:
        addr = master_addr or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        port = int(master_port or rendezvous_port(env.get("SLURM_JOB_ID", "0"), slurm.restart_count(env)))
    else:
        return DistEnv()
    return DistEnv(**dataclasses.asdict(p), master_addr=addr, master_port=port)


def export_env(d: DistEnv) -> None:
    """Set the torch.distributed variables so any library (DeepSpeed) sees the same rendezvous."""
    os.environ.update({
        "RANK": str(d.rank), "WORLD_SIZE": str(d.world_size), "LOCAL_RANK": str(d.local_rank),
        "LOCAL_WORLD_SIZE": str(d.local_world_size), "MASTER_ADDR": d.master_addr,
        "MASTER_PORT": str(d.master_port),
    })


def rank0_print(*args, file=None, **kwargs) -> None:
    """Print only on global rank 0 (the one helper for rank-0 console output)."""
    if dist_env().is_rank0:
        print(*args, file=file or sys.stdout, flush=True, **kwargs)


# --------------------------------------------------------------------------------------------------
# Rendezvous: fail fast and say why, instead of hanging until the scheduler's time limit.
# --------------------------------------------------------------------------------------------------
class RendezvousError(Classified, RuntimeError):
    """The ranks could not meet (port taken, a rank never arrived); the message is one line."""

    exit_code = 2


class AcceleratorError(Classified, RuntimeError):
    """GPUs were asked for but CUDA is not usable on this node; the message names why."""

    exit_code = 2
    retry = False


def _driver_cuda() -> str:
    """'driver 535.104.05 (CUDA 12.2)' from nvidia-smi, or why it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "no NVIDIA driver found (nvidia-smi missing)"
    drv = cuda = "?"
    for word, nxt in zip(out.split(), out.split()[1:]):
        if word == "Version:" and drv == "?":
            drv = nxt
        elif word == "Version:":
            cuda = nxt
    return f"driver {drv} (CUDA {cuda})" if drv != "?" else "nvidia-smi shows no GPU"


def cuda_problem() -> str | None:
    """None when CUDA is usable here, else one line saying why not (torch's CUDA vs the driver)."""
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return (f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, this node has "
            f"{_driver_cuda()}{hint}")


def wants_gpu(backend: str = "auto", gpus_per_node: int = 0) -> bool:
    return backend == "nccl" or gpus_per_node > 0


def choose_accelerator(backend: str = "auto", gpus_per_node: int = 0) -> str:
    """'cuda' or 'cpu' for this process, decided here from what the node has and what the config
    asks (engine.backend gloo: cpu; nccl or cluster.gpus_per_node: cuda or an error); sets DS_ACCELERATOR
    (overwriting one inherited from a submitting host) before DeepSpeed is imported.

    Raises AcceleratorError when GPUs were asked for (engine.backend nccl, cluster.gpus_per_node)
    and CUDA is not usable: 128 ranks silently training on CPU is worse than a failed job.
    """
    problem = cuda_problem()
    if problem is not None and wants_gpu(backend, gpus_per_node):
        why = "engine.backend=nccl" if backend == "nccl" else f"cluster.gpus_per_node={gpus_per_node}"
        cpu = " ".join([*(["engine.backend=gloo"] if backend == "nccl" else []),
                        *(["cluster.gpus_per_node=0"] if gpus_per_node > 0 else [])])
        raise AcceleratorError(f"{why} asks for GPUs but CUDA is not usable: {problem}; "
                               f"to train on the CPU, override {cpu}")
    # engine.backend=gloo is the CPU backend: such a recipe trains on the CPU even where GPUs are
    kind = "cpu" if problem is not None or backend == "gloo" else "cuda"
    os.environ["DS_ACCELERATOR"] = kind
    return kind


def default_backend(backend: str = "auto") -> str:
    if backend != "auto":
        return backend
    return "gloo" if cuda_problem() is not None else "nccl"


def local_device_index(d: DistEnv) -> int:
    """The CUDA device of this rank among the visible ones.

    With per-task binding (srun --gpus-per-task=1, --gpu-bind) each task sees only its own GPU, so
    LOCAL_RANK is not an index into what it sees: one visible device is device 0.
    """
    import torch

    n = torch.cuda.device_count()
    if n == 1:
        return 0
    if d.local_rank < n:
        return d.local_rank
    raise AcceleratorError(f"rank {d.rank}: local rank {d.local_rank} but only {n} GPUs visible to this task "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")


_COMM_DEVICE = None  # the device of the default group's collectives, set when the group is made
_SIDE_GROUP = None  # gloo group beside the default one (CPU-side messages under NCCL; preflight checks it)


def comm_device():
    """The device collectives of the default group run on: cuda:i under NCCL, cpu under gloo."""
    import torch

    return _COMM_DEVICE or torch.device("cpu")


def bind_local_rank(idx: int, visible: int, environ=None) -> None:
    """Export LOCAL_RANK as this rank's device index among the ``visible`` GPUs.

    DeepSpeed places ZeRO-3's parameters on ``cuda:{LOCAL_RANK}``; under per-task binding
    (``--gpus-per-task=1``, ``--gpu-bind``) a task sees one GPU while SLURM's local id is still 0-7:
    an invalid ordinal on 7 of 8 ranks. There, LOCAL_WORLD_SIZE becomes the visible count too (the
    ranks that share this view of the node). The DistEnv keeps the node-local rank.
    """
    env = os.environ if environ is None else environ
    env["LOCAL_RANK"] = str(idx)
    if visible < int(env.get("LOCAL_WORLD_SIZE") or 1):
        env["LOCAL_WORLD_SIZE"] = str(visible)


def _set_comm_device(backend: str, d: DistEnv):
    import torch

    global _COMM_DEVICE
    if backend == "nccl":
        idx = local_device_index(d)
        bind_local_rank(idx, torch.cuda.device_count())
        torch.cuda.set_device(idx)  # before the group exists: NCCL binds its communicator to it
        _COMM_DEVICE = torch.device("cuda", idx)
    else:
        _COMM_DEVICE = torch.device("cpu")
    return _COMM_DEVICE


def all_reduce(t, op: str = "sum"):
    """In-place all-reduce of ``t`` over the default group (a no-op without one); returns ``t``.

    Inside a group ``t`` must live on :func:`comm_device` — the rule NCCL enforces on GPUs, checked
    here on every backend so that a host tensor is caught wherever the group's device is not the
    host (tests set it to ``meta`` on CPU to play the GPU's part).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and t.device != comm_device():
        raise RuntimeError(f"collective on a {t.device} tensor, but the group's device is {comm_device()}: "
                           "create it on the training device (NCCL accepts no host tensors)")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t


def all_gather_object(obj) -> list:
    """Every rank's ``obj`` (plain tensors and values between our own ranks), in rank order."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def gather_object(obj, dst: int = 0) -> list | None:
    """Every rank's ``obj`` on rank ``dst`` (in rank order), None on the others: one collective
    that moves data only to where it is used (plain tensors and values between our own ranks)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    parts: list | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, parts, dst=dst)
    return parts


def rank_world() -> tuple[int, int]:
    """(rank, world size): of the live process group, else as the environment says."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    d = dist_env()
    return d.rank, d.world_size


def leave_process_group() -> None:
    """Destroy the default process group, if any, once a rank's work is done.

    A gloo rank that exits with its group alive can abort during interpreter teardown (its C++
    worker threads are still joinable: "terminate called without an active exception", exit -6),
    turning a finished job into a failed one. Call it where every rank ends the same way (a normal
    return, or an error all ranks agreed on): a rank still inside a collective can make it hang.
    """
    import torch.distributed as dist

    global _SIDE_GROUP, _COMM_DEVICE, _WAITS, _ACCELERATOR, _COLLECTIVE_S
    if dist.is_initialized():
        dist.destroy_process_group()
    _SIDE_GROUP = _COMM_DEVICE = _ACCELERATOR = _COLLECTIVE_S = None
    _WAITS = 0


def device_id_arg(backend: str, world_size: int, device, torch_version: str | None = None) -> dict:
    """``{"device_id": device}`` for init_process_group where binding the group to its GPU is safe,
    else ``{}`` — DeepSpeed's rule (deepspeed/comm/torch.py): only NCCL on a CUDA device, never for a
    group of one (a bound group builds every later group with ncclCommSplit, and one rank has no
    peer, DeepSpeed #8248), never on torch 2.6.0 to 2.7.0 (random hangs, pytorch#153960)."""
    import torch

    if backend != "nccl" or getattr(device, "type", None) != "cuda" or world_size == 1:
        return {}
    release = (torch_version or torch.__version__).split("+")[0]
    parts = tuple(int(x) for x in "".join(c if c.isdigit() or c == "." else " " for c in release)
                  .split()[0].split(".")[:3] if x)
    if (2, 6, 0) <= parts < (2, 7, 1):
        return {}
    return {"device_id": device}


def agent_store_serves(d: DistEnv, environ=None) -> bool:
    """torchrun's agent already serves the rendezvous store at MASTER_ADDR:MASTER_PORT (every rank
    is then a client of it, torch's own rule): rank 0 must not expect that port to be free."""
    env = os.environ if environ is None else environ
    return (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("MASTER_ADDR") == d.master_addr
            and env.get("MASTER_PORT") == str(d.master_port))


def init_process_group(d: DistEnv, backend: str = "auto", rendezvous_s: float = 300,
                       collective_s: float = 1800) -> bool:
    """Join the process group described by ``d`` within ``rendezvous_s`` or raise RendezvousError;
    then every collective (and every wait on the store) is bounded by ``collective_s``.

    torch gives ``init_process_group`` one ``timeout`` for both: the store's (the rendezvous, the
    group's setup) and the group's (each collective, NCCL's watchdog). The group is formed under the
    rendezvous bound and then given the collective one (:func:`bound_collectives`).
    Done before DeepSpeed starts (DeepSpeed then reuses the group). Under NCCL the rank's GPU is
    set first. Gloo binds to the interface that routes to the master (GLOO_SOCKET_IFNAME, unless
    set). Also makes the gloo side group, within the same ``rendezvous_s``. Returns False when a
    group already exists.
    """
    import datetime

    import torch.distributed as dist

    global _SIDE_GROUP
    if dist.is_initialized():
        return False
    backend = default_backend(backend)
    device = _set_comm_device(backend, d)
    if d.world_size == 1:  # a group of one still needs a store; any free local port will do
        d = DistEnv(master_port=free_port())
    where = f"{d.master_addr}:{d.master_port}"
    if d.is_rank0 and d.world_size > 1 and not agent_store_serves(d) and not port_free(d.master_port):
        raise RendezvousError(
            f"rendezvous port {d.master_port} on {d.master_addr} is already in use; "
            f"set MASTER_PORT to a free port or resubmit")
    from pipeline.network import InterfaceError, choose_gloo_interface

    try:  # the job spans nodes when the launcher says this node holds fewer ranks than the world
        ifname = (choose_gloo_interface(d.master_addr, spans_nodes=d.world_size > d.local_world_size)
                  if d.world_size > 1 else None)
    except InterfaceError as e:
        raise RendezvousError(f"rank {d.rank}/{d.world_size}: {e}") from None
    timeout = datetime.timedelta(seconds=rendezvous_s)
    try:
        dist.init_process_group(backend, init_method=f"tcp://{where}", rank=d.rank, world_size=d.world_size,
                                timeout=timeout, **device_id_arg(backend, d.world_size, device))
        if d.world_size > 1:
            _SIDE_GROUP = dist.new_group(backend="gloo", timeout=timeout)
    except Exception as e:  # torch raises DistStoreError/DistNetworkError/RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        who = "waiting for the other ranks" if d.is_rank0 else f"connecting to rank 0 at {where}"
        nic = f"; gloo on {ifname} (GLOO_SOCKET_IFNAME)" if ifname else ""
        raise RendezvousError(
            f"rank {d.rank}/{d.world_size}: rendezvous at {where} failed after {rendezvous_s:g}s "
            f"{who} ({first[:300]}){nic}; engine.rendezvous_timeout_s sets the limit") from None
    bound_collectives(collective_s)
    return True


_COLLECTIVE_S: float | None = None  # engine.collective_timeout_s of the live group


def bound_collectives(seconds: float | None = None) -> None:
    """Give every live process group, and the rendezvous store, the collective timeout (``seconds``,
    else the one set before); call it again after a library made groups of its own.

    A group made with ``new_group()`` and no timeout gets torch's default, not the default group's
    (NCCL 10 min, gloo 30 min): DeepSpeed's data-parallel group, a clone of the world made that
    way (deepspeed.utils.groups._clone_world_group), carries every ZeRO reduction and gather.
    The store's waits (a communicator made at a group's first collective fetches its id there)
    are collective waits too, once the ranks have met.
    """
    import datetime

    import torch.distributed as dist

    global _COLLECTIVE_S
    if seconds is not None:
        _COLLECTIVE_S = seconds
    if _COLLECTIVE_S is None or not (dist.is_available() and dist.is_initialized()):
        return
    timeout = datetime.timedelta(seconds=_COLLECTIVE_S)
    c10d = dist.distributed_c10d
    set_timeout = getattr(dist, "set_timeout", None) or c10d._set_pg_timeout  # public from torch 2.14
    for group in list(c10d._world.pg_map):  # the groups this rank belongs to
        set_timeout(timeout, group)
    c10d._get_default_store().set_timeout(timeout)


_ACCELERATOR = None  # what setup() chose for this process while its group lives


def setup(cfg) -> str:
    """This process's one setup for a stage: take its CPU threads from cluster.cpus_per_task
    (:func:`use_cpu_threads`, the same under every launcher), hold its host allocator steady
    (:func:`steady_allocator`: a step's freed memory is kept for the next one), decide the
    accelerator on this node, read rank/world/master from the environment (a launcher's or SLURM's;
    engine.master_addr/master_port under SLURM alone), export them for DeepSpeed, and join the process
    group (a group of one for a single process: DeepSpeed needs one); returns 'cuda' or 'cpu'.

    The config asks for GPUs with engine.backend=nccl or cluster.gpus_per_node > 0 (the B/L/H
    recipes): without usable CUDA that is an AcceleratorError under every launcher (torchrun,
    deepspeed, vitp's own, SLURM), never a silent CPU run. Idempotent: while the group lives, later
    calls return the first choice and change nothing (a second export would undo the device binding
    of per-task GPUs, bind_local_rank).
    """
    global _ACCELERATOR
    import torch.distributed as dist

    note = use_cpu_threads(cfg.cluster.cpus_per_task)
    steady_allocator()
    if note:
        rank0_print(note, file=sys.stderr)
    if _ACCELERATOR is not None and dist.is_initialized():
        return _ACCELERATOR
    kind = choose_accelerator(cfg.engine.backend, cfg.cluster.gpus_per_node)
    d = dist_env(master_addr=cfg.engine.master_addr, master_port=cfg.engine.master_port)
    export_env(d)
    init_process_group(d, cfg.engine.backend, cfg.engine.rendezvous_timeout_s, cfg.engine.collective_timeout_s)
    _ACCELERATOR = kind
    return kind


WAIT_FOR_RANK0_S = 24 * 3600  # rank 0 alone converts or consolidates a checkpoint: minutes to hours
_WAITS = 0  # wait_for_rank0 calls so far: every rank makes the same calls, so this names a barrier


def wait_for_rank0() -> None:
    """A barrier that outwaits slow work: every rank waits here until all have arrived, however long
    rank 0's own work (or a rank's slow file system) takes (WAIT_FOR_RANK0_S).

    A barrier on a group would sit inside the group's timeout (engine.collective_timeout_s; gloo applies
    it to the ranks that wait for rank 0 even in monitored_barrier), so the wait is on the
    rendezvous store, with its own timeout. Rank 0's death takes the store down: the others fail at once;
    another rank's leaves them waiting for their launcher's TERM-then-KILL (vitp's, srun, torchrun's).
    """
    import datetime

    import torch.distributed as dist

    global _WAITS
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    # torchrun's agent keeps its store across a restart of the workers: a key of each attempt
    key = f"vitp/wait_for_rank0/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}/{_WAITS}"
    _WAITS += 1
    if store.add(key, 1) == dist.get_world_size():
        store.set(key + "/all", "1")
    store.wait([key + "/all"], datetime.timedelta(seconds=WAIT_FOR_RANK0_S))


def new_gloo_group():
    """Collective: a gloo group of every rank for one background user (a checkpoint writer thread),
    apart from the groups the training thread uses: two threads never share a group's sequence of
    collectives. Its timeout is :data:`WAIT_FOR_RANK0_S` (a rank's slow file system). None without a
    group of more than one rank."""
    import datetime

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=WAIT_FOR_RANK0_S))


def any_rank(flag: bool, group=None) -> bool:
    """Collective: whether ``flag`` is true on any rank (a host tensor; ``group`` a gloo group, default
    the side group). A ``group`` given while no process group exists (the training thread left it, an
    error having ended the stage, while a writer thread still runs) raises: its own flag is no answer
    for every rank, and a writer taking it for one published a checkpoint a dead rank never wrote."""
    import torch
    import torch.distributed as dist

    alive = dist.is_available() and dist.is_initialized()
    if group is not None and not alive:
        raise RuntimeError("the process group is gone: the ranks cannot agree any more")
    if not alive or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group or _SIDE_GROUP)
    return bool(t.item())


def broadcast_from_rank0(obj):
    """Rank 0's ``obj`` (a small picklable value) on every rank: one decision for all, where each
    rank's own view could differ (a shared file system's cached listing). Over the side gloo group,
    so no device tensor and no NCCL watchdog while rank 0 decides."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_SIDE_GROUP)
    return box[0]
