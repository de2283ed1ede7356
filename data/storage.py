"""Layout of a prepared dataset folder, written atomically and read with `datasets`.

    <folder>/meta.json                     schema and how the data was made
    <folder>/train/part-00000.parquet ...
    <folder>/validation/part-00000.parquet ...
    <folder>/test/part-00000.parquet ...   only for protocols with a held-out test split
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from data.schema import FeatureSchema

SPLITS = ("train", "validation")
TEST_SPLIT = "test"  # optional: scored once, after training, by the checkpoint validation chose
META_FILE = "meta.json"
# Every shard writer uses this, so all datasets read back with the same granularity.
ROW_GROUP_SIZE = 64 * 1024


def keyed_folder(root: str | Path, name: str, key: dict) -> Path:
    """A cache subfolder per generator configuration, so different configs never share files."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return Path(root) / f"{name}-{digest}"


def staging_folder(folder: Path) -> Path:
    """A sibling folder to build into; publish_folder() renames it into place when complete."""
    staging = folder.with_name(f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    for split in SPLITS:
        (staging / split).mkdir(parents=True)
    return staging


def publish_folder(staging: Path, folder: Path) -> None:
    """Atomic on one filesystem: readers see either no folder or a complete one."""
    try:
        staging.rename(folder)
    except OSError:
        if not (folder / META_FILE).exists():
            raise
        shutil.rmtree(staging)  # another process published the same content first


@contextmanager
def staged_folder(folder: Path) -> Iterator[Path]:
    """Yields a staging folder to fill; publishes it as `folder` on success, deletes it on any failure."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(folder)
    try:
        yield staging
        publish_folder(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # never leave a half-written dataset behind
        raise


def write_prepared(folder: Path, splits: dict[str, pa.Table], schema: FeatureSchema, **details) -> None:
    """Publish in-memory tables (one shard per split) and meta.json as the prepared folder `folder`."""
    if sorted(set(splits) - {TEST_SPLIT}) != sorted(SPLITS):
        raise ValueError(f"write_prepared({folder}): got splits {sorted(splits)}, need {list(SPLITS)} "
                         f"and optionally {TEST_SPLIT!r}")
    with staged_folder(folder) as staging:
        for split, table in splits.items():
            shard_path(staging, split, 0).parent.mkdir(exist_ok=True)
            write_shard(table, shard_path(staging, split, 0))
        write_meta(staging, schema, **details)


def shard_path(staging: Path, split: str, index: int) -> Path:
    return staging / split / f"part-{index:05d}.parquet"


def write_shard(table: pa.Table, path: Path) -> None:
    pq.write_table(table, path, row_group_size=ROW_GROUP_SIZE)


def write_meta(staging: Path, schema: FeatureSchema, **details) -> None:
    (staging / META_FILE).write_text(json.dumps({"schema": schema.to_dict(), **details}, indent=2) + "\n")


def read_meta(folder: Path) -> dict:
    path = Path(folder) / META_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: {folder} is not a prepared dataset folder")
    return json.loads(path.read_text())


def load_split(folder: Path, split: str) -> datasets.Dataset:
    """Memory-mapped Arrow dataset of one split; works offline (HF_DATASETS_OFFLINE=1)."""
    files = sorted(str(path) for path in (Path(folder) / split).glob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"no parquet files in {Path(folder) / split}")
    # datasets converts the parquet files into an Arrow cache it locks and writes: beside them, or, for a
    # prepared folder shared read-only, in its own cache (HF_DATASETS_CACHE, ~/.cache/huggingface by default).
    writable = os.access(folder, os.W_OK | os.X_OK)
    try:
        return datasets.load_dataset(
            "parquet", data_files={split: files}, split=split,
            cache_dir=str(Path(folder) / ".hf_cache") if writable else None,
        )
    except (pa.ArrowException, datasets.exceptions.DatasetGenerationError) as error:  # a damaged or foreign file
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ValueError(f"cannot read the prepared {split} split in {Path(folder) / split} ({reason}); if a file "
                         f"there is damaged, delete {folder} and it is prepared again (data.prepare for Criteo)") from None
