"""models/sharding/ and training/: torchrec DistributedModelParallel on CPU (gloo), 2 processes against 1.

Each multi-process test starts tests/sharding_worker.py once per rank with torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...) and compares what the ranks wrote with a single-process
RankingModel built from the same seed, fed the whole global batch (the ranks feed its halves).

Tolerances (float32; measured values in brackets). The sharded and the single-process model do the
same arithmetic in another order: DDP averages two half-batch gradients, fbgemm's kernels pool and
accumulate rows, the all-to-all regroups them; each reordering rounds at ~6e-8 relative.
- losses rtol 1e-5 / atol 1e-7 [3e-8]; dense gradients rtol 1e-5 / atol 1e-7 [7.5e-9 absolute].
- embedding gradients atol 1e-8 [6e-11; the gradients reach 5.6e-4]. They are read from one fused
  SGD step of lr 1000 (grad = -change / lr), which keeps float32 cancellation negligible.
- after three steps of AdamW + fused row-wise Adagrad, parameters atol 2e-5 [1.3e-6 dense, 6.2e-6
  for data_parallel tables, which AdamW trains: dividing by sqrt(v) amplifies ulp-level gradient
  differences where gradients are near zero].
- predictions of a loaded checkpoint atol 1e-6, after one more step atol 1e-5.
A real error (a row or a feature mixed up, a missing 1/world_size) shows up at >= 1e-2 relative.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "sharding_worker.py"
sys.path.insert(0, str(REPO / "tests"))

import sharding_worker as worker  # noqa: E402
from models.sharding import (  # noqa: E402
    ShardingConfig,
    SparseOptimizerConfig,
    column_wise_shard_dim,
    embedding_tables,
    load_unsharded,
    plan_sharding,
    resolve_sharding_types,
)

SHARDING_TYPES = ["table_wise", "row_wise", "column_wise", "data_parallel"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, tmp_path: Path, args: dict, world_size: int = 2, timeout: float = 120) -> list:
    """Run scenario on world_size ranks as torchrun would; returns each rank's result.

    Subprocesses, not torch.multiprocessing.spawn: the Lightning scenario sets up its process group from
    torchrun's env vars (so a free port and a retry when another process takes it first are needed
    anyway), spawn's join has no timeout for a hung rank, and each rank's log file is what a failure shows."""
    for attempt in range(2):
        out = tmp_path / f"{scenario}-{world_size}-{time.monotonic_ns()}"
        out.mkdir()
        failed, logs = _run_ranks(scenario, out, args, world_size, timeout)
        # The port was free when picked; another process may have taken it before rank 0 bound it.
        if failed and attempt == 0 and any("address already in use" in log.lower() for log in logs.values()):
            continue
        break
    if failed:
        tails = [f"--- rank {rank} (exit {code}) ---\n{logs[rank][-4000:]}" for rank, code in failed.items()]
        pytest.fail(f"{scenario} failed on ranks {sorted(failed)}:\n" + "\n".join(tails))
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def _run_ranks(scenario: str, out: Path, args: dict, world_size: int, timeout: float) -> tuple[dict, dict]:
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "test_sharding",
            "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
        }  # fmt: skip
        with open(out / f"rank{rank}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), scenario, str(out), json.dumps(args)],
                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
            )
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            break
    for proc in procs:  # a rank that outlived the deadline, or waits on a peer that died
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    failed = {rank: proc.returncode for rank, proc in enumerate(procs) if proc.returncode != 0}
    logs = {rank: (out / f"rank{rank}.log").read_text() for rank in failed}
    return failed, logs


def _history_override(sharding_type: str) -> str:
    return "table_wise" if sharding_type == "data_parallel" else sharding_type


def _reference_gradients() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = worker.build_model()
    batch = worker.batch_rows(0)
    logits, _ = model(batch)
    loss = model.loss(logits, batch.labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gradients_match_single_process_for_each_sharding_type(tmp_path):
    runs = [{"sharding_type": t, "average": True} for t in SHARDING_TYPES] + [{"sharding_type": "row_wise", "average": False}]
    ranks = launch("gradients", tmp_path, {"runs": runs})
    loss, grads = _reference_gradients()
    tables = embedding_tables(worker.build_model())
    for sharding_type in SHARDING_TYPES:
        results = [r[(sharding_type, True)] for r in ranks]
        # DDP's average of the two half-batch mean losses is the global-batch mean loss.
        torch.testing.assert_close(torch.tensor(sum(r["loss"] for r in results) / 2), loss, rtol=1e-5, atol=1e-7)
        dense = results[0]["dense_grads"]
        assert set(dense) == set(results[1]["dense_grads"])
        for name, grad in dense.items():
            torch.testing.assert_close(grad, results[1]["dense_grads"][name], rtol=0, atol=0)  # DDP: one value
            torch.testing.assert_close(grad, grads[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{sharding_type} {name}: {m}")
        for table in tables.values():
            replicated = sharding_type == "data_parallel" and table.pooled
            if replicated:  # data_parallel tables train with the dense optimizer: a plain .grad
                assert table.state_key in dense, f"{table.name} missing from the dense parameters"
                continue
            assert table.state_key not in dense, f"fused {table.name} must not reach the dense optimizer"
            shape = (table.num_embeddings, table.embedding_dim)
            before = worker.assemble([r["tables_before"] for r in results], table.state_key, shape)
            after = worker.assemble([r["tables_after"] for r in results], table.state_key, shape)
            torch.testing.assert_close(before, dict(worker.build_model().named_parameters())[table.state_key].detach())
            recovered = (after - before) / -worker.SGD_PROBE_LR
            torch.testing.assert_close(
                recovered, grads[table.state_key], rtol=0, atol=1e-8, msg=lambda m: f"{sharding_type} {table.name}: {m}"
            )
    # average_sparse_gradients=False (torchrec's gradient division off): sharded rows get the sum
    # over ranks, world_size x the global-mean gradient, while dense gradients stay averaged.
    summed = [r[("row_wise", False)] for r in ranks]
    for table in tables.values():
        shape = (table.num_embeddings, table.embedding_dim)
        change = worker.assemble([r["tables_after"] for r in summed], table.state_key, shape) - worker.assemble(
            [r["tables_before"] for r in summed], table.state_key, shape
        )
        torch.testing.assert_close(change / -worker.SGD_PROBE_LR, 2 * grads[table.state_key], rtol=0, atol=2e-8)
    for name, grad in summed[0]["dense_grads"].items():
        torch.testing.assert_close(grad, grads[name], rtol=1e-5, atol=1e-7)


# No sparse weight decay: fbgemm-gpu's CPU kernel drops it for pooled tables (shard_model rejects it on CPU).
OPTIMIZER = {"name": "rowwise_adagrad", "lr": 0.05, "eps": 1e-8}
ADAMW = {"lr": 0.01, "weight_decay": 0.01}
STEPS = 3


def _reference_training(sharding_type: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, whole global batches: AdamW for the dense parameters (and data_parallel tables),
    fbgemm's exact row-wise Adagrad written out for the fused tables:
        g = grad[row];  m[row] += mean(g^2);  w[row] -= lr * g / (sqrt(m[row]) + eps)
    applied to every row the batch looked up. column_wise keeps one accumulator per row and column
    shard (each shard's kernel owns its columns), so the mean runs over each shard's columns."""
    model = worker.build_model()
    named = dict(model.named_parameters())
    tables = embedding_tables(model)
    fused = {
        t.state_key: t
        for t in tables.values()
        if not (sharding_type == "data_parallel" and t.pooled)  # the history table stays table_wise
    }
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in fused], **ADAMW)
    widths = {
        key: column_wise_shard_dim(t.embedding_dim, 4) if sharding_type == "column_wise" else t.embedding_dim
        for key, t in fused.items()
    }
    accumulators = {key: torch.zeros(t.num_embeddings, t.embedding_dim // widths[key]) for key, t in fused.items()}
    lr, eps = OPTIMIZER["lr"], OPTIMIZER["eps"]
    losses = []
    for step in range(STEPS):
        batch = worker.batch_rows(step)
        model.zero_grad()
        logits, _ = model(batch)
        loss = model.loss(logits, batch.labels)
        loss.backward()
        adamw.step()
        losses.append(loss.item())
        with torch.no_grad():
            for key, table in fused.items():
                features = batch.sparse if table.pooled else batch.sequence
                rows = torch.cat([features[f].values() for f in table.feature_names]).unique()
                weight, width = named[key], widths[key]
                for block in range(table.embedding_dim // width):
                    cols = slice(block * width, (block + 1) * width)
                    g = named[key].grad[rows, cols]
                    accumulators[key][rows, block] += g.square().mean(dim=1)
                    weight[rows, cols] -= lr * g / (accumulators[key][rows, block].sqrt() + eps)[:, None]
    return losses, {n: p.detach() for n, p in named.items()}


def test_fused_rowwise_adagrad_steps_match_single_process(tmp_path):
    ranks = launch(
        "optimizer", tmp_path, {"sharding_types": SHARDING_TYPES, "optimizer": OPTIMIZER, "adamw": ADAMW, "steps": STEPS}
    )
    tables = embedding_tables(worker.build_model())
    for sharding_type in SHARDING_TYPES:
        losses, params = _reference_training(sharding_type)
        results = [r[sharding_type] for r in ranks]
        sharded_losses = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[1]["losses"])]
        torch.testing.assert_close(torch.tensor(sharded_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        for name, value in results[0]["dense"].items():
            torch.testing.assert_close(value, params[name], rtol=0, atol=2e-5, msg=lambda m: f"{sharding_type} {name}: {m}")
        for table in tables.values():
            shape = (table.num_embeddings, table.embedding_dim)
            sharded = worker.assemble([r["tables"] for r in results], table.state_key, shape)
            torch.testing.assert_close(
                sharded, params[table.state_key], rtol=0, atol=2e-5, msg=lambda m: f"{sharding_type} {table.name}: {m}"
            )
        # the tables moved: the comparison is not between two untouched initializations
        assert not torch.equal(params[tables["t_item"].state_key], worker.build_model().categorical_embeddings.embedding_bags["t_item"].weight)


def test_torchrec_train_pipeline_pipelines_both_collections_with_unchanged_losses(tmp_path):
    """The batch is a torchrec Pipelineable and the model traces, so TrainPipelineSparseDist pipelines
    the input distribution of both embedding collections; the math stays the plain loop's."""
    ranks = launch("pipeline", tmp_path, {"sharding_types": ["row_wise", "table_wise"], "optimizer": OPTIMIZER,
                                          "adamw": ADAMW, "steps": STEPS})
    for rank, result in enumerate(ranks):
        for sharding_type, run in result.items():
            where = f"rank {rank}, {sharding_type}"
            assert run["pipelined_modules"] == ["categorical_embeddings", "sequence_embeddings"], where
            assert len(run["pipelined"]) == len(run["plain"]) == STEPS and run["ended"], where
            torch.testing.assert_close(torch.tensor(run["pipelined"]), torch.tensor(run["plain"]), rtol=0, atol=1e-6,
                                       msg=lambda m: f"{where}: {m}")


def _row_order(per_rank: list[torch.Tensor], world_size: int = 2) -> torch.Tensor:
    """Predictions of the ranks' halves back in the global batches' row order."""
    local = worker.GLOBAL_BATCH // world_size
    steps = len(worker.EVAL_STEPS)
    return torch.cat([p[i * local : (i + 1) * local] for i in range(steps) for p in per_rank])


def test_checkpoint_saved_by_two_ranks_loads_into_one_two_and_unsharded(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = launch("save", tmp_path, {"path": path, "sharding": {"sharding_type": "row_wise"}})
    saved_predictions = _row_order([r["saved"] for r in saved])
    continued = _row_order([r["continued"] for r in saved])
    two = launch("load", tmp_path, {"path": path, "attempts": [
        {"sharding": {"sharding_type": "table_wise"}},  # another plan: DCP reshards weights and optimizer state
        {"sharding": {"sharding_type": "table_wise", "tables": {"t_history": "column_wise"}}},
        {"sharding": {"sharding_type": "table_wise", "tables": {"t_history": "column_wise"}}, "sparse_state": False},
    ]})  # fmt: skip
    one = launch("load", tmp_path, {"path": path, "attempts": [{"sharding": {"sharding_type": "table_wise"}}]}, world_size=1)

    for loaded in (_row_order([r[0]["loaded"] for r in two]), one[0][0]["loaded"]):
        torch.testing.assert_close(loaded, saved_predictions, rtol=0, atol=1e-6)
    assert two[0][0]["metadata"] == {"step": 2} and one[0][0]["metadata"] == {"step": 2}
    # DDP only where there are gradients to average: one process runs the dense part unwrapped.
    assert two[0][0]["dense_wrapped_in_ddp"] and not one[0][0]["dense_wrapped_in_ddp"]
    # Dense (AdamW) and sparse (row-wise Adagrad) optimizer state came back: the next step continues
    # exactly as the saving run did, in 2 processes and in 1.
    for resumed in (_row_order([r[0]["continued"] for r in two]), one[0][0]["continued"]):
        torch.testing.assert_close(resumed, continued, rtol=0, atol=1e-5)
    # A column_wise table keeps one row-wise Adagrad accumulator per column shard: its state cannot
    # come from a row_wise save, which every rank reports; without the sparse state the weights load.
    for rank in two:
        assert "t_history.momentum1: saved (30,), this plan needs (60,)" in rank[1]["error"], rank[1]
    torch.testing.assert_close(_row_order([r[2]["loaded"] for r in two]), saved_predictions, rtol=0, atol=1e-6)

    # A plain single-process RankingModel for evaluation, without any process group.
    model = worker.build_model(seed=2)
    load_unsharded(path, model)
    model.eval()
    with torch.no_grad():
        plain = torch.cat([model(worker.batch_rows(step))[0] for step in worker.EVAL_STEPS])
    torch.testing.assert_close(plain, saved_predictions, rtol=0, atol=1e-6)


def test_setup_errors_fail_every_rank_and_meta_tables_shard(tmp_path):
    rank0, rank1 = launch("setups", tmp_path, {})
    for messages in (rank0, rank1):
        assert messages["config_mismatch"].startswith("RuntimeError: the ranks cannot shard this model together")
        assert "rank 1 has config.optimizer.lr=0.02 where rank 0 has 0.01" in messages["config_mismatch"]
        assert "rank 1 has table_checksum.t_" in messages["seed_mismatch"], messages["seed_mismatch"]
        assert messages["out_of_memory"].startswith("ValueError: the embedding tables do not fit")
        assert "t_user_group: 40 x 8, table_wise" in messages["out_of_memory"], messages["out_of_memory"]
        assert "offer 6.8 KiB of DDR each (8.0 KiB capacity" in messages["out_of_memory"]
    # the rank with the problem raises it as a ValueError; its peer learns of it instead of hanging
    assert rank1["one_rank_invalid"].startswith("ValueError") and "cannot be column_wise" in rank1["one_rank_invalid"]
    assert rank0["one_rank_invalid"].startswith("RuntimeError") and "rank 1: invalid sharding config" in rank0["one_rank_invalid"]
    # meta-device tables: torchrec initializes the shards; the data_parallel replicas agree
    assert all(0 < r["meta_loss"] < 2 for r in (rank0, rank1))
    for table in embedding_tables(worker.build_model()).values():
        shape = (table.num_embeddings, table.embedding_dim)
        full = worker.assemble([rank0["meta_tables"], rank1["meta_tables"]], table.state_key, shape)
        assert torch.isfinite(full).all() and full.abs().max() > 0, table.name
    item = "categorical_embeddings.embedding_bags.t_item.weight"  # data_parallel: one full replica per rank
    torch.testing.assert_close(rank0["meta_tables"][item], rank1["meta_tables"][item], rtol=0, atol=0)


def test_checkpoint_from_before_the_network_was_renamed_loads(tmp_path):
    """A folder saved when RankingTask held its network as `model` (keys "model.model.*", dense
    optimizer state under those names) loads into today's task, whose network is `net`."""
    import torch.distributed.checkpoint as dcp

    from models.sharding import checkpoint as ckpt

    class Task(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))

    torch.manual_seed(0)
    saved_task = Task()
    optimizer = torch.optim.AdamW(saved_task.parameters(), lr=0.1)
    saved_task.net(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    # What a folder of the old naming holds: today's state with "net." spelled "model.".
    old_names = {name: "model." + name[len("net."):] for name in saved_task.state_dict()}
    state = ckpt._renamed(ckpt.checkpoint_state(saved_task, optimizer), old_names)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "old")), no_dist=True)
    torch.save({"global_step": 1}, tmp_path / "old" / ckpt._METADATA_FILE)

    task = Task()
    fresh_optimizer = torch.optim.AdamW(task.parameters(), lr=0.1)
    assert ckpt.load_checkpoint(tmp_path / "old", task, fresh_optimizer) == {"global_step": 1}
    for (name, got), expected in zip(task.state_dict().items(), saved_task.state_dict().values()):
        assert torch.equal(got, expected), name
    for got, expected in zip(fresh_optimizer.state.values(), optimizer.state.values()):
        assert torch.equal(got["exp_avg"], expected["exp_avg"])


def test_config_errors_name_the_problem():
    tables = embedding_tables(worker.build_model())
    with pytest.raises(ValueError, match="sharding_type='diagonal' is not one of table_wise, row_wise"):
        ShardingConfig(sharding_type="diagonal")
    with pytest.raises(ValueError, match=r"tables\['t_item'\]='rowwise' is not one of table_wise, row_wise"):
        ShardingConfig(tables={"t_item": "rowwise"})
    with pytest.raises(ValueError, match="SparseOptimizerConfig.name='lamb' is not one of rowwise_adagrad, adagrad"):
        SparseOptimizerConfig(name="lamb")
    with pytest.raises(ValueError, match="lr_schedule='cosine' is not one of dense, constant"):
        SparseOptimizerConfig(lr_schedule="cosine")
    with pytest.raises(ValueError, match="'t_nope', which is neither a table nor a feature"):
        resolve_sharding_types(ShardingConfig(tables={"t_nope": "row_wise"}), tables, "cpu")
    # embedding_dim 8 splits into 4-wide shards only when column_wise_min_dim allows it
    with pytest.raises(ValueError, match=r"'t_item' cannot be column_wise: its embedding_dim=8 .* one of \[4\]"):
        resolve_sharding_types(ShardingConfig(tables={"item": "column_wise"}), tables, "cpu")
    assert resolve_sharding_types(ShardingConfig(tables={"item": "column_wise"}, column_wise_min_dim=4), tables, "cpu")["t_item"] == "column_wise"
    with pytest.raises(ValueError, match="'t_history' .* cannot be data_parallel on CPU"):
        resolve_sharding_types(ShardingConfig(sharding_type="data_parallel"), tables, "cpu")
    with pytest.raises(ValueError, match="'adam' has no CPU kernel"):
        resolve_sharding_types(ShardingConfig(optimizer={"name": "adam"}), tables, "cpu")
    # fbgemm's weight decay: rowwise_adagrad (l2/decoupled) and adam (decoupled) only, and not on CPU
    # for pooled tables, whose CPU kernel drops it
    with pytest.raises(ValueError, match="fused adagrad has no weight decay"):
        SparseOptimizerConfig(name="adagrad", weight_decay=0.01)
    with pytest.raises(ValueError, match="adam decays weights decoupled"):
        SparseOptimizerConfig(name="adam", weight_decay=0.01, weight_decay_mode="l2")
    with pytest.raises(ValueError, match="weight_decay=0.01 would be ignored on CPU for the pooled tables t_user_group"):
        resolve_sharding_types(ShardingConfig(optimizer={"weight_decay": 0.01}), tables, "cpu")
    assert resolve_sharding_types(ShardingConfig(optimizer={"weight_decay": 0.01}), tables, "cuda")
    with pytest.raises(ValueError, match="fused_uvm_caching.* needs CUDA"):
        resolve_sharding_types(ShardingConfig(compute_kernel="fused_uvm_caching"), tables, "cpu")
    # what the GPU allows
    assert set(resolve_sharding_types(ShardingConfig(sharding_type="data_parallel", optimizer={"name": "adam"}), tables, "cuda").values()) == {"data_parallel"}


def test_plan_that_does_not_fit_names_tables_and_capacity():
    model = worker.build_model()
    with pytest.raises(ValueError) as error:
        plan_sharding(model, ShardingConfig(ddr_cap_gb=4 / 1024**2), world_size=2, device="cpu")
    message = str(error.value)
    assert message.startswith("the embedding tables do not fit: they need about")
    assert "2 rank(s) offer 3.4 KiB of DDR each (4.0 KiB capacity minus the 15% storage_reservation)" in message
    assert "t_history: 30 x 8, table_wise" in message and "Raise sharding.ddr_cap_gb" in message
    plan = plan_sharding(model, ShardingConfig(sharding_type="row_wise"), world_size=2, device="cpu")
    assert plan.get_plan_for_module("categorical_embeddings")["t_item"].sharding_type == "row_wise"


def test_lightning_strategy_trains_saves_and_resumes(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    ranks = launch("lightning", tmp_path, {"dir": str(checkpoints), "sharding": {"sharding_type": "row_wise", "tables": {"t_item": "data_parallel"}}})
    path = checkpoints / "last.ckpt"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]  # rewritten in place, no leftovers
    assert (path / ".metadata").is_file() and (path / "metadata.pt").is_file()
    for result in ranks:
        # configure_optimizers returned every parameter; the fused tables were taken out
        assert result["dense_in_optimizer"] == result["dense_parameters"]
        assert result["global_steps"] == (3, 4)
        # the warmup schedule stepped 3 times before the save and once after: (4 + 1) / 4 * 0.01
        # (restarted instead of restored, it would be at (1 + 1) / 4 * 0.01)
        assert result["lr"] == pytest.approx(0.0125)
        # The tables' fused optimizer follows the dense schedule (lr_schedule "dense"): in step 3 the
        # warmup stood at (2 + 1) / 4 of the base, and the kernels updated at 0.75 * 0.01.
        assert result["sparse_kernel_lrs"] == pytest.approx([0.0075])
        assert 0 < result["validated"][0]["val_loss"] < 2  # a later Trainer reused the sharded module
        assert "different numbers of validation batches (per rank: [[2], [3]])" in result["uneven_validation"]
    # Resuming (model, dense AdamW, sparse Adagrad, scheduler, loop) lands where straight training did.
    torch.testing.assert_close(
        _row_order([r["resumed"] for r in ranks]), _row_order([r["straight"] for r in ranks]), rtol=0, atol=1e-5
    )
    # The Lightning checkpoint (a DCP folder) also loads into a plain model: its keys sit under "model."
    assert torch.load(path / "metadata.pt", weights_only=False)["global_step"] == 3
    model = worker.build_model(seed=2)
    load_unsharded(path, model)
    model.eval()
    with torch.no_grad():
        plain = torch.cat([model(worker.batch_rows(step))[0] for step in worker.EVAL_STEPS])
    torch.testing.assert_close(plain, _row_order([r["saved"] for r in ranks]), rtol=0, atol=1e-6)


def _train(tmp_path: Path, processes: int, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
               "train.py", "--config", "configs/tiny.yaml", "--trainer.strategy=torchrec",
               "--trainer.accelerator=cpu", f"--trainer.devices={processes}", "--attn=reference",
               "--sharding.sharding_type=row_wise", "--sharding.tables={t_user_group: table_wise}",
               f"--runs_dir={tmp_path / 'runs'}", f"--data.data_dir={tmp_path / 'cache'}", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_train_py_on_two_cpu_processes_then_resumed_on_one(tmp_path):
    """The user's path: torchrun train.py with the torchrec strategy (gloo), a DCP checkpoint folder
    from 2 processes, resumed by 1 process (resharded on load) in the same run folder."""
    result = _train(tmp_path, 2)
    assert result.returncode == 0, result.stderr[-3000:]
    run_folder = tmp_path / "runs" / "tiny" / "version_0"
    last = run_folder / "checkpoints" / "last.ckpt"
    assert last.is_dir() and len(list(last.glob("*.distcp"))) == 2  # one file per rank
    with open(run_folder / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows if r["train/loss"]] == list(range(40))
    assert [int(r["step"]) for r in rows if r["val/auc"]] == [19, 39]

    resumed = _train(tmp_path, 1, f"--ckpt_path={last}", "--trainer.max_steps=45")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    with open(run_folder / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows if r["train/loss"]] == list(range(45))
    assert all(float(r["train/loss"]) > 0 for r in rows if r["train/loss"])


def _losses_and_validations(run_folder: Path) -> tuple[dict[int, float], dict[int, float]]:
    with open(run_folder / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    losses = {int(r["step"]): float(r["train/loss"]) for r in rows if r["train/loss"]}
    assert len(losses) == sum(1 for r in rows if r["train/loss"]), "a step logged twice"
    return losses, {int(r["step"]): float(r["val/auc"]) for r in rows if r["val/auc"]}


def test_train_py_pipelined_matches_plain_across_epoch_end_validation_and_resume(tmp_path):
    """sharding.pipeline (torchrec's TrainPipelineSparseDist driven by Lightning) on 2 gloo processes:
    the plain step's loss at every step, across an epoch's end (16 batches per rank: the pipeline's
    last two batches of the epoch train in its last step) and validations; and a run stopped after its
    step-19 checkpoint (two batches in flight), resumed from it, repeats the uninterrupted run."""
    flat = "--model.optim.min_lr_ratio=1.0"  # a learning rate that does not depend on max_steps
    plain = _train(tmp_path / "plain", 2, flat)
    piped = _train(tmp_path / "piped", 2, flat, "--sharding.pipeline=true")
    for result in (plain, piped):
        assert result.returncode == 0, result.stderr[-3000:]
    assert "TrainPipelineSparseDist pipelines 2 sharded module(s)" in piped.stderr
    plain_losses, plain_validations = _losses_and_validations(tmp_path / "plain" / "runs" / "tiny" / "version_0")
    piped_losses, piped_validations = _losses_and_validations(tmp_path / "piped" / "runs" / "tiny" / "version_0")
    assert sorted(piped_losses) == list(range(40))
    for step, loss in plain_losses.items():
        assert piped_losses[step] == pytest.approx(loss, abs=1e-6), step
    # Lightning also validates at each epoch's end (steps 15 and 31) when the step takes its iterator.
    assert sorted(plain_validations) == [19, 39] and sorted(piped_validations) == [15, 19, 31, 39]
    for step, auc in plain_validations.items():
        assert piped_validations[step] == pytest.approx(auc, abs=1e-6)

    stopped_folder = tmp_path / "stopped" / "runs" / "tiny" / "version_0"
    stopped = _train(tmp_path / "stopped", 2, flat, "--sharding.pipeline=true", "--trainer.max_steps=25")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resumed = _train(tmp_path / "stopped", 2, flat, "--sharding.pipeline=true",
                     f"--ckpt_path={stopped_folder / 'checkpoints' / 'last.ckpt'}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed_losses, _ = _losses_and_validations(stopped_folder)
    assert sorted(resumed_losses) == list(range(40))
    for step, loss in piped_losses.items():
        assert resumed_losses[step] == pytest.approx(loss, abs=1e-6), step

    # Lightning counts automatic and manual optimizer steps apart: a plain run's checkpoint resumed
    # with the pipeline continues its global step.
    plain_folder = tmp_path / "plain" / "runs" / "tiny" / "version_0"
    switched = _train(tmp_path / "plain", 2, flat, "--sharding.pipeline=true", "--trainer.max_steps=45",
                      f"--ckpt_path={plain_folder / 'checkpoints' / 'last.ckpt'}")
    assert switched.returncode == 0, switched.stderr[-3000:]
    assert sorted(_losses_and_validations(plain_folder)[0]) == list(range(45))


def test_the_pipeline_refuses_gradient_accumulation():
    """train.py refuses accumulation for every path (test_cli_errors); a Trainer built by hand around the
    torchrec strategy meets the pipeline's own check."""
    from types import SimpleNamespace

    from training.pipeline import check_pipeline_supported

    trainer = SimpleNamespace(accumulate_grad_batches=2, lr_scheduler_configs=[])
    strategy = SimpleNamespace(precision_plugin=SimpleNamespace(), optimizers=[object()])
    with pytest.raises(ValueError, match="cannot train this setup: accumulate_grad_batches=2: the pipeline steps"):
        check_pipeline_supported(trainer, strategy)
