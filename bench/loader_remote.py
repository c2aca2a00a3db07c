"""Shards in an object store, side by side in one run: vitp's streaming reader against local disk and
against webdataset's own ``pipe:curl`` pipeline, and a mid-shard resume by byte offset against a scan.

An S3-compatible server (moto's, on 127.0.0.1) holds the same shards as a local folder:

  vitp_local   TrainLoader over the local folder
  vitp_s3      the same TrainLoader over ``s3://bench/ds`` (retried, read-ahead ranged reads)
  wds_pipe     webdataset's own pipeline over ``pipe:curl -s URL`` of the same objects (presigned URLs),
               as its README writes one: shuffle, ``decode("pil")``, ``to_tuple``, a torchvision transform
               (RandomResizedCrop, flip, PILToTensor: bench/loader.py's ImageFolder arm), ``batched``;
               the same shuffle buffer, workers and consumer, uint8 batches of the same shape
  wds_pipe_io  the same ``pipe:curl`` reading with vitp's own decode+augment and batching: the I/O paths
               alone (``ratio loader_s3_vs_wds_pipe_io``)

Each rep runs the three once, in alternating order; a ratio is the median of the per-rep ratios.
Resume: one shard of ``--resume-mib`` MiB (small JPEGs padded with incompressible bytes) served by nginx
over HTTP (moto copies a whole object for every ranged read, which would make a scan through it cost
the square of the shard's size); the time from a fresh loader with a state in the middle of that shard
to its first batch, when it seeks (shuffle replayed on positions, ranged read from the recorded offset)
against when it re-reads the prefix (the path for datasets without offsets), interleaved, medians.

Prints ``ratio loader_s3_vs_local``, ``ratio loader_s3_vs_wds_pipe`` (and ``_io``) and ``ratio resume_seek_vs_scan``.

Example:  python bench/loader_remote.py --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.loader import SCALE, SIZE, Consumer, natural_jpeg  # noqa: E402
from data_prep.schema import INFO_FILE, DatasetInfo, SplitShards  # noqa: E402
from data_prep.tar import TarSink, tar_member  # noqa: E402
from pipeline.config import DataCfg  # noqa: E402
from pipeline.data.augment import TrainTransform, stack  # noqa: E402
from pipeline.data.loader import TrainLoader, collate_as_is  # noqa: E402


def write_shards(root: Path, samples: list[list[tuple[str, bytes]]], shards: int, classes: int = 10) -> None:
    """Samples (lists of (extension, bytes)) into ``shards`` tars the way prep writes them: its tar
    members, its ``<shard>_stats.json`` with per-sample offsets, an ``_info.json``."""
    root.mkdir(parents=True, exist_ok=True)
    files, lengths = [], []
    for s in range(shards):
        idx = list(range(s, len(samples), shards))
        name = f"train-{s:06d}"
        tar, offsets = TarSink(root / f"{name}.tar"), []
        for i in idx:
            offsets.append(tar.pos)
            tar.add_members(b"".join(tar_member(f"{i:07d}.{ext}", b) for ext, b in samples[i]))
        tar.close()
        stats = {"shard": f"{name}.tar", "count": len(idx), "offsets": offsets}
        (root / f"{name}_stats.json").write_text(json.dumps(stats))
        files.append(f"{name}.tar")
        lengths.append(len(idx))
    info = DatasetInfo({"train": SplitShards("train", tuple(files), tuple(lengths), len(samples))}, num_classes=classes)
    (root / INFO_FILE).write_text(info.to_json())


class WdsPipe(torch.utils.data.IterableDataset):
    """webdataset's reading over ``pipe:`` URLs, one share of the shards per worker, then the same
    per-sample transform and batching as vitp's workers do (the I/O paths alone)."""

    def __init__(self, urls: list[str], batch: int, shuffle: int):
        self.urls, self.batch, self.shuffle = urls, batch, shuffle

    def __iter__(self):
        import webdataset as wds

        wi = torch.utils.data.get_worker_info()
        d, n = (0, 1) if wi is None else (wi.id, wi.num_workers)
        tf = TrainTransform(SIZE, SCALE, True, None)
        pipe = wds.DataPipeline(wds.SimpleShardList(self.urls[d::n]), wds.tarfile_to_samples(),
                                wds.shuffle(self.shuffle), wds.to_tuple("jpg", "cls"))
        buf, k = [], 0
        for img, cls in pipe:
            buf.append((tf(img, k), int(cls)))
            k += 1
            if len(buf) == self.batch:
                yield stack([x for x, _ in buf]), np.array([y for _, y in buf])
                buf = []


def wds_own_pipeline(urls: list[str], batch: int, shuffle: int, workers: int):
    """webdataset's own pipeline as its README writes one, with torchvision's transform."""
    import torchvision.transforms as T
    import webdataset as wds

    tf = T.Compose([T.RandomResizedCrop(SIZE, scale=SCALE), T.RandomHorizontalFlip(), T.PILToTensor()])
    ds = (wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, workersplitter=wds.split_by_worker)
          .shuffle(shuffle).decode("pil").to_tuple("jpg", "cls").map_tuple(tf, int).batched(batch, partial=False))
    return wds.WebLoader(ds, batch_size=None, num_workers=workers, worker_init_fn=_one_thread)


def _one_thread(_):
    torch.set_num_threads(1)


def measure(loader) -> float:
    """Images/s from the first batch to the end of one epoch (worker start-up excluded)."""
    n, t0, consume = 0, None, Consumer()
    for x, *_ in loader:
        consume(x)
        if t0 is None:
            t0 = time.perf_counter()
            continue
        n += x.shape[0]
    return n / (time.perf_counter() - t0)


class ScanResume(TrainLoader):
    """The loader as it resumes a dataset whose shards record no offsets: re-reading the prefix."""

    def stream_spec(self):
        return dataclasses.replace(super().stream_spec(), seek_resume=False)


def first_batch_s(cls, cfg: DataCfg, sd: dict, batch: int) -> float:
    """Seconds from a fresh loader (its description read) with state ``sd`` to its first batch."""
    t = time.perf_counter()
    ld = cls(cfg, img_size=64, micro_batch=batch, global_batch=batch, rank=0, world_size=1, seed=0, num_workers=0)
    ld.load_state_dict(sd)
    next(iter(ld))
    return time.perf_counter() - t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small run (≈2 min on 2 cores)")
    ap.add_argument("--images", type=int, default=768)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None, help="default 5 (3 with --quick)")
    ap.add_argument("--resume-mib", type=int, default=1024, help="size of the resume bench's shard (quick: 256)")
    ap.add_argument("--part", choices=("all", "loader", "resume"), default="all")
    a = ap.parse_args(argv)
    if a.quick:
        a.images, a.resume_mib = 384, 256
    a.reps = a.reps or (3 if a.quick else 5)
    torch.set_num_threads(1)
    import boto3
    import fsspec

    from tests.auth_services import stop_process
    from tests.object_store import start_http, start_s3

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server, nginx = start_s3(tmp / "s3"), None
        try:
            os.environ.update(server.env)
            s3 = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1")
            s3.create_bucket(Bucket="bench")
            fs = fsspec.filesystem("s3", skip_instance_cache=True)

            t = time.perf_counter()
            local = tmp / "ds"
            write_shards(local, [[("cls", str(i % 10).encode()), ("jpg", natural_jpeg(i))] for i in range(a.images)],
                         shards=8)
            fs.put(str(local) + "/", "bench/ds", recursive=True)
            urls = [s3.generate_presigned_url("get_object", Params={"Bucket": "bench", "Key": f"ds/train-{s:06d}.tar"},
                                              ExpiresIn=3600) for s in range(8)]
            print(f"data: {a.images} JPEGs 500x375 in 8 shards, local + s3 ({time.perf_counter() - t:.1f}s); "
                  f"workers={a.workers} batch={a.batch} cpus={os.cpu_count()}", flush=True)

            def vitp(path):
                cfg = DataCfg(path=path, workers=a.workers, shuffle_buffer=256, crop_scale=list(SCALE))
                return TrainLoader(cfg, img_size=SIZE, micro_batch=a.batch, global_batch=a.batch, rank=0,
                                   world_size=1, seed=0)

            pipe_urls = [f"pipe:curl -s '{u}'" for u in urls]

            def wds_pipe_io():
                ds = WdsPipe(pipe_urls, a.batch, 256)
                return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=a.workers,
                                                   worker_init_fn=_one_thread, collate_fn=collate_as_is)

            pipes = {"vitp_local": lambda: vitp(str(local)), "vitp_s3": lambda: vitp("s3://bench/ds"),
                     "wds_pipe": lambda: wds_own_pipeline(pipe_urls, a.batch, 256, a.workers),
                     "wds_pipe_io": wds_pipe_io}
            runs: dict[str, list[float]] = {k: [] for k in pipes}
            for rep in range(a.reps if a.part != "resume" else 0):
                for name in (list(pipes) if rep % 2 == 0 else list(pipes)[::-1]):
                    runs[name].append(measure(pipes[name]()))
                    print(f"rep {rep} {name:11s} {runs[name][-1]:8.1f} img/s", flush=True)
            for name, ips in runs.items() if a.part != "resume" else ():
                print(f"best {name:11s} {max(ips):8.1f} img/s")

            # ── resume in the middle of one big shard ──
            seek, scan = [], []
            if a.part == "loader":
                return _report(runs, seek, scan)
            t = time.perf_counter()
            rng = np.random.default_rng(0)
            small = natural_jpeg(0, 64, 48)
            per = 64 << 10
            n = (a.resume_mib << 20) // per
            big = tmp / "big"
            pad = rng.integers(0, 256, per, dtype=np.uint8).tobytes()
            write_shards(big, [[("bin", pad[i % 997:] + pad[:i % 997]), ("cls", b"1"), ("jpg", small)]
                               for i in range(n)], shards=1)
            nginx, base = start_http(tmp / "nginx", tmp)  # an object server whose ranged reads cost their length
            print(f"resume: one shard of {n} samples, {(big / 'train-000000.tar').stat().st_size / 2**20:.0f} MiB "
                  f"({time.perf_counter() - t:.1f}s)", flush=True)
            cfg = DataCfg(path=f"{base}/big", workers=0, shuffle_buffer=16, crop_scale=list(SCALE))
            sd = {**TrainLoader(cfg, img_size=64, micro_batch=8, global_batch=8, rank=0, world_size=1,
                                seed=0, num_workers=0).state_dict(), "step": n // 16}  # half-way
            first_batch_s(TrainLoader, cfg, sd, 8)  # warm-up: connections, imports
            for rep in range(a.reps):
                for cls, out in ((TrainLoader, seek), (ScanResume, scan)) if rep % 2 == 0 else \
                        ((ScanResume, scan), (TrainLoader, seek)):
                    out.append(first_batch_s(cls, cfg, sd, 8))
                print(f"rep {rep} resume seek {seek[-1]:.3f}s  scan {scan[-1]:.3f}s", flush=True)
        finally:
            stop_process(server.proc)
            if nginx is not None:
                stop_process(nginx)
    _report(runs, seek, scan)


def _report(runs: dict, seek: list, scan: list) -> None:
    for label, num, den in (("loader_s3_vs_local", "vitp_s3", "vitp_local"),
                            ("loader_s3_vs_wds_pipe", "vitp_s3", "wds_pipe"),
                            ("loader_s3_vs_wds_pipe_io", "vitp_s3", "wds_pipe_io")):
        per_rep = [x / y for x, y in zip(runs[num], runs[den])]
        if per_rep:
            print(f"reps {label} " + " ".join(f"{r:.3f}" for r in per_rep))
            print(f"ratio {label} {statistics.median(per_rep):.3f}")
    if seek:
        print(f"median resume seek {statistics.median(seek):.3f}s scan {statistics.median(scan):.3f}s")
        print(f"ratio resume_seek_vs_scan {statistics.median(seek) / statistics.median(scan):.3f}")


if __name__ == "__main__":
    main()
