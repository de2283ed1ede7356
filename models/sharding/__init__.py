"""Shard the embedding tables of a model across processes with torchrec's DistributedModelParallel.

    from models.sharding import ShardingConfig, shard_model, dense_parameters, save_checkpoint
    dist.init_process_group("gloo")              # or "nccl" with one GPU per process
    model = RankingModel(schema, model_config)   # identical (same seed) on every rank
    sharded, plan = shard_model(model, ShardingConfig(sharding_type="row_wise"), device=device)
    optimizer = torch.optim.AdamW(dense_parameters(sharded), lr=1e-3)
    logits, _ = sharded(local_batch)             # each rank feeds its own part of the global batch
    loss = sharded.module.loss(logits, local_batch.labels); loss.backward(); optimizer.step()
    save_checkpoint(path, sharded, optimizer)    # DCP: one folder, a file per rank
    load_checkpoint(path, sharded, optimizer)    # any world size and plan: DCP reshards
    load_unsharded(path, RankingModel(schema, model_config))   # one process, e.g. for evaluation

The modules, each importing only those above it:
    config.py      ShardingConfig, SparseOptimizerConfig: what a config may say
    plan.py        the model's tables, their sharding types, torchrec's planner
    shard.py       shard_model (rank agreement, DMP), and the dense / sparse parameters of its result
    checkpoint.py  DCP checkpoints: save_checkpoint, load_checkpoint, load_unsharded
Nothing here imports Lightning: training/strategy.py (TorchrecStrategy, strategy="torchrec") and
training/pipeline.py train a sharded model under a Lightning Trainer, launched with torchrun (one
process per GPU, or per CPU "device").

Versions: every torchrec name used here exists in torchrec 1.6.1 (the GPU image: torch 2.11,
fbgemm-gpu 1.6) and 1.8.0 (CPU CI: torch 2.13); tests/test_sharding.py passes with both torchrec
packages on the CPU stack. fbgemm-gpu's CPU kernels are narrower than its CUDA ones, and shard_model
rejects up front what they would get wrong: Adam (no CPU kernel), sparse weight decay on pooled
tables (the CPU row-wise Adagrad passes weight_decay=0 to fbgemm's SparseAdaGrad), data_parallel
EmbeddingCollection tables (the CPU dense kernel ignores PoolingMode.NONE, the failure of torchrec
issue #1255) and UVM kernels. torchrec plans row_wise for EmbeddingBagCollection only on CUDA; our
sharder allows it on CPU too, where the tests check it against one process.
"""

from .checkpoint import RENAMED_PREFIXES, checkpoint_metadata, checkpoint_state, load_checkpoint, load_unsharded, save_checkpoint
from .config import ShardingConfig, SparseOptimizerConfig
from .plan import TableInfo, column_wise_shard_dim, embedding_tables, plan_sharding, resolve_sharding_types
from .shard import (
    check_ranks_agree,
    dense_named_parameters,
    dense_parameters,
    embedding_parameter_ids,
    load_full_tables,
    shard_model,
    sparse_optimizer,
)

__all__ = [
    "RENAMED_PREFIXES",
    "ShardingConfig",
    "SparseOptimizerConfig",
    "TableInfo",
    "check_ranks_agree",
    "checkpoint_metadata",
    "checkpoint_state",
    "column_wise_shard_dim",
    "dense_named_parameters",
    "dense_parameters",
    "embedding_parameter_ids",
    "embedding_tables",
    "load_checkpoint",
    "load_full_tables",
    "load_unsharded",
    "plan_sharding",
    "resolve_sharding_types",
    "save_checkpoint",
    "shard_model",
    "sparse_optimizer",
]
