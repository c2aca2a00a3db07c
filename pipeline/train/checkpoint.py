"""Checkpoints that count only when complete, resume, and weight export.

Layout under ``RUN_DIR/checkpoints/``::

    tmp-step-00000040/          being written (DeepSpeed files from every rank + our named states)
    step-00000040/              published: rank 0 wrote manifest.json, then renamed tmp-… → step-…
        mp_rank_00_model_states.pt, *_optim_states.pt    DeepSpeed (model + optimizer, all ranks)
        vitp_rank0.pt, vitp_rank1.pt                      each rank's named states (RNG, loader position, log window)
        vitp_shared.pt                                    the states equal on every rank (EMA, few-shot progress)
        manifest.json                                     step, world size, run id, model + run config
    LATEST                      name of the newest published checkpoint (written atomically)

:class:`CheckpointManager` writes and reads them: it takes the run's parts as named
:class:`Stateful` objects (``state_dict``/``load_state_dict``), saves each under its name, restores
each by name, and decides when to save. Other stages read checkpoints through
:func:`checkpoint_in`, :func:`read_manifest` and :func:`read_weights`.

DeepSpeed's own ``latest`` file is not written: it appears before every rank has finished. A
checkpoint exists iff its ``step-*`` folder exists with a manifest (a rename is atomic), so a job
killed mid-save leaves only a ``tmp-*`` folder that resume ignores and the next save deletes.

Shared file systems: each rank fsyncs the files it wrote before the barrier, rank 0 fsyncs the
folders around each rename, so a published checkpoint is on stable storage and not only in some
client's cache. The manifest records every file's size; resume skips (with a one-line warning) a
checkpoint whose files are missing or of another size and takes the previous complete one. Rank 0
alone chooses the checkpoint to resume and tells the others: an NFS client's cached listing of
``checkpoints/`` may lag behind, and ranks that disagree would load different steps.

Our extras are read with torch.load(weights_only=True) and JSON; DeepSpeed reads its own files with
torch.load(weights_only=False) (deepspeed 0.19.8), so only load checkpoints you wrote.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from pipeline import faults
from pipeline.distributed import broadcast_from_rank0, rank0_print, rank_world, wait_for_rank0
from pipeline.files import atomic_write, fsync_path, replacing

MANIFEST = "manifest.json"
SHARED = "vitp_shared.pt"  # the states equal on every rank, written once by rank 0
_PREFIX, _TMP = "step-", "tmp-step-"


def root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def tag_for(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def complete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Published checkpoints of a run, oldest first."""
    r = root(run_dir)
    if not r.is_dir():
        return []
    found = [p for p in r.iterdir() if p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()
             and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def latest_checkpoint(run_dir: str | os.PathLike, *, warn: bool = True) -> Path | None:
    """The newest published checkpoint whose files are all there at their recorded sizes; an
    incomplete newer one is skipped with a one-line warning on stderr."""
    for ckpt in reversed(complete_checkpoints(run_dir)):
        problem = incomplete(ckpt)
        if problem is None:
            return ckpt
        if warn:
            print(f"warning: skipping checkpoint {ckpt}: {problem}", file=sys.stderr, flush=True)
    return None


def resume_choice(run_dir: str | os.PathLike) -> Path | None:
    """Collective: rank 0's :func:`latest_checkpoint`, on every rank (their own listings may be stale)."""
    rank = rank_world()[0]
    mine = latest_checkpoint(run_dir) if rank == 0 else None
    name = broadcast_from_rank0(mine.name if mine is not None else None)
    return root(run_dir) / name if name else None


def read_manifest(ckpt: str | os.PathLike) -> dict:
    return json.loads((Path(ckpt) / MANIFEST).read_text())


def checkpoint_in(path: str | os.PathLike) -> Path | None:
    """The checkpoint ``path`` names: a ``step-*`` folder itself, else a run dir's newest complete
    one; None when there is none."""
    p = Path(path)
    return p if (p / MANIFEST).is_file() else latest_checkpoint(p)


def read_weights(ckpt: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict | None]:
    """A checkpoint folder's consolidated fp32 model weights (any ZeRO stage, no engine needed) and
    its model config (build_vit kwargs) from the manifest: how other stages read a checkpoint."""
    from pipeline.train import engine as eng

    return eng.fp32_state_dict(str(ckpt)), read_manifest(ckpt).get("model_config")


def incomplete(ckpt: str | os.PathLike) -> str | None:
    """Why ``ckpt`` cannot be trusted (a file missing or of another size than the manifest records),
    or None. Manifests written before sizes were recorded are taken as they are."""
    ckpt = Path(ckpt)
    try:
        sizes = read_manifest(ckpt).get("sizes") or {}
    except (OSError, ValueError) as e:
        return f"unreadable {MANIFEST} ({e})"
    for name, size in sorted(sizes.items()):
        try:
            got = (ckpt / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if got != size:
            return f"{name} has {got} bytes, the manifest recorded {size}"
    return None


def _names(folder: Path) -> list[str]:
    """Relative paths of the files under ``folder``."""
    return [str((Path(d) / n).relative_to(folder)) for d, _, names in os.walk(folder) for n in names]


def _files(folder: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``folder`` (once no rank writes there any more)."""
    return {n: (folder / n).stat().st_size for n in _names(folder)}


def written_by(name: str, rank: int) -> bool:
    """Whether ``rank`` wrote checkpoint file ``name``: DeepSpeed names ZeRO partitions by their
    data-parallel rank (``*zero_pp_rank_R_*``), our extras are ``vitp_rankR.pt``; the rest (the
    module file) is rank 0's."""
    m = re.search(r"(?:pp_rank_|vitp_rank)(\d+)", Path(name).name)
    return int(m.group(1)) == rank if m else rank == 0


def fsync_own_files(folder: Path, rank: int) -> int:
    """fsync the files this rank wrote into ``folder`` (a client flushes only its own writes);
    returns how many."""
    # names only: other ranks are still writing (and renaming) their files here, a stat could miss one
    own = [n for n in _names(folder) if written_by(n, rank)]
    for n in own:
        fsync_path(folder / n)
    return len(own)


def publish(tmp: Path, final: Path, manifest: dict) -> None:
    """Rank 0, once every rank's files are on stable storage: record the sizes in the manifest, then
    rename ``tmp`` to ``final`` and point LATEST at it, each step flushed before the next."""
    sizes = {n: s for n, s in _files(tmp).items() if n != MANIFEST}
    doc = dict(manifest, files=sorted(sizes), sizes=sizes)
    atomic_write(tmp / MANIFEST, json.dumps(doc, indent=1), fsync=True)  # also flushes tmp's entries
    os.replace(tmp, final)
    fsync_path(final.parent)
    atomic_write(final.parent / "LATEST", final.name + "\n", fsync=True)


# --------------------------------------------------------------------------------------------------
# Named states: what the manager saves besides DeepSpeed's model + optimizer
# --------------------------------------------------------------------------------------------------
class Stateful(Protocol):
    """A part of the run that saves and loads itself. Its ``state_dict`` holds tensors, numbers,
    strings, lists and dicts only (the checkpoint is read back with weights_only=True).

    An optional class attribute ``checkpoint_scope`` says whose state it is:
      "per_rank" (the default)  each rank saves its own; resumed on another number of ranks, every
                                rank loads rank 0's (the RNG; the loader position, which checks its layout)
      "rank_local"              each rank saves its own, restored only on the same number of ranks
                                (the log window's partial sums, which another rank count cannot continue)
      "shared"                  equal on every rank: rank 0 saves it once, every rank loads it (EMA, the
                                few-shot evaluators' progress)
    """

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


SCOPES = ("per_rank", "rank_local", "shared")


def scope_of(obj) -> str:
    scope = getattr(obj, "checkpoint_scope", "per_rank")
    if scope not in SCOPES:
        raise ValueError(f"{type(obj).__name__}.checkpoint_scope: {scope!r} is not one of {SCOPES}")
    return scope


def rng_state() -> dict:
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "python": {"version": py_state[0], "state": torch.tensor(py_state[1], dtype=torch.int64),
                   "gauss": json.dumps(py_state[2])},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), json.loads(p["gauss"])))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class RngState:
    """This process's torch / numpy / Python (and CUDA) generators as a :class:`Stateful`."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, sd: dict) -> None:
        set_rng_state(sd)


def universal_for(ckpt: Path, world: int) -> Path | None:
    """If ``ckpt`` was written by a different number of ranks, convert it (rank 0) to DeepSpeed's
    universal format and return that folder; None when the world size matches."""
    from pipeline.train import engine as eng

    saved = read_manifest(ckpt)["world_size"]
    if saved == world:
        return None
    if read_manifest(ckpt).get("zero_stage", 1) == 0:
        raise RuntimeError(f"{ckpt}: written by {saved} ranks without ZeRO; resume it on {saved} ranks "
                           f"(universal conversion needs engine.zero_stage >= 1)")
    out = ckpt.with_name(ckpt.name + ".universal")
    if rank_world()[0] == 0 and not (out / "done").is_file():
        workers, scratch = eng.conversion_workers(), eng.scratch_dir(out.parent)
        rank0_print(f"checkpoint {ckpt.name} was written by {saved} ranks, resuming on {world}: converting "
                    f"it to a universal checkpoint (deepspeed.checkpoint.ds_to_universal) in {out.name}, "
                    f"{workers} worker(s), intermediate files in {scratch}")
        shutil.rmtree(out, ignore_errors=True)
        for stale in [*out.parent.glob("vitp-universal-*"), *out.parent.glob(".*.universal.tmp")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a job killed while converting
        eng.to_universal(str(ckpt), str(out), workers=workers)
    wait_for_rank0()  # the conversion takes minutes for a large model: longer than NCCL would wait
    return out


@dataclass
class Resumed:
    step: int
    manifest: dict  # what rank 0 recorded (run config, model config, MLflow run id, ...)


class CheckpointManager:
    """Saves and restores a run: DeepSpeed's model + optimizer through its own collective save, and
    the named :class:`Stateful` parts, each its own entry (``states={"loader": ..., "ema": ...}``).
    It decides for itself when to save: the loop offers every step (:meth:`maybe_save`, as
    torchtitan's ``checkpointer.save(step, last_step=...)``) and it saves every ``every`` steps, at
    ``last_step``, at the end of a job (``last_step=True``) and once per step at most.
    ``manifest()``: the JSON-able facts rank 0 records at each save. ``save`` and ``restore`` are
    collective: call them on every rank.

    Files: ``vitp_rank<R>.pt`` per rank ({"step", "world_size", "states": {name: state}}) and
    ``vitp_shared.pt`` (rank 0: the "shared" states).
    """

    name = "checkpoint"

    def __init__(self, run_dir: str | os.PathLike, engine, states: dict[str, Stateful], *, every: int,
                 last_step: int, keep: int, manifest: Callable[[], dict] = dict):
        self.run_dir, self.engine, self.states = Path(run_dir), engine, dict(states)
        self.every, self.last_step, self.keep, self.manifest = every, last_step, keep, manifest
        self.scopes = {name: scope_of(obj) for name, obj in self.states.items()}
        self._saved_at: int | None = None

    def due(self, step: int, last_step: bool = False) -> bool:
        """Whether :meth:`maybe_save` would save ``step``."""
        if step == self._saved_at:
            return False
        return last_step or bool(self.every and step % self.every == 0) or step == self.last_step

    def maybe_save(self, step: int, *, last_step: bool = False, before: Callable[[], object] = lambda: None
                   ) -> Path | None:
        """Collective: save ``step`` if it is one to save (see the class); ``before()`` runs first,
        only then (the loop's check that the step's update was finite)."""
        if not self.due(step, last_step):
            return None
        before()
        return self.save(step)

    def path(self, step: int) -> Path:
        return root(self.run_dir) / tag_for(step)

    def save(self, step: int) -> Path:
        """Write checkpoint ``step`` on every rank, then publish it atomically; keep the newest ``keep``."""
        from pipeline.train import engine as eng

        rank, world = rank_world()
        r = root(self.run_dir)
        tmp, final = r / f"{_TMP}{step:08d}", self.path(step)
        if rank == 0:
            r.mkdir(parents=True, exist_ok=True)
            for stale in r.glob(f"{_TMP}*"):  # left by a job killed while saving
                shutil.rmtree(stale, ignore_errors=True)
            if final.exists():  # re-saving a step (a resumed run's final save)
                shutil.rmtree(final)
        wait_for_rank0()  # rank 0 may have had old folders to delete
        eng.save_checkpoint(self.engine, str(r), tmp.name)
        own = {n: o.state_dict() for n, o in self.states.items() if self.scopes[n] != "shared"}
        with replacing(tmp / f"vitp_rank{rank}.pt") as part:
            torch.save({"step": step, "rank": rank, "world_size": world, "states": own}, part)
        if rank == 0:
            shared = {n: o.state_dict() for n, o in self.states.items() if self.scopes[n] == "shared"}
            with replacing(tmp / SHARED) as part:
                torch.save({"step": step, "states": shared}, part)
        fsync_own_files(tmp, rank)
        faults.hit("save", step)
        wait_for_rank0()  # every rank's files are on stable storage (a large shard on a slow file system takes minutes)
        if rank == 0:
            publish(tmp, final, dict(self.manifest(), step=step, world_size=world, saved_at=time.time()))
            for old in complete_checkpoints(self.run_dir)[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
                shutil.rmtree(old.with_name(old.name + ".universal"), ignore_errors=True)
        wait_for_rank0()  # deleting old checkpoints can outlast a collective's timeout
        self._saved_at = step
        return final

    def restore(self, ckpt: Path, universal: Path | None = None) -> Resumed:
        """Load model + optimizer (DeepSpeed) and every named state from ``ckpt``. With ``universal``
        (written by another number of ranks, see :func:`universal_for`) the DeepSpeed state comes from
        the converted folder, "per_rank" states from rank 0's file and "rank_local" ones start afresh."""
        from pipeline.train import engine as eng

        rank = rank_world()[0]
        src = universal or ckpt
        eng.load_checkpoint(self.engine, str(src.parent), src.name)
        mine = ckpt / f"vitp_rank{rank if universal is None else 0}.pt"
        own = torch.load(mine, map_location="cpu", weights_only=True)
        shared = torch.load(ckpt / SHARED, map_location="cpu", weights_only=True)["states"]
        for name, obj in self.states.items():
            scope = self.scopes[name]
            if scope == "rank_local" and universal is not None:
                continue
            saved = shared if scope == "shared" and name in shared else own["states"]  # EMA was per rank before
            if name not in saved:
                raise RuntimeError(f"{ckpt}: holds no saved state {name!r} (saved: {sorted(saved) or 'none'}); "
                                   "it was written with another configuration or vitp version")
            obj.load_state_dict(saved[name])
        return Resumed(int(own["step"]), read_manifest(ckpt))


