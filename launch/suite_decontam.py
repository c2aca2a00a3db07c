"""Was each suite dataset's test split among the test sets the pre-training data was checked against?

The checkpoint's manifest names its run's ``data.path``; its DataSource says what it was checked
against (a prep output: ``_info.json``'s ``decontaminated`` block, `vitp prep --exclude-near`'s sets and
`vitp decontam`'s as its ``_exclude.json`` holds them, merged by read_info), each a list of test sets
(addresses) and the splits taken of them. A suite dataset is "yes" when its address is one of them and
its test split one of the splits taken (no splits given: ``test`` if that test set has one, else all),
"no" otherwise, and "" when the pre-training data is not known (weights from a file, a manifest without
``data.path``, synthetic data, an image folder, data that cannot be read).
"""

from __future__ import annotations

from data_prep import store


def pretrain_data(source: str) -> str | None:
    """The ``data.path`` of the run whose checkpoint ``source`` names (None: not one of our checkpoints)."""
    from pipeline.checkpoint_layout import checkpoint_in, read_manifest

    try:
        ck = checkpoint_in(source)
        return (read_manifest(ck).get("config") or {}).get("data.path") if ck is not None else None
    except (OSError, ValueError):
        return None


def checked_sets(data: str) -> list[tuple[str, list[str] | None]] | None:
    """(address, splits) of every test set ``data`` was checked against; None when its kind keeps no
    such record (synthetic data, an image folder)."""
    from pipeline.data import source_for

    return source_for(data).checked_against()


def _taken(address: str, splits: list[str] | None) -> set[str] | None:
    """The splits of a test set that were checked (None: all of them)."""
    from pipeline.data import source_for

    if splits:
        return set(splits)
    try:
        has = source_for(address).split_sizes()
    except (OSError, ValueError):  # not readable now: say what was asked, all of its splits
        has = {}
    return {"test"} if "test" in has else None


def marks(source: str, datasets) -> dict[str, str]:
    """{dataset name: "yes" | "no" | ""} for the suite's ``datasets`` (each with .name, .data, .test_split)."""
    data = pretrain_data(source)
    try:
        sets = checked_sets(data) if data else None
    except (OSError, ValueError):
        sets = None
    if sets is None:
        return {d.name: "" for d in datasets}
    out = {}
    for d in datasets:
        address = store.public(d.data).rstrip("/")
        hit = False
        for a, splits in sets:
            if a == address:
                taken = _taken(d.data, splits)
                hit = hit or taken is None or d.test_split in taken
        out[d.name] = "yes" if hit else "no"
    return out
