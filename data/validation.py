"""Whole-split checks run once before training, so bad rows fail at setup, not mid-epoch."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.schema import LABEL, FeatureSchema

# Checked in slices so a memory-mapped split far larger than RAM is never materialized at once.
_ROWS_PER_CHECK = 1 << 20


def _fail(split: str, column: str, row: int, value, problem: str) -> None:
    raise ValueError(f"{split}: column {column!r}, row {row}: {problem} (value {value!r})")


def _check_types(table_schema: pa.Schema, schema: FeatureSchema, split: str) -> None:
    present = set(table_schema.names)
    missing = [name for name in schema.column_names + (LABEL,) if name not in present]
    if missing:
        raise ValueError(f"{split}: missing column(s) {missing}; columns present: {table_schema.names}")

    def require(name: str, ok: bool, expected: str) -> None:
        if not ok:
            raise ValueError(f"{split}: column {name!r} has type {table_schema.field(name).type}, expected {expected}")

    for name in schema.dense:
        require(name, pa.types.is_floating(table_schema.field(name).type), "a float type")
    for name in schema.categorical_names:
        require(name, pa.types.is_integer(table_schema.field(name).type), "an integer type")
    for name in schema.sequence_names:
        column_type = table_schema.field(name).type
        is_int_list = (pa.types.is_list(column_type) or pa.types.is_large_list(column_type)) and pa.types.is_integer(
            column_type.value_type
        )
        require(name, is_int_list, "a list of integers")
    label_type = table_schema.field(LABEL).type
    require(LABEL, pa.types.is_floating(label_type) or pa.types.is_integer(label_type), "a numeric type")


def _first_true(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _check_nulls(part: pa.Table, name: str, row_offset: int, split: str) -> None:
    column = part.column(name)
    if column.null_count:
        row = _first_true(column.is_null().to_numpy(zero_copy_only=False))
        _fail(split, name, row_offset + row, None, "missing value")


def _check_ids(ids: np.ndarray, num_embeddings: int) -> int | None:
    return _first_true((ids < 0) | (ids >= num_embeddings))


def _check_part(part: pa.Table, schema: FeatureSchema, row_offset: int, split: str) -> None:
    for name in schema.dense:
        _check_nulls(part, name, row_offset, split)
        values = part.column(name).to_numpy()
        row = _first_true(~np.isfinite(values))
        if row is not None:
            _fail(split, name, row_offset + row, float(values[row]), "dense value is not finite")

    for name, num_embeddings in schema.categorical:
        _check_nulls(part, name, row_offset, split)
        ids = part.column(name).to_numpy()
        row = _check_ids(ids, num_embeddings)
        if row is not None:
            _fail(split, name, row_offset + row, int(ids[row]), f"id outside [0, {num_embeddings})")

    for name, num_embeddings, max_len in schema.sequence:
        _check_nulls(part, name, row_offset, split)
        lists = part.column(name).combine_chunks()
        lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False)
        row = _first_true((lengths < 0) | (lengths > max_len))
        if row is not None:
            _fail(split, name, row_offset + row, int(lengths[row]), f"sequence length outside [0, {max_len}]")
        ids = lists.flatten().to_numpy(zero_copy_only=False)
        position = _check_ids(ids, num_embeddings)
        if position is not None:
            row = int(np.searchsorted(np.cumsum(lengths), position, side="right"))
            _fail(split, name, row_offset + row, int(ids[position]), f"sequence id outside [0, {num_embeddings})")

    _check_nulls(part, LABEL, row_offset, split)
    labels = part.column(LABEL).to_numpy().astype(np.float64)
    row = _first_true(~((labels == 0.0) | (labels == 1.0)))
    if row is not None:
        _fail(split, LABEL, row_offset + row, float(labels[row]), "label must be 0 or 1")


def validate_table(table: pa.Table, schema: FeatureSchema, split: str = "data") -> None:
    """Raise ValueError naming split, column, first offending row and value; return None when clean."""
    _check_types(table.schema, schema, split)
    if table.num_rows == 0:
        raise ValueError(f"{split}: no rows")
    for row_offset in range(0, table.num_rows, _ROWS_PER_CHECK):
        part = table.slice(row_offset, _ROWS_PER_CHECK)
        _check_part(part, schema, row_offset, split)
