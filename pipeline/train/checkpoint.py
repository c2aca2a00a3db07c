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
each by name, and decides when to save. Which folders are checkpoints and which of them count is
pipeline/checkpoint_layout.py's (readers outside train ask it); pipeline.weights reads one's weights.

DeepSpeed's own ``latest`` file is not written: it appears before every rank has finished. A
checkpoint exists iff its ``step-*`` folder exists with a manifest (a rename is atomic), so a job
killed mid-save leaves only a ``tmp-*`` folder that resume ignores and the next save deletes.

In the background (checkpoint.async, the default): inside the step each rank copies what it would
write to host memory (DeepSpeed's files captured through its checkpoint-engine slot,
pipeline/train/engine.py ``snapshot_checkpoint``; our named states), then a thread writes and flushes
the files; once every rank's thread has (they agree over their own gloo group), rank 0's publishes it
(the manifest last, then the one rename) and prunes the oldest. A kill at any moment of that leaves
the previous checkpoint as the resume point. The next save waits for the write only if it is still
running; a stop (preemption) and the end of a run wait for it, then save inline; a write that failed
stops the run at a step boundary (:class:`CheckpointWriteFailed`, one line naming the file).

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

import functools
import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from pipeline import faults
from pipeline.checkpoint_layout import (
    MANIFEST,
    TMP_PREFIX,
    complete_checkpoints,
    latest_checkpoint,
    read_manifest,
    root,
    tag_for,
    tmp_tag_for,
)
from pipeline.distributed import any_rank, broadcast_from_rank0, new_gloo_group, rank0_print, rank_world, wait_for_rank0
from pipeline.errors import Classified
from pipeline.files import atomic_write, fsync_path
from pipeline.train.saving import Background, HostCopy, free_space, without_crc

SHARED = "vitp_shared.pt"  # the states equal on every rank, written once by rank 0


def resume_choice(run_dir: str | os.PathLike) -> Path | None:
    """Collective: rank 0's :func:`latest_checkpoint`, on every rank (their own listings may be stale)."""
    rank = rank_world()[0]
    mine = latest_checkpoint(run_dir) if rank == 0 else None
    name = broadcast_from_rank0(mine.name if mine is not None else None)
    return root(run_dir) / name if name else None


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
    faults.hit("publish", int(manifest.get("step", -1)))
    os.replace(tmp, final)  # the one rename that makes it the resume point
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


class CheckpointWriteFailed(Classified, RuntimeError):
    """A checkpoint's files could not be written or published (a full disk, a vanished mount): the
    run stops with the last complete checkpoint as its resume point. A retry may find the space."""

    exit_code = 1
    retry = True


PLAN_AFTER = 4  # checkpoint.every_minutes: steps of a job that rank 0 times before it first picks a step


class CheckpointManager:
    """Saves and restores a run: DeepSpeed's model + optimizer through its own collective save, and
    the named :class:`Stateful` parts, each its own entry (``states={"loader": ..., "ema": ...}``).
    It decides for itself when to save: the loop offers every step (:meth:`maybe_save`, as
    torchtitan's ``checkpointer.save(step, last_step=...)``) and it saves every ``every`` steps, at
    the step rank 0 picked for ``every_minutes``, at ``last_step``, at the end of a job
    (``last_step=True``) and once per step at most.
    ``manifest()``: the JSON-able facts rank 0 records at each save. ``save``, ``wait`` and
    ``restore`` are collective: call them on every rank.

    ``background``: a save copies every rank's states to host memory inside the step (a snapshot,
    :class:`pipeline.train.saving.HostCopy`) and a thread writes the files, then rank 0 publishes
    and prunes, while training goes on; the next save waits for that write only if it is still
    running. The writer threads agree over their own gloo group. A write that fails leaves
    :attr:`failed` set; the loop stops on it at a step boundary (:meth:`wait` raises
    :class:`CheckpointWriteFailed` on every rank). Without it, the same steps run inline.

    Minutes cadence: rank 0 times the steps and picks the step of the next save (at each save, and
    :data:`PLAN_AFTER` steps into a job without one); every rank gets that step, and the checkpoint
    records it, so a resumed run saves at the step the interrupted one had picked.

    Files: ``vitp_rank<R>.pt`` per rank ({"step", "world_size", "states": {name: state}}) and
    ``vitp_shared.pt`` (rank 0: the "shared" states, and ``cadence``).
    """

    name = "checkpoint"

    def __init__(self, run_dir: str | os.PathLike, engine, states: dict[str, Stateful], *, every: int,
                 last_step: int, keep: int, manifest: Callable[[], dict] = dict, every_minutes: float = 0.0,
                 background: bool = False):
        self.run_dir, self.engine, self.states = Path(run_dir), engine, dict(states)
        self.every, self.last_step, self.keep, self.manifest = every, last_step, keep, manifest
        self.every_minutes, self.background = every_minutes, background
        self.scopes = {name: scope_of(obj) for name, obj in self.states.items()}
        self._saved_at: int | None = None
        self._group = new_gloo_group() if background else None  # collective: the writer threads' own
        self._copy, self._writer = HostCopy(), Background()
        self.blocked_s: float | None = None  # how long the last save held the loop (bench/checkpoint.py)
        self._next_at: int | None = None  # every_minutes: the step rank 0 picked for the next save
        self._clock: tuple[int, float] | None = None  # (step, rank 0's clock) the next pick measures from

    @property
    def writing(self) -> bool:
        """This rank's background write is still running."""
        return self._writer.running

    @property
    def write_cpu_s(self) -> float | None:
        """The CPU time this rank's last write took (its thread's: torch.save, fsync, publishing)."""
        return self._writer.cpu_s

    @property
    def failed(self) -> bool:
        """This rank's last background write failed (the loop shares it with the step's flags)."""
        return self._writer.error is not None

    def due(self, step: int, last_step: bool = False) -> bool:
        """Whether :meth:`maybe_save` would save ``step``."""
        if step == self._saved_at:
            return False
        return (last_step or bool(self.every and step % self.every == 0) or step == self.last_step
                or step == self._next_at)

    def maybe_save(self, step: int, *, last_step: bool = False, before: Callable[[], object] = lambda: None,
                   wait: bool = False) -> Path | None:
        """Collective: save ``step`` if it is one to save (see the class); ``before()`` runs first,
        only then (the loop's check that the step's update was finite)."""
        if self.every_minutes:
            if self._clock is None:  # this job's first step: timed from here (not its start-up)
                self._clock = (step, time.monotonic())
            elif self._next_at is None and step == self._clock[0] + PLAN_AFTER:
                self._pick(step)
        if not self.due(step, last_step):
            return None
        before()
        return self.save(step, wait=wait)

    def _pick(self, step: int) -> None:
        """Collective: rank 0's choice of the next save's step, ``every_minutes`` ahead at the pace of
        the steps since the last choice; kept when there is no step to time yet."""
        now = time.monotonic()
        if self._clock is not None and step > self._clock[0]:
            per_step = (now - self._clock[1]) / (step - self._clock[0])
            ahead = max(1, round(self.every_minutes * 60 / max(per_step, 1e-9)))
            self._next_at = broadcast_from_rank0(step + ahead)
        self._clock = (step, now)

    def path(self, step: int) -> Path:
        return root(self.run_dir) / tag_for(step)

    def save(self, step: int, *, wait: bool = False) -> Path:
        """Snapshot checkpoint ``step`` on every rank, then write it (in the background, unless
        ``wait`` or the manager writes inline) and publish it atomically; keep the newest ``keep``."""
        from pipeline.train import engine as eng

        began = time.perf_counter()
        self.wait()  # the previous write, if it is still running; raises if it failed
        rank, world = rank_world()
        r = root(self.run_dir)
        tmp, final = r / tmp_tag_for(step), self.path(step)
        if rank == 0:
            r.mkdir(parents=True, exist_ok=True)
            for stale in r.glob(f"{TMP_PREFIX}*"):  # left by a job killed while saving
                shutil.rmtree(stale, ignore_errors=True)
            if final.exists():  # re-saving a step (a resumed run's final save)
                shutil.rmtree(final)
        wait_for_rank0()  # rank 0 may have had old folders to delete
        if self.every_minutes:
            self._pick(step)
        files = eng.snapshot_checkpoint(self.engine, str(r), tmp.name, self._copy)
        _dump_optimizer(self.engine, "saved", step)
        own = {n: o.state_dict() for n, o in self.states.items() if self.scopes[n] != "shared"}
        files.append((tmp / f"vitp_rank{rank}.pt", self._copy(
            {"step": step, "rank": rank, "world_size": world, "states": own}), torch.save))
        if rank == 0:
            shared = {n: o.state_dict() for n, o in self.states.items() if self.scopes[n] == "shared"}
            files.append((tmp / SHARED, self._copy(
                {"step": step, "states": shared, "cadence": {"next_at": self._next_at}}), torch.save))
        self._copy.done()
        manifest = dict(self.manifest(), step=step, world_size=world, saved_at=time.time()) if rank == 0 else None
        inline = wait or not self.background
        self._writer.run(functools.partial(self._write, step, files, tmp, final, manifest), inline=inline)
        self._saved_at = step
        if inline:
            self.wait()
        self.blocked_s = time.perf_counter() - began
        return final

    def _write(self, step: int, files: list, tmp: Path, final: Path, manifest: dict | None) -> str | None:
        """Every rank: write its files and flush them; once all have, rank 0 publishes and prunes.
        -> None, or the one line saying what failed (the checkpoint is then not published)."""
        rank = rank_world()[0]
        error, where = None, tmp
        try:
            faults.hit("save_begin", step)
            with without_crc():
                for where, state, write in files:
                    write(state, str(where))
            fsync_own_files(tmp, rank)
            faults.hit("save", step)
        except Exception as e:  # a full disk (torch's zip writer may say only "unexpected pos"), a vanished mount
            error = (f"checkpoint {final.name}: writing {where} failed ({type(e).__name__}: {e}; "
                     f"{free_space(tmp)} free there); not published")
        files.clear()  # the host copies stay in their buffers for the next save, nothing else holds them
        if any_rank(error is not None, self._group):  # every rank's files are on stable storage, or one failed
            if manifest is not None:  # every rank is done with it: its space goes back (a full disk)
                shutil.rmtree(tmp, ignore_errors=True)
            return error or f"checkpoint {final.name}: another rank could not write its files to {tmp}; not published"
        if manifest is None:
            return None
        try:
            publish(tmp, final, manifest)
        except Exception as e:
            return f"checkpoint {final.name}: publishing {tmp} failed ({type(e).__name__}: {e}); not published"
        for old in complete_checkpoints(self.run_dir)[:-self.keep]:  # never the newest: keep >= 1
            shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(old.with_name(old.name + ".universal"), ignore_errors=True)
        return None

    def wait(self, *, check: bool = True) -> None:
        """Collective: the write in flight is finished on every rank (its checkpoint published).
        ``check``: if it failed on any rank, raise :class:`CheckpointWriteFailed` on every rank (this
        rank's line, or the other rank's failure)."""
        self._writer.wait()
        wait_for_rank0()  # rank 0's publishing and pruning can outlast a collective's timeout
        if any_rank(self.failed) and check:
            last = latest_checkpoint(self.run_dir, warn=False)
            raise CheckpointWriteFailed(f"{self._writer.error or 'another rank could not write its checkpoint files'}; "
                                        f"last complete checkpoint: {last or 'none'}")

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
        shared_file = torch.load(ckpt / SHARED, map_location="cpu", weights_only=True)
        shared = shared_file["states"]
        for name, obj in self.states.items():
            scope = self.scopes[name]
            if scope == "rank_local" and universal is not None:
                continue
            saved = shared if scope == "shared" and name in shared else own["states"]  # EMA was per rank before
            if name not in saved:
                raise RuntimeError(f"{ckpt}: holds no saved state {name!r} (saved: {sorted(saved) or 'none'}); "
                                   "it was written with another configuration or vitp version")
            obj.load_state_dict(saved[name])
        step = int(own["step"])
        picked = (shared_file.get("cadence") or {}).get("next_at")
        self._next_at = picked if self.every_minutes and picked is not None and picked > step else None
        _dump_optimizer(self.engine, "resumed", step)
        return Resumed(step, read_manifest(ckpt))


def _dump_optimizer(engine, what: str, step: int) -> None:
    """Collective when asked (a test's seam, pipeline/faults.py): rank 0 writes the full optimizer state."""
    path = faults.optimizer_dump(what, step)
    if path is not None:
        from pipeline.train import engine as eng

        state = eng.full_optimizer_state(engine)
        if rank_world()[0] == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)


