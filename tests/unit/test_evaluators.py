"""Declared evaluators (pipeline/eval/evaluators): the old keys as entries, one-line refusals of bad
entries before anything starts, the task kind decided once, and the periodic order by declaration."""

import json

import pytest
import torch

from pipeline.config import ConfigError, EvalConfig, load_config
from pipeline.data import DataError
from pipeline.eval import evaluators as evals
from pipeline.eval.task import Task
from pipeline.train.checkpoint import CheckpointManager

TINY = "configs/pretrain/tiny_cpu.yaml"


def _cfg(*overrides):
    return load_config(TINY, ["data.path=synthetic:classes=4,train=8,val=8", *overrides], world_size=1)


def test_the_old_keys_are_entries():
    cfg = _cfg("train.eval_every=5", "train.fewshot_every=7", "eval.fewshot_data=[pets=/d/pets,/d/flowers]",
               "eval.fewshot_shots=[1,5]", "eval.fewshot_seeds=2", "eval.fewshot_l2=0.5", "data.val_split=minival")
    got = [(k, e.model_dump()) for k, e in evals.run_entries(cfg)]
    common = dict(split=None, train_split="train", test_split="test", every=7, prefix="fewshot/", shots=[1, 5],
                  seeds=2, l2=0.5)
    assert got == [
        ("data.val_split", dict(name="val", type="classify", data=None, split="minival", train_split=None,
                                test_split=None, every=5, prefix="val_")),
        ("eval.fewshot_data", dict(name="pets", type="fewshot", data="/d/pets", **common)),
        ("eval.fewshot_data", dict(name="flowers", type="fewshot", data="/d/flowers", **common))]
    # a declared entry named like a shorthand one replaces it; the others follow in declared order
    cfg = _cfg("evals=[{name: val, type: classify, split: val, every: 2}, {name: probe, type: linear_probe, "
               "train_split: train, test_split: val}]")
    assert [(k, e.name, e.every) for k, e in evals.run_entries(cfg)] == [("evals[0]", "val", 2),
                                                                         ("evals[1]", "probe", 0)]
    assert [k for k, _ in evals.run_entries(_cfg("data.val_split=null"))] == []  # no val split: no validation


def test_vitp_eval_flags_are_entries_and_a_list_replaces_them():
    ev = load_config(None, ["data.path=d", "eval.checkpoint=r", "eval.split=test", "eval.fewshot=true",
                            "eval.linear_probe=true", "eval.max_train_images=9", "eval.fewshot_shots=[2]"],
                     schema=EvalConfig)
    got = {k: e.model_dump(exclude_none=True) for k, e in evals.eval_entries(ev)}
    assert got == {
        "eval.split": dict(name="test", type="classify", split="test", every=0),
        "eval.fewshot": dict(name="fewshot", type="fewshot", train_split="train", test_split="test", every=0,
                             prefix="", shots=[2], seeds=3, l2=1024.0),
        "eval.linear_probe": dict(name="linear_probe", type="linear_probe", train_split="train", test_split="test",
                                  every=0, max_train_images=9)}
    listed = load_config(None, ["data.path=d", "eval.checkpoint=r", "evals=[{name: a, type: classify, split: v}]"],
                         schema=EvalConfig)
    assert [(k, e.name) for k, e in evals.eval_entries(listed)] == [("evals[0]", "a")]
    with pytest.raises(ConfigError, match=r"^eval: nothing to do"):
        evals.eval_entries(load_config(None, ["eval.top1=false"], schema=EvalConfig))


@pytest.mark.parametrize("entry, message", [
    ({"name": "a", "type": "nope", "split": "val"},
     r"^evals\[0\]\.type: unknown evaluator type 'nope' \(known: classify, fewshot, linear_probe; or package"),
    ({"name": "a", "type": "no_such.module:Class", "split": "val"},
     r"^evals\[0\]\.type: cannot load evaluator 'no_such.module:Class': ModuleNotFoundError"),
    ({"name": "a", "type": "pipeline.config:Section", "split": "val"}, r"^evals\[0\]\.type: .* is not an evaluator"),
    ({"name": "a", "type": "fewshot", "train_split": "train"},
     r"^evals\[0\]\.test_split: missing; a fewshot evaluator reads the split it names$"),
    ({"name": "a", "type": "classify"}, r"^evals\[0\]\.split: missing"),
    ({"name": "a", "type": "fewshot", "train_split": "t", "test_split": "v", "shot": [1]},
     r"^evals\[0\]\.shot: unknown key \(did you mean 'shots'\?\)$"),
    ({"name": "a", "type": "fewshot", "train_split": "t", "test_split": "v", "shots": [0]},
     r"^evals\[0\]\.shots: each shot count must be >= 1; got \[0\]$"),
    ({"name": "a", "type": "classify", "split": "v", "seeds": 3}, r"^evals\[0\]\.seeds: unknown key"),
])
def test_a_bad_entry_is_one_line_naming_its_key(entry, message):
    cfg = _cfg(f"evals=[{json.dumps(entry)}]")
    with pytest.raises(ConfigError, match=message):
        evals.declare(evals.run_entries(cfg))


def test_config_refuses_unnamed_and_twin_entries():
    with pytest.raises(ConfigError, match=r"^evals\[0\]\.name: Field required"):
        _cfg("evals=[{type: classify}]")
    with pytest.raises(ConfigError, match=r"^evals: two evaluators named 'a'"):
        _cfg("evals=[{name: a, type: classify, split: val}, {name: a, type: classify, split: val}]")


def test_a_dataset_without_the_split_is_refused_before_queueing(tmp_path):
    from launch.submit import SubmitError, check_data, load_submit_config

    split = {"filenames": ["a.tar"]}
    for d, splits in (("data", {"train": split, "val": split}), ("pets", {"train": split})):
        (tmp_path / d).mkdir()
        (tmp_path / d / "_info.json").write_text(json.dumps({"splits": splits}))
    entry = {"name": "pets", "type": "fewshot", "data": str(tmp_path / "pets"), "train_split": "train",
             "test_split": "test"}
    cfg = load_submit_config(TINY, [f"data.path={tmp_path / 'data'}", f"evals=[{json.dumps(entry)}]"])
    with pytest.raises(SubmitError, match=r"^evals\[0\]\.test_split: 'test' not in .*pets/_info.json \(has: train\)"):
        check_data(cfg, "pretrain")
    with pytest.raises(DataError, match=r"^evals\[0\]\.test_split: 'test' not in"):
        evals.check_data(evals.declare(evals.run_entries(cfg)), cfg.data.path)


def test_the_task_kind_names_the_metrics_and_the_loss():
    class Info:
        multi_label = True

    multi, single = Task.of(Info()), Task(False, "softmax")
    assert (multi.hit, multi.loss, single.hit) == ("prec1", "sigmoid", "top1")
    assert Task.of(Info(), "softmax").loss == "softmax"  # as the run trained
    assert multi.show({"val_prec1": 0.5}, "val_") == "prec@1 0.5000" and single.show({"top1": 0.25}) == "top1 0.2500"
    logits, y = torch.tensor([[2.0, 0.0]]), torch.tensor([0])
    assert single.per_sample_loss(logits, y).item() == pytest.approx(torch.log1p(torch.exp(torch.tensor(-2.0))).item())


def test_the_checkpoint_manager_decides_when_to_save():
    m = CheckpointManager("unused", None, {}, every=4, last_step=10, keep=1)
    assert [s for s in range(1, 11) if m.due(s)] == [4, 8, 10]
    assert m.due(7, last_step=True)  # the end of a job
    m._saved_at = 8  # noqa: SLF001 - as after save(8)
    assert not m.due(8) and not m.due(8, last_step=True)  # once per step
