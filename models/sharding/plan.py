"""Planning: which tables the model has (embedding_tables), the sharding type each gets
(resolve_sharding_types, which rejects what the device's kernels would get wrong), and torchrec's
EmbeddingShardingPlanner placing them on the ranks (plan_sharding), with an error naming tables and
sizes when they do not fit."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.constants import DDR_CAP, HBM_CAP
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import PlannerError, PlannerErrorType
from torchrec.distributed.types import ShardingPlan, ShardingType

from .config import ShardingConfig

# fbgemm's CPU TBE implements these optimizers only ("Optimizer adam is not supported in CPU mode").
_CPU_OPTIMIZERS = ("rowwise_adagrad", "adagrad", "sgd")
_BYTES_PER_GB = 1024**3


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


def table_parameter(module: nn.Module, table: TableInfo) -> nn.Parameter:
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
) -> ShardingPlan:
    """Run EmbeddingShardingPlanner for module (whose tables must already carry their sparse optimizer,
    see attach_sparse_optimizer, so the plan counts optimizer state): plan_resolved_sharding for the
    sharding types resolve_sharding_types gives module's tables."""
    device = torch.device(device)
    tables = embedding_tables(module)
    return plan_resolved_sharding(
        module, config, tables, resolve_sharding_types(config, tables, device.type), world_size=world_size,
        device=device, local_world_size=local_world_size, process_group=process_group,
    )


def plan_resolved_sharding(
    module: nn.Module,
    config: ShardingConfig,
    tables: Mapping[str, TableInfo],
    sharding_types: Mapping[str, str],
    *,
    world_size: int,
    device: torch.device | str,
    local_world_size: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> ShardingPlan:
    """The plan for module's `tables` (embedding_tables(module)) with the `sharding_types` already
    resolved and checked for them (resolve_sharding_types), as shard_model has them.

    Without process_group the plan is made locally (no communication). With one, rank 0 plans and
    broadcasts the plan or the error, so every rank raises the same ValueError instead of the others
    waiting forever for a plan (torchrec's collective_plan raises on rank 0 only).
    """
    device = torch.device(device)
    device_type = device.type

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
