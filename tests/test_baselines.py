"""The baseline architectures (models/baselines.py): against torchrec's own models and the DeepFM
paper's definition, every table trained, and each arch training through train.py."""

import json
import shutil
import statistics
from itertools import combinations
from pathlib import Path

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN

from data.datamodule import CTRDataModule
from data.schema import FeatureSchema
from models import RankingModelConfig
from models.baselines import BASELINE_ARCHS, BaselineConfig, BaselineModel
from tests.test_model import SCHEMA, make_batch
from tests.test_train import read_metrics, run_train
from train import ARCHS, RankingTask

REPO = Path(__file__).resolve().parents[1]
CONFIG = BaselineConfig(embedding_dim=8, dense_arch=[16], over_arch=[32, 16], dcn_num_layers=2, dcn_low_rank_dim=4)


@pytest.mark.parametrize("arch", ["dlrm", "dcnv2"])
def test_dlrm_towers_compute_what_torchrecs_models_do(arch):
    """With one categorical collection (torchrec's DLRM takes one), the same weights give the same logits."""
    schema = FeatureSchema(dense=SCHEMA.dense, categorical=SCHEMA.categorical, sequence=())
    torch.manual_seed(0)
    ours = BaselineModel(schema, arch, CONFIG)
    collection = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t_{name}", embedding_dim=CONFIG.embedding_dim, num_embeddings=n, feature_names=[name])
        for name, n in schema.categorical
    ])  # fmt: skip
    sizes = dict(dense_in_features=len(schema.dense), dense_arch_layer_sizes=[*CONFIG.dense_arch, CONFIG.embedding_dim],
                 over_arch_layer_sizes=[*CONFIG.over_arch, 1])  # fmt: skip
    if arch == "dlrm":
        theirs = DLRM(collection, **sizes)
    else:
        theirs = DLRM_DCN(collection, **sizes, dcn_num_layers=CONFIG.dcn_num_layers,
                          dcn_low_rank_dim=CONFIG.dcn_low_rank_dim)  # fmt: skip
    state = {key.replace("embeddings.categorical_embeddings.", "sparse_arch.embedding_bag_collection.")
             .removeprefix("tower."): value for key, value in ours.state_dict().items()}  # fmt: skip
    theirs.load_state_dict(state)  # strict: every parameter has its counterpart
    batch = make_batch([0] * 5, [0] * 5)
    batch.sequence = None  # not read: the schema has no sequence features
    logits, tokens = ours(batch)
    torch.testing.assert_close(logits, theirs(batch.dense, batch.sparse).squeeze(1), rtol=0, atol=0)
    assert tokens == 0


def test_deepfm_adds_first_order_pairwise_field_products_and_the_deep_part():
    torch.manual_seed(0)
    model = BaselineModel(SCHEMA, "deepfm", CONFIG)
    batch = make_batch([3, 0, 1], [1, 2, 0])
    logits, _ = model(batch)
    tower = model.tower
    fields = torch.cat([tower.dense_arch(batch.dense).unsqueeze(1), model.embeddings(batch)], dim=1)
    pairwise = sum((fields[:, f] * fields[:, g]).sum(1) for f, g in combinations(range(fields.shape[1]), 2))
    linear = model.linear_embeddings(batch)
    first_order = tower.first_order.dense(batch.dense).squeeze(1) + linear.sum(dim=(1, 2))
    deep = tower.deep.dense_module(fields.flatten(1)).squeeze(1)
    torch.testing.assert_close(logits, first_order + pairwise + deep, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", BASELINE_ARCHS)
def test_every_table_and_weight_gets_a_gradient(arch):
    torch.manual_seed(0)
    model = BaselineModel(SCHEMA, arch, CONFIG)
    batch = make_batch([3, 0, 1, 2], [1, 2, 0, 4])
    logits, _ = model(batch)
    assert logits.shape == (4,)
    model.loss(logits, batch.labels).backward()
    without = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert without == [], without
    tables = [name for name, _ in model.named_parameters() if "embedding_bags" in name]
    expected = len(SCHEMA.categorical) + len(SCHEMA.sequence)
    assert len(tables) == expected * ((arch in ("lr", "deepfm")) + (arch != "lr"))
    assert model.train_step_flops(8) == 2 * model.train_step_flops(4) > 0


def test_compiled_tower_computes_what_the_eager_one_does():
    torch.manual_seed(0)
    eager = BaselineModel(SCHEMA, "deepfm", CONFIG)
    torch.manual_seed(0)
    compiled = BaselineModel(SCHEMA, "deepfm", BaselineConfig(**{**CONFIG.__dict__, "compile": True}))
    for lengths in ([3, 0, 1, 2], [1, 1, 5]):  # two batch shapes: one dynamic-shape graph
        batch = make_batch(lengths, lengths[::-1])
        torch.testing.assert_close(compiled(batch)[0], eager(batch)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", BASELINE_ARCHS)
def test_each_arch_trains_through_train_py_with_its_config(tmp_path, arch):
    result = run_train("--config", "configs/tiny.yaml", "--config", f"configs/{arch}.yaml",
                       f"--runs_dir={tmp_path / 'runs'}", f"--data.data_dir={tmp_path / 'cache'}")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "runs" / arch / "version_0")
    losses = [float(row["train/loss"]) for row in rows if row["train/loss"]]
    assert len(losses) == 40 and statistics.mean(losses[-5:]) < statistics.mean(losses[:5]) - 0.02
    assert [float(row["val/auc"]) for row in rows if row["val/auc"]][-1] > 0.5
    assert all(float(row["train/tflops"]) > 0 for row in rows if row["train/loss"])
    assert not (tmp_path / "runs" / arch / "version_0" / "test.json").exists()  # the synthetic data has no test split


@pytest.mark.parametrize("run, args", [
    ("dcnv2", ["--config", "configs/dcnv2.yaml", "--data.protocol=recbole_context"]),
    ("dcnv2", ["--config", "configs/dcnv2.yaml", "--data.protocol=time_split_history", "--data.max_history_len=16"]),
    ("tiny", ["--data.protocol=time_split_history", "--data.max_history_len=0"]),  # block attention, no history
    ("dcnv2", ["--config", "configs/dcnv2.yaml", "--data.protocol=recbole_context", "--checkpoint.best_metric=auc"]),
])  # fmt: skip
def test_a_protocol_with_a_test_split_is_scored_by_the_best_validation_checkpoint(tmp_path, run, args):
    shutil.copytree(REPO / "tests" / "fixtures" / "ml-1m-tiny", tmp_path / "cache" / "raw" / "ml-1m")
    result = run_train("--config", "configs/tiny.yaml", *args, "--data.dataset=movielens1m",
                       "--data.num_train=0", "--data.num_val=0",
                       "--data.batch_size=16", "--trainer.max_steps=12", "--trainer.val_check_interval=5",
                       f"--runs_dir={tmp_path / 'runs'}", f"--data.data_dir={tmp_path / 'cache'}")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_folder = tmp_path / "runs" / run / "version_0"
    scores = json.loads((run_folder / "test.json").read_text())
    best = sorted((run_folder / "checkpoints").glob("best-step*.ckpt"))
    assert scores["checkpoint"] == str(best[0]) and len(best) == 1
    rows = read_metrics(run_folder)
    assert [float(row["test/auc"]) for row in rows if row.get("test/auc")] == [pytest.approx(scores["test/auc"])]
    assert 0 < scores["test/logloss"] and "test AUC" in result.stdout
    # The summary after test scoring (which restores the callbacks' state of that checkpoint) names the newest.
    assert f"last checkpoint: {run_folder / 'checkpoints' / 'last.ckpt'} (resume" in result.stdout, result.stdout
    # The kept checkpoint is the best validation by checkpoint.best_metric: its file name holds that value.
    metric = "auc" if "--checkpoint.best_metric=auc" in args else "ne"
    validations = [float(row[f"val/{metric}"]) for row in rows if row.get(f"val/{metric}")]
    best_value = max(validations) if metric == "auc" else min(validations)
    assert len(validations) >= 2 and best[0].name.endswith(f"-{metric}{best_value:.4f}.ckpt")


@pytest.mark.parametrize("max_history_len", [8, 0])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_trains_on_the_time_split_with_and_without_history(tmp_path, arch, max_history_len):
    """The same samples with the history feature and without it (max_history_len=0): every architecture
    builds on either schema, with a history table only when there is a history, and takes a gradient step."""
    shutil.copytree(REPO / "tests" / "fixtures" / "ml-1m-tiny", tmp_path / "raw" / "ml-1m")
    data = CTRDataModule(dataset="movielens1m", data_dir=str(tmp_path), max_history_len=max_history_len,
                         num_train=0, num_val=0, batch_size=32)  # fmt: skip
    data.prepare_data()
    data.setup("fit")
    torch.manual_seed(0)
    task = RankingTask(data.schema.to_dict(), net=RankingModelConfig(d_model=32, embedding_dim=8, num_layers=1),
                       arch=arch, baseline=CONFIG)  # fmt: skip
    has_history_table = any("history" in name for name, _ in task.net.named_parameters())
    assert has_history_table == (max_history_len > 0)
    batch = next(iter(data.test_dataloader()))
    assert (batch.history_lengths.sum() > 0) == (max_history_len > 0)
    logits, _ = task.net(batch)
    task.net.loss(logits, batch.labels).backward()
    assert logits.shape == (batch.batch_size,) and torch.isfinite(logits).all()


@pytest.mark.parametrize("args, message", [
    (["--model.arch=xgboost"], "Expected a typing.Literal['block_attention', 'lr', 'dlrm', 'dcnv2', 'deepfm']"),
    (["--model.arch=dlrm", "--model.baseline.over_arch=[]"], "over_arch (at least one layer)"),
    (["--data.dataset=movielens1m", "--data.protocol=random"], "protocol='random': for dataset='movielens1m' it must"),
])  # fmt: skip
def test_bad_arch_or_protocol_gives_a_clear_error(args, message):
    result = run_train(*args, "--dry_run=true")
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
