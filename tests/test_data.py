"""Synthetic data, collate, validation and the datamodule."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

from data.baseline import binary_auc, logistic_regression_auc
from data.batch import ArrowBatchCollator
from data.datamodule import CTRDataModule
from data.schema import LABEL, FeatureSchema, signed_log1p
from data.synthetic import (
    SyntheticConfig, ensure_synthetic, generate, synthetic_config, synthetic_folder, synthetic_schema,
)
from data.validation import validate_table

SMALL = SyntheticConfig(num_train=3000, num_val=1000, vocab_size=200, num_items=300, max_history_len=200, seed=7)
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_data():
    return generate(SMALL)


def test_generation_is_deterministic_for_a_seed(small_data):
    again = generate(SMALL)
    assert again.train.equals(small_data.train)
    assert again.validation.equals(small_data.validation)
    other_seed = generate(SyntheticConfig(**{**SMALL.__dict__, "seed": 8}))
    assert not other_seed.train.equals(small_data.train)


def test_generated_columns_follow_the_schema(small_data):
    schema = synthetic_schema(SMALL)
    assert small_data.train.schema.equals(schema.features().arrow_schema, check_metadata=False)
    assert small_data.train.num_rows == SMALL.num_train
    assert small_data.validation.num_rows == SMALL.num_val
    validate_table(small_data.train, schema)  # generated data must pass its own checks
    lengths = pc.list_value_length(small_data.train.column("history")).to_numpy()
    assert lengths.min() == 0 and lengths.max() <= SMALL.max_history_len
    assert 0.05 < np.mean(lengths == 0) < 0.2
    assert np.mean(lengths % 64 != 0) > 0.5  # most histories end in a partial 64-token block
    assert np.mean(lengths > 128) > 0.05  # and many span several blocks
    dense = small_data.train.column("dense_0").to_numpy()
    assert np.mean(dense == 0.0) > 0.05  # missing counts became 0


def test_label_rate_is_ads_like(small_data):
    labels = np.concatenate([small_data.train.column(LABEL).to_numpy(), small_data.validation.column(LABEL).to_numpy()])
    assert set(np.unique(labels)) == {0.0, 1.0}
    assert 0.2 <= labels.mean() <= 0.3


def test_planted_interactions_drive_the_label(small_data):
    labels = np.concatenate([small_data.train.column(LABEL).to_numpy(), small_data.validation.column(LABEL).to_numpy()])
    assert binary_auc(small_data.pair_term, labels) > 0.65
    assert binary_auc(small_data.match_term, labels) > 0.65
    assert binary_auc(small_data.click_probability, labels) > 0.8


def test_logistic_regression_without_interactions_falls_short_of_the_rule():
    config = SyntheticConfig(num_train=12000, num_val=3000, vocab_size=200, num_items=300, max_history_len=128, seed=3)
    data = generate(config)
    schema = synthetic_schema(config)
    collate = ArrowBatchCollator(schema)
    train = [collate(data.train.slice(i, 256)) for i in range(0, data.train.num_rows, 256)]
    val = [collate(data.validation.slice(i, 512)) for i in range(0, data.validation.num_rows, 512)]
    baseline_auc = logistic_regression_auc(schema, train, val, epochs=3)
    oracle_auc = binary_auc(data.click_probability[config.num_train :], data.validation.column(LABEL).to_numpy())
    assert 0.55 < baseline_auc < oracle_auc - 0.1


def test_binary_auc_matches_pair_counting():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, size=200).astype(float)  # many ties
    labels = (rng.random(200) < 0.3).astype(float)
    positive, negative = scores[labels == 1], scores[labels == 0]
    wins = (positive[:, None] > negative[None, :]).sum() + 0.5 * (positive[:, None] == negative[None, :]).sum()
    assert binary_auc(scores, labels) == pytest.approx(wins / (positive.size * negative.size))


def test_signed_log1p_keeps_sign_and_zeroes_missing():
    out = signed_log1p(np.array([0.0, 1.0, -2.0, np.nan, 1e9]))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [0.0, np.log(2), -np.log(3), 0.0, np.log1p(1e9)], rtol=1e-6)


def test_collate_builds_the_contract_batch(small_data):
    schema = synthetic_schema(SMALL)
    rows = small_data.train.take([5, 0, 17, 2999, 3])  # arbitrary order, like a shuffled batch
    batch = ArrowBatchCollator(schema)(rows)
    assert batch.batch_size == 5
    assert batch.dense.dtype == torch.float32 and batch.dense.shape == (5, SMALL.num_dense)
    np.testing.assert_array_equal(batch.dense[:, 2].numpy(), rows.column("dense_2").to_numpy())
    assert batch.labels.dtype == torch.float32 and batch.labels.shape == (5,)

    assert batch.sparse.keys() == [name for name, _ in schema.categorical]
    assert torch.equal(batch.sparse.lengths(), torch.ones(5 * len(schema.categorical), dtype=torch.int64))
    assert batch.sparse.values().dtype == torch.int64
    np.testing.assert_array_equal(batch.sparse["item"].values().numpy(), rows.column("item").to_numpy())

    history = batch.sequence["history"]
    assert batch.sequence.keys() == ["history"] and batch.sequence.stride() == 5
    expected = rows.column("history").to_pylist()
    assert history.lengths().tolist() == [len(ids) for ids in expected]
    assert history.values().tolist() == [i for ids in expected for i in ids]


def test_batch_to_and_pin_memory_keep_contents(small_data):
    batch = ArrowBatchCollator(synthetic_schema(SMALL))(small_data.train.slice(0, 8))
    moved = batch.to("cpu")
    assert torch.equal(moved.sequence.values(), batch.sequence.values())
    assert torch.equal(moved.dense, batch.dense) and moved.batch_size == 8
    if torch.cuda.is_available():
        assert batch.pin_memory().dense.is_pinned()


def test_collate_handles_a_schema_without_sequences():
    schema = FeatureSchema(dense=("d",), categorical=(("c", 10),), sequence=())
    rows = pa.table({"d": pa.array([0.5, 1.0], pa.float32()), "c": [3, 4], LABEL: pa.array([0, 1], pa.float32())})
    batch = ArrowBatchCollator(schema)(rows)
    assert batch.sequence.keys() == [] and batch.sequence.stride() == 2
    assert batch.sparse.values().tolist() == [3, 4]


def _replace_column(table: pa.Table, column: str, values: pa.Array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(column), column, values)


def _corrupt(table: pa.Table, column: str, row: int, value) -> pa.Table:
    values = table.column(column).to_pylist()
    values[row] = value
    return _replace_column(table, column, pa.array(values, table.schema.field(column).type))


@pytest.mark.parametrize(
    ("column", "row", "value", "message"),
    [
        ("ad_campaign", 41, -1, "outside [0, 200)"),
        ("ad_campaign", 42, 200, "outside [0, 200)"),
        ("history", 43, [1] * 201, "sequence length outside [0, 200]"),
        ("history", 44, [5, 300], "sequence id outside [0, 300)"),
        ("history", 45, None, "missing value"),
        (LABEL, 46, float("nan"), "label must be 0 or 1"),
        (LABEL, 47, 2.0, "label must be 0 or 1"),
        ("dense_3", 48, float("inf"), "not finite"),
        ("dense_3", 49, None, "missing value"),
    ],
)
def test_validation_names_column_row_and_value(small_data, column, row, value, message):
    bad = _corrupt(small_data.train, column, row, value)
    with pytest.raises(ValueError) as error:
        validate_table(bad, synthetic_schema(SMALL), split="train")
    text = str(error.value)
    assert f"column {column!r}" in text and f"row {row}:" in text and message in text
    assert "train" in text


def test_validation_rejects_missing_columns_and_wrong_types(small_data):
    schema = synthetic_schema(SMALL)
    with pytest.raises(ValueError, match=r"missing column\(s\) \['item'\]"):
        validate_table(small_data.train.drop_columns(["item"]), schema)
    as_float = _replace_column(small_data.train, "item", pc.cast(small_data.train.column("item"), pa.float64()))
    with pytest.raises(ValueError, match=r"column 'item' has type double, expected an integer type"):
        validate_table(as_float, schema)
    as_strings = _replace_column(small_data.train, "dense_0", pc.cast(small_data.train.column("dense_0"), pa.string()))
    with pytest.raises(ValueError, match=r"column 'dense_0' has type string, expected a float type"):
        validate_table(as_strings, schema)


def test_validation_reports_rows_in_later_slices(small_data, monkeypatch):
    monkeypatch.setattr("data.validation._ROWS_PER_CHECK", 1000)
    bad = _corrupt(small_data.train, "history", 2500, [0, 0, 999])
    with pytest.raises(ValueError, match=r"row 2500: sequence id outside \[0, 300\) \(value 999\)"):
        validate_table(bad, synthetic_schema(SMALL))


TINY = dict(num_train=300, num_val=130, batch_size=64, vocab_size=50, num_items=40, max_history_len=100, seed=1)


def _epoch(loader) -> list:
    return [(batch.labels.clone(), batch.sequence.values().clone(), batch.sparse.values().clone()) for batch in loader]


def test_datamodule_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
    module = CTRDataModule(data_dir=str(tmp_path), **TINY)
    assert module.schema == synthetic_schema(synthetic_config(module.args))  # known before any data exists
    assert not any(tmp_path.iterdir())
    module.prepare_data()
    module.setup("fit")
    train_batches = list(module.train_dataloader())
    assert [batch.batch_size for batch in train_batches] == [64, 64, 64, 64, 44]
    val_labels = torch.cat([batch.labels for batch in module.val_dataloader()])
    assert val_labels.shape == (130,)

    # Same seed, fresh module: the same shuffled order; the cache is reused, not regenerated.
    folder = module.prepared_folder()
    parquet = folder / "train" / "part-00000.parquet"
    written_at = parquet.stat().st_mtime_ns
    again = CTRDataModule(data_dir=str(tmp_path), **TINY)
    again.prepare_data()
    again.setup("fit")
    assert parquet.stat().st_mtime_ns == written_at
    for first, second in zip(_epoch(module.train_dataloader()), _epoch(again.train_dataloader())):
        assert all(torch.equal(a, b) for a, b in zip(first, second))

    # Worker processes must yield exactly what the main process yields.
    with_workers = CTRDataModule(data_dir=str(tmp_path), num_workers=2, **TINY)
    with_workers.setup("fit")
    for first, second in zip(_epoch(module.val_dataloader()), _epoch(with_workers.val_dataloader())):
        assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_a_batch_larger_than_the_training_data_is_warned_about(tmp_path, caplog):
    module = CTRDataModule(data_dir=str(tmp_path), **{**TINY, "batch_size": 1024})
    module.prepare_data()
    module.setup("fit")
    with caplog.at_level(logging.WARNING, logger="data.datamodule"):
        batches = list(module.train_dataloader())
    assert [batch.batch_size for batch in batches] == [300]
    assert "data.batch_size=1024 is more than the 300 training rows" in caplog.text
    caplog.clear()
    fitting = CTRDataModule(data_dir=str(tmp_path), **TINY)
    fitting.setup("fit")
    with caplog.at_level(logging.WARNING, logger="data.datamodule"):
        fitting.train_dataloader()
    assert "batch_size" not in caplog.text


def test_datamodule_keeps_configs_apart_and_ignores_leftover_staging(tmp_path):
    base = CTRDataModule(data_dir=str(tmp_path), **TINY)
    other = CTRDataModule(data_dir=str(tmp_path), **{**TINY, "num_items": 60})
    assert base.prepared_folder() != other.prepared_folder()
    # An interrupted run leaves only a hidden staging folder, which must not count as prepared data.
    leftover = tmp_path / f".{base.prepared_folder().name}.tmp-1-dead"
    (leftover / "train").mkdir(parents=True)
    (leftover / "train" / "part-00000.parquet").write_bytes(b"truncated")
    ensure_synthetic(synthetic_config(base.args), tmp_path)
    base.setup("fit")
    assert sum(batch.batch_size for batch in base.train_dataloader()) == TINY["num_train"]
    with pytest.raises(FileNotFoundError, match="not a prepared dataset folder"):
        other.setup("fit")


def test_failed_synthetic_write_leaves_no_folder_behind(tmp_path, monkeypatch):
    def fail_after_shards(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("data.storage.write_meta", fail_after_shards)
    config = synthetic_config(CTRDataModule(data_dir=str(tmp_path), **TINY).args)
    with pytest.raises(OSError, match="disk full"):
        ensure_synthetic(config, tmp_path)
    assert list(tmp_path.iterdir()) == []  # neither the published folder nor its staging folder
    monkeypatch.undo()
    assert ensure_synthetic(config, tmp_path) == synthetic_folder(config, tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == [synthetic_folder(config, tmp_path).name]


def test_datamodule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dataset='imagenet' is not one of"):
        CTRDataModule(dataset="imagenet")
    with pytest.raises(ValueError, match="num_categorical=2"):
        CTRDataModule(num_categorical=2)


def test_datamodule_works_with_datasets_offline_env(tmp_path):
    code = (
        "from data.datamodule import CTRDataModule\n"
        f"m = CTRDataModule(data_dir={str(tmp_path)!r}, num_train=100, num_val=50, batch_size=32)\n"
        "m.prepare_data(); m.setup('fit'); print(sum(b.batch_size for b in m.train_dataloader()))\n"
    )
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "100"


@pytest.mark.parametrize("num_rows, world_size", [(300, 1), (300, 2), (301, 3), (5, 4)])
def test_ranks_read_disjoint_rows_and_as_many_batches(num_rows, world_size):
    """Training: every rank the same number of rows of one shared permutation, no row twice (at most
    world_size - 1 rows of an epoch unused). Validation: every row exactly once, and every rank as
    many batches (a sharded model's lookups need all ranks at every step)."""
    from data.datamodule import ShardedSampler, even_batches

    train = [list(ShardedSampler(num_rows, True, seed=3, rank=r, world_size=world_size)) for r in range(world_size)]
    seen = [row for rows in train for row in rows]
    assert len(set(seen)) == len(seen) and len(seen) > num_rows - world_size
    assert len({len(rows) for rows in train}) == 1

    validation = [ShardedSampler(num_rows, False, seed=0, rank=r, world_size=world_size).rows() for r in range(world_size)]
    batches = [even_batches(rows, num_rows, 64, world_size) for rows in validation]
    assert len({len(b) for b in batches}) == 1 and all(len(batch) <= 64 for b in batches for batch in b)
    rows = sorted(row for rank_batches in batches for batch in rank_batches for row in batch)
    assert rows == list(range(num_rows))


def test_resumed_sampler_continues_the_epoch_where_it_stopped():
    from data.datamodule import ShardedSampler

    full = list(ShardedSampler(100, True, seed=1))
    resumed = ShardedSampler(100, True, seed=1)
    resumed.load_state_dict({"epoch": 0, "consumed": 37})
    resumed.set_epoch(0)  # Lightning calls this before the epoch: the same epoch keeps the position
    assert list(resumed) == full[37:]
    resumed.set_epoch(1)  # a new epoch starts from its beginning, in another order
    assert len(list(resumed)) == 100 and list(resumed) != full
