"""The training batch and the collate function that builds it from Arrow rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from data.schema import LABEL, FeatureSchema


@dataclass
class Batch:
    dense: torch.Tensor  # float32 [B, len(schema.dense)]
    sparse: KeyedJaggedTensor  # categorical keys, lengths all 1
    sequence: KeyedJaggedTensor  # sequence keys, lengths 0..max_len
    labels: torch.Tensor  # float32 [B] of 0/1

    def to(self, device, non_blocking: bool = False) -> "Batch":
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(device, non_blocking=non_blocking),
            sequence=self.sequence.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> "Batch":
        return Batch(
            dense=self.dense.pin_memory(),
            sparse=self.sparse.pin_memory(),
            sequence=self.sequence.pin_memory(),
            labels=self.labels.pin_memory(),
        )

    @property
    def batch_size(self) -> int:
        return self.labels.shape[0]


def _owned_tensor(column: pa.ChunkedArray | pa.Array, dtype: np.dtype) -> torch.Tensor:
    # Arrow hands out read-only views of memory-mapped files; the batch must own writable memory.
    array = column.to_numpy() if isinstance(column, pa.ChunkedArray) else column.to_numpy(zero_copy_only=False)
    return torch.from_numpy(np.array(array, dtype=dtype))


class ArrowBatchCollator:
    """Turns an Arrow table of rows (one DataLoader batch) into a Batch, column-wise.

    Works on whole columns (no per-row Python), so long histories cost one
    flatten per batch rather than a loop over tokens.
    """

    def __init__(self, schema: FeatureSchema):
        self.schema = schema

    def __call__(self, rows: pa.Table) -> Batch:
        batch_size = rows.num_rows
        schema = self.schema

        if schema.dense:
            dense = np.stack([rows.column(name).to_numpy() for name in schema.dense], axis=1)
            dense = torch.from_numpy(dense.astype(np.float32, copy=False))
        else:
            dense = torch.zeros(batch_size, 0, dtype=torch.float32)

        categorical_names = list(schema.categorical_names)  # KJT keys must be a list
        # KJT values are key-major: all samples of the first key, then the next key.
        sparse_values = [_owned_tensor(rows.column(name), np.int64) for name in categorical_names]
        sparse = KeyedJaggedTensor(
            keys=categorical_names,
            values=torch.cat(sparse_values) if sparse_values else torch.empty(0, dtype=torch.int64),
            lengths=torch.ones(len(categorical_names) * batch_size, dtype=torch.int32),
            stride=batch_size,
        )

        sequence_names = list(schema.sequence_names)
        sequence_values, sequence_lengths = [], []
        for name in sequence_names:
            lists = rows.column(name).combine_chunks()
            # flatten() honours slicing offsets, unlike .values
            sequence_values.append(_owned_tensor(lists.flatten(), np.int64))
            sequence_lengths.append(_owned_tensor(pc.list_value_length(lists), np.int32))
        sequence = KeyedJaggedTensor(
            keys=sequence_names,
            values=torch.cat(sequence_values) if sequence_values else torch.empty(0, dtype=torch.int64),
            lengths=torch.cat(sequence_lengths) if sequence_lengths else torch.empty(0, dtype=torch.int32),
            stride=batch_size,
        )

        labels = _owned_tensor(rows.column(LABEL), np.float32)
        return Batch(dense=dense, sparse=sparse, sequence=sequence, labels=labels)
