"""The interface every dataset a stage reads implements (``pipeline.data.source_for`` picks one).

A :class:`DataSource` is bound to one ``data.path``; it describes the dataset (:meth:`read_info`), makes
this rank's training and evaluation batches (:meth:`train_loader`, :meth:`eval_loader`) and turns a
uint8 batch on the device into the model's input (:meth:`normalize`); it reads a split's labels
without decoding an image (:meth:`split_labels`: a few-shot evaluator draws its subsets from them).
Two implement it:

    ShardSource       (pipeline.data.loader)     a `vitp prep` folder of WebDataset tars
    SyntheticSource   (pipeline.data.synthetic)  ``synthetic[:options]``, generated in memory

What the loaders they return promise is written down as :class:`TrainBatches` and
:class:`EvalBatches`; a new dataset kind is one new subclass and one line in ``source_for``.
Mixup/cutmix is not the source's business: :mod:`pipeline.data.mixing` does it, seeded by
:attr:`TrainBatches.position`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from pipeline.data.shards import Info


@runtime_checkable
class TrainBatches(Protocol):
    """A rank's training micro-batches ``(images uint8 [B, 3, S, S], labels)``; labels are int64 [B],
    or multi-hot bool [B, K] on multi-label data. Checkpointed through ``state_dict``."""

    def forever(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Micro-batches across epochs without end."""
        ...

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, micro-batch within it) of the batch last yielded: the seed of per-batch randomness
        outside the loader (mixup), so a resumed run repeats it."""
        ...

    @property
    def skipped(self) -> Mapping[str, int]:
        """Bad samples this rank met so far, by reason (``shards.SKIP_REASONS``); logged as a metric."""
        ...

    def read_stats(self) -> dict:
        """Read throughput to log with the training metrics ({} when there is none to report)."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class EvalBatches(Protocol):
    """Each sample of a split once over all ranks, as ``len()`` batches per rank (the same on
    every rank) of ``(images uint8 [B, 3, S, S], labels, valid bool [B])``; padding rows are invalid.
    ``num_samples``: the samples over all ranks; ``rank_positions``: this rank's positions of the split,
    in the order its valid rows come; ``batch``: rows per batch."""

    num_samples: int
    rank_positions: Sequence[int]
    batch: int

    def __len__(self) -> int:
        """The number of batches, the same on every rank (the eval loop runs collectives in lock-step)."""
        ...

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]: ...


class DataSource(ABC):
    """One dataset, as the stages read it (see the module docstring)."""

    kind = ""  # names the source in MLflow's dataset inputs ("local", "synthetic")
    holds_minival = True  # a minival (data.minival_fraction, data.train_limit) can be held out of its train split

    def __init__(self, path: str):
        self.path = str(path)
        self._info: Info | None = None

    def read_info(self) -> Info:
        """The dataset's description (classes, splits with sample counts), read once per source."""
        if self._info is None:
            self._info = self._read_info()
        return self._info

    @abstractmethod
    def _read_info(self) -> Info: ...

    @abstractmethod
    def train_loader(self, cfg_data, *, img_size: int, micro_batch: int, global_batch: int, rank: int,
                     world_size: int, seed: int, pin_memory: bool = False) -> TrainBatches:
        """This rank's endless training micro-batches, ``global_batch / world_size`` images per step."""

    @abstractmethod
    def eval_loader(self, cfg_data, *, img_size: int, batch: int, rank: int, world_size: int,
                    split: str, positions: Sequence[int] | None = None, workers: int | None = None) -> EvalBatches:
        """This rank's share of ``split``, each sample once over the ranks; ``positions``: only these
        sorted positions of the split (a few-shot subset), cut the same way; ``workers``: decoding
        processes (default data.workers)."""

    @abstractmethod
    def split_labels(self, split: str, rank: int, world_size: int) -> dict[int, list]:
        """This rank's parts of ``split``'s labels, ``{part: [label of each position]}`` (parts r, r+W,
        ...; a part is a shard): joined in part order over the ranks, every position's label, read
        without decoding an image."""

    @staticmethod
    @abstractmethod
    def normalize(images: torch.Tensor) -> torch.Tensor:
        """uint8 [B, 3, H, W] on the device → float [B, 3, H, W], the model's input range."""

    def dataset_name(self) -> str:
        """The short name MLflow shows for this dataset (before ``/split``)."""
        return self.kind

    def source_fields(self) -> dict:
        """Where the data came from, as MLflow's dataset ``source`` (JSON) says it."""
        return {"spec": self.path}

    def where(self) -> str:
        """The address error messages and plans name for the dataset's description."""
        from data_prep import store

        return store.public(self.path)

    def check_reachable(self, key: str) -> None:
        """A remote dataset answers (bucket, 403, 404) before anything is queued: one line naming
        ``key`` and the address (data_prep.store.AddressError) otherwise; a local one is not probed."""
        from data_prep import store

        if store.is_remote(self.path):
            store.check_readable(self.path, key)

    def split_sizes(self) -> dict[str, int]:
        """{split: its size, 0 when empty} for the split checks made before a run starts."""
        return {k: sp.num_samples for k, sp in self.read_info().splits.items()}

    def checked_against(self) -> list[tuple[str, list[str] | None]] | None:
        """(address, splits taken or None) of every test set this data was checked against for
        near-duplicates (`vitp prep --exclude-near`, `vitp decontam`); None where the kind keeps no
        such record (the suite's "decontaminated" column says "not known")."""
        return None

    def shard_addresses(self, split: str) -> list[str]:
        """The files ``split`` is streamed from, as its description names them (none are opened):
        submission warns when too few remote ones feed the loader streams. [] for data without shards."""
        return []


class ClassLoaders:
    """``train_loader``/``eval_loader``/``_read_info`` for a source whose loaders are two classes that
    take the declared arguments as they are (both of vitp's sources): mix it in before DataSource."""

    train_loader_class: type
    eval_loader_class: type
    info_reader: Callable[[str], Info]  # a staticmethod: path -> Info

    def _read_info(self) -> Info:
        return self.info_reader(self.path)

    def train_loader(self, cfg_data, *, img_size: int, micro_batch: int, global_batch: int, rank: int,
                     world_size: int, seed: int, pin_memory: bool = False) -> TrainBatches:
        return self.train_loader_class(cfg_data, img_size=img_size, micro_batch=micro_batch,
                                       global_batch=global_batch, rank=rank, world_size=world_size, seed=seed,
                                       pin_memory=pin_memory)

    def eval_loader(self, cfg_data, *, img_size: int, batch: int, rank: int, world_size: int,
                    split: str, positions: Sequence[int] | None = None, workers: int | None = None) -> EvalBatches:
        return self.eval_loader_class(cfg_data, img_size=img_size, batch=batch, rank=rank, world_size=world_size,
                                      split=split, positions=positions, num_workers=workers)
