"""On the local SLURM cluster: `vitp submit prep --exclude-near` as an array writes what a single-process
`vitp prep --exclude-near` writes, byte for byte; the test set is hashed once, by the submitter. So does
`vitp submit decontam` of what `vitp decontam` writes (_exclude.json and _info.json); a bad test set is
one line and nothing queued."""

from __future__ import annotations

import json
import shutil

import pytest

from data_prep import prep
from data_prep.decontam import WORK_DIR, decontam
from data_prep.schema import EXCLUDE_FILE, INFO_FILE
from launch.jobs import read_index
from tests.data_prep_fixtures import tree_bytes
from tests.e2e.test_prep_store_slurm import RES, cli
from tests.integration.test_prep_decontam import sets  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_prep_array_with_exclude_near_matches_local_prep(slurm_cluster, sets, tmp_path):  # noqa: F811
    near = ["--exclude-near", str(sets["china"]), "--exclude-near", str(sets["flower"])]
    prep(sets["train"], tmp_path / "local", max_samples_per_shard=3, progress=False,
         exclude_near=[str(sets["china"]), str(sets["flower"])])
    r = cli(["submit", "prep", sets["train"], tmp_path / "array", "--tasks", "3", "--max-samples-per-shard", "3",
             *near, "--resources", RES, f"cluster.log_dir={tmp_path / 'jobs'}", "--wait"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(read_index(tmp_path / "jobs")) == 3
    local, array = tree_bytes(tmp_path / "local"), tree_bytes(tmp_path / "array")
    assert local.keys() == array.keys() and sum(n.endswith(".tar") for n in local) >= 3
    assert [n for n in local if local[n] != array[n]] == []
    assert json.loads(local["_info.json"])["decontaminated"]["rejected"] == 2


def test_decontam_array_matches_local_decontam(slurm_cluster, sets, tmp_path):  # noqa: F811
    prep(sets["train"], tmp_path / "local", max_samples_per_shard=3, progress=False)  # 4 shards, unchecked
    shutil.copytree(tmp_path / "local", tmp_path / "array")
    decontam(tmp_path / "local", [str(sets["china"]), str(sets["flower"])], None, 12)
    jobs = [f"cluster.log_dir={tmp_path / 'jobs'}"]
    r = cli(["submit", "decontam", tmp_path / "array", "--tasks", "3", "--exclude-near", tmp_path / "nope",
             "--resources", RES, *jobs])
    assert (r.returncode, r.stderr.strip()) == (2, f"error: --exclude-near {tmp_path / 'nope'}: not found")
    assert read_index(tmp_path / "jobs") == [] and not (tmp_path / "array" / WORK_DIR).exists()
    r = cli(["submit", "decontam", tmp_path / "array", "--tasks", "3", "--exclude-near", sets["china"],
             "--exclude-near", sets["flower"], "--resources", RES, *jobs, "--wait"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(read_index(tmp_path / "jobs")) == 3
    local = (tmp_path / "local" / EXCLUDE_FILE).read_bytes()
    assert (tmp_path / "array" / EXCLUDE_FILE).read_bytes() == local and json.loads(local)["excluded"] == 2
    # the merging task also wrote the sets into _info.json, as the local run did
    info = (tmp_path / "local" / INFO_FILE).read_bytes()
    assert (tmp_path / "array" / INFO_FILE).read_bytes() == info
    assert json.loads(info)["decontaminated"]["excluded"] == 2
