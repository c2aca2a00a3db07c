"""bench/gpu_step.py's loader sections: TrainLoader alone against the step (``loader_vs_step_gpu``) and
vitp's step fed by it as the training loop feeds it (``data_wait_<model>_gpu``), over `vitp prep` shards of
synthetic photos written once per run (:func:`write_images`; also make gpu-check's pre-training data)."""

from __future__ import annotations

import io
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.gpu_contestants import BUILDERS
from pipeline import faults
from pipeline.data.loader import TrainLoader, normalize


class LoaderSections:
    """Methods of bench/gpu_step.py's Bench (its args, device, cfg(), batch(), sync(), free(), log())."""

    tmp: tempfile.TemporaryDirectory | None = None  # the shards' folder, made at first use
    shards: Path | None = None

    def train_loader(self, cfg, batch: int):
        """TrainLoader at micro batch ``batch`` over `vitp prep` shards of synthetic photos (written once, in
        a folder removed at the end), os.cpu_count() workers, pinned on a GPU."""
        from data_prep import prep

        a, cores = self.args, os.cpu_count() or 1
        if self.tmp is None:
            self.tmp = tempfile.TemporaryDirectory(prefix="vitp_gpu_bench_")
            n, (lo, hi) = (24, (40, 80)) if a.smoke else (a.loader_images, (300, 500))
            src, self.shards = Path(self.tmp.name) / "images", Path(self.tmp.name) / "shards"
            t = time.perf_counter()
            write_images(src, n, lo, hi)
            prep(src, self.shards, workers=cores, progress=False, max_samples_per_shard=max(1, n // cores), seed=0)
            made = len(list(self.shards.glob("train-*.tar")))
            self.log(f"loader: {n} JPEGs {lo}-{hi} px prepped into {made} shards in {time.perf_counter() - t:.1f}s; "
                     f"{cores} workers")
        data = cfg.data.model_copy(update={"path": str(self.shards), "workers": cores,
                                           "shuffle_buffer": min(cfg.data.shuffle_buffer, 1000)})
        return TrainLoader(data, img_size=cfg.model.img_size, micro_batch=batch, global_batch=batch, rank=0,
                           world_size=1, seed=0, pin_memory=self.cuda)

    def loader_rate(self, cfg, batch: int) -> float:
        """Images/s of TrainLoader, as the loop consumes them (copied and normalised on the device), alone."""
        a, cores = self.args, os.cpu_count() or 1
        it = self.train_loader(cfg, batch).forever()
        per_window = max(cores, 2)

        def take(k: int) -> None:
            for _ in range(k):
                images, _labels = next(it)
                normalize(images.to(self.device, non_blocking=True))

        take(per_window)  # every worker has started and filled its shuffle buffer
        rates = []
        for _ in range(1 if a.smoke else 3):
            self.sync()
            t = time.perf_counter()
            take(per_window)
            self.sync()
            rates.append(per_window * batch / (time.perf_counter() - t))
        it.close()  # ends the workers
        self.log(f"loader at micro batch {batch}: " + " ".join(f"{r:.0f}" for r in rates) + " img/s per window")
        return statistics.median(rates)

    def data_wait(self, name: str, batch: int) -> float:
        """vitp's step fed by TrainLoader as pipeline/train/loop.py feeds it (the uint8 batch copied without
        blocking, normalised on the device): the share of the timed windows' wall time spent in the
        loader's next(), on host clocks as the training records' data_wait; the device is synchronised
        at each window's ends only."""
        a, cfg = self.args, self.cfg(name, batch)
        it = self.train_loader(cfg, batch).forever()
        micro, close = BUILDERS["vitp"](cfg, *self.batch(cfg, batch), self.num_classes, self.device)

        def fed() -> float:  # one optimizer step (accumulation 1); -> seconds waited for its batch
            t = time.perf_counter()
            faults.slow_batch()  # the loop's seam where a batch is fetched (a test slows the loader there)
            images, labels = next(it)
            waited = time.perf_counter() - t
            micro(images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True))
            return waited

        try:
            for _ in range(a.warmup):
                fed()
            waits, walls = [], []
            for _ in range(a.windows):
                self.sync()
                t = time.perf_counter()
                waits.append(sum(fed() for _ in range(a.steps)))
                self.sync()
                walls.append(time.perf_counter() - t)
        finally:
            it.close()
            close()
            self.free()
        wait = sum(waits) / sum(walls)
        self.log(f"{name} fed by the loader at b={batch}: {batch * a.steps * a.windows / sum(walls):.1f} img/s, "
                 f"data_wait {wait:.1%}; per window " + " ".join(f"{w / t:.1%}" for w, t in zip(waits, walls)))
        return wait

    def close(self) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()
            self.tmp = None


def write_images(root: Path, n: int, lo: int, hi: int, classes: int = 10) -> None:
    """``n`` photo-like JPEGs (smooth colour fields, shapes, sensor noise; q90) of lo..hi px a side
    in an ImageFolder tree."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(0)
    for i in range(n):
        w, h = (int(v) for v in rng.integers(lo, hi + 1, 2))
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        chans = [np.sin(x / rng.uniform(15, 90) + rng.uniform(0, 6)) * 50
                 + np.cos(y / rng.uniform(15, 90) + rng.uniform(0, 6)) * 40 + rng.uniform(60, 190) for _ in range(3)]
        im = Image.fromarray(np.clip(np.stack(chans, -1) + rng.normal(0, 8, (h, w, 3)), 0, 255).astype(np.uint8))
        d = ImageDraw.Draw(im)
        for _ in range(8):
            x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
            d.ellipse([x0, y0, x0 + int(rng.integers(8, w // 2)), y0 + int(rng.integers(8, h // 2))],
                      fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
        folder = root / f"c{i % classes:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        im.filter(ImageFilter.GaussianBlur(1.0)).save(buf, "JPEG", quality=90)
        (folder / f"{i:05d}.jpg").write_bytes(buf.getvalue())
