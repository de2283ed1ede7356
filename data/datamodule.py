"""Lightning data module: prepares, validates and batches any registered dataset (data/registry.py),
each process reading its own shard, resumable mid-epoch."""

from __future__ import annotations

import logging
from pathlib import Path

import datasets
import lightning
import pyarrow as pa
import torch
from torch.utils.data import DataLoader

from data.batch import ArrowBatchCollator
from data.registry import DataArgs, DatasetName, dataset_spec
from data.schema import FeatureSchema
from data.storage import TEST_SPLIT, load_split, read_meta
from data.validation import validate_table

log = logging.getLogger(__name__)


class ArrowRows(torch.utils.data.Dataset):
    """Map-style view whose batched access returns one Arrow table, so collate stays columnar."""

    def __init__(self, dataset: datasets.Dataset):
        self.rows = dataset.with_format("arrow")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> pa.Table:
        return self.rows[[index]]

    def __getitems__(self, indices: list[int]) -> pa.Table:
        return self.rows[indices]


class ShardedSampler(torch.utils.data.Sampler[int]):
    """This process's rows of one epoch, resumable mid-epoch.

    With `shuffle`, an epoch's order is a permutation seeded by (seed, epoch), the same on every
    rank; rank r takes every world_size-th row of it, cut so that every rank gets as many (at most
    world_size - 1 rows of an epoch go unused, and no row is seen twice). Without it (validation),
    rank r takes rows r, r + world_size, ..., all of them. Iteration starts `consumed` rows into the
    epoch: 0, or where a checkpoint left off.
    """

    def __init__(self, num_rows: int, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1):
        self.num_rows, self.shuffle, self.seed, self.rank, self.world_size = num_rows, shuffle, seed, rank, world_size
        self.epoch, self.consumed = 0, 0

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this before each epoch; a new epoch starts from its beginning."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def rows(self) -> torch.Tensor:
        """This rank's rows of the current epoch, in order."""
        if not self.shuffle:
            return torch.arange(self.rank, self.num_rows, self.world_size)
        order = torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        per_rank = self.num_rows // self.world_size
        return order[self.rank: per_rank * self.world_size: self.world_size]

    def __iter__(self):
        return iter(self.rows()[self.consumed:].tolist())

    def __len__(self) -> int:
        # The whole epoch's share, also when resuming into it: Lightning counts the epoch's batches
        # from its start and resumes its own count where the checkpoint left off.
        return len(self.rows()) if not self.shuffle else self.num_rows // self.world_size

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


def even_batches(rows: torch.Tensor, total_rows: int, batch_size: int, world_size: int) -> list[list[int]]:
    """One rank's rows (of `total_rows` shared by `world_size` ranks) in near-equal batches of at most
    `batch_size`, as many as every other rank gets: a sharded model's lookups exchange rows between
    the ranks at every batch, so all of them must run each one. Used for validation, where every
    row must count once (training instead drops the few rows that would unbalance the ranks)."""
    per_rank = -(-total_rows // world_size)
    num_batches = max(1, -(-per_rank // batch_size))
    return [chunk.tolist() for chunk in torch.tensor_split(rows, num_batches)]


class CTRDataModule(lightning.LightningDataModule):
    """
    Args:
        dataset: "synthetic" (generated), "criteo" (data_dir is the folder written by
            `python -m data.prepare criteo --out ...`), "movielens100k" or "movielens1m" (fetched and
            prepared on first use).
        protocol: the dataset's named split (None: its default). MovieLens: "time_split_history" (default:
            train / validation / test by global time, 8:1:1, with the user's earlier items as history)
            or "recbole_context" (RecBole's random 8:1:1 train/validation/test split, seeded by `seed`).
            A split with a test part is scored on it after training (train.py).
        data_dir: cache root for synthetic/movielens*, the prepared folder for criteo.
        num_train: training rows to generate (synthetic); at most this many, 0 = all (real datasets).
        num_val: validation rows to generate (synthetic); at most this many, 0 = all (real datasets).
        batch_size: rows per batch, per process (the global batch is world_size times it).
        num_workers: DataLoader worker processes collating batches (0: in the training process).
        seed: the data's seed: synthetic generation, the training order of every epoch, and the random
            split of a protocol that has one; the model's initialization is seed_everything's.
        num_dense: dense features to generate (synthetic).
        num_categorical: categorical features to generate (synthetic; at least 3).
        vocab_size: rows of each hashed categorical table (synthetic, and criteo's --table-size).
        num_items: synthetic item vocabulary (candidate item and history).
        max_history_len: longest history kept (synthetic, MovieLens time_split_history; for MovieLens, 0
            drops the history feature and keeps the same samples and split).
    """

    def __init__(
        self,
        dataset: DatasetName = "synthetic",
        data_dir: str = "data/cache",
        num_train: int = 32768,
        num_val: int = 4096,
        batch_size: int = 256,
        num_workers: int = 0,
        seed: int = 0,
        protocol: str | None = None,
        num_dense: int = 8,
        num_categorical: int = 6,
        vocab_size: int = 1000,
        num_items: int = 200,
        max_history_len: int = 256,
    ):
        super().__init__()
        self.spec = dataset_spec(dataset, protocol)  # raises ValueError naming what is registered
        if batch_size < 1 or num_workers < 0 or num_train < 0 or num_val < 0:
            raise ValueError(
                f"need batch_size >= 1, num_workers >= 0, num_train >= 0, num_val >= 0; got "
                f"batch_size={batch_size}, num_workers={num_workers}, num_train={num_train}, num_val={num_val}"
            )
        self.args = DataArgs(
            data_dir=Path(data_dir), num_train=num_train, num_val=num_val, seed=seed, num_dense=num_dense,
            num_categorical=num_categorical, vocab_size=vocab_size, num_items=num_items,
            max_history_len=max_history_len, protocol=protocol,
        )
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.schema: FeatureSchema = self.spec.schema(self.args)  # also checks the dataset's own arguments
        self.collate = ArrowBatchCollator(self.schema)
        self.splits: dict[str, datasets.Dataset] = {}
        self.train_sampler: ShardedSampler | None = None
        self._sampler_state: dict | None = None

    def prepared_folder(self) -> Path:
        return self.spec.folder(self.args)

    def prepare_data(self) -> None:
        self.spec.prepare(self.args)

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        folder = self.prepared_folder()
        prepared_schema = FeatureSchema.from_dict(read_meta(folder)["schema"])
        if prepared_schema != self.schema:
            differences = prepared_schema.differences(self.schema)
            shown = ", ".join(differences[:3]) + (f", ... ({len(differences)} in all)" if len(differences) > 3 else "")
            raise ValueError(
                f"prepared data in {folder} does not match the data arguments (prepared vs arguments): {shown}; "
                f"re-prepare the data or change the arguments (e.g. data.vocab_size)"
            )
        limits = {"train": self.args.num_train, "validation": self.args.num_val}
        if (folder / TEST_SPLIT).is_dir():
            limits[TEST_SPLIT] = 0  # a test score counts every row
        for split, limit in limits.items():
            rows = load_split(folder, split)
            if not self.spec.generated and 0 < limit < len(rows):
                log.warning(
                    "%s: using only the first %d of %d %s rows (num_train/num_val; 0 = all)",
                    folder, limit, len(rows), split,
                )  # fmt: skip
                rows = rows.select(range(limit))  # a contiguous range stays a zero-copy slice
            validate_table(rows.with_format("arrow")[:], self.schema, split=f"{folder}/{split}")
            self.splits[split] = rows

    def _rank_and_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        if not self.splits:
            raise RuntimeError("CTRDataModule: call prepare_data() and setup() before asking for dataloaders")
        rank, world_size = self._rank_and_world()
        sampler = ShardedSampler(len(self.splits[split]), shuffle, self.args.seed, rank, world_size)
        batching = dict(batch_size=self.batch_size, sampler=sampler)
        if not shuffle and world_size > 1:
            batching = dict(batch_sampler=even_batches(sampler.rows(), len(self.splits[split]), self.batch_size,
                                                       world_size))
        return DataLoader(
            ArrowRows(self.splits[split]),
            **batching,
            collate_fn=self.collate,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader:
        loader = self._loader("train", shuffle=True)
        self.train_sampler = loader.sampler
        if 0 < len(self.train_sampler) < self.batch_size:
            log.warning(
                "data.batch_size=%d is more than the %d training rows each process has: every step trains on "
                "those %d rows, the whole epoch in one batch", self.batch_size, len(self.train_sampler),
                len(self.train_sampler),
            )  # fmt: skip
        if self._sampler_state is not None:  # resuming: continue the epoch where the checkpoint left off
            self.train_sampler.load_state_dict(self._sampler_state)
            self._sampler_state = None
        return loader

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", shuffle=False)

    @property
    def has_test_split(self) -> bool:
        return TEST_SPLIT in self.splits

    def test_dataloader(self) -> DataLoader:
        if not self.has_test_split:
            raise RuntimeError(f"{self.prepared_folder()} has no {TEST_SPLIT!r} split (its protocol holds none out)")
        return self._loader(TEST_SPLIT, shuffle=False)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        # Counted as a training step takes the batch, not as the loader yields it: Lightning fetches
        # one batch ahead, and a checkpoint must resume at the first batch no step has seen.
        if self.trainer is not None and self.trainer.training:
            self.count_trained(batch)
        return batch

    def count_trained(self, batch) -> None:
        """Moves the resume point of the training epoch past `batch`. Lightning's own batch transfer
        calls it; a step that fetches batches itself (sharding.pipeline) calls it once it has trained one."""
        if self.train_sampler is not None:
            self.train_sampler.consumed += batch.batch_size

    @property
    def data_stream(self) -> dict:
        """The arguments that decide which training batches come in which order (not where the data
        lives, how it is loaded, or the validation's size): a checkpoint keeps them, and a run resumed from
        it must have the same (training/resume.py)."""
        kept = {name: value for name, value in vars(self.args).items() if name not in ("data_dir", "num_val")}
        return {"dataset": self.dataset, "batch_size": self.batch_size, **kept}

    def state_dict(self) -> dict:
        sampler = {"train_sampler": self.train_sampler.state_dict()} if self.train_sampler is not None else {}
        return {**sampler, "data_stream": self.data_stream}

    def load_state_dict(self, state_dict: dict) -> None:
        self._sampler_state = state_dict.get("train_sampler")
