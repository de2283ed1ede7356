"""One rank of a tests/test_sharding.py scenario, and the builders the tests share with it.

Run as torchrun would start it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set):

    python tests/sharding_worker.py <scenario> <out_dir> '<json args>'

Each rank writes what the test compares to <out_dir>/rank<r>.pt. The batches come from the repo's
own data path (data.synthetic.generate -> ArrowBatchCollator -> Batch of KeyedJaggedTensors); rank r
of W takes rows [r*B/W, (r+1)*B/W) of each global batch of B rows.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from functools import cache
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from data.batch import ArrowBatchCollator, Batch  # noqa: E402
from data.synthetic import SyntheticConfig, generate, synthetic_schema  # noqa: E402
from models import RankingModel, RankingModelConfig  # noqa: E402

# Small tables (rows 30-40, dim 8: column_wise_min_dim=4 gives two column shards), short histories.
SYNTHETIC = SyntheticConfig(
    num_train=512, num_val=64, num_dense=4, num_categorical=4, vocab_size=40, num_items=30, max_history_len=12
)
MODEL = RankingModelConfig(
    d_model=16, num_heads=2, num_layers=1, mlp_ratio=2, embedding_dim=8, n_dense_tokens=1, attn_backend="reference"
)
SCHEMA = synthetic_schema(SYNTHETIC)
GLOBAL_BATCH = 32
SGD_PROBE_LR = 1000.0  # fused SGD step -lr*grad: weight change / -lr recovers the embedding gradient


def build_model(seed: int = 0) -> RankingModel:
    torch.manual_seed(seed)
    return RankingModel(SCHEMA, MODEL)


@cache
def _train_rows():
    return generate(SYNTHETIC).train


def batch_rows(step: int, rank: int = 0, world_size: int = 1, batch_size: int = GLOBAL_BATCH) -> Batch:
    """Rank's part of global batch number step (world_size=1: the whole global batch)."""
    local = batch_size // world_size
    start = step * batch_size + rank * local
    return ArrowBatchCollator(SCHEMA)(_train_rows().slice(start, local))


def table_keys() -> list[str]:
    from models.sharding import embedding_tables

    return [table.state_key for table in embedding_tables(build_model()).values()]


def local_tables(model: torch.nn.Module) -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
    """This rank's pieces of every table: [(offsets, values)], one full piece for replicated tables."""
    from models.sharding.shard import _local_shards

    state = model.state_dict()
    pieces = {}
    for key in table_keys():
        shards = _local_shards(state[key])
        if shards is None:
            pieces[key] = [((0, 0), state[key].detach().clone())]
        else:
            pieces[key] = [(offsets, tensor.detach().clone()) for tensor, offsets in shards]
    return pieces


def assemble(per_rank: list[dict], key: str, shape: tuple[int, int]) -> torch.Tensor:
    full = torch.full(shape, float("nan"))
    for pieces in per_rank:
        for offsets, tensor in pieces[key]:
            full[offsets[0] : offsets[0] + tensor.shape[0], offsets[1] : offsets[1] + tensor.shape[1]] = tensor.cpu()
    return full


def _sharding_config(**kwargs):
    from models.sharding import ShardingConfig

    return ShardingConfig(column_wise_min_dim=4, **kwargs)


def _with_history_override(sharding_type: str) -> dict[str, str]:
    # The history table lives in an EmbeddingCollection, which cannot be data_parallel on CPU.
    return {"t_history": "table_wise"} if sharding_type == "data_parallel" else {}


def scenario_gradients(rank: int, world_size: int, args: dict) -> dict:
    """One forward/backward per run ({"sharding_type", "average"}): loss, dense gradients, and the
    fused tables after one SGD step of lr SGD_PROBE_LR (from which the test recovers their gradients)."""
    from models.sharding import dense_named_parameters, shard_model

    results = {}
    for run in args["runs"]:
        sharding_type = run["sharding_type"]
        model = build_model()
        config = _sharding_config(
            sharding_type=sharding_type,
            tables=_with_history_override(sharding_type),
            optimizer={"name": "sgd", "lr": SGD_PROBE_LR},
            average_sparse_gradients=run["average"],
        )
        sharded, _ = shard_model(model, config, device=torch.device("cpu"))
        before = local_tables(sharded)
        batch = batch_rows(0, rank, world_size)
        logits, _ = sharded(batch)
        loss = sharded.module.loss(logits, batch.labels)
        loss.backward()
        results[(sharding_type, run["average"])] = {
            "loss": loss.item(),
            "dense_grads": {n: p.grad.clone() for n, p in dense_named_parameters(sharded) if p.grad is not None},
            "tables_before": before,
            "tables_after": local_tables(sharded),
        }
    return results


def scenario_optimizer(rank: int, world_size: int, args: dict) -> dict:
    """A few steps of fused row-wise Adagrad (tables) + AdamW (dense) per sharding type."""
    from models.sharding import dense_parameters, shard_model

    results = {}
    for sharding_type in args["sharding_types"]:
        model = build_model()
        config = _sharding_config(
            sharding_type=sharding_type, tables=_with_history_override(sharding_type), optimizer=args["optimizer"]
        )
        sharded, _ = shard_model(model, config, device=torch.device("cpu"))
        optimizer = torch.optim.AdamW(dense_parameters(sharded), **args["adamw"])
        losses = [_train_step(sharded, optimizer, step, rank, world_size) for step in range(args["steps"])]
        results[sharding_type] = {
            "losses": losses,
            "tables": local_tables(sharded),
            "dense": {n: p.detach().clone() for n, p in sharded.module.named_parameters() if n not in table_keys()},
        }
    return results


def scenario_pipeline(rank: int, world_size: int, args: dict) -> dict:
    """Per sharding type: the losses of a plain loop and of torchrec's TrainPipelineSparseDist (which
    distributes the next batch's features ahead of the step) over the same batches from the same
    start, which collections the pipeline pipelined, and whether it then ended cleanly."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from models.sharding import dense_parameters, shard_model

    batches = [batch_rows(step, rank, world_size) for step in range(args["steps"])]
    results = {}
    for sharding_type in args["sharding_types"]:
        def build():
            config = _sharding_config(sharding_type=sharding_type, optimizer=args["optimizer"])
            sharded, _ = shard_model(build_model(), config, device=torch.device("cpu"))
            return sharded, torch.optim.AdamW(dense_parameters(sharded), **args["adamw"])

        plain, optimizer = build()
        plain_losses = [_train_step(plain, optimizer, step, rank, world_size) for step in range(args["steps"])]

        piped, optimizer = build()
        piped_losses = []

        def forward(batch):  # (what the pipeline backpropagates, what progress() returns)
            logits, _ = piped(batch)
            loss = piped.module.loss(logits, batch.labels)
            piped_losses.append(loss.item())
            return loss, logits

        pipeline = TrainPipelineSparseDist(piped, optimizer, torch.device("cpu"), custom_model_fwd=forward)
        source = iter(batches)
        for _ in batches:
            pipeline.progress(source)
        try:  # every batch it took is trained: the next call finds none
            pipeline.progress(source)
            ended = False
        except StopIteration:
            ended = True
        results[sharding_type] = {
            "plain": plain_losses, "pipelined": piped_losses, "ended": ended,
            "pipelined_modules": sorted(name for name, module in piped.module.named_modules()
                                        if any(module is m for m in pipeline._pipelined_modules)),
        }
    return results


def _predict(model, steps: list[int], rank: int, world_size: int) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = torch.cat([model(batch_rows(step, rank, world_size))[0] for step in steps])
    model.train()
    return out


def _train_step(model, optimizer, step: int, rank: int, world_size: int) -> float:
    """One step of the sharded model on this rank's part of global batch `step`; its loss."""
    batch = batch_rows(step, rank, world_size)
    optimizer.zero_grad()
    logits, _ = model(batch)
    loss = model.module.loss(logits, batch.labels)
    loss.backward()
    optimizer.step()
    return loss.item()


EVAL_STEPS = [10, 11]  # held-out global batches for predictions


def scenario_save(rank: int, world_size: int, args: dict) -> dict:
    """Train two steps, save, record predictions; then one more step and its predictions (what a
    resumed run must reproduce)."""
    from models.sharding import dense_parameters, save_checkpoint, shard_model

    sharded, _ = shard_model(build_model(), _sharding_config(**args["sharding"]), device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(dense_parameters(sharded), lr=0.01)
    for step in range(2):
        _train_step(sharded, optimizer, step, rank, world_size)
    save_checkpoint(args["path"], sharded, optimizer, metadata={"step": 2})
    saved = _predict(sharded, EVAL_STEPS, rank, world_size)
    _train_step(sharded, optimizer, 2, rank, world_size)
    return {"saved": saved, "continued": _predict(sharded, EVAL_STEPS, rank, world_size)}


def scenario_load(rank: int, world_size: int, args: dict) -> list[dict]:
    """Load the checkpoint into freshly initialized (another seed) sharded models, possibly of another
    world size and plan: predictions, then the same next step as scenario_save. One result per attempt
    ({"sharding": ..., "sparse_state": bool}); an attempt that raises records the message."""
    from models.sharding import dense_parameters, load_checkpoint, shard_model

    results = []
    for attempt in args["attempts"]:
        sharded, _ = shard_model(build_model(seed=1), _sharding_config(**attempt["sharding"]), device=torch.device("cpu"))
        optimizer = torch.optim.AdamW(dense_parameters(sharded), lr=0.01)
        try:
            metadata = load_checkpoint(
                args["path"], sharded, optimizer, load_sparse_optimizer=attempt.get("sparse_state", True)
            )
        except ValueError as error:
            results.append({"error": str(error)})
            continue
        loaded = _predict(sharded, EVAL_STEPS, rank, world_size)
        _train_step(sharded, optimizer, 2, rank, world_size)
        results.append({
            "metadata": metadata, "loaded": loaded, "continued": _predict(sharded, EVAL_STEPS, rank, world_size),
            "dense_wrapped_in_ddp": isinstance(sharded._dmp_wrapped_module, torch.nn.parallel.DistributedDataParallel),
        })  # fmt: skip
    return results


def scenario_setups(rank: int, world_size: int, args: dict) -> dict:
    """Setups that must fail on every rank with a clear message (not hang), and tables built on the
    meta device (how tables too large for one host's memory are built), which must shard and run."""
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

    from models.sharding import ShardingConfig, shard_model

    cases = {
        # rank 1 runs with a different sparse learning rate
        "config_mismatch": (build_model(), ShardingConfig(optimizer={"lr": 0.01 if rank == 0 else 0.02})),
        # only rank 1 asks for a column split its tables cannot take
        "one_rank_invalid": (build_model(), ShardingConfig(sharding_type="column_wise" if rank == 1 else "table_wise")),
        # a plan that does not fit: 2 ranks of 8 KiB host memory
        "out_of_memory": (build_model(), ShardingConfig(ddr_cap_gb=8 / 1024**2)),
        # rank 1 built its tables from another seed: filling the shards from both would mix two models
        "seed_mismatch": (build_model(seed=rank), ShardingConfig()),
    }
    messages = {}
    for name, (model, config) in cases.items():
        try:
            shard_model(model, config, device=torch.device("cpu"))
            messages[name] = None
        except (ValueError, RuntimeError) as error:
            messages[name] = f"{type(error).__name__}: {error}"

    model = build_model()
    meta = torch.device("meta")
    model.categorical_embeddings = EmbeddingBagCollection(tables=model.categorical_embeddings.embedding_bag_configs(), device=meta)
    model.sequence_embeddings = EmbeddingCollection(tables=model.sequence_embeddings.embedding_configs(), device=meta)
    sharded, _ = shard_model(model, ShardingConfig(sharding_type="row_wise", tables={"t_item": "data_parallel"}))
    batch = batch_rows(0, rank, world_size)
    logits, _ = sharded(batch)
    sharded.module.loss(logits, batch.labels).backward()
    messages["meta_loss"] = sharded.module.loss(logits, batch.labels).item()
    messages["meta_tables"] = local_tables(sharded)
    return messages


def scenario_lightning(rank: int, world_size: int, args: dict) -> dict:
    """TorchrecStrategy under a Lightning Trainer (started by torchrun's environment, as train.py
    would be): A trains 4 steps straight; B trains 3, its ModelCheckpoint rewriting last.ckpt after
    every step; C resumes that checkpoint into a model initialized from another seed and trains to
    step 4. C must end where A ended."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from models.sharding import dense_parameters
    from training.strategy import TorchrecStrategy

    class Task(L.LightningModule):
        def __init__(self, seed: int):
            super().__init__()
            self.net = build_model(seed)

        def training_step(self, batch, batch_idx):
            logits, _ = self.net(batch)
            loss = self.net.loss(logits, batch.labels)
            self.log("loss", loss, batch_size=batch.batch_size)
            return loss

        def validation_step(self, batch, batch_idx):
            logits, _ = self.net(batch)
            self.log("val_loss", self.net.loss(logits, batch.labels), batch_size=batch.batch_size, sync_dist=True)

        def configure_optimizers(self):
            # Deliberately every parameter: the strategy must leave the fused tables out.
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)
            warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / 4)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    # An epoch of 3 batches: B's checkpoint falls on an epoch boundary, so C's step 4 sees A's 4th batch.
    loader = DataLoader([batch_rows(step, rank, world_size) for step in range(3)], batch_size=None)

    def trainer(max_steps: int, callbacks: list | None = None, limit_val_batches: float = 0) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu", devices=world_size, strategy=TorchrecStrategy(_sharding_config(**args["sharding"])),
            max_steps=max_steps, logger=False, callbacks=callbacks, enable_checkpointing=bool(callbacks),
            enable_progress_bar=False,
            enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
            limit_val_batches=limit_val_batches,
        )  # fmt: skip

    def predictions(task: Task) -> torch.Tensor:
        task.net.eval()  # the sharded RankingModel: its tables still sharded after fit
        with torch.no_grad():
            out = torch.cat([task.net(batch_rows(step, rank, world_size))[0] for step in EVAL_STEPS])
        task.net.train()
        return out

    straight = Task(seed=0)
    trainer(4).fit(straight, loader)
    saved = Task(seed=0)
    saving = trainer(3, [ModelCheckpoint(dirpath=args["dir"], filename="last", every_n_train_steps=1)])
    saving.fit(saved, loader)
    dense_count = sum(len(g["params"]) for g in saving.optimizers[0].param_groups)
    # The rate the fused kernels used in the last step (its backward), read from the kernels themselves.
    def kernel_lrs(optimizer) -> set[float]:
        if hasattr(optimizer, "_emb_module"):  # torchrec's EmbeddingFusedOptimizer
            return {optimizer._emb_module.get_learning_rate()}
        return set().union(*(kernel_lrs(inner) for _, inner in optimizer._optims))

    sparse_kernel_lrs = sorted(kernel_lrs(saving.strategy.sparse))
    resumed = Task(seed=1)
    resuming = trainer(4)
    resuming.fit(resumed, loader, ckpt_path=f"{args['dir']}/last.ckpt")
    # Validation with batches of different sizes per rank works; with a different number of
    # batches per rank it would hang in the lookups, so the strategy refuses it up front.
    sizes = [batch_rows(5 + step, rank, world_size, 30 + 2 * rank) for step in range(2)]
    validated = trainer(1, limit_val_batches=1.0).validate(straight, DataLoader(sizes, batch_size=None))
    try:
        extra = [batch_rows(step, rank, world_size) for step in range(2 + rank)]
        trainer(1, limit_val_batches=1.0).validate(Task(seed=0), DataLoader(extra, batch_size=None))
        uneven = None
    except RuntimeError as error:
        uneven = str(error)
    return {
        "validated": validated,
        "uneven_validation": uneven,
        "dense_in_optimizer": dense_count,
        "dense_parameters": len(dense_parameters(saved)),
        "global_steps": (saving.global_step, resuming.global_step),
        "lr": resuming.optimizers[0].param_groups[0]["lr"],
        "sparse_kernel_lrs": sparse_kernel_lrs,
        "straight": predictions(straight),
        "saved": predictions(saved),
        "resumed": predictions(resumed),
    }


def scenario_cuda(rank: int, world_size: int, args: dict) -> dict:
    """CUDA smoke test for the GPU machine (one rank, nccl; not part of the CPU suite): per sharding
    type, loss, dense and embedding gradients against an unsharded model on the GPU; a fused Adam step
    (CUDA only); a DCP checkpoint loaded into a plain CPU model."""
    from models.sharding import ShardingConfig, dense_named_parameters, load_unsharded, save_checkpoint, shard_model

    device = torch.device(args.get("device", "cuda:0"))  # "cpu" runs the same checks on the CPU stack
    reference = build_model().to(device)
    batch = batch_rows(0).to(device)
    logits, _ = reference(batch)
    loss = reference.loss(logits, batch.labels)
    loss.backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    report: dict = {}
    for sharding_type in ("table_wise", "row_wise", "column_wise", "data_parallel"):
        config = ShardingConfig(
            sharding_type=sharding_type,
            tables=_with_history_override(sharding_type) if device.type == "cpu" else {},
            column_wise_min_dim=4,
            optimizer={"name": "sgd", "lr": SGD_PROBE_LR},
        )
        sharded, _ = shard_model(build_model(), config, device=device)
        before, out_pieces = local_tables(sharded), None
        out, _ = sharded(batch)
        sharded_loss = sharded.module.loss(out, batch.labels)
        sharded_loss.backward()
        out_pieces = local_tables(sharded)
        shapes = {k: tuple(grads[k].shape) for k in before}
        before = {k: assemble([before], k, shapes[k]).to(device) for k in shapes}  # one rank holds every piece
        after = {k: assemble([out_pieces], k, shapes[k]).to(device) for k in shapes}
        dense = max((p.grad - grads[n]).abs().max().item() for n, p in dense_named_parameters(sharded))
        # data_parallel tables are not fused (on CUDA none are): the dense optimizer owns them, so the
        # `dense` check above already compared their gradients; no SGD probe moved them.
        fused = [k for k in before if not (sharding_type == "data_parallel" and (device.type == "cuda" or "embedding_bags" in k))]
        embedding = max((((after[k] - before[k]) / -SGD_PROBE_LR - grads[k]).abs().max().item() for k in fused),
                        default=None)
        report[sharding_type] = {"loss": abs(sharded_loss.item() - loss.item()), "dense": dense, "embedding": embedding}
    second = "adam" if device.type == "cuda" else "rowwise_adagrad"  # fbgemm has no CPU Adam
    sharded, _ = shard_model(build_model(), ShardingConfig(optimizer={"name": second, "lr": 0.01}), device=device)
    before = local_tables(sharded)
    out, _ = sharded(batch)
    sharded.module.loss(out, batch.labels).backward()
    after = local_tables(sharded)
    moved = [(assemble([before], k, tuple(grads[k].shape)) != assemble([after], k, tuple(grads[k].shape))).any(dim=1).sum().item() for k in after]
    report[f"{second}_rows_moved"] = moved
    save_checkpoint(args["path"], sharded)
    with torch.no_grad():
        sharded.eval()
        expected = sharded(batch)[0].cpu()
        plain = build_model(seed=3)
        load_unsharded(args["path"], plain)
        plain.eval()
        report["checkpoint"] = (plain(batch_rows(0))[0] - expected).abs().max().item()
    print("CUDA smoke:", json.dumps(report), flush=True)
    # fp32 throughout: sharded and plain differ only in summation order.
    errors = [(f"{t} {what}", v) for t in report if isinstance(report[t], dict)
              for what, v in report[t].items() if v is not None and v > 1e-4]
    errors += [(f"{second} left a table unchanged", 0)] if not all(report[f"{second}_rows_moved"]) else []
    errors += [("checkpoint", report["checkpoint"])] if report["checkpoint"] > 1e-5 else []
    if errors:
        raise AssertionError(f"CUDA smoke beyond tolerance: {errors}")
    return report


SCENARIOS = {
    "gradients": scenario_gradients,
    "optimizer": scenario_optimizer,
    "save": scenario_save,
    "load": scenario_load,
    "setups": scenario_setups,
    "cuda": scenario_cuda,
    "pipeline": scenario_pipeline,
}
NEEDS_PROCESS_GROUP = set(SCENARIOS)
SCENARIOS["lightning"] = scenario_lightning  # Lightning sets up the process group itself


def main() -> None:
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    args = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    if scenario not in NEEDS_PROCESS_GROUP:
        result = SCENARIOS[scenario](rank, world_size, args)
    else:
        import torch.distributed as dist

        dist.init_process_group(args.get("backend", "gloo"))
        try:
            result = SCENARIOS[scenario](rank, world_size, args)
        finally:
            dist.destroy_process_group()
    torch.save(result, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    try:
        main()
        # The result is saved: leave without interpreter teardown, where a thread left joinable (torchrec's
        # pipeline or gloo) once aborted a rank with "terminate called without an active exception" (CI, 2026-12-06).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # do not wait for peers stuck in a collective
