"""Evaluation counts against hand-computed numbers; artifacts; whole evaluations on synthetic data."""

import json
import math

import pytest
import torch

from pipeline.config import DataCfg, EvalCfg
from pipeline.eval.evaluators import Context, prelogits, score_model
from pipeline.eval.loop import classify, write_artifacts, write_results
from pipeline.eval.task import Task
from pipeline.model import build_vit
from pipeline.weights import WeightsError as TransferError
from pipeline.weights import load_model
from pipeline.weights import save_model as save_safetensors


class FixedLogits(torch.nn.Module):
    """Returns the logits stored for each input id (x[:, 0, 0, 0] holds the id)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.tensor(logits, dtype=torch.float32)

    def forward(self, x):
        return self.logits[x[:, 0, 0, 0].long()]


def _batches(ids, labels, bs):
    x = torch.tensor(ids, dtype=torch.float32).view(-1, 1, 1, 1)
    y = torch.tensor(labels)
    return [(x[i:i + bs], y[i:i + bs]) for i in range(0, len(ids), bs)]


def test_classify_matches_hand_counts():
    logits = [[2.0, 1.0, 0.0, -1.0, -2.0, -3.0],   # pred 0
              [0.0, 3.0, 1.0, 0.5, 0.2, 0.1],      # pred 1
              [1.0, 0.0, 0.5, 0.4, 0.3, 0.2],      # pred 0
              [0.0, 0.0, 0.0, 0.0, 0.0, 9.0],      # pred 5
              [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]]      # pred 5
    labels = [0, 1, 2, 4, 0]
    # top-5 of 6 classes misses exactly the lowest logit: sample 4 (label 0 has the lowest) is a miss
    res = classify(FixedLogits(logits), _batches(range(5), labels, 2), 6)
    assert res.n == 5
    assert res.top1 == pytest.approx(2 / 5)  # s0 and s1
    conf = torch.zeros(6, 6, dtype=torch.long)
    for t, p in zip(labels, [0, 1, 0, 5, 5]):
        conf[t, p] += 1
    assert torch.equal(res.confusion, conf)
    per = res.per_class
    assert per[0] == 0.5 and per[1] == 1.0 and per[2] == 0.0 and per[3] is None and per[4] == 0.0
    lg = torch.tensor(logits)
    ce = torch.nn.functional.cross_entropy(lg, torch.tensor(labels))
    assert res.loss == pytest.approx(ce.item(), rel=1e-6)
    top5 = sum(int(t in lg[i].topk(5).indices.tolist()) for i, t in enumerate(labels))
    assert res.top5 == pytest.approx(top5 / 5)
    assert res.top5 < 1.0


def test_classify_without_confusion_counts_the_same():
    """In-training validation's counts (per class hits and samples): every number as with the matrix."""
    logits = [[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 0.5], [0.0, 0.0, 9.0]]
    labels = [0, 1, 2, 0]
    full = classify(FixedLogits(logits), _batches(range(4), labels, 3), 3)
    lean = classify(FixedLogits(logits), _batches(range(4), labels, 3), 3, confusion=False)
    assert lean.confusion is None and lean.correct.tolist() == [1, 1, 0] and lean.support.tolist() == [2, 1, 1]
    assert (lean.n, lean.top1, lean.top5, lean.per_class) == (full.n, full.top1, full.top5, full.per_class) \
        == (4, 0.5, 1.0, [0.5, 1, 0])
    assert lean.loss == full.loss


# One in-training validation over ImageNet-21k's classes, in a fresh process (its peak RSS is then this
# validation's): a linear head with 21,843 outputs, 6 synthetic images. Prints the logged record and
# how far the validation raised the process's peak RSS, in bytes.
_VALIDATE_21K = """
import functools, json, resource, sys
import torch
import torch.nn.functional as F
from pipeline.config import DataCfg, EvalEntry
from pipeline.data import source_for
from pipeline.eval import evaluators as evals
from pipeline.eval.task import Task

K, path = 21843, "synthetic:classes=21843,train=1,val=6"
source = source_for(path)
ctx = evals.Context(DataCfg(path=path), Task.of(source.read_info()), img_size=8, batch=4, device=torch.device("cpu"),
                    rank=0, world=1)
(val,) = evals.declare([("data.val_split", EvalEntry(name="val", type="classify", split="val", prefix="val_"))])
v = val.build(ctx)  # as a training run builds its validation
loader = v.batches
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, K))
list(loader)  # decoded once before: the measure is the validation's own
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
record = v.run(model, 1)
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
with torch.no_grad():
    x, y = torch.cat([b[0] for b in loader])[:6], torch.cat([b[1] for b in loader])[:6]
    logits = model(source.normalize(x))
want = {"val_top1": (logits.argmax(1) == y).double().mean().item(),
        "val_loss": F.cross_entropy(logits, y).item(), "val_n": 6}
print(json.dumps({"record": record, "want": want, "grown": grown}))
"""


def test_validation_over_21843_classes_counts_per_class_not_a_confusion_matrix():
    """In-training validation keeps 2K counts: over 21,843 classes its peak memory stays far below
    the K x K int64 matrix (3.8 GB) the confusion counting allocates, and it logs the same numbers."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _VALIDATE_21K], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    matrix = 21843 * 21843 * 8
    assert got["grown"] < 256 * 2**20 < matrix / 10, f"validation raised the peak RSS by {got['grown']} bytes"
    rec, want = got["record"], got["want"]
    assert rec["val_n"] == want["val_n"] and rec["val_top1"] == pytest.approx(want["val_top1"], abs=1e-9)
    assert rec["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)


def test_classify_rejects_class_count_mismatch():
    with pytest.raises(ValueError, match="model gives 2 logits but the dataset has 3 classes"):
        classify(FixedLogits([[0.0, 1.0]]), _batches([0], [0], 1), 3)


def test_artifacts_and_results_json(tmp_path):
    res = classify(FixedLogits([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), _batches([0, 1, 2], [0, 1, 1], 3), 2)
    paths = write_artifacts(res, tmp_path, "val", ["cat", "dog"])
    per = json.loads((tmp_path / "per_class_val.json").read_text())
    assert per == [{"class": 0, "name": "cat", "accuracy": 1.0, "support": 1},
                   {"class": 1, "name": "dog", "accuracy": 0.5, "support": 2}]
    assert json.loads((tmp_path / "confusion_val.json").read_text()) == [[1, 0], [1, 1]]
    png = tmp_path / "confusion_val.png"
    assert png in paths and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_results({"a": 1}, tmp_path)
    write_results({"b": 2.5}, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text()) == {"a": 1, "b": 2.5}


def _tiny(num_classes=10, img=16, **kw):
    torch.manual_seed(0)
    return build_vit(width=32, depth=1, heads=2, mlp_dim=64, patch=4, img_size=img, num_classes=num_classes, **kw)


def test_evaluate_model_on_synthetic_counts_every_val_sample(tmp_path):
    data = DataCfg(path="synthetic:classes=4,train=64,val=24")
    model = _tiny(4)
    res = score_model(model, data, batch=10, fewshot_cfg=EvalCfg(fewshot_shots=[1, 5], fewshot_seeds=2),
                         linear_probe=True, out_dir=tmp_path)
    assert res["val/n"] == 24
    assert 0.0 <= res["val/top1"] <= res["val/top5"] <= 1.0
    assert res["val/loss"] == pytest.approx(math.log(4), rel=1e-6)  # zero head: uniform logits
    for k in ("fewshot/1shot", "fewshot/5shot", "fewshot/5shot_std", "linear_probe/top1"):
        assert 0.0 <= res[k] <= 1.0
    # the synthetic classes are distinct colour templates: a linear read-out of random features finds them
    assert res["linear_probe/top1"] > 0.5
    assert (tmp_path / "confusion_val.png").is_file()


def test_evaluate_model_head_mismatch_is_clear():
    with pytest.raises(ValueError, match="the dataset has 4 classes but the model's head has 10"):
        score_model(_tiny(10), DataCfg(path="synthetic:classes=4,train=8,val=8"))


def test_prelogits_width_and_cap():
    model = _tiny(3, representation_size=24)
    x = torch.randint(0, 255, (10, 3, 16, 16), dtype=torch.uint8)
    valid = torch.ones(10, dtype=torch.bool)
    batches = [(x[:4], torch.zeros(4), valid[:4]), (x[4:], torch.ones(6), valid[4:])]
    ctx = Context(DataCfg(), Task(False), img_size=16, batch=4, device=torch.device("cpu"), rank=0, world=1)
    f, y = prelogits(model, batches, ctx, lambda t: t.float() / 127.5 - 1, max_images=7)
    assert f.shape == (7, 24) and y.tolist() == [0] * 4 + [1] * 3


def test_load_model_roundtrip_and_errors(tmp_path):
    model = _tiny(5)
    torch.nn.init.normal_(model.head.weight)
    path = save_safetensors(model, tmp_path / "m.safetensors")
    back = load_model(path)
    x = torch.randn(2, 3, 16, 16)
    assert torch.allclose(back(x), model.eval()(x), atol=1e-6)
    big = load_model(path, img_size=32)  # pos-emb resampled to the 8x8 grid
    assert big.pos_embed.shape == (1, 65, 32)
    with pytest.raises(TransferError, match="no such checkpoint"):
        load_model(tmp_path / "nope.safetensors")
    plain = tmp_path / "plain.pth"
    torch.save(model.state_dict(), plain)
    with pytest.raises(TransferError, match="pass --model"):
        load_model(plain)


def test_a_checkpoint_folder_is_joined_by_the_consolidator_the_caller_passes(tmp_path):
    """weights never imports train: a step-* folder is read through the layout, joined by `consolidate`."""
    model = _tiny(5)
    torch.nn.init.normal_(model.head.weight)
    ck = tmp_path / "run" / "checkpoints" / "step-00000003"
    ck.mkdir(parents=True)
    (ck / "manifest.json").write_text(json.dumps({"step": 3, "model_config": model.config}))
    with pytest.raises(TransferError, match=f"^{ck}: a DeepSpeed checkpoint needs consolidating"):
        load_model(tmp_path / "run")
    asked = []
    back = load_model(tmp_path / "run", consolidate=lambda d: asked.append(d) or model.state_dict())
    assert asked == [str(ck)]  # the run dir's newest complete checkpoint
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(back(x), model.eval()(x))
