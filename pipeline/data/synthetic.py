"""A deterministic in-memory image-classification set: :class:`SyntheticSource`, a DataSource.

``data.path=synthetic`` (options: ``synthetic:classes=10,train=2048,val=256,noise=60``) trains
without any files: tests, benchmarks, smoke runs. Sample ``i`` of a split is a fixed per-class
pattern plus noise seeded by ``i``, so a model can learn it and every sample is reproducible; the
run's seed only changes the order.

Batches follow one global order: optimizer step ``s`` consumes samples ``[s*G, (s+1)*G)`` of the
(epoch-wise shuffled) stream; micro batch ``m`` of rank ``r`` is the slice at
``(m*world + r)*micro``. The loader's position is a step count, so it survives a world-size change.
"""

from __future__ import annotations

import hashlib
import json

import torch

from pipeline.config.batch import BatchLayout
from pipeline.data.shards import Info, SplitInfo
from pipeline.data.source import ClassLoaders, DataSource

PREFIX = "synthetic:"
_DEFAULTS = {"classes": 10, "train": 2048, "val": 256, "noise": 60}


def parse_spec(path: str) -> dict[str, int]:
    spec = dict(_DEFAULTS)
    body = str(path)[len(PREFIX):].strip() if str(path).startswith(PREFIX) else ""
    for item in filter(None, body.split(",")):
        k, _, v = item.partition("=")
        if k not in spec or not v.isdigit():
            raise ValueError(f"data.path: bad synthetic option {item!r} (known: {', '.join(_DEFAULTS)}=INT)")
        spec[k] = int(v)
    return spec


def read_info(path: str) -> Info:
    """The same description a `vitp prep` folder gives (no shard files: ``urls`` is empty)."""
    spec = parse_spec(path)
    splits = {s: SplitInfo(s, spec[s], (), ()) for s in ("train", "val") if spec[s] > 0}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return Info(str(path), spec["classes"], tuple(str(i) for i in range(spec["classes"])), splits, digest)


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 3, H, W] → float [B, 3, H, W] in [-1, 1] (the paper's inception-style range)."""
    return images.float().div_(127.5).sub_(1.0)


def _templates(classes: int, img_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_007)
    coarse = torch.rand(classes, 3, 4, 4, generator=g) * 255
    return torch.nn.functional.interpolate(coarse, size=(img_size, img_size), mode="nearest")


def _samples(idx: list[int], split_salt: int, spec: dict, img_size: int,
             templates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``idx`` → (uint8 [B, 3, H, W], int64 [B])."""
    labels = torch.tensor([(i * 7 + split_salt) % spec["classes"] for i in idx], dtype=torch.int64)
    imgs = torch.empty(len(idx), 3, img_size, img_size)
    for j, i in enumerate(idx):
        g = torch.Generator().manual_seed(split_salt * 7_919_111 + i)
        imgs[j] = templates[labels[j]] + spec["noise"] * torch.randn(3, img_size, img_size, generator=g)
    return imgs.clamp_(0, 255).to(torch.uint8), labels


class TrainLoader:
    """Endless micro batches ``(uint8 [micro, 3, H, W], int64 [micro])`` for this rank."""

    def __init__(self, data_cfg, *, img_size: int, micro_batch: int, global_batch: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, pin_memory: bool = False):
        self.spec = parse_spec(data_cfg.path)
        self.img_size, self.micro, self.global_batch = img_size, micro_batch, global_batch
        self.rank, self.world, self.seed = rank, world_size, seed
        self.pin_memory = pin_memory
        self.accum = BatchLayout(global_batch, micro_batch, world_size).accumulation
        self.n = self.spec["train"]
        self.steps_per_epoch = max(1, self.n // global_batch)
        self._templates = _templates(self.spec["classes"], img_size)
        self._micro_done = 0  # micro batches yielded by this rank
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 31 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=g), epoch
        return self._perm

    def _indices(self, k: int) -> list[int]:
        step, m = divmod(k, self.accum)
        start = step * self.global_batch + (m * self.world + self.rank) * self.micro
        out = []
        for pos in range(start, start + self.micro):
            epoch, j = divmod(pos, self.n)
            out.append(int(self._order(epoch)[j]))
        return out

    def __iter__(self):
        while True:
            idx = self._indices(self._micro_done)
            self._micro_done += 1
            x, y = _samples(idx, 0, self.spec, self.img_size, self._templates)
            yield (x.pin_memory(), y.pin_memory()) if self.pin_memory else (x, y)

    def forever(self):
        """Micro batches without end (the stream already crosses epochs)."""
        return iter(self)

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, micro batch within it) of the batch last yielded, epochs of ``steps_per_epoch`` steps."""
        return divmod(max(self._micro_done - 1, 0), self.steps_per_epoch * self.accum)

    @property
    def skipped(self) -> dict[str, int]:
        """Always empty: generated samples are never bad."""
        return {}

    def read_stats(self) -> dict:
        """Nothing is read: generated samples."""
        return {}

    def state_dict(self) -> dict:
        """Position in optimizer steps (world-size independent); call at a step boundary."""
        return {"steps": self._micro_done // self.accum}

    def load_state_dict(self, state: dict) -> None:
        self._micro_done = int(state["steps"]) * self.accum

    def __repr__(self) -> str:
        return f"synthetic TrainLoader({json.dumps(self.spec)})"


class EvalLoader:
    """Each val sample exactly once over all ranks (rank r takes i ≡ r mod world), as batches
    ``(uint8 [B, 3, H, W], int64 [B], valid bool [B])``. Like pipeline.data.loader, every rank yields the
    same number of batches; padding rows have valid=False and label -1."""

    def __init__(self, data_cfg, *, img_size: int, batch: int, rank: int = 0, world_size: int = 1,
                 split: str = "val", positions=None, num_workers: int | None = None):
        self.spec = parse_spec(data_cfg.path)
        self.img_size, self.batch = img_size, batch
        n = self.spec["val" if split != "train" else "train"]
        every = list(range(n)) if positions is None else list(positions)
        self.num_samples = len(every)
        self.idx = self.rank_positions = every[rank::world_size]  # generated on the fly: no workers
        per_rank = -(-len(every) // world_size)  # ceil(n / world)
        self.num_batches = -(-per_rank // batch)
        self._templates = _templates(self.spec["classes"], img_size)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        for b in range(self.num_batches):
            idx = self.idx[b * self.batch:(b + 1) * self.batch]
            x = torch.zeros(self.batch, 3, self.img_size, self.img_size, dtype=torch.uint8)
            y = torch.full((self.batch,), -1, dtype=torch.int64)
            valid = torch.zeros(self.batch, dtype=torch.bool)
            if idx:
                x[:len(idx)], y[:len(idx)] = _samples(idx, 1, self.spec, self.img_size, self._templates)
                valid[:len(idx)] = True
            yield x, y, valid


class SyntheticSource(ClassLoaders, DataSource):
    """``synthetic[:options]`` as a :class:`~pipeline.data.source.DataSource` (no files)."""

    kind = "synthetic"
    holds_minival = False
    normalize = staticmethod(normalize)

    train_loader_class, eval_loader_class = TrainLoader, EvalLoader
    info_reader = staticmethod(read_info)

    def where(self) -> str:
        return f"data.path {self.path}"

    def split_labels(self, split: str, rank: int, world_size: int) -> dict[int, list]:
        spec = parse_spec(self.path)
        n = spec["val" if split != "train" else "train"]  # as EvalLoader reads it (salt 1)
        return {0: [(i * 7 + 1) % spec["classes"] for i in range(n)]} if rank == 0 else {}
