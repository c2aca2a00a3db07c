"""Prep's one schema: `vitp prep` and `vitp submit prep` take the same options, with the same names,
defaults and meaning, and both parse into pipeline.config.PrepCfg (which `prep()` takes)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from data_prep.build import prep
from data_prep.cli import prep_options
from data_prep.cli import prep_parser as vitp_prep_parser
from data_prep.plan import load_plan
from launch.cli import main
from launch.submit_args import prep_parser
from pipeline.config import ConfigError, PrepCfg, PrepConfig, prep_cfg
from tests.data_prep_fixtures import jpeg_bytes, natural_image

PREP_ONLY = {"--shard-range", "--no-progress"}  # an array task sets these itself
SUBMIT_ONLY = {"--tasks", "--cluster", "--resources", "--wait", "--dry-run", "--skip-driver-check"}
HIDDEN = {"--shard-size-mb"}  # an old spelling, refused


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


# one value for every option: (argv, the field it sets, the value the schema holds)
EVERY = [
    (["--seed", "3"], "seed", 3), (["--val-fraction", "0.25"], "val_fraction", 0.25),
    (["--split-column", "part"], "split_column", "part"), (["--path-column", "file"], "path_column", "file"),
    (["--label-column", "y"], "label_column", "y"), (["--labels-column", "ys"], "labels_column", "ys"),
    (["--classes", "c.txt"], "classes", "c.txt"), (["--shard-size", "500MB"], "shard_size", 500_000_000),
    (["--max-samples-per-shard", "7"], "max_samples_per_shard", 7),
    (["--resize-shorter", "64"], "resize_shorter", 64), (["--resize-longer", "80"], "resize_longer", 80),
    (["--quality", "70"], "quality", 70), (["--min-size", "8"], "min_size", 8),
    (["--max-pixels", "1000000"], "max_pixels", 1_000_000), (["--no-keep-original"], "keep_original", False),
    (["--dedup"], "dedup", True), (["--workers", "2"], "workers", 2),
    (["--staging-dir", "/tmp/x"], "staging_dir", "/tmp/x"),
    (["--part-size", "8MiB"], "part_size", 8 << 20),
    (["--exclude-near", "a", "--exclude-near", "b"], "exclude_near", ["a", "b"]),
    (["--exclude-near", "a", "--exclude-near-splits", "test,val"], "exclude_near_splits", ["test", "val"]),
    (["--near-threshold", "6"], "near_threshold", 6),
]


def _through_prep(argv: list[str]) -> PrepCfg:
    return prep_cfg(prep_options(vitp_prep_parser().parse_args(["src", "out", *argv])))


def _through_submit(argv: list[str]) -> PrepCfg:
    return prep_cfg(prep_options(prep_parser().parse_intermixed_args(["src", "out", *argv])))


def test_both_commands_have_the_same_options_and_defaults():
    mine, theirs = _options(vitp_prep_parser()), _options(prep_parser())
    assert set(mine) - set(theirs) == PREP_ONLY
    assert set(theirs) - set(mine) == SUBMIT_ONLY
    shared = set(mine) & set(theirs)
    for name in shared:
        a, b = mine[name], theirs[name]
        assert (a.dest, a.default, a.type, a.nargs, type(a)) == (b.dest, b.default, b.type, b.nargs, type(b)), name
        assert a.help == b.help, name
    # every field of the schema is an option of both (its flag is the field's name), and nothing else
    fields = {_options(vitp_prep_parser())[s].dest for s in shared - HIDDEN}
    assert fields == set(PrepCfg.model_fields)
    assert {f for _, f, _ in EVERY} == set(PrepCfg.model_fields)
    # no option given: both give the schema's defaults
    assert _through_prep([]) == _through_submit([]) == PrepCfg()


@pytest.mark.parametrize("argv,field,value", EVERY, ids=[f for _, f, _ in EVERY])
def test_every_option_means_the_same_through_both(argv, field, value):
    a, b = _through_prep(argv), _through_submit(argv)
    assert a == b
    assert getattr(a, field) == value


def test_a_byte_size_caps_shards_alike_through_both(tmp_path):
    """`--shard-size 500MB` through either command: no 5000-sample cap beside it."""
    for cfg in (_through_prep(["--shard-size", "500MB"]), _through_submit(["--shard-size", "500MB"])):
        assert cfg.samples_cap is None and cfg.shard_size == 500_000_000
    assert PrepCfg().samples_cap == 5000
    assert _through_submit(["--max-samples-per-shard", "9"]).samples_cap == 9
    # and through prep(): the stored plan cuts by bytes alone
    rng, src = np.random.default_rng(0), tmp_path / "img"
    for i in range(6):
        (src / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (src / f"c{i % 2}" / f"{i}.jpg").write_bytes(jpeg_bytes(natural_image(rng, 32, 24)))
    prep(src, tmp_path / "out", _through_submit(["--shard-size", "500MB"]), progress=False)
    assert load_plan(tmp_path / "out")["request"]["max_samples_per_shard"] is None


def test_old_spelling_and_bad_values_are_one_line_naming_the_option(tmp_path, capsys):
    assert main(["submit", "prep", str(tmp_path), str(tmp_path / "o"), "--shard-size-mb", "500", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: --shard-size-mb: renamed; use --shard-size 500MB (bytes with a unit)"
    assert main(["prep", str(tmp_path), str(tmp_path / "o"), "--near-threshold", "99"]) == 2
    assert capsys.readouterr().err.strip() == "error: --near-threshold: must be <= 24; got 99"
    assert main(["prep", str(tmp_path), str(tmp_path / "o"), "--workers", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --workers: must be >= 1; got 0"
    assert not (tmp_path / "o").exists()  # before any work
    with pytest.raises(ConfigError, match=r"^--exclude-near-splits: given without --exclude-near$"):
        prep_cfg({"exclude_near_splits": "test"})


def test_submit_config_carries_the_schema():
    cfg = PrepConfig(prep=_through_submit(["--quality", "70", "--shard-size", "1GB"]))
    again = PrepConfig.model_validate(json.loads(cfg.model_dump_json()))
    assert again.prep == cfg.prep and again.prep.quality == 70


def test_flags_help_and_defaults_come_from_the_schema():
    """Each flag is made from its PrepCfg field: its name, --help text and (through the schema) default;
    the image options prep stores with default to the same values."""
    from data_prep.images import ImageOptions
    from pipeline.config.prep import flag

    opts = _options(vitp_prep_parser())
    for name, field in PrepCfg.model_fields.items():
        action = opts[field.json_schema_extra["cli"]["flag"] or flag(name)]
        assert (action.dest, action.help, action.default) == (name, field.description, None), name
    assert PrepCfg.model_fields["quality"].description.endswith("(default 90)")
    assert ImageOptions.of(PrepCfg()) == ImageOptions()
    cfg = _through_prep(["--quality", "70", "--max-pixels", "1000000", "--resize-longer", "64", "--no-keep-original"])
    assert ImageOptions.of(cfg) == ImageOptions(resize_longer=64, quality=70, max_pixels=1_000_000, keep_original=False)
