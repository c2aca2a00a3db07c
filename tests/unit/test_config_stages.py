"""Each stage validates the sections it reads; each section validates itself."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeline.config import (
    Config,
    ConfigError,
    DataCfg,
    EngineCfg,
    EvalConfig,
    PrepConfig,
    from_dict,
    load_config,
    to_dict,
)


def test_eval_and_prep_need_no_model():
    ev = load_config(None, ["data.path=shards", "eval.checkpoint=runs/x", "eval.batch=8"], schema=EvalConfig)
    assert ev.eval.batch == 8 and ev.data.path == "shards" and not hasattr(ev, "model")
    assert set(to_dict(ev)) == {"data", "eval", "engine", "tracking", "hardware", "cluster", "evals"}
    assert from_dict(to_dict(ev), schema=EvalConfig) == ev
    prep = load_config(None, ["cluster.nodes=2"], schema=PrepConfig)
    assert prep.world_size_planned == 2 and set(to_dict(prep)) == {"engine", "hardware", "cluster", "prep"}


def test_a_stage_refuses_a_section_it_does_not_read():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.width=8"], schema=EvalConfig)
    assert str(e.value).startswith("model: unknown key (valid: data, eval, engine, tracking, hardware, cluster")
    with pytest.raises(ConfigError, match=r"^optim: unknown key"):
        load_config(None, ["optim.lr=1"], schema=PrepConfig)


def test_training_needs_a_model():
    with pytest.raises(ConfigError, match=r"^model: give model.name \(e.g. vit_b16\) or all of width"):
        load_config(None, [], schema=Config)


def test_a_section_validates_itself():
    assert DataCfg(path="x", crop_scale=[0.5, 1.0]).crop_scale == [0.5, 1.0]
    with pytest.raises(ValidationError, match=r"data.crop_scale: need \[lo, hi\]"):
        DataCfg(crop_scale=[0.9, 0.1])
    with pytest.raises(ValidationError, match=r"engine.offload_params: needs engine.zero_stage=3; got 1"):
        EngineCfg(offload_params=True)


def test_list_items_and_mappings_are_named_by_key():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.crop_scale=[0.5, x]"], schema=EvalConfig)
    assert str(e.value) == "data.crop_scale[1]: expected a number, got 'x'"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["cluster.extra_sbatch={gres: [1]}"], schema=PrepConfig)
    assert str(e.value) == "cluster.extra_sbatch.gres: expected a string, got [1]"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["cluster=5"], schema=PrepConfig)
    assert str(e.value) == "cluster: expected a section (mapping), got 5"
