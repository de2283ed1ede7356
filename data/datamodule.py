"""Lightning data module: prepares, validates and batches any supported dataset."""

from __future__ import annotations

import logging
from pathlib import Path

import datasets
import lightning
import pyarrow as pa
import torch
from torch.utils.data import DataLoader

from data.batch import ArrowBatchCollator
from data.criteo import criteo_schema
from data.movielens import MovieLensConfig, ensure_movielens, movielens_folder, movielens_schema
from data.schema import FeatureSchema
from data.storage import META_FILE, load_split, read_meta
from data.synthetic import SyntheticConfig, ensure_synthetic, synthetic_folder, synthetic_schema
from data.validation import validate_table

DATASETS = ("synthetic", "criteo", "movielens100k")
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


class CTRDataModule(lightning.LightningDataModule):
    """
    Args:
        dataset: "synthetic" (generated), "criteo" (data_dir is the folder written by
            `python -m data.prepare criteo --out ...`) or "movielens100k" (fetched and prepared on first use).
        data_dir: cache root for synthetic/movielens100k, the prepared folder for criteo.
        num_train, num_val: rows to generate (synthetic); at most this many rows, 0 = all (real datasets).
        num_dense, num_categorical: synthetic feature counts (num_categorical >= 3).
        vocab_size: rows of each hashed categorical table (synthetic, and criteo's --table-size).
        num_items: synthetic item vocabulary (candidate item and history).
        max_history_len: longest history kept (synthetic, movielens100k).
    """

    def __init__(
        self,
        dataset: str = "synthetic",
        data_dir: str = "data/cache",
        num_train: int = 32768,
        num_val: int = 4096,
        batch_size: int = 256,
        num_workers: int = 0,
        seed: int = 0,
        num_dense: int = 8,
        num_categorical: int = 6,
        vocab_size: int = 1000,
        num_items: int = 200,
        max_history_len: int = 256,
    ):
        super().__init__()
        if dataset not in DATASETS:
            raise ValueError(f"dataset={dataset!r} is not one of {DATASETS}")
        if batch_size < 1 or num_workers < 0 or num_train < 0 or num_val < 0:
            raise ValueError(
                f"need batch_size >= 1, num_workers >= 0, num_train >= 0, num_val >= 0; got "
                f"batch_size={batch_size}, num_workers={num_workers}, num_train={num_train}, num_val={num_val}"
            )
        self.dataset = dataset
        self.data_dir = Path(data_dir)
        self.num_train = num_train
        self.num_val = num_val
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        if dataset == "synthetic":
            self.synthetic_config = SyntheticConfig(
                num_train=num_train,
                num_val=num_val,
                num_dense=num_dense,
                num_categorical=num_categorical,
                vocab_size=vocab_size,
                num_items=num_items,
                max_history_len=max_history_len,
                seed=seed,
            )
            self.schema: FeatureSchema = synthetic_schema(self.synthetic_config)
        elif dataset == "criteo":
            self.schema = criteo_schema(vocab_size)
        else:
            self.movielens_config = MovieLensConfig(max_history_len=max_history_len)
            self.schema = movielens_schema(self.movielens_config)
        self.collate = ArrowBatchCollator(self.schema)
        self.splits: dict[str, datasets.Dataset] = {}

    def prepared_folder(self) -> Path:
        if self.dataset == "synthetic":
            return synthetic_folder(self.synthetic_config, self.data_dir)
        if self.dataset == "criteo":
            return self.data_dir
        return movielens_folder(self.movielens_config, self.data_dir)

    def prepare_data(self) -> None:
        if self.dataset == "synthetic":
            ensure_synthetic(self.synthetic_config, self.data_dir)
        elif self.dataset == "movielens100k":
            ensure_movielens(self.movielens_config, self.data_dir)
        elif not (self.data_dir / META_FILE).exists():
            raise FileNotFoundError(
                f"{self.data_dir} holds no prepared Criteo data; run `python -m data.prepare criteo --input <tsv> "
                f"--out {self.data_dir} --table-size {self.schema.categorical[0][1]}` first"
            )

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        folder = self.prepared_folder()
        prepared_schema = FeatureSchema.from_dict(read_meta(folder)["schema"])
        if prepared_schema != self.schema:
            raise ValueError(
                f"prepared data in {folder} has schema {prepared_schema}, but the datamodule arguments give "
                f"{self.schema}; re-prepare the data or change the arguments (e.g. vocab_size)"
            )
        limits = {"train": self.num_train, "validation": self.num_val}
        for split, limit in limits.items():
            rows = load_split(folder, split)
            if self.dataset != "synthetic" and 0 < limit < len(rows):
                log.warning(
                    "%s: using only the first %d of %d %s rows (num_train/num_val; 0 = all)",
                    folder, limit, len(rows), split,
                )  # fmt: skip
                rows = rows.select(range(limit))  # a contiguous range stays a zero-copy slice
            validate_table(rows.with_format("arrow")[:], self.schema, split=f"{folder}/{split}")
            self.splits[split] = rows

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        if not self.splits:
            raise RuntimeError("CTRDataModule: call prepare_data() and setup() before asking for dataloaders")
        return DataLoader(
            ArrowRows(self.splits[split]),
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
            collate_fn=self.collate,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", shuffle=False)
