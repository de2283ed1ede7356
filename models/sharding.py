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

With Lightning: Trainer(strategy=TorchrecStrategy(ShardingConfig(...))), or strategy="torchrec" once
this module is imported; launch with torchrun (one process per GPU, or per CPU "device").

What happens in shard_model, in order:
1. Every EmbeddingBagCollection / EmbeddingCollection table gets a sharding type (the config's
   default or a per-table override) and, unless it is data_parallel, a fused sparse optimizer attached
   with torchrec.optim.apply_optimizer_in_backward: the fbgemm TBE kernel updates the rows it looked
   up inside the backward pass, so those tables never get a .grad and no dense optimizer may own them.
   data_parallel tables are replicated, their gradients all-reduced; the dense optimizer trains them.
2. The ranks compare a fingerprint (versions, backend, device, config, tables, dense shapes, table
   checksums) and fail together, with one message naming the differences, instead of hanging later.
3. Rank 0 runs EmbeddingShardingPlanner (a Topology of world_size devices with the configured HBM/DDR
   capacity; ParameterConstraints restrict each table to its one sharding type and compute kernel)
   and broadcasts the plan, or the error, so that a plan that does not fit fails on every rank.
4. DistributedModelParallel shards the tables and wraps the rest of the model in DDP (on more than
   one process; one process has nothing to average and runs it unwrapped). A sharded
   EmbeddingBagCollection returns its features grouped by shard, not in table order: models read
   its KeyedTensor by feature name (RankingModel.embed does).
5. The unsharded table values are copied into the shards (copy_weights), so a sharded run starts
   from exactly the single-process initialization. torchrec keeps the unsharded EmbeddingBagCollection
   parameters referenced (its sharding infos), so tables too large for host memory must be built on
   the meta device (torchrec then initializes the shards; copy_weights skips them).

Gradient scale: DDP averages the dense (and data_parallel table) gradients over the ranks, and
torchrec's all-to-all backward divides the gradients it returns to sharded rows by the world size
(torchrec.distributed.comm_ops.set_gradient_division, on by default), so every parameter gets the
gradient of the mean loss over the global batch, as one process on the whole global batch would
(tests/test_sharding.py checks this per sharding type). average_sparse_gradients=False sums instead.

Versions: every torchrec name used here exists in torchrec 1.6.1 (the GPU image: torch 2.11,
fbgemm-gpu 1.6) and 1.8.0 (CPU CI: torch 2.13); tests/test_sharding.py passes with both torchrec
packages on the CPU stack. fbgemm-gpu's CPU kernels are narrower than its CUDA ones, and shard_model
rejects up front what they would get wrong: Adam (no CPU kernel), sparse weight decay on pooled
tables (the CPU row-wise Adagrad passes weight_decay=0 to fbgemm's SparseAdaGrad), data_parallel
EmbeddingCollection tables (the CPU dense kernel ignores PoolingMode.NONE, the failure of torchrec
issue #1255) and UVM kernels. torchrec plans row_wise for EmbeddingBagCollection only on CUDA; our
sharder allows it on CPU too, where the tests check it against one process.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import shutil
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torchrec
import torchrec.optim as trec_optim
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torchmetrics import Metric
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed import comm_ops
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.model_parallel import DataParallelWrapper, DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.constants import DDR_CAP, HBM_CAP
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import PlannerError, PlannerErrorType
from torchrec.distributed.types import ShardedModule, ShardingEnv, ShardingPlan, ShardingType
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.optim.keyed import CombinedOptimizer

log = logging.getLogger(__name__)

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "data_parallel")
SPARSE_OPTIMIZERS = ("rowwise_adagrad", "adagrad", "adam", "sgd")
COMPUTE_KERNELS = ("fused", "fused_uvm", "fused_uvm_caching", "auto")
WEIGHT_DECAY_MODES = ("l2", "decoupled")
# fbgemm's CPU TBE implements these optimizers only ("Optimizer adam is not supported in CPU mode").
_CPU_OPTIMIZERS = ("rowwise_adagrad", "adagrad", "sgd")
# torchrec's placeholders accept the TBE's keyword arguments (beta1, weight_decay_mode, ...); the
# sharder maps each class to fbgemm's EmbOptimType and builds the fused kernel with those kwargs.
_OPTIMIZER_CLASSES = {
    "rowwise_adagrad": trec_optim.RowWiseAdagrad,
    "adagrad": trec_optim.Adagrad,
    "adam": trec_optim.Adam,
    "sgd": trec_optim.SGD,
}
_METADATA_FILE = "metadata.pt"  # non-tensor extras (Lightning's loop state, ...), written by rank 0
_BYTES_PER_GB = 1024**3


@dataclass
class SparseOptimizerConfig:
    """The fused optimizer fbgemm applies to sharded tables inside the backward pass.

    Args:
        name: rowwise_adagrad (one accumulator per row: the recsys default), adagrad, adam (CUDA
            only) or sgd.
        lr: learning rate; under TorchrecStrategy scaled each step as the dense optimizer's is.
        lr_schedule: "dense": each step the sparse lr is lr times the dense learning rate's current
            fraction of its base (warmup, decay), as torchrec's DLRM example schedules both with one
            policy; "constant": lr throughout.
        eps: added to the denominator (adagrad, adam).
        weight_decay: 0 disables it. fbgemm implements it for rowwise_adagrad (not on CPU for pooled
            tables, whose CPU kernel drops it) and adam only.
        weight_decay_mode: l2 (added to the gradient) or decoupled (w -= lr * wd * w); default: l2
            for rowwise_adagrad, decoupled for adam (fbgemm's Adam is AdamW-style only).
        beta1, beta2: Adam's moment decays.
    """

    name: str = "rowwise_adagrad"
    lr: float = 0.01
    lr_schedule: str = "dense"
    eps: float = 1e-8
    weight_decay: float = 0.0
    weight_decay_mode: str | None = None
    beta1: float = 0.9
    beta2: float = 0.999

    def __post_init__(self) -> None:
        if self.name not in SPARSE_OPTIMIZERS:
            raise ValueError(f"sparse optimizer {self.name!r} is not one of {', '.join(SPARSE_OPTIMIZERS)}")
        if self.lr_schedule not in ("dense", "constant"):
            raise ValueError(f"sparse optimizer lr_schedule {self.lr_schedule!r} is not 'dense' or 'constant'")
        if self.weight_decay_mode is None:
            self.weight_decay_mode = "decoupled" if self.name == "adam" else "l2"
        if self.weight_decay_mode not in WEIGHT_DECAY_MODES:
            raise ValueError(
                f"weight_decay_mode {self.weight_decay_mode!r} is not one of {', '.join(WEIGHT_DECAY_MODES)}"
            )
        if self.lr < 0 or self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(
                f"sparse optimizer needs lr >= 0, eps > 0, weight_decay >= 0; got lr={self.lr}, eps={self.eps}, "
                f"weight_decay={self.weight_decay}"
            )
        if self.weight_decay > 0 and self.name in ("adagrad", "sgd"):
            raise ValueError(f"fbgemm's fused {self.name} has no weight decay; use rowwise_adagrad or adam, or weight_decay 0")
        if self.weight_decay > 0 and self.name == "adam" and self.weight_decay_mode != "decoupled":
            raise ValueError("fbgemm's fused adam decays weights decoupled (AdamW) only; set weight_decay_mode: decoupled")

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for apply_optimizer_in_backward, i.e. for fbgemm's TBE constructor."""
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

        kwargs: dict[str, Any] = {"lr": self.lr, "eps": self.eps}
        if self.weight_decay > 0:
            kwargs["weight_decay"] = self.weight_decay
            if self.name == "rowwise_adagrad":
                # fbgemm ignores weight_decay unless a mode is set (its default is WeightDecayMode.NONE).
                kwargs["weight_decay_mode"] = WeightDecayMode.L2 if self.weight_decay_mode == "l2" else WeightDecayMode.DECOUPLE
        if self.name == "adam":
            kwargs.update(beta1=self.beta1, beta2=self.beta2)
        return kwargs


@dataclass
class ShardingConfig:
    """How the embedding tables are sharded and trained; every field can be set from YAML.

    Args:
        sharding_type: default for every table: table_wise, row_wise, column_wise or data_parallel.
        tables: per-table overrides, e.g. {t_item: data_parallel, history: row_wise} (a table name,
            or the name of a feature the table serves).
        compute_kernel: fused (tables in HBM on CUDA, in host memory on CPU), fused_uvm,
            fused_uvm_caching (CUDA: tables in host memory, a cache in HBM) or auto (the planner
            picks among those the device allows). data_parallel tables always use "dense".
        optimizer: the fused sparse optimizer of the non-data_parallel tables.
        column_wise_min_dim: narrowest column shard (torchrec's min_partition); a shard's width is the
            smallest multiple of 4 >= this that divides embedding_dim.
        hbm_cap_gb, ddr_cap_gb: per-rank capacity the planner may use (default: the GPU's memory for
            HBM, torchrec's 128 GB for DDR); a plan that does not fit raises ValueError naming tables
            and sizes.
        storage_reservation: share of each rank's capacity kept for everything else (activations,
            dense model, input buffers).
        planner_batch_size: per-rank batch size for the planner's cost estimates (default 512).
        average_sparse_gradients: torchrec's gradient division (process-wide): sharded rows get the
            gradient of the global-mean loss, like DDP's dense gradients; False sums over the ranks.
        copy_weights: copy the unsharded tables' values into the shards (False: torchrec's own
            initialization of the shards).
        pipeline: train through torchrec's TrainPipelineSparseDist (TorchrecStrategy; see
            LightningTrainPipeline): the next batch is copied to the device and its features are
            distributed on side streams while this step computes, so the host never waits for the
            device in the input all-to-all's split exchange.
    """

    sharding_type: str = "table_wise"
    tables: dict[str, str] = field(default_factory=dict)
    compute_kernel: str = "fused"
    optimizer: SparseOptimizerConfig = field(default_factory=SparseOptimizerConfig)
    column_wise_min_dim: int = 128
    hbm_cap_gb: float | None = None
    ddr_cap_gb: float | None = None
    storage_reservation: float = 0.15
    planner_batch_size: int | None = None
    average_sparse_gradients: bool = True
    copy_weights: bool = True
    pipeline: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, Mapping):
            self.optimizer = SparseOptimizerConfig(**self.optimizer)
        self.tables = dict(self.tables or {})
        for where, value in [("sharding_type", self.sharding_type)] + [
            (f"tables[{name!r}]", value) for name, value in self.tables.items()
        ]:
            if value not in SHARDING_TYPES:
                raise ValueError(f"sharding {where}={value!r} is not a sharding type; use one of {', '.join(SHARDING_TYPES)}")
        if self.compute_kernel not in COMPUTE_KERNELS:
            raise ValueError(f"compute_kernel={self.compute_kernel!r} is not one of {', '.join(COMPUTE_KERNELS)}")
        if self.column_wise_min_dim < 1:
            raise ValueError(f"column_wise_min_dim={self.column_wise_min_dim} must be >= 1")
        if not 0 <= self.storage_reservation < 1:
            raise ValueError(f"storage_reservation={self.storage_reservation} must be in [0, 1)")
        for name in ("hbm_cap_gb", "ddr_cap_gb", "planner_batch_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}={value} must be > 0 (or null for torchrec's default)")


@dataclass(frozen=True)
class TableInfo:
    """One embedding table of an EmbeddingBagCollection or EmbeddingCollection."""

    name: str
    module_path: str  # where the collection sits in the model, e.g. "categorical_embeddings"
    pooled: bool  # True: EmbeddingBagCollection, False: EmbeddingCollection
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]

    @property
    def state_key(self) -> str:
        """The table's key in model.state_dict(), sharded or not."""
        attribute = "embedding_bags" if self.pooled else "embeddings"
        return ".".join(part for part in (self.module_path, attribute, self.name, "weight") if part)

    @property
    def kind(self) -> str:
        return "EmbeddingBagCollection" if self.pooled else "EmbeddingCollection"


def embedding_tables(module: nn.Module) -> dict[str, TableInfo]:
    """Every table of every (unsharded) EmbeddingBagCollection / EmbeddingCollection in module."""
    tables: dict[str, TableInfo] = {}
    for path, child in module.named_modules():
        if isinstance(child, EmbeddingBagCollection):
            configs, pooled = child.embedding_bag_configs(), True
        elif isinstance(child, EmbeddingCollection):
            configs, pooled = child.embedding_configs(), False
        else:
            continue
        for config in configs:
            if config.name in tables:
                # The planner's constraints and the plan are keyed by table name.
                raise ValueError(f"table name {config.name!r} appears twice (in {tables[config.name].module_path!r} and {path!r})")
            tables[config.name] = TableInfo(
                name=config.name,
                module_path=path,
                pooled=pooled,
                num_embeddings=config.num_embeddings,
                embedding_dim=config.embedding_dim,
                feature_names=tuple(config.feature_names),
            )
    return tables


def _table_parameter(module: nn.Module, table: TableInfo) -> nn.Parameter:
    collection = module.get_submodule(table.module_path) if table.module_path else module
    tables = collection.embedding_bags if table.pooled else collection.embeddings
    return tables[table.name].weight


def column_wise_shard_dim(embedding_dim: int, min_dim: int) -> int:
    """The column shard width torchrec's planner uses: the smallest multiple of 4 that is >= min_dim
    and divides embedding_dim, else embedding_dim itself (one shard, i.e. no split)."""
    for width in range(min_dim, embedding_dim):
        if embedding_dim % width == 0 and width % 4 == 0:
            return width
    return embedding_dim


def resolve_sharding_types(config: ShardingConfig, tables: Mapping[str, TableInfo], device_type: str) -> dict[str, str]:
    """The sharding type of each table; ValueError for an override naming no table or a type the
    table cannot use on this device."""
    by_feature = {feature: table.name for table in tables.values() for feature in table.feature_names}
    chosen = {name: config.sharding_type for name in tables}
    for key, sharding_type in config.tables.items():
        name = key if key in tables else by_feature.get(key)
        if name is None:
            raise ValueError(
                f"sharding.tables names {key!r}, which is neither a table nor a feature of the model; "
                f"tables: {', '.join(tables)}"
            )
        chosen[name] = sharding_type

    problems = []
    if device_type == "cpu" and config.compute_kernel not in ("fused", "auto"):
        problems.append(f"compute_kernel={config.compute_kernel!r} needs CUDA (UVM); on CPU use 'fused'")
    if device_type == "cpu" and config.optimizer.name not in _CPU_OPTIMIZERS and any(
        t != "data_parallel" for t in chosen.values()
    ):
        problems.append(
            f"sparse optimizer {config.optimizer.name!r} has no CPU kernel in fbgemm-gpu; on CPU use one of "
            f"{', '.join(_CPU_OPTIMIZERS)}"
        )
    pooled_fused = [n for n, t in chosen.items() if t != "data_parallel" and tables[n].pooled]
    if device_type == "cpu" and config.optimizer.weight_decay > 0 and pooled_fused:
        problems.append(
            f"sparse weight_decay={config.optimizer.weight_decay} would be ignored on CPU for the pooled tables "
            f"{', '.join(pooled_fused)}: fbgemm-gpu's CPU row-wise Adagrad for EmbeddingBag tables calls fbgemm's "
            "SparseAdaGrad with weight_decay=0; set sharding.optimizer.weight_decay: 0 on CPU (it works on CUDA)"
        )
    for name, sharding_type in chosen.items():
        table = tables[name]
        if sharding_type == "column_wise":
            width = column_wise_shard_dim(table.embedding_dim, config.column_wise_min_dim)
            if width == table.embedding_dim:
                widths = [w for w in range(4, table.embedding_dim, 4) if table.embedding_dim % w == 0]
                hint = (
                    f"set sharding.column_wise_min_dim to one of {widths}"
                    if widths
                    else "no width below embedding_dim is a multiple of 4 that divides it"
                )
                problems.append(
                    f"table {name!r} cannot be column_wise: its embedding_dim={table.embedding_dim} has no column shard "
                    f"width that is a multiple of 4, >= column_wise_min_dim={config.column_wise_min_dim} and divides it, "
                    f"so it would not be split ({hint}; or use table_wise / row_wise)"
                )
        if sharding_type == "data_parallel" and not table.pooled and device_type == "cpu":
            problems.append(
                f"table {name!r} (an EmbeddingCollection table) cannot be data_parallel on CPU: fbgemm-gpu's CPU dense "
                "kernel ignores PoolingMode.NONE and returns pooled rows (the failure of torchrec issue #1255); use table_wise, "
                "row_wise or column_wise for it on CPU (data_parallel works on CUDA)"
            )
    if problems:
        raise ValueError("invalid sharding config:\n  " + "\n  ".join(problems))
    return chosen


class _EmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """torchrec offers row_wise for EmbeddingBagCollection only on CUDA; its CPU path (block-bucketized
    input all-to-all, fused CPU TBE) works, and tests/test_sharding.py checks it against one process."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = list(super().sharding_types(compute_device_type))
        if ShardingType.ROW_WISE.value not in types:
            types.append(ShardingType.ROW_WISE.value)
        return types


def make_sharders() -> list:
    return [_EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]


def _constraints(config: ShardingConfig, sharding_types: Mapping[str, str]) -> dict[str, ParameterConstraints]:
    constraints = {}
    for name, sharding_type in sharding_types.items():
        if sharding_type == "data_parallel":
            kernels = ["dense"]
        else:
            kernels = None if config.compute_kernel == "auto" else [config.compute_kernel]
        constraints[name] = ParameterConstraints(
            sharding_types=[sharding_type],
            compute_kernels=kernels,
            min_partition=config.column_wise_min_dim if sharding_type == "column_wise" else None,
        )
    return constraints


def _capacities(config: ShardingConfig, device: torch.device) -> tuple[int, int]:
    """Per-rank (HBM, DDR) bytes for the planner: the config's, else the GPU's own memory for HBM
    (torchrec's default assumes 32 GB) and torchrec's 128 GB for DDR."""
    if config.hbm_cap_gb is not None:
        hbm = int(config.hbm_cap_gb * _BYTES_PER_GB)
    elif device.type == "cuda" and torch.cuda.is_available():
        hbm = torch.cuda.get_device_properties(device.index or 0).total_memory
    else:
        hbm = HBM_CAP
    ddr = int(config.ddr_cap_gb * _BYTES_PER_GB) if config.ddr_cap_gb is not None else DDR_CAP
    return hbm, ddr


def _topology(
    world_size: int, device_type: str, capacities: tuple[int, int], local_world_size: int | None
) -> Topology:
    # torchrec 1.8 logs a warning for a Topology built without its TopologyFactory (which 1.6 lacks
    # in the same form); a directly built Topology is what both versions plan with.
    topology_log = logging.getLogger("torchrec.distributed.planner.types")
    level = topology_log.level
    topology_log.setLevel(logging.ERROR)
    try:
        return Topology(
            world_size=world_size,
            compute_device=device_type,
            hbm_cap=capacities[0],
            ddr_cap=capacities[1],
            local_world_size=local_world_size,
        )
    finally:
        topology_log.setLevel(level)


def _optimizer_state_bytes_per_row(name: str, dim: int) -> int:
    return {"rowwise_adagrad": 4, "adagrad": 4 * dim, "adam": 8 * dim, "sgd": 0}[name]


def _format_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    raise AssertionError


def _insufficient_storage_message(
    config: ShardingConfig,
    tables: Mapping[str, TableInfo],
    sharding_types: Mapping[str, str],
    world_size: int,
    device_type: str,
    capacities: tuple[int, int],
    planner_message: str,
) -> str:
    uses_hbm = device_type == "cuda" and config.compute_kernel in ("fused", "auto")
    kind, capacity = ("HBM", capacities[0]) if uses_hbm else ("DDR", capacities[1])
    usable = capacity * (1 - config.storage_reservation)
    lines, total = [], 0.0
    for name, table in tables.items():
        sharding_type = sharding_types[name]
        per_row = 4 * table.embedding_dim  # fp32 weights
        if sharding_type != "data_parallel":
            per_row += _optimizer_state_bytes_per_row(config.optimizer.name, table.embedding_dim)
        size = table.num_embeddings * per_row
        copies = world_size if sharding_type == "data_parallel" else 1
        total += size * copies
        note = ""
        if sharding_type in ("table_wise", "data_parallel") and size > usable:
            note = " -- more than one rank can hold: shard it row_wise or column_wise"
        lines.append(
            f"{name}: {table.num_embeddings} x {table.embedding_dim}, {sharding_type}, about {_format_bytes(size)}"
            f"{' per replica' if copies > 1 else ''}{note}"
        )
    first_lines = " ".join(planner_message.strip().splitlines()[:2])
    return (
        f"the embedding tables do not fit: they need about {_format_bytes(total)} (fp32 weights plus "
        f"{config.optimizer.name} state), and {world_size} rank(s) offer {_format_bytes(usable)} of {kind} each "
        f"({_format_bytes(capacity)} capacity minus the {config.storage_reservation:.0%} storage_reservation).\n  "
        + "\n  ".join(lines)
        + f"\nRaise sharding.{'hbm' if kind == 'HBM' else 'ddr'}_cap_gb if the devices have more, use more ranks, "
        f"row_wise/column_wise for large tables"
        + (", or compute_kernel fused_uvm_caching (tables in host memory)" if kind == "HBM" else "")
        + f".\ntorchrec planner: {first_lines}"
    )


def plan_sharding(
    module: nn.Module,
    config: ShardingConfig,
    *,
    world_size: int,
    device: torch.device | str,
    local_world_size: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    tables: Mapping[str, TableInfo] | None = None,
    sharding_types: Mapping[str, str] | None = None,
) -> ShardingPlan:
    """Run EmbeddingShardingPlanner for module (whose tables must already carry their sparse optimizer,
    see attach_sparse_optimizer, so the plan counts optimizer state). `tables` and `sharding_types`
    are embedding_tables(module) and resolve_sharding_types(...), found here unless given.

    Without process_group the plan is made locally (no communication). With one, rank 0 plans and
    broadcasts the plan or the error, so every rank raises the same ValueError instead of the others
    waiting forever for a plan (torchrec's collective_plan raises on rank 0 only).
    """
    device = torch.device(device)
    device_type = device.type
    if tables is None:
        tables = embedding_tables(module)
    if sharding_types is None:
        sharding_types = resolve_sharding_types(config, tables, device_type)

    def make_plan() -> tuple[ShardingPlan | None, str | None]:
        capacities = _capacities(config, device)
        planner = EmbeddingShardingPlanner(
            topology=_topology(world_size, device_type, capacities, local_world_size),
            batch_size=config.planner_batch_size,
            storage_reservation=FixedPercentageStorageReservation(config.storage_reservation),
            constraints=_constraints(config, sharding_types),
            debug=False,
        )
        try:
            return planner.plan(module, make_sharders()), None
        except PlannerError as error:
            if error.error_type == PlannerErrorType.INSUFFICIENT_STORAGE or "insufficient storage" in str(error):
                message = _insufficient_storage_message(
                    config, tables, sharding_types, world_size, device_type, capacities, str(error)
                )
            else:
                message = f"torchrec's planner found no sharding plan ({error.error_type.value}): {error}"
            return None, message
        except Exception as error:  # noqa: BLE001 -- the other ranks wait for rank 0's answer: always send one
            if process_group is None:
                raise
            return None, f"sharding plan failed on rank 0: {type(error).__name__}: {error}"

    if process_group is None:
        plan, message = make_plan()
    else:
        result = [make_plan() if dist.get_rank(process_group) == 0 else None]
        dist.broadcast_object_list(result, src=dist.get_global_rank(process_group, 0), group=process_group)
        plan, message = result[0]
    if message is not None:
        raise ValueError(message)
    return plan


def attach_sparse_optimizer(
    module: nn.Module, config: ShardingConfig, sharding_types: Mapping[str, str], tables: Mapping[str, TableInfo]
) -> list[nn.Parameter]:
    """Mark every non-data_parallel table for the fused optimizer; returns the marked (unsharded) params."""
    optimizer_class = _OPTIMIZER_CLASSES[config.optimizer.name]
    params = [_table_parameter(module, tables[name]) for name, t in sharding_types.items() if t != "data_parallel"]
    if params:
        with warnings.catch_warnings():
            # torchrec's wrapper is deprecated in favour of torch's private _apply_optimizer_in_backward,
            # which it calls; the public name is the one that exists in every supported version.
            warnings.simplefilter("ignore", DeprecationWarning)
            trec_optim.apply_optimizer_in_backward(optimizer_class, params, config.optimizer.kwargs())
    return params


def _release_in_backward_hooks(params: Iterable[nn.Parameter]) -> None:
    """apply_optimizer_in_backward keeps each parameter's AccumulateGrad node (which holds the parameter)
    in module-level maps, so the unsharded tables would stay alive after sharding. Drop those entries:
    sharding replaced the parameters, their hooks can never fire. Best effort if torch renames them."""
    try:
        maps = importlib.import_module("torch.distributed.optim.apply_optimizer_in_backward")
    except ImportError:
        return
    handles_map = getattr(maps, "param_to_optim_hook_handle_map", None)
    acc_grad_map = getattr(maps, "param_to_acc_grad_map", None)
    for param in params:
        if handles_map is not None:
            for handle in handles_map.pop(param, ()):
                handle.remove()
        if acc_grad_map is not None:
            acc_grad_map.pop(param, None)


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__, "torchrec": getattr(torchrec, "__version__", "?")}
    try:
        import fbgemm_gpu

        versions["fbgemm_gpu"] = getattr(fbgemm_gpu, "__version__", "?")
    except ImportError:
        versions["fbgemm_gpu"] = "missing"
    return versions


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    else:
        out[prefix] = value


def _device_problem(device: torch.device, backend: str) -> str | None:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"device {device} but CUDA is not available on this rank"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"device {device} but this rank sees {torch.cuda.device_count()} GPU(s)"
        if "nccl" not in backend:
            return f"device {device} needs the nccl backend (torchrec's all-to-all of CUDA tensors), got {backend!r}"
    elif device.type == "cpu":
        if "gloo" not in backend:
            return f"device cpu needs the gloo backend, got {backend!r}"
    else:
        return f"device type {device.type!r} is not supported (cpu or cuda)"
    return None


def _fingerprint(
    module: nn.Module,
    config: ShardingConfig,
    device: torch.device,
    backend: str,
    tables: Mapping[str, TableInfo],
    sharding_types: Mapping[str, str],
) -> dict[str, Any]:
    fingerprint: dict[str, Any] = {}
    _flatten("version", _versions(), fingerprint)
    fingerprint["backend"] = backend
    fingerprint["device_type"] = device.type
    _flatten("config", asdict(config), fingerprint)
    table_ids = {id(_table_parameter(module, table)) for table in tables.values()}
    for name, table in tables.items():
        fingerprint[f"table.{name}"] = (table.kind, table.num_embeddings, table.embedding_dim, sharding_types.get(name))
    dense = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters() if id(p) not in table_ids]
    fingerprint["dense_parameters"] = f"{len(dense)} tensors, sha1 {hashlib.sha1(repr(dense).encode()).hexdigest()[:12]}"
    if config.copy_weights:
        # The shards are filled from each rank's own copy of the table: they must be the same (same seed).
        for name, table in tables.items():
            weight = _table_parameter(module, table).detach()
            if weight.device.type != "meta":
                weight = weight.double()
                fingerprint[f"table_checksum.{name}"] = (round(float(weight.sum()), 9), round(float(weight.square().sum()), 9))
    return fingerprint


def check_ranks_agree(fingerprint: Mapping[str, Any], process_group: dist.ProcessGroup | None = None) -> None:
    """all_gather every rank's fingerprint (plus 'error', a problem found locally) and raise the same
    RuntimeError on every rank if any rank failed or any value differs from rank 0's."""
    world_size = dist.get_world_size(process_group)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, dict(fingerprint), group=process_group)
    problems = [f"rank {rank}: {fp['error']}" for rank, fp in enumerate(gathered) if fp.get("error")]
    reference = gathered[0]
    for rank, fp in enumerate(gathered[1:], start=1):
        for key in sorted(set(reference) | set(fp)):
            if key != "error" and reference.get(key) != fp.get(key):
                problems.append(f"rank {rank} has {key}={fp.get(key)!r} where rank 0 has {reference.get(key)!r}")
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise RuntimeError("the ranks cannot shard this model together:\n  " + "\n  ".join(shown))


class _NoDataParallel(DataParallelWrapper):
    """The dense part of a one-process model stays unwrapped: it has no gradients to average, and DDP
    would still add per-parameter hooks, bucket copies and an allreduce to every step, and split a
    torch.compile'd tower into one graph per gradient bucket. DMP still materializes meta parameters
    before calling wrap."""

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        pass


def shard_model(
    module: nn.Module,
    config: ShardingConfig | None = None,
    *,
    device: torch.device | str | None = None,
    process_group: dist.ProcessGroup | None = None,
    ddp_kwargs: Mapping[str, Any] | None = None,
) -> tuple[DistributedModelParallel, ShardingPlan]:
    """Shard module's embedding tables over the ranks of process_group (default: the world) with
    DistributedModelParallel; the rest of the model becomes data parallel (DDP).

    module is changed in place (its collections are replaced by sharded ones): keep using the returned
    DMP, or dmp.module for the unwrapped model. Every rank must call this with an identical module
    (same seed) and config; any difference raises RuntimeError on all ranks. device defaults to
    cuda:<current device> with nccl, else cpu. ddp_kwargs go to the DDP wrapping the dense part
    (static_graph, find_unused_parameters, bucket_cap_mb, or any DDP argument); on one process
    there is no DDP (nothing to average) and they are unused.

    Returns (the DMP-wrapped model, the sharding plan).
    """
    config = config or ShardingConfig()
    if not dist.is_initialized():
        raise RuntimeError("shard_model needs torch.distributed: call dist.init_process_group first (gloo on CPU, nccl on CUDA)")
    process_group = process_group or dist.group.WORLD
    world_size, backend = dist.get_world_size(process_group), str(dist.get_backend(process_group))
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and torch.cuda.is_available() and device.index < torch.cuda.device_count():
        torch.cuda.set_device(device)  # all_gather_object over nccl uses the current device

    tables: dict[str, TableInfo] = {}
    sharding_types: dict[str, str] = {}
    local_error: Exception | None = None
    try:
        tables = embedding_tables(module)
        if not tables:
            sharded = [n for n, m in module.named_modules() if isinstance(m, (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection))]
            if sharded:
                raise ValueError(f"the model's embedding collections are already sharded ({', '.join(sharded)}): shard a freshly built model")
            raise ValueError("the model holds no EmbeddingBagCollection or EmbeddingCollection to shard")
        sharding_types = resolve_sharding_types(config, tables, device.type)
        problem = _device_problem(device, backend)
        if problem is not None:
            raise ValueError(problem)
    except ValueError as error:
        local_error = error
    fingerprint = _fingerprint(module, config, device, backend, tables, sharding_types)
    fingerprint["error"] = str(local_error) if local_error else None
    try:
        check_ranks_agree(fingerprint, process_group)
    except RuntimeError:
        if local_error is not None:
            raise local_error from None  # this rank's own problem, as the ValueError it is
        raise

    comm_ops.set_gradient_division(config.average_sparse_gradients)
    originals = {name: _table_parameter(module, table).detach() for name, table in tables.items()}
    fused = attach_sparse_optimizer(module, config, sharding_types, tables)
    # Ranks per host (torchrun sets LOCAL_WORLD_SIZE): the planner prices intra- vs inter-host traffic.
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None
    if local_world_size is None and device.type == "cuda":
        local_world_size = min(world_size, torch.cuda.device_count())
    plan = plan_sharding(
        module, config, world_size=world_size, device=device, local_world_size=local_world_size,
        process_group=process_group, tables=tables, sharding_types=sharding_types,
    )

    ddp_kwargs = dict(ddp_kwargs or {})
    wrapper = _NoDataParallel() if world_size == 1 else DefaultDataParallelWrapper(
        bucket_cap_mb=ddp_kwargs.pop("bucket_cap_mb", 25),
        static_graph=ddp_kwargs.pop("static_graph", True),
        find_unused_parameters=ddp_kwargs.pop("find_unused_parameters", False),
        ddp_kwargs=ddp_kwargs,
    )
    with warnings.catch_warnings():
        # torch 2.13 deprecates DDP's broadcast_buffers, which torchrec 1.8 still passes.
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        dmp = DistributedModelParallel(
            module,
            env=ShardingEnv.from_process_group(process_group),
            device=device,
            plan=plan,
            sharders=make_sharders(),
            data_parallel_wrapper=wrapper,
        )
    _release_in_backward_hooks(fused)
    del fused
    if config.copy_weights:
        full = {tables[name].state_key: weight for name, weight in originals.items() if weight.device.type != "meta"}
        if len(full) < len(originals):
            log.warning("copy_weights: tables built on the meta device keep torchrec's initialization")
        load_full_tables(dmp, full)
    originals.clear()
    return dmp, plan


def _local_shards(value: Any) -> list[tuple[torch.Tensor, tuple[int, ...]]] | None:
    """(tensor, offsets) of this rank's shards of a ShardedTensor / DTensor, None for a plain tensor."""
    if hasattr(value, "local_shards") and callable(value.local_shards):  # ShardedTensor
        return [(shard.tensor, tuple(shard.metadata.shard_offsets)) for shard in value.local_shards()]
    if type(value).__name__ == "DTensor":
        raise NotImplementedError("DTensor state (ShardingEnv output_dtensor=True) is not supported here")
    return None


@torch.no_grad()
def load_full_tables(model: nn.Module, tables: Mapping[str, torch.Tensor]) -> None:
    """Set sharded (or replicated) tables from full tensors, keyed as in model.state_dict()."""
    state = model.state_dict()
    for key, full in tables.items():
        if key not in state:
            raise KeyError(f"{key} is not in the model's state_dict")
        target = state[key]
        shards = _local_shards(target)
        if shards is None:
            target.copy_(full)
            continue
        for tensor, offsets in shards:
            index = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))
            tensor.copy_(full[index])
    # The local shards are views of the fused kernels' weights; loading them back through the module
    # is torchrec's way to set sharded weights and keeps any kernel-side copies (caches) in sync.
    model.load_state_dict(state, strict=False)


def is_fused_parameter(parameter: torch.Tensor) -> bool:
    """True for table parameters that the fused sparse optimizer updates inside backward."""
    return hasattr(parameter, "_in_backward_optimizers")


def dense_named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs a normal optimizer must own: everything that trains except the tables
    that the fused sparse optimizer updates (data_parallel tables are included). Works on unsharded
    models too (then every trainable parameter)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad and not is_fused_parameter(p)]


def dense_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for _, p in dense_named_parameters(module)]


def embedding_parameter_ids(module: nn.Module) -> set[int]:
    """ids of every embedding parameter (torchrec tables, sharded or not, and nn.Embedding/EmbeddingBag),
    e.g. to exempt them from weight decay in the dense optimizer."""
    kinds = (
        EmbeddingBagCollection,
        EmbeddingCollection,
        ShardedEmbeddingBagCollection,
        ShardedEmbeddingCollection,
        nn.Embedding,
        nn.EmbeddingBag,
    )
    return {id(p) for m in module.modules() if isinstance(m, kinds) for p in m.parameters()}


def sparse_optimizer(model: nn.Module) -> CombinedOptimizer | None:
    """The fused optimizer(s) of the sharded tables in model (a DMP, or any module holding sharded
    collections), keyed by table path like DMP.fused_optimizer; None when nothing is sharded. Its
    state_dict holds the per-table optimizer state (e.g. row-wise Adagrad accumulators), sharded like
    the tables; its param_groups hold the sparse learning rate."""
    if isinstance(model, DistributedModelParallel):
        model = model.module

    def collect(module: nn.Module, path: str, found: list) -> list:
        if isinstance(module, FusedOptimizerModule):
            found.append((path, module.fused_optimizer))
            return found
        for name, child in module.named_children():
            collect(child, f"{path}.{name}" if path else name, found)
        return found

    found = collect(model, "", [])
    return CombinedOptimizer(found) if found else None


# ---- checkpoints (torch.distributed.checkpoint) ----


def _optimizer_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError("the dense optimizer holds a parameter that is not in the model")
            ordered.append(names[id(param)])
    return ordered


def _named_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """optimizer.state_dict() keyed by parameter name instead of position, so it loads into any world size."""
    names = _optimizer_names(optimizer, model)
    state = optimizer.state_dict()
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def _load_named_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module, named: Mapping[str, Any]) -> None:
    index = {name: i for i, name in enumerate(_optimizer_names(optimizer, model))}
    missing = [name for group in named["param_groups"] for name in group["params"] if name not in index]
    if missing:
        raise ValueError(f"the checkpoint's dense optimizer holds parameters this optimizer lacks: {missing[:5]}")
    optimizer.load_state_dict(
        {
            "state": {index[name]: value for name, value in named["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]],
        }
    )


@torch.no_grad()
def _initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the lazily built state of the parameters that have none (one step with zero gradients
    and lr 0, the others left out of it) so that DCP can load into it in place."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    missing = {id(p) for p in params if not optimizer.state.get(p)}
    if not missing:
        return
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p) if id(p) in missing else None
    saved_lrs = [group.get("lr") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            if lr is not None:
                group["lr"] = lr
        for p, grad in zip(params, saved_grads):
            p.grad = grad


def _as_list(optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None) -> list:
    if optimizers is None:
        return []
    if isinstance(optimizers, torch.optim.Optimizer) or hasattr(optimizers, "param_groups"):
        return [optimizers]
    return list(optimizers)


def checkpoint_state(
    model: nn.Module, dense_optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None
) -> dict[str, Any]:
    """What a checkpoint holds: the model's state_dict (sharded tables as ShardedTensors, replicated
    tensors once), the fused sparse optimizer's state (sharded like the tables) and each dense
    optimizer's state keyed by parameter name."""
    state: dict[str, Any] = {"model": model.state_dict()}
    sparse = sparse_optimizer(model)
    if sparse is not None:
        state["sparse_optimizer"] = sparse.state_dict()
    for i, optimizer in enumerate(_as_list(dense_optimizers)):
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap Lightning's LightningOptimizer
        # DMP's named_parameters strips its own and DDP's prefixes: the names match state_dict keys.
        state[f"dense_optimizer_{i}"] = _named_optimizer_state(optimizer, model)
    return state


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    dense_optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    metadata: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Save from every rank with torch.distributed.checkpoint into the folder path (on a filesystem all
    ranks share): each rank writes its own shards; metadata (anything torch.save can store) is written
    by rank 0. The folder is written beside path and renamed when complete, so a crash keeps the old one."""
    path = Path(path)
    distributed = dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    staging = path.with_name(path.name + ".saving")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    if distributed:
        dist.barrier(group=process_group)
    dcp.save(
        checkpoint_state(model, dense_optimizers),
        storage_writer=dcp.FileSystemWriter(str(staging)),
        process_group=process_group,
        no_dist=not distributed,
    )
    if rank == 0:
        torch.save(dict(metadata or {}), staging / _METADATA_FILE)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        staging.rename(path)
    if distributed:
        dist.barrier(group=process_group)


def _saved_tensors(path: Path) -> dict[str, Any]:
    """The checkpoint's flattened keys and their DCP metadata (global sizes)."""
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def _load_planner() -> dcp.DefaultLoadPlanner:
    # flatten_sharded_tensors (meant for 2-D nested ShardedTensors) drops a ShardedTensor without local
    # shards, which table_wise gives every rank but the owner; DCP then finds checkpoint keys missing
    # from the flattened state, concludes the checkpoint predates torch 2.4 and re-flattens in the old
    # format, which names the optimizers' param_groups differently ("Missing key ... param_groups").
    # torchrec's ShardedTensors are 1-D placements and need no flattening.
    return dcp.DefaultLoadPlanner(flatten_sharded_tensors=False)


def _check_shapes(
    state: Mapping[str, Any], saved: Mapping[str, Any], path: Path, process_group: dist.ProcessGroup | None
) -> None:
    """Compare every tensor's global shape with the checkpoint's (`saved`: _saved_tensors) before DCP
    reads anything; the ranks pool what they found (the fused optimizer's keys differ between ranks)
    and all raise, or none."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(dict(state))
    problems = []
    for key, value in flat.items():
        size = getattr(saved.get(key), "size", None)
        if size is None or not isinstance(value, torch.Tensor) or tuple(value.size()) == tuple(size):
            continue
        if key.startswith("sparse_optimizer."):
            problems.append(
                f"{key}: saved {tuple(size)}, this plan needs {tuple(value.size())} (row-wise optimizer state of a "
                "column_wise table has one accumulator per row and column shard, so it only reloads into the same "
                "column split; pass load_sparse_optimizer=False to restart the sparse optimizer state)"
            )
        else:
            problems.append(f"{key}: saved {tuple(size)}, the model has {tuple(value.size())}")
    if dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, problems, group=process_group)
        problems = list(dict.fromkeys(p for rank_problems in gathered for p in rank_problems))
    if problems:
        raise ValueError(f"{path} does not fit this model:\n  " + "\n  ".join(problems[:10]))


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    dense_optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    load_sparse_optimizer: bool = True,
    process_group: dist.ProcessGroup | None = None,
    weights_only: bool | None = False,
) -> dict[str, Any]:
    """Load a save_checkpoint folder into a sharded model of any world size and sharding plan (DCP
    reshards) and, if given, its dense optimizer(s), matched by parameter name. The fused sparse
    optimizer state is restored when the checkpoint has it and load_sparse_optimizer is True. Returns
    the metadata. ValueError, on every rank, when a shape differs from the checkpoint's."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint folder written by save_checkpoint (no .metadata)")
    saved_tensors = _saved_tensors(path)
    available = set(saved_tensors)
    optimizers = [getattr(o, "_optimizer", o) for o in _as_list(dense_optimizers)]
    for optimizer in optimizers:
        _initialize_optimizer_state(optimizer)
    state = checkpoint_state(model, optimizers)
    if "sparse_optimizer" in state and (
        not load_sparse_optimizer or not any(k.startswith("sparse_optimizer.") for k in available)
    ):
        del state["sparse_optimizer"]  # not wanted, or saved without one (e.g. from an unsharded model)
    for i in range(len(optimizers)):
        key = f"dense_optimizer_{i}"
        if not any(k.startswith(key + ".") for k in available):
            raise ValueError(f"{path} holds no state for dense optimizer {i}")
        # Parameters the saved optimizer never stepped have no state there: they start fresh.
        saved = {name for name in state[key]["state"] if any(k.startswith(f"{key}.state.{name}.") for k in available)}
        state[key]["state"] = {name: value for name, value in state[key]["state"].items() if name in saved}
    _check_shapes(state, saved_tensors, path, process_group)
    distributed = dist.is_initialized()
    dcp.load(
        state,
        storage_reader=dcp.FileSystemReader(str(path)),
        planner=_load_planner(),
        process_group=process_group,
        no_dist=not distributed,
    )
    model.load_state_dict(state["model"])
    if "sparse_optimizer" in state:
        sparse_optimizer(model).load_state_dict(state["sparse_optimizer"])
    for i, optimizer in enumerate(optimizers):
        _load_named_optimizer_state(optimizer, model, state[f"dense_optimizer_{i}"])
    metadata_file = path / _METADATA_FILE
    return torch.load(metadata_file, weights_only=weights_only) if metadata_file.is_file() else {}


def checkpoint_metadata(path: str | Path, *, weights_only: bool = True) -> dict[str, Any]:
    """The non-tensor entries of a checkpoint (Lightning's global_step, hyper_parameters, loops, ...):
    the metadata of a save_checkpoint / TorchrecStrategy folder, or a regular Lightning .ckpt file."""
    path = Path(path)
    file = path / _METADATA_FILE if path.is_dir() else path
    # Memory-mapped: only the entries read are loaded, not a whole Lightning .ckpt's weights.
    return torch.load(file, map_location="cpu", weights_only=weights_only, mmap=True)


def load_unsharded(path: str | Path, model: nn.Module, *, strict: bool = True) -> None:
    """Load a save_checkpoint folder (written by any number of ranks) into a plain, unsharded model in
    one process, e.g. a RankingModel for evaluation. The model's keys may sit under a prefix in the
    checkpoint (a Lightning checkpoint stores RankingTask's "model." keys): it is found automatically."""
    path = Path(path)
    available = set(_saved_tensors(path))
    model_state = model.state_dict()
    probe = next(iter(model_state))
    candidates = sorted({k[: -len(probe)] for k in available if k.endswith("." + probe) or k == probe}, key=len)
    prefix = next((c for c in candidates if all(c + k in available for k in model_state)), None)
    if prefix is None:
        missing = [k for k in model_state if not any(c + k in available for c in candidates)][:5] or list(model_state)[:5]
        if strict:
            raise ValueError(f"{path} has no model state matching this model; missing e.g. {missing}")
        prefix = candidates[0] if candidates else "model."
    # DCP flattens nested dicts by joining keys with ".", so any prefix can be rebuilt as one level.
    head, _, rest = prefix.partition(".")
    state = {head: {rest + k: v for k, v in model_state.items() if prefix + k in available}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), planner=_load_planner(), no_dist=True)
    model.load_state_dict({k[len(rest):]: v for k, v in state[head].items()}, strict=strict)


# ---- Lightning ----

_SHARDED_ATTRIBUTE = "_torchrec_sharded"  # (DMP, ShardingConfig, plan) on a LightningModule sharded by the strategy


class LightningTrainPipeline:
    """torchrec's TrainPipelineSparseDist driven by Lightning's training loop (ShardingConfig.pipeline).

    The pipeline runs forward, backward and the optimizer step itself, and fetches two batches ahead:
    while batch i trains, batch i+1's features are distributed and batch i+2 is copied to the device,
    each on its own stream. So the LightningModule trains under manual optimization, taking Lightning's
    data iterator (training_step(dataloader_iter)), and its forward(batch) must return (loss, a dict of
    outputs), as the pipeline calls it. progress() trains one batch per Lightning step, except at the
    end of an epoch's batches: the batches still in flight train in that same step (each one an
    optimizer step and a count in Lightning's batch progress), so an epoch ends with all of its
    batches trained and a checkpoint at its end resumes exactly. What differs from automatic
    optimization: no fp16 gradient scaler (32-true or bf16-mixed), no gradient accumulation, and
    Lightning validates at every epoch's end (its rule for a step that takes the iterator).
    """

    def __init__(self, strategy: "TorchrecStrategy"):
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        self.strategy = strategy
        self.pipeline = TrainPipelineSparseDist(strategy.model, _PipelineOptimizer(strategy), strategy.root_device)
        self._epoch_iterator: Any = None  # Lightning's iterator of the current epoch
        self._batches: _EpochBatches | None = None
        self._paused: list[tuple[nn.Module, Any]] = []
        self._announced = False

    def progress(self, dataloader_iter: Any) -> list[dict[str, Any]]:
        """Trains the next batch, or at the end of the epoch's batches every one left; returns, per
        trained batch, the forward's outputs with "lr", the rate its optimizer step used."""
        trainer = self.strategy.lightning_module.trainer
        epoch_loop = trainer.fit_loop.epoch_loop
        batch_progress = epoch_loop.batch_progress
        if dataloader_iter is not self._epoch_iterator:  # a new (or resumed) epoch
            # Lightning has counted this step's batch already; limit_train_batches may end the epoch early.
            remaining = trainer.num_training_batches - (batch_progress.current.ready - 1)
            self._epoch_iterator, self._batches = dataloader_iter, _EpochBatches(dataloader_iter, remaining)
        # Lightning's validation leaves the DMP in eval mode (it restores the LightningModule's mode
        # only), and the pipeline skips backward and the optimizer step for a model in eval mode.
        # Compared first: train() walks every submodule, host work this step need not pay otherwise.
        dmp, training = self.strategy.model, self.strategy.lightning_module.training
        if dmp.training != training:
            dmp.train(training)
        steps = [self._train_one()]
        if not self._announced:  # the first step traced the model and chose the modules to pipeline
            self._announced = True
            pipelined = len(self.pipeline._pipelined_modules)
            rank_zero_info(f"sharding.pipeline: TrainPipelineSparseDist pipelines {pipelined} sharded module(s)")
            if not pipelined:
                rank_zero_warn("sharding.pipeline pipelines no sharded module: their features do not come straight from "
                               "the batch, so every input all-to-all still runs inside its step")
        if self._batches.exhausted:
            while trainer.max_steps < 0 or trainer.global_step < trainer.max_steps:
                try:
                    steps.append(self._train_one())
                except StopIteration:
                    break
            # Lightning counts one batch per step, in its batch progress (validation schedule, epoch
            # end) and in the step its loggers see (the validation rows' index).
            batch_progress.increment_by(len(steps) - 1)
            epoch_loop._batches_that_stepped += len(steps) - 1
        return steps

    def _train_one(self) -> dict[str, Any]:
        lr = self.strategy.optimizers[0].param_groups[0]["lr"]
        outputs = self.pipeline.progress(self._batches)
        if not isinstance(outputs, Mapping):
            raise TypeError("with sharding.pipeline, the LightningModule's forward must return (loss, dict of outputs); "
                            f"its second item was a {type(outputs).__name__}")
        return {**outputs, "lr": lr}

    def pause(self) -> None:
        """Gives the sharded modules back their own forwards (for validation): the pipeline replaced
        them with ones that read features it distributed ahead, which a validation batch never is.
        Not pipeline.detach(): re-attaching restarts the input all-to-all of the batch in flight."""
        self._paused = [(module, module.__dict__.pop("forward"))
                        for module in _sharded_modules_and_input_dists(self.strategy.model) if "forward" in module.__dict__]

    def resume(self) -> None:
        for module, forward in self._paused:
            module.forward = forward
        self._paused = []


def _sharded_modules_and_input_dists(model: nn.Module) -> Iterable[nn.Module]:
    """The modules whose forwards the pipeline replaces: the sharded modules, and the all-to-alls of
    their input dists (held in plain lists, out of modules()' reach)."""
    for sharded in model.modules():
        if isinstance(sharded, ShardedModule):
            for module in sharded.modules():
                yield module
                for input_dist in getattr(module, "_input_dists", None) or []:
                    yield from input_dist.modules()


class _EpochBatches:
    """The Batches of Lightning's (batch, batch_idx, dataloader_idx) iterator, at most `remaining`
    of them; `exhausted` once the pipeline has taken the last."""

    def __init__(self, dataloader_iter: Any, remaining: int):
        self.dataloader_iter, self.remaining, self.exhausted = dataloader_iter, remaining, False

    def __iter__(self) -> "_EpochBatches":
        return self

    def __next__(self) -> Any:
        if self.remaining <= 0:
            self.exhausted = True
            raise StopIteration
        try:
            batch, _, _ = next(self.dataloader_iter)
        except StopIteration:
            self.exhausted = True
            raise
        self.remaining -= 1
        if self.remaining == 0 or getattr(self.dataloader_iter, "done", False):
            self.exhausted = True
        return batch


class _PipelineOptimizer:
    """What TrainPipelineSparseDist steps once per batch, doing what Lightning's automatic
    optimization would around the LightningModule's one optimizer."""

    def __init__(self, strategy: "TorchrecStrategy"):
        self.strategy = strategy

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The first thing of each step, before its backward (where the fused table update runs).
        self.strategy._schedule_sparse_lr()
        self.strategy.lightning_module.optimizers().zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        module = self.strategy.lightning_module
        trainer = module.trainer
        optimizer = module.optimizers()  # the LightningOptimizer: its step counts the global step
        if trainer.gradient_clip_val:
            module.configure_gradient_clipping(optimizer.optimizer, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        optimizer.step()
        for config in trainer.lr_scheduler_configs:
            config.scheduler.step()


def _check_pipeline_supported(trainer: pl.Trainer, strategy: "TorchrecStrategy") -> None:
    problems = []
    if getattr(strategy.precision_plugin, "scaler", None) is not None:
        problems.append(f"precision {trainer.precision!r} scales the loss, which the pipeline's backward does not: use 32-true or bf16-mixed")
    if trainer.accumulate_grad_batches != 1:
        problems.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches}: the pipeline steps the optimizer every batch")
    if len(strategy.optimizers) != 1:
        problems.append(f"{len(strategy.optimizers)} optimizers: the pipeline steps one")
    for config in trainer.lr_scheduler_configs:
        if config.interval != "step" or config.frequency != 1 or config.reduce_on_plateau:
            problems.append(f"LR scheduler {type(config.scheduler).__name__} (interval {config.interval!r}, frequency "
                            f"{config.frequency}): the pipeline steps schedulers every step")
    if problems:
        raise ValueError("sharding.pipeline cannot train this setup: " + "; ".join(problems))


def _carry_step_count(trainer: pl.Trainer, pipelined: bool) -> None:
    """Lightning counts optimizer steps separately under automatic and manual optimization; a run
    resumed with sharding.pipeline switched continues the count the checkpoint's mode kept."""
    loop = trainer.fit_loop.epoch_loop
    automatic, manual = loop.automatic_optimization.optim_progress.optimizer.step, loop.manual_optimization.optim_step_progress
    source, target = (automatic, manual) if pipelined else (manual, automatic)
    if source.total.completed > target.total.completed:
        target.load_state_dict(source.state_dict())


class TorchrecStrategy(DDPStrategy):
    """Lightning's DDP, with the model wrapped by torchrec's DistributedModelParallel instead of DDP:
    embedding tables sharded by shard_model (fused sparse optimizer), everything else data parallel.

        trainer = L.Trainer(strategy=TorchrecStrategy(ShardingConfig(sharding_type="row_wise")),
                            accelerator="gpu", devices=8)     # or strategy="torchrec": the defaults
        torchrun --nproc-per-node 2 train.py --trainer.strategy=torchrec --trainer.accelerator=cpu ...

    - configure_optimizers may return optimizers over all parameters: the strategy removes the fused
      table parameters from them (dense_parameters() gives the same list directly).
    - Checkpoints are torch.distributed.checkpoint folders (every rank writes its shards; the path,
      e.g. last.ckpt, is a folder) with the dense optimizers, the sparse optimizer state and
      Lightning's loop state; resuming (ckpt_path) reshards to the current world size and plan.
      load_unsharded() reads one into a plain model.
    - Each rank must see its own part of the data (DistributedSampler, as Lightning's DDP sets up,
      or the data module's own per-rank sampler). The sharded lookups exchange rows between ranks,
      so every rank must run every step: the strategy checks at the start of training, validation
      and test that the ranks have as many batches, and raises RuntimeError otherwise. Training
      batches must also have one size on all ranks (torchrec's backward all-gathers them); batches
      of different sizes are fine for validation.
    - Precision: 32-true or *-mixed (the tables stay fp32); manual optimization is not supported.
    - sharding.pipeline trains through torchrec's TrainPipelineSparseDist (LightningTrainPipeline).
    """

    strategy_name = "torchrec"

    def __init__(
        self,
        sharding: ShardingConfig | Mapping[str, Any] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **ddp_kwargs,
        )
        self.sharding = ShardingConfig(**sharding) if isinstance(sharding, Mapping) else (sharding or ShardingConfig())
        self.plan: ShardingPlan | None = None
        self.sparse: CombinedOptimizer | None = None  # the tables' fused optimizer, once sharded
        self.train_pipeline: LightningTrainPipeline | None = None  # with sharding.pipeline, while fitting

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a checkpoint loads into the sharded model and its optimizers

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint already restored them

    def model_to_device(self) -> None:
        """Move everything but the embedding collections, which DMP places shard by shard (moving the
        whole tables to one GPU first is what sharding avoids)."""
        assert self.model is not None
        skip: set[int] = set()
        for module in self.model.modules():
            if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
                skip.update(id(m) for m in module.modules())
        device = self.root_device
        for module in self.model.modules():
            if id(module) in skip:
                continue
            if isinstance(module, Metric):  # its _apply moves its states and takes no `recurse`
                module.to(device)
            else:
                module._apply(lambda t: t.to(device), recurse=False)

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        # A module sharded by an earlier setup (this Trainer's or another's) keeps its DMP: sharding
        # replaced its collections, and a second DDP over its parameters would double their hooks.
        previous = self.model.__dict__.get(_SHARDED_ATTRIBUTE)
        if previous is not None:
            dmp, config, plan = previous
            if config != self.sharding:
                raise ValueError(
                    f"this LightningModule was sharded with {config}; a Trainer with another sharding config "
                    "needs a freshly built module"
                )
            self.model, self.plan = dmp, plan
        else:
            if fitting and self._layer_sync:
                self.model = self._layer_sync.apply(self.model)
            self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            module = self.model
            self.model, self.plan = shard_model(module, self.sharding, device=self.root_device, ddp_kwargs=self._ddp_kwargs)
            module.__dict__[_SHARDED_ATTRIBUTE] = (self.model, self.sharding, self.plan)  # not a submodule
        self.sparse = sparse_optimizer(self.model)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        self.train_pipeline = None
        if fitting and self.sharding.pipeline:
            _check_pipeline_supported(trainer, self)
            self.train_pipeline = LightningTrainPipeline(self)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        removed = 0
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                kept = [p for p in group["params"] if not is_fused_parameter(p)]
                removed += len(group["params"]) - len(kept)
                group["params"] = kept
        if removed:
            rank_zero_info(f"TorchrecStrategy: {removed} fused table parameter(s) left to the sparse optimizer")

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.train_pipeline is not None:
            # The step calls the pipeline, which calls the DMP (and its DDP) itself: not inside another
            # DDP forward, as Lightning's redirection would. It sets the sparse lr at every batch.
            with self.precision_plugin.train_step_context():
                return self.lightning_module.training_step(*args, **kwargs)
        self._schedule_sparse_lr()
        return super().training_step(*args, **kwargs)

    def _schedule_sparse_lr(self) -> None:
        """Sets this step's sparse learning rate before its backward, where the fused update runs
        (sharding.optimizer.lr_schedule "dense": scaled as the first dense scheduler scales its lr)."""
        if self.sparse is None or self.sharding.optimizer.lr_schedule != "dense":
            return
        configs = self.lightning_module.trainer.lr_scheduler_configs
        fraction = 1.0
        if configs:
            scheduler = configs[0].scheduler
            base = scheduler.base_lrs[0]
            fraction = scheduler.get_last_lr()[0] / base if base else 1.0
        for group in self.sparse.param_groups:
            group["lr"] = self.sharding.optimizer.lr * fraction
        self.sparse.step()  # only hands the lr to the fused kernels: their update runs inside backward

    def _check_same_batch_counts(self, what: str, counts: Any) -> None:
        """Every sharded lookup is a collective: a rank with fewer batches leaves the others waiting
        forever. Compare the counts up front and fail on every rank instead."""
        if self.world_size < 2:
            return
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, counts)
        if any(g != gathered[0] for g in gathered):
            raise RuntimeError(
                f"TorchrecStrategy: the ranks would run different numbers of {what} batches (per rank: {gathered}); "
                "the sharded embedding lookups need every rank in every step, so the data must give each rank as "
                "many batches (and, for training, batches of one size): pad or drop the remainder"
            )

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        self._check_same_batch_counts("training", trainer.num_training_batches)
        _carry_step_count(trainer, pipelined=self.train_pipeline is not None)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.train_pipeline is not None:
            self.train_pipeline.pause()
        trainer = self.lightning_module.trainer
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        self._check_same_batch_counts("validation", counts)

    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self.train_pipeline is not None:
            self.train_pipeline.resume()

    def on_test_start(self) -> None:
        super().on_test_start()
        self._check_same_batch_counts("test", self.lightning_module.trainer.num_test_batches)

    def teardown(self) -> None:
        # Keep the sharded model where it is (Strategy.teardown would move it to the CPU, which the
        # fused kernels' buffers do not survive); hand back the LightningModule itself.
        self.model = self.lightning_module
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("TorchrecStrategy.save_checkpoint takes no storage_options: it writes with torch.distributed.checkpoint")
        path = Path(self.broadcast(str(filepath)))
        metadata = dict(checkpoint)
        metadata.pop("state_dict", None)  # the live model is saved instead, shard by shard
        with_optimizers = metadata.pop("optimizer_states", None) is not None
        save_checkpoint(path, self.model, self.optimizers if with_optimizers else None, metadata=metadata)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        return load_checkpoint(path, self.model, self.optimizers or None, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint loaded the model

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint loaded the optimizers


if "torchrec" not in StrategyRegistry:
    StrategyRegistry.register(
        "torchrec", TorchrecStrategy, description="torchrec DistributedModelParallel: sharded tables, DDP for the rest"
    )
