"""Checkpoints on a shared file system: who fsyncs what, sizes in the manifest, a truncated file."""

from __future__ import annotations

import json
import os

import pytest

from pipeline import checkpoint_layout as layout
from pipeline.train import checkpoint as ck

# what DeepSpeed 0.19.8 writes for 2 data-parallel ranks (ZeRO-2, then ZeRO-3's per-rank module files and
# BF16_Optimizer's prefix), plus vitp's per-rank extras
FILES = {0: ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "vitp_rank0.pt",
             "zero_pp_rank_0_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"],
         1: ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "vitp_rank1.pt",
             "zero_pp_rank_1_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]}


def _written(folder, ranks=(0, 1)):
    folder.mkdir(parents=True)
    for r in ranks:
        for i, n in enumerate(FILES[r]):
            (folder / n).write_bytes(bytes(100 + 10 * i + r))


@pytest.fixture
def fsyncs(monkeypatch):
    """Every os.fsync, as the path of the descriptor it flushed."""
    seen = []
    real = os.fsync

    def spy(fd):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def test_each_rank_fsyncs_exactly_the_files_it_wrote(tmp_path, fsyncs):
    tmp = tmp_path / "checkpoints" / "tmp-step-00000004"
    _written(tmp)
    assert ck.fsync_own_files(tmp, 0) == 5
    mine = sorted(os.path.basename(p) for p in fsyncs)
    assert mine == sorted(FILES[0])
    fsyncs.clear()
    assert ck.fsync_own_files(tmp, 1) == 4
    assert sorted(os.path.basename(p) for p in fsyncs) == sorted(FILES[1])  # together: every file, once


def test_publish_records_sizes_and_flushes_each_rename(tmp_path, fsyncs):
    r = tmp_path / "checkpoints"
    tmp, final = r / "tmp-step-00000004", r / "step-00000004"
    _written(tmp)
    ck.publish(tmp, final, {"step": 4, "world_size": 2})
    doc = layout.read_manifest(final)
    assert doc["sizes"] == {n: (final / n).stat().st_size for n in FILES[0] + FILES[1]}
    assert doc["files"] == sorted(doc["sizes"])
    assert (r / "LATEST").read_text() == "step-00000004\n"
    # the manifest (file, then tmp's entries), the rename (checkpoints/), LATEST (file, then checkpoints/)
    names = [os.path.basename(p) for p in fsyncs]
    assert names[0].startswith(".manifest.json") and names[1] == "tmp-step-00000004"
    assert names[2] == "checkpoints" and names[3].startswith(".LATEST") and names[4] == "checkpoints"
    assert len(fsyncs) == 5
    assert layout.incomplete(final) is None and layout.latest_checkpoint(tmp_path) == final


def test_truncated_or_missing_file_skips_to_the_previous_checkpoint(tmp_path, capsys):
    r = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _written(r / f"tmp-step-{step:08d}")
        ck.publish(r / f"tmp-step-{step:08d}", r / layout.tag_for(step), {"step": step, "world_size": 2})
    shard = r / "step-00000006" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:-7])  # a client crashed before its cache reached the server
    (r / "step-00000004" / "vitp_rank0.pt").unlink()
    assert layout.latest_checkpoint(tmp_path) == r / "step-00000002"
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"warning: skipping checkpoint {r / 'step-00000006'}: zero_pp_rank_1_mp_rank_00_optim_states.pt has "
        f"{shard.stat().st_size} bytes, the manifest recorded {shard.stat().st_size + 7}",
        f"warning: skipping checkpoint {r / 'step-00000004'}: vitp_rank0.pt is missing"]
    assert ck.resume_choice(tmp_path) == r / "step-00000002"  # no process group: this process is rank 0


def test_manifest_without_sizes_is_taken_as_it_is(tmp_path):
    d = layout.root(tmp_path) / layout.tag_for(2)
    _written(d)
    (d / layout.MANIFEST).write_text(json.dumps({"step": 2, "world_size": 2}))  # written before sizes were recorded
    assert layout.latest_checkpoint(tmp_path) == d


def test_conversion_uses_the_tasks_cores_and_node_local_scratch(tmp_path, monkeypatch):
    from pipeline.train.engine import conversion_workers, scratch_dir

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)))
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert conversion_workers() == 12
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    assert conversion_workers() == 8  # SLURM's share, even where the affinity mask is wider
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert conversion_workers() == 1
    run = tmp_path / "run"
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    monkeypatch.delenv("TMPDIR", raising=False)
    assert scratch_dir(run) == str(run)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert scratch_dir(run) == str(tmp_path)
    monkeypatch.setenv("SLURM_TMPDIR", str(tmp_path / "missing"))
    assert scratch_dir(run) == str(tmp_path)  # a name that is no folder is passed over
    (tmp_path / "job").mkdir()
    monkeypatch.setenv("SLURM_TMPDIR", str(tmp_path / "job"))
    assert scratch_dir(run) == str(tmp_path / "job")
