"""The suite's `decontaminated` column (launch/suite_decontam.py): from the checkpoint's manifest to the
pre-training data, and from its `_info.json` (`vitp prep --exclude-near`) and `_exclude.json` (`vitp
decontam`) to each suite dataset's test split: checked, not checked, or not known; in the tables and as
a tag on the suite's MLflow parent run."""

from __future__ import annotations

import csv
import json
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from data_prep import prep
from data_prep.decontam import decontam
from launch.suite_decontam import marks
from launch.suite_table import write_tables
from tests.data_prep_fixtures import jpeg_bytes, natural_image

KW = dict(max_samples_per_shard=4, progress=False)


def _prepped(tmp_path, name: str, seed: int):
    """A prep output with a test and a val split of two generated pictures each."""
    rng, src = np.random.default_rng(seed), tmp_path / f"{name}_src"
    lines = ["path,label,split"]
    for i, split in enumerate(["test", "test", "val", "val"]):
        (src / split).mkdir(parents=True, exist_ok=True)
        (src / split / f"{i}.jpg").write_bytes(jpeg_bytes(natural_image(rng, 64, 48)))
        lines.append(f"{split}/{i}.jpg,c{i % 2},{split}")
    (src / "labels.csv").write_text("\n".join(lines) + "\n")
    prep(src / "labels.csv", tmp_path / name, split_column="split", **KW)
    return tmp_path / name


def _pretrained(tmp_path):
    """(pets, cifar, pre, ck): two test sets; a pre-training prep output checked against pets' test
    split; a checkpoint (its manifest) of a run over it."""
    pets, cifar = _prepped(tmp_path, "pets", 1), _prepped(tmp_path, "cifar", 2)
    train = tmp_path / "train_src" / "a"
    train.mkdir(parents=True)
    rng = np.random.default_rng(3)
    for i in range(3):
        (train / f"{i}.jpg").write_bytes(jpeg_bytes(natural_image(rng, 64, 48)))
    pre = tmp_path / "pre"
    prep(train.parent, pre, exclude_near=[str(pets)], **KW)  # pets' test split (it has one)
    ck = tmp_path / "run" / "step-2"
    ck.mkdir(parents=True)
    (ck / "manifest.json").write_text(json.dumps({"step": 2, "config": {"data.path": str(pre)}}))
    return pets, cifar, pre, ck


def test_checked_unchecked_and_unknown_test_splits(tmp_path):
    pets, cifar, pre, ck = _pretrained(tmp_path)
    ds = [SimpleNamespace(name="pets", data=str(pets), test_split="test"),
          SimpleNamespace(name="pets_val", data=str(pets), test_split="val"),
          SimpleNamespace(name="cifar", data=str(cifar), test_split="test")]
    assert marks(str(ck), ds) == {"pets": "yes", "pets_val": "no", "cifar": "no"}
    decontam(pre, [str(cifar)], None, 12)  # checked after the fact
    assert marks(str(ck), ds) == {"pets": "yes", "pets_val": "no", "cifar": "yes"}
    # _info.json names both: prep's set as prep wrote it, cifar beside it as checked after prep; a rerun
    # of the same prep (it writes _info.json again) keeps it so
    info = (pre / "_info.json").read_bytes()
    block = json.loads(info)["decontaminated"]
    assert [(a["address"], a.get("by"), a.get("rejected"), a.get("excluded")) for a in block["against"]] == [
        (str(pets), None, 0, None), (str(cifar), "vitp decontam", None, 0)]
    assert (block["rejected"], block["excluded"]) == (0, 0)
    prep(tmp_path / "train_src", pre, exclude_near=[str(pets)], **KW)
    assert (pre / "_info.json").read_bytes() == info
    (pre / "_exclude.json").unlink()  # the list undone: cifar no longer counts as checked
    assert marks(str(ck), ds) == {"pets": "yes", "pets_val": "no", "cifar": "no"}
    # weights from a file, or a run over synthetic data: nothing to say
    (tmp_path / "w.safetensors").write_bytes(b"")
    assert marks(str(tmp_path / "w.safetensors"), ds) == {"pets": "", "pets_val": "", "cifar": ""}
    (ck / "manifest.json").write_text(json.dumps({"config": {"data.path": "synthetic:train=8"}}))
    assert set(marks(str(ck), ds).values()) == {""}


def test_the_tables_carry_the_column(tmp_path):
    rows = [{"dataset": "pets", "phase": "final", "lr": 0.01, "test_top1": 0.5, "selected": True,
             "status": "completed", "run_dir": "x", "decontaminated": "yes"},
            {"dataset": "cifar", "phase": "final", "lr": 0.01, "test_top1": 0.7, "selected": True,
             "status": "completed", "run_dir": "y", "decontaminated": "no"}]
    write_tables(tmp_path, rows)
    with open(tmp_path / "suite.csv", newline="") as f:
        assert [r["decontaminated"] for r in csv.DictReader(f)] == ["yes", "no"]
    md = (tmp_path / "suite.md").read_text().splitlines()
    assert md[0] == f"| dataset | {tmp_path.name} | decontaminated |"
    assert md[2:] == ["| pets | 50.00 | yes |", "| cifar | 70.00 | no |", "| **mean** | 60.00 |  |"]
    for r in rows:
        r["decontaminated"] = ""
    write_tables(tmp_path, rows)  # not known: the markdown as before
    assert (tmp_path / "suite.md").read_text().splitlines()[0] == f"| dataset | {tmp_path.name} |"


@pytest.mark.mlflow_server
def test_the_mlflow_parent_is_tagged(mlflow_server, tmp_path):
    """The suite's parent run says which datasets' test splits the pre-training data was checked against."""
    from launch.suite import Suite
    from launch.suite_mlflow import open_parent
    from tests.integration.test_mlflow_runs import run_of
    from tests.integration.test_suite import ROOT

    pets, cifar, _, ck = _pretrained(tmp_path)
    spec = yaml.safe_load((ROOT / "configs/suite/tiny.yaml").read_text())
    spec.update(transfer_config=str(ROOT / spec["transfer_config"]),
                datasets=[{"name": "pets", "data": str(pets)}, {"name": "cifar", "data": str(cifar)}])
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    suite = Suite(str(tmp_path / "s.yaml"), [f"init.from={ck}", f"run.dir={tmp_path / 'out'}",
                                             f"tracking.uri={mlflow_server}",
                                             f"tracking.experiment=suite-{uuid.uuid4().hex[:10]}"])
    sink = open_parent(suite)
    sink.close(status="FINISHED")
    assert run_of(mlflow_server, sink.run_id)["tags"]["vitp.decontaminated"] == "pets=yes,cifar=no"
