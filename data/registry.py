"""The datasets CTRDataModule serves, by name. A new dataset is one module exporting
`DATASET = DatasetSpec(...)` plus one line in DATASET_MODULES."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from data.schema import FeatureSchema

DATASET_MODULES = {
    "synthetic": "data.synthetic",
    "criteo": "data.criteo",
    "movielens100k": "data.movielens",
    "movielens1m": "data.movielens1m",
}
# The type of CTRDataModule's `dataset`, from the registry: jsonargparse lists the names in --help and
# rejects any other.
DatasetName = Literal[tuple(DATASET_MODULES)]


@dataclass(frozen=True)
class DataArgs:
    """The data module's arguments, as every dataset's functions receive them (each reads its own)."""

    data_dir: Path
    num_train: int
    num_val: int
    seed: int
    num_dense: int
    num_categorical: int
    vocab_size: int
    num_items: int
    max_history_len: int
    protocol: str | None  # a dataset's named split protocol; None = its default


@dataclass(frozen=True)
class DatasetSpec:
    # The features its prepared rows hold (checked against the prepared folder's own record).
    schema: Callable[[DataArgs], FeatureSchema]
    # Where its prepared folder lives. Reading it prepares nothing (every rank reads it).
    folder: Callable[[DataArgs], Path]
    # Makes sure the prepared folder exists, generating or fetching it if the dataset can (one process
    # per machine does this); raises FileNotFoundError saying how to prepare it otherwise.
    prepare: Callable[[DataArgs], Path]
    # True: num_train/num_val generate that many rows. False: they keep the first rows of the prepared
    # splits (0 = all).
    generated: bool = False
    # The named split protocols it offers (data.protocol), the default first; empty: just its own split.
    protocols: tuple[str, ...] = ()


def dataset_spec(name: str, protocol: str | None = None) -> DatasetSpec:
    if name not in DATASET_MODULES:
        raise ValueError(f"dataset={name!r} is not one of {tuple(DATASET_MODULES)}")
    spec = importlib.import_module(DATASET_MODULES[name]).DATASET
    if protocol is not None and protocol not in spec.protocols:
        offered = f"one of {spec.protocols}" if spec.protocols else "null: it has one split of its own"
        raise ValueError(f"protocol={protocol!r}: for dataset={name!r} it must be {offered}")
    return spec
