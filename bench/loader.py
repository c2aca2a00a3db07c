"""Training-loader throughput, side by side in one run (images/s to a training-ready float batch).

Same ~500×375 JPEGs, same worker count, train transform at 224 (inception crop + flip):

  vitp          TrainLoader over WebDataset shards
  inmemory      the same decode+augment over bytes already in RAM (the ceiling: no tar I/O)
  imagefolder   torchvision ImageFolder + DataLoader, the usual recipe (RandomResizedCrop, flip) with
                PILToTensor in the workers
  timm_wds      timm's own WebDataset reader over the same shards + timm.data.create_loader
                (same crop scale, flip, no colour jitter; its uint8 fast_collate batches)
  vitp_1w       vitp with one worker, for the scaling ratio
  vitp_rank     vitp with ``data.order: rank`` (each rank/worker reads its own contiguous range through a
                shuffle buffer; the order before the global one), against the default global order
  cpu_1p/cpu_Np the per-sample transform alone in 1 and in N (= --workers) plain processes, no loader:
                what the machine itself gives for N processes of this work (context for 2w vs 1w)

Every loader hands uint8 batches to one consumer in the main process, the same for all: normalise
into one reused float buffer (`consume`), as a training step does on the device. (timm's own CPU
prefetcher and the float ToTensor+Normalize recipe allocate a fresh float batch each step instead,
~4,700 page faults a batch; that is the consumer's cost, not the loader's, so it is left out of all.)

Each rep runs every pipeline once, in alternating order. A ratio is the median over reps of the
ratio within each rep, so machine-speed drift between reps (±15% on a shared VM) cancels; the
per-rep ratios and each pipeline's best rep are printed too.
Prints ``ratio loader_vs_inmemory``, ``loader_vs_imagefolder``, ``loader_2w_vs_1w``, ``loader_vs_timm_wds``,
``loader_global_order_vs_rank_order`` and ``machine_Np_vs_1p``.

Example:  python bench/loader.py --quick
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep.schema import INFO_FILE, DatasetInfo, SplitShards  # noqa: E402
from pipeline.config import DataCfg  # noqa: E402
from pipeline.data.augment import TrainTransform, normalize, stack  # noqa: E402
from pipeline.data.loader import TrainLoader, collate_as_is  # noqa: E402  (the loader's collate_fn)

SIZE, SCALE = 224, (0.08, 1.0)


def natural_jpeg(i: int, w: int = 500, h: int = 375) -> bytes:
    """Smooth gradients, blurred shapes and sensor-like noise: compresses like a photo (~30-60 kB)."""
    rng = np.random.default_rng(i)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    chans = [np.sin(x / rng.uniform(15, 90) + rng.uniform(0, 6)) * 50
             + np.cos(y / rng.uniform(15, 90) + rng.uniform(0, 6)) * 40 + rng.uniform(60, 190) for _ in range(3)]
    im = Image.fromarray(np.clip(np.stack(chans, -1) + rng.normal(0, 10, (h, w, 3)), 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(im)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        d.ellipse([x0, y0, x0 + int(rng.integers(10, 160)), y0 + int(rng.integers(10, 160))],
                  fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    im = im.filter(ImageFilter.GaussianBlur(1.2))
    b = io.BytesIO()
    im.save(b, "JPEG", quality=90)
    return b.getvalue()


def make_data(root: Path, n: int, shards: int, classes: int = 10) -> list[tuple[bytes, int]]:
    samples = [(natural_jpeg(i), i % classes) for i in range(n)]
    for c in range(classes):
        (root / "folder" / f"c{c:02d}").mkdir(parents=True, exist_ok=True)
    files, lengths = [], []
    for s in range(shards):
        idx = list(range(s, n, shards))
        name = f"train-{s:06d}.tar"
        offsets = []  # each sample's byte offset, as prep records them in <shard>_stats.json
        with tarfile.open(root / name, "w") as tar:
            for i in idx:
                data, label = samples[i]
                offsets.append(tar.offset)
                for ext, b in (("cls", str(label).encode()), ("jpg", data), ("json", b"{}")):
                    ti = tarfile.TarInfo(f"{i:06d}.{ext}")
                    ti.size = len(b)
                    tar.addfile(ti, io.BytesIO(b))
                (root / "folder" / f"c{label:02d}" / f"{i:06d}.jpg").write_bytes(data)
        (root / f"train-{s:06d}_stats.json").write_text(json.dumps({"count": len(idx), "offsets": offsets}))
        files.append(name)
        lengths.append(len(idx))
    info = DatasetInfo({"train": SplitShards("train", tuple(files), tuple(lengths), n)}, num_classes=classes)
    (root / INFO_FILE).write_text(info.to_json())
    return samples


class InMemory(torch.utils.data.IterableDataset):
    """The ceiling: vitp's per-sample transform over bytes in RAM, batched in the workers."""

    def __init__(self, samples, batch):
        self.samples, self.batch, self.tf = samples, batch, TrainTransform(SIZE, SCALE, True, None)

    def __iter__(self):
        wi = torch.utils.data.get_worker_info()
        d, n = (0, 1) if wi is None else (wi.id, wi.num_workers)
        nb = len(self.samples) // self.batch
        for b in range(d, nb, n):
            chunk = self.samples[b * self.batch:(b + 1) * self.batch]
            imgs = [self.tf(data, b * 7919 + j) for j, (data, _) in enumerate(chunk)]
            yield stack(imgs), np.array([lab for _, lab in chunk])  # labels inline, as vitp sends them


def _one_thread(_):
    torch.set_num_threads(1)


class PlainProcesses:
    """The train transform over the images in ``procs`` forked processes (an equal share each), timed
    from a barrier to the last exit; no tar, no batching, no IPC."""

    def __init__(self, samples, procs: int):
        self.data, self.procs = [d for d, _ in samples], procs

    def _work(self, k: int, barrier) -> None:
        torch.set_num_threads(1)
        tf = TrainTransform(SIZE, SCALE, True, None)
        barrier.wait()
        for i in range(k, len(self.data), self.procs):
            tf(self.data[i], i)

    def rate(self) -> float:
        ctx = mp.get_context("fork")
        barrier = ctx.Barrier(self.procs + 1)
        ps = [ctx.Process(target=self._work, args=(k, barrier)) for k in range(self.procs)]
        for p in ps:
            p.start()
        barrier.wait()
        t = time.perf_counter()
        for p in ps:
            p.join()
        return len(self.data) / (time.perf_counter() - t)


def pipelines(root: Path, samples, batch: int, workers: int):
    from torchvision import datasets
    from torchvision import transforms as T

    cfg = DataCfg(path=str(root), workers=workers, shuffle_buffer=256, crop_scale=list(SCALE))

    def vitp(w, c=cfg):
        return lambda: TrainLoader(c, img_size=SIZE, micro_batch=batch, global_batch=batch, rank=0, world_size=1,
                                   seed=0, num_workers=w)

    def inmem():
        return torch.utils.data.DataLoader(InMemory(samples, batch), batch_size=None, num_workers=workers,
                                           worker_init_fn=_one_thread, collate_fn=collate_as_is)

    def folder():
        tf = T.Compose([T.RandomResizedCrop(SIZE, scale=SCALE), T.RandomHorizontalFlip(), T.PILToTensor()])
        ds = datasets.ImageFolder(str(root / "folder"), transform=tf)
        return torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True,
                                           worker_init_fn=_one_thread)

    def timm_wds():
        from timm.data import create_dataset, create_loader

        ds = create_dataset("wds/bench", root=str(root), split="train", is_training=True, batch_size=batch)
        loader = create_loader(ds, input_size=(3, SIZE, SIZE), batch_size=batch, is_training=True, scale=SCALE,
                               color_jitter=0.0, hflip=0.5, interpolation="bilinear", mean=(0.5,) * 3,
                               std=(0.5,) * 3, num_workers=workers, device=torch.device("cpu"),
                               use_prefetcher=True, persistent_workers=False)
        return loader.loader  # the DataLoader inside timm's PrefetchLoader: uint8 batches, for `consume`

    return {"vitp": vitp(workers), "inmemory": inmem, "imagefolder": folder, "timm_wds": timm_wds,
            "vitp_1w": vitp(1), "vitp_rank": vitp(workers, cfg.model_copy(update={"order": "rank"})),
            "cpu_1p": lambda: PlainProcesses(samples, 1),
            f"cpu_{workers}p": lambda: PlainProcesses(samples, workers)}


class Consumer:
    """What the training loop does with each batch, the same for every loader: uint8 [B, 3, S, S] →
    normalised float32 in one reused buffer (on a GPU the caching allocator hands back the same
    block; on the CPU a fresh buffer per batch costs ~4,700 page faults)."""

    def __init__(self):
        self.buf = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.uint8:
            raise TypeError(f"bench: a loader yielded {x.dtype} batches; every loader must hand over uint8")
        if self.buf is None or self.buf.shape != x.shape:
            self.buf = torch.empty(x.shape)
        return normalize(x, out=self.buf)


def measure(make) -> float:
    """Images/s from the first batch to the end of one epoch (worker start-up excluded)."""
    loader = make()
    if isinstance(loader, PlainProcesses):
        return loader.rate()
    n, t0, consume = 0, None, Consumer()
    for x, _ in loader:
        x = consume(x)
        if t0 is None:
            t0 = time.perf_counter()
            continue
        n += x.shape[0]
    return n / (time.perf_counter() - t0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small run (≈1 min on 2 cores)")
    ap.add_argument("--images", type=int, default=1536)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None, help="default 5 (2 with --quick)")
    ap.add_argument("--only", default="", help="comma-separated subset of pipelines")
    a = ap.parse_args(argv)
    if a.quick:
        a.images = 384
    a.reps = a.reps or (2 if a.quick else 5)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        samples = make_data(root, a.images, shards=8)
        kb = np.mean([len(d) for d, _ in samples]) / 1024
        print(f"data: {a.images} JPEGs 500x375 (~{kb:.0f} kB) in 8 shards + ImageFolder, "
              f"{time.perf_counter() - t:.1f}s; workers={a.workers} batch={a.batch} cpus={os.cpu_count()}")
        pipes = pipelines(root, samples, a.batch, a.workers)
        if a.only:
            pipes = {k: v for k, v in pipes.items() if k in a.only.split(",")}
        runs: dict[str, list[float]] = {name: [] for name in pipes}
        for rep in range(a.reps):
            names = list(pipes) if rep % 2 == 0 else list(pipes)[::-1]  # alternate order against drift
            for name in names:
                runs[name].append(measure(pipes[name]))
                print(f"rep {rep} {name:12s} {runs[name][-1]:8.1f} img/s", flush=True)
    for name, ips in runs.items():
        print(f"best {name:12s} {max(ips):8.1f} img/s")
    w = a.workers
    for label, num, den in (("loader_vs_inmemory", "vitp", "inmemory"),
                            ("loader_vs_imagefolder", "vitp", "imagefolder"),
                            ("loader_2w_vs_1w", "vitp", "vitp_1w"), ("loader_vs_timm_wds", "vitp", "timm_wds"),
                            ("loader_global_order_vs_rank_order", "vitp", "vitp_rank"),
                            (f"machine_{w}p_vs_1p", f"cpu_{w}p", "cpu_1p")):
        if num in runs and den in runs:
            per_rep = [x / y for x, y in zip(runs[num], runs[den])]
            print(f"reps {label} " + " ".join(f"{r:.3f}" for r in per_rep))
            print(f"ratio {label} {statistics.median(per_rep):.3f}")


if __name__ == "__main__":
    main()
