"""Multi-label data end to end on one process: manifests → `vitp prep` shards (read back by timm's and
plain webdataset readers) → the loader's multi-hot targets, their mixing and exact resume → losses
and metrics (precision@1, average precision against sklearn)."""

import csv
import itertools
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data_prep import prep, verify
from data_prep.sources import list_source
from pipeline.config import DataCfg
from pipeline.data.loader import EvalLoader, TrainLoader, read_info
from pipeline.data.mixing import Mixer
from pipeline.eval.loop import average_precision, classify_multilabel
from pipeline.train.loss import loss_fn, top1_hits
from tests.multilabel_data import BAD_ROWS, COLOURS, stripes_manifest

NAMES = list(COLOURS)


@pytest.fixture(scope="module")
def stripes(tmp_path_factory):
    """(shards folder, {source path: sorted label indices}) of 40 train + 10 val images, 5 shards."""
    root = tmp_path_factory.mktemp("stripes")
    m = stripes_manifest(root, 40, 10)
    res = prep(m, root / "shards", split_column="split", max_samples_per_shard=8, classes=NAMES, progress=False)
    assert res["num_samples"] == {"train": 40, "val": 10}
    truth = {}
    with open(m, newline="") as f:
        for row in csv.DictReader(f):
            cell = row["labels"]
            if row["path"] not in BAD_ROWS:
                truth[row["path"]] = sorted(NAMES.index(n) for n in (json.loads(cell) if cell[0] == "[" else
                                                                      cell.split(";")))
    return root / "shards", truth


def _json_labels(out):
    import webdataset as wds

    return {s["__key__"]: s["json"] for s in wds.WebDataset(str(out / "train-{000000..000004}.tar"),
                                                             shardshuffle=False).decode()}


def test_prep_stores_primary_cls_and_full_labels_and_rejects_bad_fields(stripes):
    out, truth = stripes
    info = json.loads((out / "_info.json").read_text())
    assert info["multi_label"] is True and info["num_classes"] == 6
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert {r["path"]: r["reason"] for r in rejects} == {p: "bad_label" for p in BAD_ROWS}
    for r in rejects:
        assert BAD_ROWS[r["path"]][1] in r["detail"]
    assert verify(out) == []
    import webdataset as wds

    seen = 0
    for s in wds.WebDataset(str(out / "train-{000000..000004}.tar"), shardshuffle=False).decode():
        meta = s["json"]  # decoded by webdataset's default handlers, as .cls is
        assert meta["labels"] == truth[meta["source"]] and s["cls"] in meta["labels"]
        assert s["cls"] == NAMES.index(meta["label"])
        seen += 1
    assert seen == 40


def test_timm_reads_the_shards_both_ways(stripes):
    from timm.data.readers.reader_wds import ReaderWds

    out, truth = stripes
    primary = [int(t) for _, t in ReaderWds(str(out), split="val")]
    full = [t for _, t in ReaderWds(str(out), split="val", target_key="labels")]
    assert len(primary) == len(full) == 10
    assert all(p in f and f == sorted(f) for p, f in zip(primary, full))
    assert sorted(map(tuple, full)) == sorted(tuple(v) for k, v in truth.items() if int(k[4:9]) >= 40)


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_manifest_label_spellings_and_bad_fields(tmp_path, fmt):
    rows = [{"path": "a.jpg", "labels": "2;0;2"}, {"path": "b.jpg", "labels": "[1]"},
            {"path": "c.jpg", "labels": "1;7"}, {"path": "d.jpg", "labels": ""}, {"path": "e.jpg", "labels": "[1, x"}]
    if fmt != "csv":  # native lists where the format has them
        rows[1]["labels"] = [1]
    m = tmp_path / f"m.{fmt}"
    if fmt == "csv":
        m.write_text("path,labels\n" + "".join(f'{r["path"]},"{r["labels"]}"\n' for r in rows))
    elif fmt == "jsonl":
        m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist([dict(r, labels=json.dumps(r["labels"]) if isinstance(r["labels"], list)
                                                  else r["labels"]) for r in rows]), m)
    src = list_source(m, classes=["x", "y", "z"])
    assert src.multi_label
    assert [(it.rel, it.cls, it.labels) for it in src.items] == [("a.jpg", 2, (0, 2)), ("b.jpg", 1, (1,))]
    why = {r["path"]: r["detail"] for r in src.rejects}
    assert why == {"c.jpg": "label 7 >= 3 classes", "d.jpg": "labels is empty",
                   "e.jpg": "labels '[1, x': not 'a;b;c', a JSON list or a list of names/indices"}
    assert {r["reason"] for r in src.rejects} == {"bad_label"}


def _cfg(out, **kw):
    return DataCfg(path=str(out), workers=0, shuffle_buffer=8, crop_scale=[0.5, 1.0], **kw)


def test_loader_yields_multi_hot_targets_that_match_the_json(stripes):
    out, truth = stripes
    ld = TrainLoader(_cfg(out), img_size=16, micro_batch=8, global_batch=8, rank=0, world_size=1, return_keys=True)
    by_key = {k: meta["labels"] for k, meta in _json_labels(out).items()}
    images, labels, keys = next(iter(ld))
    assert images.shape == (8, 3, 16, 16) and labels.dtype == torch.bool and labels.shape == (8, 6)
    for row, key in zip(labels, keys):
        assert row.nonzero().flatten().tolist() == by_key[key]
    ev = EvalLoader(_cfg(out), img_size=16, batch=4, rank=1, world_size=2, split="val", num_workers=0)
    got = list(ev)
    assert len(got) == 2 and got[1][1].shape == (4, 6)
    assert got[1][2].tolist() == [True, False, False, False] and not got[1][1][1:].any()  # padding has no class


def test_mixed_multi_hot_targets_and_exact_resume(stripes):
    out, _ = stripes
    cfg = _cfg(out, mixup=0.4, cutmix=1.0, label_smoothing=0.1)

    def loader():
        return TrainLoader(cfg, img_size=16, micro_batch=4, global_batch=8, rank=1, world_size=2, seed=3)

    a = loader()
    mix = Mixer(a.info.num_classes, cfg.mixup, cfg.cutmix, cfg.label_smoothing, multi_label=True, seed=3, rank=1)
    it = iter(a)
    next(it)  # one micro batch, then the checkpoint
    state = a.state_dict()
    ref = [(x, y, *mix(x.float(), y, a.position)) for x, y in itertools.islice(it, 3)]
    b = loader()
    b.load_state_dict(state)
    got = [(x, y, *mix(x.float(), y, b.position)) for x, y in itertools.islice(iter(b), 3)]
    assert len(got) == 3
    for r, g in zip(ref, got):
        assert all(torch.equal(u, v) for u, v in zip(r, g))
    _, y0, _, t0 = ref[0]
    # each row is a mix of its own and its mirror row's label sets, smoothed towards 0.5
    y, s = y0.float(), 0.1
    smooth = y * (1 - s) + s / 2
    lam = [((t0[i] - smooth.flip(0)[i]) / (smooth[i] - smooth.flip(0)[i])) for i in range(len(y))]
    lam = torch.cat([v[(smooth[i] != smooth.flip(0)[i])] for i, v in enumerate(lam)])
    assert torch.allclose(lam, lam[0].expand_as(lam), atol=1e-5) and 0 <= float(lam[0]) <= 1
    assert torch.allclose(t0, lam[0] * smooth + (1 - lam[0]) * smooth.flip(0), atol=1e-6)


def test_smoothing_without_mixing_and_the_losses():
    y = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 0]], dtype=torch.bool)
    _, t = Mixer(4, label_smoothing=0.2, multi_label=True)(torch.zeros(2, 3, 4, 4), y, (0, 0))
    assert torch.allclose(t, torch.tensor([[0.9, 0.1, 0.9, 0.1], [0.1, 0.9, 0.1, 0.1]]))
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0], [0.0, 3.0, -2.0, 1.0]])
    want = torch.nn.functional.binary_cross_entropy_with_logits(logits, y.float(), reduction="none").sum(-1)
    assert torch.allclose(loss_fn("sigmoid", logits, y, reduction="none"), want)
    soft = -(torch.tensor([[0.5, 0, 0.5, 0], [0, 1.0, 0, 0]]) * logits.log_softmax(-1)).sum(-1)
    assert torch.allclose(loss_fn("softmax", logits, y, reduction="none"), soft)  # 1/k on each of k labels
    assert int(top1_hits(logits, y)) == 2 and int(top1_hits(torch.tensor([[0.0, 1, 0, 0]] * 2), y)) == 1
    one_hot = torch.tensor([2, 1])
    assert torch.allclose(loss_fn("softmax", logits, torch.nn.functional.one_hot(one_hot, 4).float()),
                          loss_fn("softmax", logits, one_hot))


def test_average_precision_matches_sklearn_with_ties():
    from sklearn.metrics import average_precision_score

    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (60, 7), generator=g).float()  # many ties
    targets = torch.rand(60, 7, generator=g) < 0.3
    targets[:, 6] = False  # a class without positives has no AP
    ap = average_precision(scores, targets)
    assert ap[6] is None
    for c in range(6):
        assert ap[c] == pytest.approx(average_precision_score(targets[:, c].numpy(), scores[:, c].numpy()))


class Logits(torch.nn.Module):
    """Returns the fixed logits of the batch's image ids (pixel [0, 0, 0])."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.tensor(table)

    def forward(self, x):
        return self.table[x[:, 0, 0, 0].long()]


def test_classify_multilabel_prec1_and_map():
    table = [[3.0, 1, 0], [0, 2, 1], [1, 0, 5], [0, 0, 0]]
    y = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 1], [0, 1, 0]], dtype=torch.bool)
    x = torch.arange(4).view(4, 1, 1, 1).expand(4, 3, 2, 2).to(torch.uint8)
    valid = torch.tensor([True, True, True, False])  # the last row is padding
    res = classify_multilabel(Logits(table), [(x[:2], y[:2], valid[:2]), (x[2:], y[2:], valid[2:])], 3, mean_ap=True)
    assert (res.n, res.hits) == (3, 2) and res.prec1 == pytest.approx(2 / 3)
    # class 0 ranked: +, -, + -> (1 + 2/3) / 2; class 1: -, + -> 1/2; class 2: + first -> 1
    assert res.ap == [pytest.approx(5 / 6), pytest.approx(0.5), pytest.approx(1.0)]
    assert res.mean_ap == pytest.approx((5 / 6 + 0.5 + 1) / 3)
    assert set(res.metrics("val")) == {"val/prec1", "val/loss", "val/n", "val/mAP"}


def test_read_info_single_label_stays_single(tmp_path):
    from tests.unit.test_data_shards import write_dataset

    write_dataset(tmp_path, {"train": [3]})
    assert read_info(tmp_path).multi_label is False


@pytest.mark.parametrize("recipe", ["tiny_cpu", "vit_b16", "vit_l16", "vit_h14"])
def test_pretrain_recipes_take_a_multilabel_folder_unchanged(stripes, recipe, repo_root):
    """Each shipped recipe's data, loss and metric path on multi-label shards (the model aside: the
    2-rank test trains one): multi-hot targets, a finite loss of the recipe's kind, precision@1."""
    from pipeline.config import load_config

    out, _ = stripes
    cfg = load_config(repo_root / f"configs/pretrain/{recipe}.yaml", [f"data.path={out}"])
    ld = TrainLoader(cfg.data, img_size=cfg.model.img_size, micro_batch=8, global_batch=8, rank=0, world_size=1,
                     seed=cfg.seed, num_workers=0)
    images, labels = next(iter(ld))
    assert images.shape == (8, 3, cfg.model.img_size, cfg.model.img_size) and labels.shape == (8, 6)
    x, targets = Mixer(6, cfg.data.mixup, cfg.data.cutmix, cfg.data.label_smoothing, multi_label=True, seed=cfg.seed,
                       rank=0)(images.float(), labels, ld.position)
    logits = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    loss = loss_fn(cfg.train.loss, logits, targets, label_smoothing=cfg.data.label_smoothing)
    assert torch.isfinite(loss) and 0 <= int(top1_hits(logits, labels)) <= 8
