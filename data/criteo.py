"""Criteo display-advertising TSV -> prepared parquet shards, streaming in constant memory.

Input lines (Kaggle Display Advertising Challenge / Criteo 1TB click logs):
    label \t I1..I13 (integers, may be negative) \t C1..C26 (hex hashes), any feature may be empty.
Transforms:
    I*: signed_log1p(x) = sign(x) * log1p(|x|); empty -> 0. Criteo has -1/-2/-3 values;
        keeping the sign separates them from 0 rather than clamping them away.
    C*: empty -> id 0; otherwise 1 + (hex value mod (table_size - 1)), i.e. the hashing trick
        into a table of table_size rows with row 0 reserved for "missing".
The last val_fraction of the lines (the latest, as the files are in time order) form the
validation split; a first pass counts the lines to place that boundary.
Malformed lines are counted, reported with line numbers and skipped, or stop the run with
strict=True. Nothing is dropped silently: the summary is logged and stored in meta.json.
"""

from __future__ import annotations

import gzip
import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from data.registry import DataArgs, DatasetSpec
from data.schema import LABEL, FeatureSchema, signed_log1p
from data.storage import META_FILE, ROW_GROUP_SIZE, SPLITS, shard_path, staged_folder, write_meta

log = logging.getLogger(__name__)

NUM_DENSE = 13
NUM_CATEGORICAL = 26
DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
CATEGORICAL_NAMES = tuple(f"C{i}" for i in range(1, NUM_CATEGORICAL + 1))
COLUMNS = (LABEL, *DENSE_NAMES, *CATEGORICAL_NAMES)
DEFAULT_TABLE_SIZE = 1 << 20
_DENSE_PATTERN = r"^(-?[0-9]{1,18})?$"  # up to 18 digits always fits int64
_HEX_PATTERN = r"^([0-9a-fA-F]{1,16})?$"  # up to 16 hex digits always fits uint64
_REPORTED_MALFORMED = 10

_NIBBLE = np.zeros(256, dtype=np.uint64)
for _digit, _char in enumerate("0123456789abcdef"):
    _NIBBLE[ord(_char)] = _digit
    _NIBBLE[ord(_char.upper())] = _digit


def criteo_schema(table_size: int) -> FeatureSchema:
    return FeatureSchema(
        dense=DENSE_NAMES,
        categorical=tuple((name, table_size) for name in CATEGORICAL_NAMES),
        sequence=(),
    )


@dataclass
class Malformed:
    line_number: int
    reason: str
    text: str

    def __str__(self) -> str:
        return f"line {self.line_number}: {self.reason}: {self.text[:120]!r}"


@dataclass
class ParseSummary:
    lines_read: int = 0
    rows_written: dict[str, int] = field(default_factory=lambda: {split: 0 for split in SPLITS})
    malformed_count: int = 0
    first_malformed: list[Malformed] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "lines_read": self.lines_read,
            "rows_written": self.rows_written,
            "malformed_count": self.malformed_count,
            "first_malformed": [str(item) for item in self.first_malformed],
        }


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _check_format(input_path: Path) -> None:
    """Refuses, before reading it all, a file whose first line is comma-separated: a Criteo sample
    published as CSV, whose every line would otherwise be skipped (or, with --strict, the first) as
    malformed."""
    with _open(input_path) as source:
        first = source.readline().rstrip(b"\r\n")
    if b"\t" not in first and b"," in first:
        header = " (a header)" if not first.split(b",")[0].strip().isdigit() else ""
        raise ValueError(
            f"{input_path}: line 1 is comma-separated, {first.count(b',') + 1} fields{header}: "
            f"{_decode(first[:60])!r}; expected Criteo's tab-separated lines of {len(COLUMNS)} fields (label 0/1, "
            f"13 integers, 26 hex hashes), no header"
        )


def count_lines(path: Path) -> int:
    lines, last = 0, b"\n"
    with _open(path) as source:
        while block := source.read(1 << 24):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")


def _hex_to_uint64(strings: pa.StringArray) -> np.ndarray:
    """Parse validated hex strings column-wise: each digit is shifted by its distance from the string's end."""
    offsets = np.frombuffer(strings.buffers()[1], dtype=np.int32)[strings.offset : strings.offset + len(strings) + 1]
    data = np.frombuffer(strings.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    offsets = offsets - offsets[0]
    lengths = np.diff(offsets)
    values = np.zeros(len(strings), dtype=np.uint64)
    nonempty = np.flatnonzero(lengths)
    if nonempty.size:
        string_end = np.repeat(offsets[1:], lengths)
        shift = (string_end - 1 - np.arange(offsets[-1])).astype(np.uint64) * np.uint64(4)
        values[nonempty] = np.add.reduceat(_NIBBLE[data] << shift, offsets[nonempty])
    return values


def _read_tsv(lines: list[bytes]) -> pa.Table:
    return pa_csv.read_csv(
        pa.BufferReader(b"\n".join(lines) + b"\n"),
        read_options=pa_csv.ReadOptions(column_names=list(COLUMNS), use_threads=False),
        parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False, escape_char=False),
        convert_options=pa_csv.ConvertOptions(
            column_types={name: pa.string() for name in COLUMNS}, strings_can_be_null=False
        ),
    )


def _field_count_problems(stripped: list[bytes]) -> dict[int, str]:
    tab_counts = [line.count(b"\t") for line in stripped]
    problems = {}
    for index, (line, tabs) in enumerate(zip(stripped, tab_counts)):
        if b"\r" in line or b"\n" in line:
            problems[index] = "line break inside the line"
        elif tabs != len(COLUMNS) - 1:
            problems[index] = f"expected {len(COLUMNS)} tab-separated fields, got {tabs + 1}"
    return problems


def _field_value_problems(raw: pa.Table) -> dict[int, str]:
    """Row -> the first bad field of that row, checked column-wise with Arrow kernels."""
    checks = [(LABEL, pc.is_in(raw.column(LABEL), value_set=pa.array(["0", "1"])), "not 0 or 1")]
    checks += [
        (name, pc.match_substring_regex(raw.column(name), _DENSE_PATTERN), "not an integer") for name in DENSE_NAMES
    ]
    checks += [
        (name, pc.match_substring_regex(raw.column(name), _HEX_PATTERN), "not a hex hash of at most 16 digits")
        for name in CATEGORICAL_NAMES
    ]
    problems = {}
    for name, valid, description in checks:
        for row in np.flatnonzero(~valid.to_numpy(zero_copy_only=False)):
            value = raw.column(name)[int(row)].as_py()
            problems.setdefault(int(row), f"column {name} value {value!r} is {description}")
    return problems


def _to_rows(raw: pa.Table, schema: FeatureSchema) -> pa.Table:
    table_size = schema.categorical[0][1]
    columns: dict[str, pa.Array] = {}
    for name in DENSE_NAMES:
        text = raw.column(name).combine_chunks()
        integers = pc.cast(pc.if_else(pc.equal(text, ""), pa.scalar(None, pa.string()), text), pa.int64())
        columns[name] = pa.array(signed_log1p(integers.to_numpy(zero_copy_only=False).astype(np.float64)))
    for name in CATEGORICAL_NAMES:
        text = raw.column(name).combine_chunks()
        hashed = _hex_to_uint64(text) % np.uint64(table_size - 1) + np.uint64(1)
        missing = pc.equal(text, "").to_numpy(zero_copy_only=False)
        columns[name] = pa.array(np.where(missing, 0, hashed).astype(np.int64))
    columns[LABEL] = pa.array(pc.cast(raw.column(LABEL), pa.float32()).to_numpy())
    return pa.table(columns, schema=schema.features().arrow_schema)


def parse_lines(
    lines: list[bytes], first_line_number: int, schema: FeatureSchema
) -> tuple[pa.Table, np.ndarray, list[Malformed]]:
    """Parse raw lines into rows of the prepared format.

    Returns the rows of the well-formed lines, their 1-based line numbers, and the malformed lines in order.
    """
    stripped = [line.rstrip(b"\r\n") for line in lines]
    reasons = _field_count_problems(stripped)
    candidates = np.array([index for index in range(len(lines)) if index not in reasons], dtype=np.int64)
    if candidates.size:
        raw = _read_tsv([stripped[index] for index in candidates])
        value_problems = _field_value_problems(raw)
        if value_problems:
            reasons.update({int(candidates[row]): reason for row, reason in value_problems.items()})
            good = np.setdiff1d(np.arange(len(candidates)), list(value_problems))
            raw, candidates = raw.take(good), candidates[good]
        rows = _to_rows(raw, schema)
    else:
        rows = schema.features().arrow_schema.empty_table()
    malformed = [
        Malformed(first_line_number + index, reasons[index], _decode(stripped[index])) for index in sorted(reasons)
    ]
    return rows, first_line_number + candidates, malformed


def _decode(line: bytes) -> str:
    return line.decode("utf-8", errors="replace")


class ShardWriter:
    """Streams rows into part-NNNNN.parquet files of at most shard_rows rows each."""

    def __init__(self, staging: Path, split: str, arrow_schema: pa.Schema, shard_rows: int):
        self.staging, self.split, self.arrow_schema, self.shard_rows = staging, split, arrow_schema, shard_rows
        self.shard_index, self.rows_in_shard, self.writer = 0, 0, None

    def write(self, rows: pa.Table) -> None:
        while rows.num_rows:
            if self.writer is None:
                path = shard_path(self.staging, self.split, self.shard_index)
                self.writer = pq.ParquetWriter(path, self.arrow_schema)
            take = min(rows.num_rows, self.shard_rows - self.rows_in_shard)
            self.writer.write_table(rows.slice(0, take), row_group_size=ROW_GROUP_SIZE)
            self.rows_in_shard += take
            rows = rows.slice(take)
            if self.rows_in_shard == self.shard_rows:
                self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer, self.rows_in_shard = None, 0
            self.shard_index += 1


def _convert(
    input_path: Path, staging: Path, schema: FeatureSchema, shard_rows: int, first_validation_line: int,
    strict: bool, chunk_lines: int,
) -> ParseSummary:
    writers = {split: ShardWriter(staging, split, schema.features().arrow_schema, shard_rows) for split in SPLITS}
    summary = ParseSummary()
    with _open(input_path) as source:
        while lines := list(itertools.islice(source, chunk_lines)):
            rows, line_numbers, malformed = parse_lines(lines, summary.lines_read + 1, schema)
            summary.lines_read += len(lines)
            if malformed and strict:
                raise ValueError(f"{input_path}: malformed {malformed[0]}")
            for item in malformed:
                if len(summary.first_malformed) < _REPORTED_MALFORMED:
                    summary.first_malformed.append(item)
                    log.warning("%s: skipping malformed %s", input_path, item)
            summary.malformed_count += len(malformed)
            boundary = int(np.searchsorted(line_numbers, first_validation_line))
            for split, part in (("train", rows.slice(0, boundary)), ("validation", rows.slice(boundary))):
                writers[split].write(part)
                summary.rows_written[split] += part.num_rows
    for writer in writers.values():
        writer.close()
    empty = [split for split in SPLITS if summary.rows_written[split] == 0]
    if empty:
        raise ValueError(f"{input_path}: no valid rows for split(s) {empty}; summary: {summary.to_dict()}")
    return summary


def prepare_criteo(
    input_path: str | Path,
    out: str | Path,
    *,
    table_size: int = DEFAULT_TABLE_SIZE,
    shard_rows: int = 1_000_000,
    val_fraction: float = 0.1,
    strict: bool = False,
    chunk_lines: int = 100_000,
) -> ParseSummary:
    """Convert a labeled Criteo TSV (optionally .gz) into the prepared folder `out`."""
    input_path, out = Path(input_path), Path(out)
    if table_size < 2 or shard_rows < 1 or chunk_lines < 1 or not 0.0 < val_fraction < 1.0:
        raise ValueError(
            f"need table_size >= 2, shard_rows >= 1, chunk_lines >= 1, 0 < val_fraction < 1; got table_size="
            f"{table_size}, shard_rows={shard_rows}, chunk_lines={chunk_lines}, val_fraction={val_fraction}"
        )
    if out.exists():
        raise FileExistsError(f"{out} already exists; remove it to prepare again")
    if not input_path.is_file():
        raise FileNotFoundError(f"{input_path}: no such file")
    _check_format(input_path)
    schema = criteo_schema(table_size)
    total_lines = count_lines(input_path)
    first_validation_line = total_lines - int(round(total_lines * val_fraction)) + 1
    log.info("%s: %d lines; lines >= %d go to validation", input_path, total_lines, first_validation_line)

    with staged_folder(out) as staging:
        summary = _convert(input_path, staging, schema, shard_rows, first_validation_line, strict, chunk_lines)
        write_meta(
            staging, schema, source="criteo", input=str(input_path), table_size=table_size,
            val_fraction=val_fraction, summary=summary.to_dict(),
        )  # fmt: skip
    log.info(
        "%s: read %d lines, wrote %s rows, skipped %d malformed lines%s",
        input_path, summary.lines_read, summary.rows_written, summary.malformed_count,
        f" (first: {summary.first_malformed[0]})" if summary.first_malformed else "",
    )  # fmt: skip
    return summary


def _prepared_folder(args: DataArgs) -> Path:
    """Criteo's terms keep it from being fetched here: data_dir is the --out folder of `data.prepare criteo`."""
    if not (args.data_dir / META_FILE).exists():
        raise FileNotFoundError(
            f"{args.data_dir} holds no prepared Criteo data; run `python -m data.prepare criteo --input <tsv> "
            f"--out {args.data_dir} --table-size {args.vocab_size}` first"
        )
    return args.data_dir


DATASET = DatasetSpec(
    schema=lambda args: criteo_schema(args.vocab_size), folder=lambda args: args.data_dir, prepare=_prepared_folder
)
