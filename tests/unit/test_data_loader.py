"""TrainLoader / EvalLoader behaviour on tiny shards (in-process ranks; workers where it matters)."""

from __future__ import annotations

import collections
import io
import itertools
import random
import time
import warnings

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFilter

from pipeline.config import ConfigError, DataCfg
from pipeline.data.augment import DecodeError, EvalTransform, TrainTransform, inception_crop_box
from pipeline.data.loader import DataError, EvalLoader, TrainLoader, normalize
from pipeline.data.mixing import Mixer
from tests.unit.test_data_shards import image_bytes, label_of, write_dataset

SIZES = [3, 9, 5, 12, 11]  # 40 samples in 5 uneven shards


def replace(cfg, **changes):
    """A copy of a config section with ``changes``, validated as an override would be."""
    return type(cfg).model_validate({**cfg.model_dump(), **changes})


@pytest.fixture
def data(tmp_path):
    keys = write_dataset(tmp_path, {"train": SIZES, "val": [4, 3]})
    return DataCfg(path=str(tmp_path), workers=0, shuffle_buffer=8, crop_scale=[0.3, 1.0]), keys


def loader(cfg, rank=0, world=2, **kw):
    args = dict(img_size=16, micro_batch=4, global_batch=8, rank=rank, world_size=world, seed=3, return_keys=True)
    return TrainLoader(cfg, **{**args, **kw})


def epoch(ld):
    return [(x.clone(), y.clone(), list(k)) for x, y, k in ld]


def test_epoch_partitions_dataset_across_ranks(data):
    cfg, keys = data
    l0, l1 = loader(cfg, 0), loader(cfg, 1)
    assert (l0.steps_per_epoch, l0.accum_steps, l0.micro_batches_per_epoch, len(l0)) == (5, 1, 5, 5)
    b0, b1 = epoch(l0), epoch(l1)
    assert len(b0) == len(b1) == 5
    seen = [k for _, _, ks in b0 + b1 for k in ks]
    assert collections.Counter(seen) == collections.Counter(keys["train"])  # 40 = 5 steps x 8: all once
    for x, y, ks in b0 + b1:
        assert x.dtype == torch.uint8 and x.shape == (4, 3, 16, 16) and y.dtype == torch.int64
        assert y.tolist() == [label_of(k) for k in ks]
    # next epoch: a new shard permutation and shuffle, same multiset
    e1 = [k for _, _, ks in epoch(l0) + epoch(l1) for k in ks]
    assert collections.Counter(e1) == collections.Counter(keys["train"]) and e1 != seen


def test_uneven_dataset_drops_tail_per_epoch(tmp_path):
    keys = write_dataset(tmp_path, {"train": [7, 6, 4, 9, 5]})["train"]  # 31 samples, global batch 8
    cfg = DataCfg(path=str(tmp_path), workers=0, shuffle_buffer=4)
    b = [epoch(loader(cfg, r)) for r in (0, 1)]
    assert len(b[0]) == len(b[1]) == 3  # 31 // 8
    seen = [k for bs in b for _, _, ks in bs for k in ks]
    assert len(seen) == len(set(seen)) == 24 and set(seen) <= set(keys)


def test_same_seed_same_stream_other_seed_differs(data):
    cfg, _ = data
    a, b, c = epoch(loader(cfg)), epoch(loader(cfg)), epoch(loader(cfg, seed=4))
    assert [k for *_, k in a] == [k for *_, k in b]
    assert all(torch.equal(x1, x2) for (x1, *_), (x2, *_) in zip(a, b))
    assert [k for *_, k in a] != [k for *_, k in c]


def test_accumulation_and_dataset_smaller_than_global_batch(data):
    cfg, _ = data
    ld = loader(cfg, world=1, global_batch=16, micro_batch=4)
    assert (ld.steps_per_epoch, ld.accum_steps, len(epoch(ld))) == (2, 4, 8)
    ld = loader(cfg, world=1, global_batch=64, micro_batch=32)
    assert ld.steps_per_epoch == 1 and len(epoch(ld)) == 2  # 40 < 64: one step, samples wrap


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("k", [0, 3, 5, 6])
def test_resume_is_bit_exact(data, workers, k):
    cfg, _ = data
    cfg = replace(cfg, workers=workers, randaugment="rand-m9-mstd0.5")
    ref = loader(cfg, 1)
    want = epoch(ref) + epoch(ref)  # two epochs: 10 micro-batches
    first = loader(cfg, 1)
    got = list(itertools.islice(first.forever(), k))
    sd = first.state_dict()
    assert sd["epoch"] * 5 + sd["step"] == k and len(got) == k
    again = loader(cfg, 1, seed=99)  # the state's seed wins
    again.load_state_dict(sd)
    rest = list(itertools.islice(again.forever(), 10 - k))
    for (x1, y1, k1), (x2, y2, k2) in zip(want[k:], rest):
        assert k1 == k2 and torch.equal(y1, y2) and torch.equal(x1, x2)


def test_layout_change_resumes_at_next_epoch(data):
    cfg, _ = data
    ld = loader(cfg)
    next(iter(ld))
    sd = ld.state_dict()
    other = loader(cfg, global_batch=16)
    with pytest.warns(UserWarning, match="different layout"):
        other.load_state_dict(sd)
    assert (other.epoch, other.step) == (1, 0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [0, 2])
def test_bad_samples_skipped_counted_and_padded(tmp_path, workers):
    keys = write_dataset(tmp_path, {"train": SIZES}, missing_cls={"train_00004"},
                         bad_image={"train_00010", "train_00020"})["train"]
    shard = tmp_path / "train-000003.tar"  # 12 samples; cut in the middle
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cfg = DataCfg(path=str(tmp_path), workers=workers, shuffle_buffer=8)
    lds = [loader(cfg, r) for r in (0, 1)]
    with warnings.catch_warnings():  # (emitted in the worker processes when workers > 0)
        warnings.simplefilter("ignore")
        batches = [epoch(ld) for ld in lds]
    assert [len(b) for b in batches] == [5, 5]  # fixed steps despite the losses
    seen = [k for b in batches for _, _, ks in b for k in ks]
    assert len(seen) == 40 and "train_00004" not in seen and {"train_00010", "train_00020"}.isdisjoint(seen)
    assert set(seen) <= set(keys)
    total = collections.Counter()
    for ld in lds:
        total.update(ld.skipped)
    assert total["corrupt_tar"] == 1 and total["missing_cls"] == 1 and total["undecodable_image"] == 2
    for b in batches:
        for _, y, ks in b:  # small arrays cross from the workers as numpy; tensors again here
            assert isinstance(y, torch.Tensor) and y.dtype == torch.int64
            assert y.tolist() == [label_of(k) for k in ks]


def test_resampled_mode(data):
    cfg, keys = data
    cfg = replace(cfg, resampled=True)
    b = [epoch(loader(cfg, r)) for r in (0, 1)]
    assert [len(x) for x in b] == [5, 5]
    seen = [k for bs in b for _, _, ks in bs for k in ks]
    assert set(seen) <= set(keys["train"]) and len(seen) == 40


def test_one_shard_feeds_every_rank_and_worker(tmp_path):
    """The loader splits samples, not shards: one shard serves 2 ranks x 2 workers (4 streams), each
    sample once per epoch."""
    keys = write_dataset(tmp_path, {"train": [32]})["train"]
    cfg = DataCfg(path=str(tmp_path), workers=2, shuffle_buffer=4)
    batches = [epoch(loader(cfg, r, micro_batch=2)) for r in (0, 1)]
    assert [len(b) for b in batches] == [8, 8]  # 32 // 8 = 4 steps x 2 micro batches of 2, per rank
    per_rank = [[k for _, _, ks in b for k in ks] for b in batches]
    assert [len(set(r)) for r in per_rank] == [16, 16] and not set(per_rank[0]) & set(per_rank[1])
    assert collections.Counter(per_rank[0] + per_rank[1]) == collections.Counter(keys)


def test_workers_outlive_the_stop_signals_slurm_sends_to_every_process(tmp_path):
    """scancel (TERM) and preemption (USR2) reach the loader workers too: they must keep serving until
    the main process has finished its step and saved."""
    import os
    import signal

    import psutil

    keys = write_dataset(tmp_path, {"train": [16, 16]})["train"]
    cfg = DataCfg(path=str(tmp_path), workers=2, shuffle_buffer=4)
    earlier = {c.pid for c in psutil.Process(os.getpid()).children()}  # what other tests left, if anything
    it = iter(loader(cfg, 0, world=1, micro_batch=4, global_batch=4))
    seen = list(next(it)[2])
    me = psutil.Process(os.getpid())
    # the loader's workers are forks of this process (multiprocessing's resource tracker, a child too
    # when this test is the process's first to start workers, is not)
    workers = [c for c in me.children() if c.pid not in earlier and c.cmdline() == me.cmdline()]
    assert len(workers) == 2
    # SLURM signals a job's processes once they run; a worker still starting (the first batch came from
    # the other one) has not yet set its handlers: wait until both ignore TERM and USR2
    ignored = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGUSR2 - 1))
    deadline = time.monotonic() + 60
    while not all(int(_status(w.pid)["SigIgn"], 16) & ignored == ignored for w in workers):
        assert time.monotonic() < deadline, "a loader worker never set its stop-signal handlers"
        time.sleep(0.05)
    for w in workers:
        w.send_signal(signal.SIGTERM)
        w.send_signal(signal.SIGUSR2)
    seen += [k for _, _, ks in it for k in ks]
    assert collections.Counter(seen) == collections.Counter(keys)


def _status(pid: int) -> dict[str, str]:
    """/proc/PID/status as {field: value}."""
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def test_clear_errors(data, tmp_path):
    cfg, _ = data
    with pytest.raises(ConfigError, match="not divisible"):
        loader(cfg, global_batch=12)
    with pytest.raises(DataError, match="no split 'test'"):
        loader(cfg, split="test")
    with pytest.raises(DataError, match="_info.json: not found"):
        loader(replace(cfg, path=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="data.randaugment"):
        loader(replace(cfg, randaugment="auto-m9"))


@pytest.mark.parametrize("workers", [0, 2])
def test_eval_exactly_once_across_three_ranks(data, workers):
    cfg, keys = data
    cfg = replace(cfg, workers=workers)
    lds = [EvalLoader(cfg, img_size=16, batch=2, rank=r, world_size=3, return_keys=True) for r in range(3)]
    assert [ld.num_samples_rank for ld in lds] == [2, 2, 3] and {ld.num_batches for ld in lds} == {2}
    seen = []
    for ld in lds:
        out = list(ld)
        assert len(out) == ld.num_batches
        for x, y, m, ks in out:
            assert x.shape == (2, 3, 16, 16) and x.dtype == torch.uint8
            assert isinstance(m, torch.Tensor) and m.dtype == torch.bool and y.dtype == torch.int64
            assert (y[~m] == -1).all() and (x[~m] == 0).all()
            seen += [k for k, v in zip(ks, m.tolist()) if v]
            assert y[m].tolist() == [label_of(k) for k, v in zip(ks, m.tolist()) if v]
        assert sum(int(m.sum()) for _, _, m, _ in out) == ld.num_samples_rank
    assert sorted(seen) == sorted(keys["val"])


def test_eval_transform_and_undecodable(tmp_path):
    write_dataset(tmp_path, {"val": [5]}, bad_image={"val_00001"})
    cfg = DataCfg(path=str(tmp_path), workers=0, eval_crop_pct=0.875)
    ld = EvalLoader(cfg, img_size=16, batch=4, rank=0, world_size=1)
    with pytest.warns(UserWarning, match="val_00001"):
        out = list(ld)
    assert [m.tolist() for _, _, m in out] == [[True, False, True, True], [True, False, False, False]]
    assert ld.skipped == {"undecodable_image": 1}


def test_transforms_shapes_and_seeding():
    data = image_bytes(1, "jpg", size=(120, 80))
    tf = TrainTransform(32, (0.08, 1.0), True, "rand-m9-mstd0.5")
    a, b, c = tf(data, 5), tf(data, 5), tf(data, 6)
    assert a.shape == (3, 32, 32) and torch.equal(a, b) and not torch.equal(a, c)
    for pct in (1.0, 0.875):
        assert EvalTransform(24, pct)(image_bytes(2, "png", size=(50, 90))).shape == (3, 24, 24)


def test_normalize_and_mix(data):
    cfg, _ = data
    x = torch.tensor([0, 255], dtype=torch.uint8).view(2, 1, 1, 1).expand(2, 3, 2, 2)
    n = normalize(x)
    assert n.dtype == torch.float32 and n[0].eq(-1).all() and n[1].eq(1).all()
    r = torch.randint(0, 256, (2, 3, 5, 7), dtype=torch.uint8)
    buf = torch.full((2, 3, 5, 7), float("nan"))
    o = normalize(r, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), out=buf)
    assert o.data_ptr() == buf.data_ptr() and torch.equal(o, normalize(r, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)))
    with pytest.raises(ValueError, match=r"out is torch.float32 \(2, 3, 5, 6\)"):
        normalize(r, out=torch.empty(2, 3, 5, 6))
    ld = loader(replace(cfg, label_smoothing=0.1))
    _, y, _ = next(iter(ld))
    xx, t = Mixer(3, label_smoothing=0.1, seed=3, rank=0)(torch.zeros(4, 3, 16, 16), y, ld.position)
    assert t.shape == (4, 3) and torch.allclose(t.sum(1), torch.ones(4))
    assert torch.allclose(t.max(1).values, torch.full((4,), 0.9 + 0.1 / 3))
    ld = loader(replace(cfg, mixup=0.8, cutmix=1.0))
    mix = Mixer(3, mixup=0.8, cutmix=1.0, seed=3, rank=0)
    xs, y, _ = next(iter(ld))
    f = normalize(xs)
    m1, m2 = mix(f.clone(), y, ld.position), mix(f.clone(), y, ld.position)  # same batch position → same mix
    assert torch.equal(m1[0], m2[0]) and torch.equal(m1[1], m2[1]) and m1[1].shape == (4, 3)
    assert torch.allclose(m1[1].sum(1), torch.ones(4))


def _photo(w=500, h=375, seed=0, mode="RGB", fmt="JPEG") -> bytes:
    """A smooth photo-like image (gradients + a few shapes + mild noise) encoded as fmt."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    chans = [np.sin(xx / rng.uniform(20, 80)) * 50 + np.cos(yy / rng.uniform(20, 80)) * 40 + 128 for _ in range(3)]
    im = Image.fromarray(np.clip(np.stack(chans, -1) + rng.normal(0, 6, (h, w, 3)), 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(im)
    for _ in range(6):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        d.ellipse([x0, y0, x0 + 80, y0 + 60], fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    b = io.BytesIO()
    im.filter(ImageFilter.GaussianBlur(1.0)).convert(mode).save(b, fmt, quality=92)
    return b.getvalue()


def _pil_reference(data: bytes, box, size: int, flip: bool, resample) -> torch.Tensor:
    """What torchvision's RandomResizedCrop does: full Pillow decode, crop, antialiased resize."""
    im = Image.open(io.BytesIO(data)).convert("RGB").resize((size, size), resample, box=box)
    a = np.asarray(im)
    return torch.from_numpy(np.ascontiguousarray((a[:, ::-1] if flip else a).transpose(2, 0, 1)))


@pytest.mark.parametrize("fmt,mode", [("JPEG", "RGB"), ("JPEG", "L"), ("JPEG", "CMYK"), ("PNG", "RGBA"),
                                      ("PNG", "P")])
def test_fast_train_decode_matches_pillow_reference(fmt, mode):
    """The reduced (DCT-scaled) decode + resize equals the full-decode Pillow pipeline up to resampling
    noise, for every crop size (a reduction by up to 8x, and enlargements)."""
    data = _photo(seed=3, mode=mode, fmt=fmt)
    tf = TrainTransform(96, (0.02, 1.0), hflip=True)
    errs = []
    for seed in range(40):
        rng = random.Random(seed)
        x, y, cw, ch = inception_crop_box(500, 375, rng, tf.scale)
        flip = rng.random() < 0.5
        ref = _pil_reference(data, (x, y, x + cw, y + ch), 96, flip, Image.Resampling.BILINEAR)
        got = tf(data, seed)
        assert got.shape == ref.shape == (3, 96, 96) and got.dtype == torch.uint8
        errs.append((got.float() - ref.float()).abs().mean().item())
    print(f"{fmt} {mode}: mean abs error max {max(errs):.2f}")
    assert max(errs) < 3.0, errs  # grey levels out of 255; a wrong box or flip gives tens


def test_fast_eval_decode_matches_pillow_reference():
    data = _photo(seed=4)
    for size, pct in ((64, 1.0), (224, 0.875), (384, 1.0)):  # reduce by ~6x, ~1.4x; enlarge
        got = EvalTransform(size, pct)(data)
        short = size if pct == 1.0 else int(size / pct)
        tw, th = (size, size) if pct == 1.0 else (round(500 * short / 375), short)
        im = Image.open(io.BytesIO(data)).convert("RGB").resize((tw, th), Image.Resampling.BICUBIC)
        left, top = (tw - size) // 2, (th - size) // 2
        ref = torch.from_numpy(np.asarray(im.crop((left, top, left + size, top + size))).transpose(2, 0, 1).copy())
        assert got.shape == ref.shape == (3, size, size)
        err = (got.float() - ref.float()).abs().mean().item()
        print(f"eval {size} {pct}: mean abs error {err:.2f}")
        assert err < 3.0, (size, pct)


def test_truncated_or_garbage_jpeg_is_a_decode_error():
    data = _photo(seed=5)
    for bad in (data[: len(data) // 2], b"\xff\xd8\xff" + b"\0" * 100, b"not an image"):
        with pytest.raises(DecodeError):
            TrainTransform(32)(bad, 0)
        with pytest.raises(DecodeError):
            EvalTransform(32)(bad)


@pytest.mark.parametrize("workers,start", [(2, 0), (2, 3)])
def test_forever_keeps_its_workers_across_epochs_with_the_same_batches(data, monkeypatch, workers, start):
    """One DataLoader (one set of workers) serves epoch after epoch, yielding exactly what epoch-by-
    epoch iteration yields, from a resumed position too; its state resumes bit-exactly."""
    import pipeline.data.loader as loader_mod

    cfg, _ = data
    cfg = replace(cfg, workers=workers)
    ref = loader(cfg)
    ref.load_state_dict({**loader(cfg).state_dict(), "step": start})
    expected = [b for _ in range(3) for b in epoch(ref)][: 12 - start]  # 5 per epoch: into the 3rd

    made = []
    real = loader_mod._batches
    monkeypatch.setattr(loader_mod, "_batches", lambda *a, **k: made.append(a) or real(*a, **k))
    ld = loader(cfg)
    ld.load_state_dict({**ld.state_dict(), "step": start})
    it = ld.forever()
    got = [(x.clone(), y.clone(), list(k)) for x, y, k in itertools.islice(it, 12 - start - 3)]
    state = ld.state_dict()
    got += [(x.clone(), y.clone(), list(k)) for x, y, k in itertools.islice(it, 3)]
    assert len(made) == 1  # one loader for the whole run: its workers persist across epochs
    assert (state["epoch"], state["step"]) == divmod(12 - 3, 5)
    assert [k for *_, k in got] == [k for *_, k in expected]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected))
    resumed = loader(cfg)
    resumed.load_state_dict(state)
    tail = [(x, y, list(k)) for x, y, k in itertools.islice(resumed.forever(), 3)]
    assert [k for *_, k in tail] == [k for *_, k in expected[-3:]]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(tail, expected[-3:]))


def test_train_transform_without_random_crop_resizes_the_whole_image():
    """data.random_crop=false (VTAB's counting and distance tasks): the whole image, resized, every seed."""
    from pipeline.data.augment import EncodedImage, decode_crop

    data = _photo(seed=5, mode="RGB", fmt="JPEG")
    src = EncodedImage(data)
    whole = torch.from_numpy(np.ascontiguousarray(decode_crop(src, (0, 0, src.w, src.h), 32, 32))).permute(2, 0, 1)
    tf = TrainTransform(32, hflip=False, random_crop=False)
    assert all(torch.equal(tf(data, seed), whole) for seed in range(5))
    assert not torch.equal(TrainTransform(32, hflip=False)(data, 0), whole)  # the inception crop does crop


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator")
@pytest.mark.parametrize("workers", [0, 1])
def test_pin_memory_pins_the_labels_with_the_images(data, workers, monkeypatch):
    """The labels cross from the workers as numpy: with pin_memory they are pinned here, as the images
    are, so neither reaches the GPU from pageable memory. (Pinning needs an accelerator: this machine's
    pin_memory is recorded instead; tests/gpu pins for real.)"""
    cfg, _ = data
    pinned: set[int] = set()

    def pin(self):
        out = self.clone()
        pinned.add(out.data_ptr())
        return out
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: self.data_ptr() in pinned)
    ld = loader(replace(cfg, workers=workers), pin_memory=True)
    for x, y, _ in itertools.islice(iter(ld), 3):
        assert x.data_ptr() in pinned and y.data_ptr() in pinned and y.dtype == torch.int64
