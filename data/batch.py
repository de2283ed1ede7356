"""The training batch and the collate function that builds it from Arrow rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from data.schema import LABEL, FeatureSchema


@dataclass
class Batch(Pipelineable):
    """One training batch. A torchrec Pipelineable, so TrainPipelineSparseDist can copy it to the
    device on its own stream and distribute its features ahead of the step that uses them."""

    dense: torch.Tensor  # float32 [B, len(schema.dense)]
    sparse: KeyedJaggedTensor  # categorical keys, lengths all 1
    sequence: KeyedJaggedTensor  # sequence keys, lengths 0..max_len
    labels: torch.Tensor  # float32 [B] of 0/1
    # Each sample's history items over every sequence feature, on the host (numpy, never moved):
    # token and FLOP counts come from here without reading lengths back from the device.
    history_lengths: np.ndarray | None = None

    def to(self, device, non_blocking: bool = True) -> "Batch":
        # Non-blocking by default: from the loader's pinned memory the copy is asynchronous, so the
        # host never waits for the device to drain its queue before the step (a blocking copy would).
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(device, non_blocking=non_blocking),
            sequence=self.sequence.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            history_lengths=self.history_lengths,
        )

    def record_stream(self, stream: torch.Stream) -> None:
        # Tensors copied on a side stream and used on another must not be reused before that use ends.
        for part in (self.dense, self.sparse, self.sequence, self.labels):
            part.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return Batch(
            dense=self.dense.pin_memory(),
            sparse=self.sparse.pin_memory(),
            sequence=self.sequence.pin_memory(),
            labels=self.labels.pin_memory(),
            history_lengths=self.history_lengths,
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
        # length_per_key/offset_per_key given here, on the host: torchrec would otherwise compute
        # them from the lengths on the device, a host read inside every training step.
        # Lengths are int64 like the ids: the offsets torchrec derives from them take their dtype, and
        # embedding_bag converts offsets unlike its ids on the device, one launch per table and step.
        sparse = KeyedJaggedTensor(
            keys=categorical_names,
            values=torch.cat(sparse_values) if sparse_values else torch.empty(0, dtype=torch.int64),
            lengths=torch.ones(len(categorical_names) * batch_size, dtype=torch.int64),
            stride=batch_size,
            length_per_key=[batch_size] * len(categorical_names),
            offset_per_key=[batch_size * i for i in range(len(categorical_names) + 1)],
        )

        sequence_names = list(schema.sequence_names)
        sequence_values, sequence_lengths = [], []
        for name in sequence_names:
            lists = rows.column(name).combine_chunks()
            # flatten() honours slicing offsets, unlike .values
            sequence_values.append(_owned_tensor(lists.flatten(), np.int64))
            sequence_lengths.append(_owned_tensor(pc.list_value_length(lists), np.int64))
        items_per_key = [len(values) for values in sequence_values]
        sequence = KeyedJaggedTensor(
            keys=sequence_names,
            values=torch.cat(sequence_values) if sequence_values else torch.empty(0, dtype=torch.int64),
            lengths=torch.cat(sequence_lengths) if sequence_lengths else torch.empty(0, dtype=torch.int64),
            stride=batch_size,
            length_per_key=items_per_key,
            offset_per_key=np.concatenate([[0], np.cumsum(items_per_key, dtype=np.int64)]).tolist(),
        )
        history_lengths = sum((lengths.numpy() for lengths in sequence_lengths),
                              np.zeros(batch_size, dtype=np.int64))

        labels = _owned_tensor(rows.column(LABEL), np.float32)
        return Batch(dense=dense, sparse=sparse, sequence=sequence, labels=labels, history_lengths=history_lengths)
