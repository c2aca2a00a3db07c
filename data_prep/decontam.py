"""`vitp decontam OUT --exclude-near TEST ...`: check a finished prep output against test sets chosen
after it was made, from the signatures prep stored beside each shard (``<shard>_sig.npz``; no image
is read or decoded), and write ``OUT/_exclude.json``, the samples every loader then leaves out
(pipeline/data/shards.py: read_info) without the shards being rewritten.

``_exclude.json`` (``version``: EXCLUDE_VERSION): the signature, its version and the threshold, per test set its address
without secrets, image count, digest, the training samples it excluded (``rejected``) and the distinct
test images that had a duplicate (``duplicated``); ``excluded`` in all; and ``samples``: [{"split",
"shard", "index" (the sample's number in its shard), "key", "of", "distance", "margin"}] sorted. The
same test sets again give the same bytes.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np

from . import store
from .schema import EXCLUDE_FILE, EXCLUDE_VERSION, INFO_FILE, DatasetInfo
from .shards import signatures_name
from .testsets import build_index, check_test_sets


def _signatures(out: str, info: DatasetInfo) -> dict[str, dict]:
    """{shard filename: {"hash", "thumb", "key"}} of every shard, all read before any lookup; a missing
    file is one line (an output from before prep stored them)."""
    names = [f for sp in info.splits.values() for f in sp.filenames]
    sig_names = [signatures_name(f.removesuffix(".tar")) for f in names]
    got = store.read_files(out, sig_names)
    sigs = {}
    for f, s in zip(names, sig_names):
        if got[s] is None:
            raise ValueError(f"{store.public(store.join(out, s))}: not found: this output was prepared before "
                             "prep stored signatures; run the same `vitp prep` again (it remakes the shards "
                             "without them)")
        z = np.load(io.BytesIO(got[s]), allow_pickle=False)
        sigs[f] = {k: z[k] for k in ("hash", "thumb", "key")}
    return sigs


def decontam(out: str | os.PathLike, test_sets: list[str], splits: list[str] | None, threshold: int) -> dict:
    """Check every sample of OUT against ``test_sets``; write OUT/_exclude.json; return its summary (the
    file without ``samples``). Bad input (OUT not a finished prep output, a missing or unreadable test
    set, missing signatures) is a ValueError of one line, before anything is written."""
    out = str(out).rstrip("/")
    raw = store.read_file(out, INFO_FILE)
    if raw is None:
        raise ValueError(f"{store.public(out)}: no {INFO_FILE} (not a finished `vitp prep` output)")
    info = DatasetInfo.from_json(raw.decode("utf-8"), store.public(store.join(out, INFO_FILE)))
    sigs = _signatures(out, info)
    check_test_sets(test_sets)
    index, names, block = build_index(test_sets, splits, threshold)
    samples = []
    for split, sp in info.splits.items():
        for f in sp.filenames:
            s = sigs[f]
            for i, (h, t, key) in enumerate(zip(s["hash"], s["thumb"], s["key"])):
                m = index.nearest(int(h), t)
                if m is not None:
                    samples.append({"split": split, "shard": f, "index": i, "key": str(key),
                                    "of": names[m.test], "distance": m.distance, "margin": m.margin})
    against = []
    for a in block["against"]:
        mine = [s["of"] for s in samples if s["of"].startswith(a["address"] + "/")]
        against.append({**a, "rejected": len(mine), "duplicated": len(set(mine))})
    summary = {**{k: v for k, v in block.items() if k not in ("against", "version")},
               "signature_version": block["version"], "version": EXCLUDE_VERSION, "against": against,
               "excluded": len(samples)}
    doc = {**summary, "samples": sorted(samples, key=lambda s: (s["split"], s["shard"], s["index"]))}
    store.write_file(out, EXCLUDE_FILE, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode("utf-8"))
    return summary
