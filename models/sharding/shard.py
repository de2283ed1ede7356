"""Sharding: shard_model wraps a model in torchrec's DistributedModelParallel once the ranks agree
on it, and the views of a sharded model the optimizers and checkpoints need (dense_parameters,
sparse_optimizer, load_full_tables).

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
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import torchrec
import torchrec.optim as trec_optim
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed import comm_ops
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.model_parallel import DataParallelWrapper, DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer
from torchrec.optim.optimizers import in_backward_optimizer_filter

from .config import ShardingConfig
from .plan import TableInfo, embedding_tables, make_sharders, plan_resolved_sharding, resolve_sharding_types, table_parameter

log = logging.getLogger(__name__)

# torchrec's placeholders accept the TBE's keyword arguments (beta1, weight_decay_mode, ...); the
# sharder maps each class to fbgemm's EmbOptimType and builds the fused kernel with those kwargs.
_OPTIMIZER_CLASSES = {
    "rowwise_adagrad": trec_optim.RowWiseAdagrad,
    "adagrad": trec_optim.Adagrad,
    "adam": trec_optim.Adam,
    "sgd": trec_optim.SGD,
}


def attach_sparse_optimizer(
    module: nn.Module, config: ShardingConfig, sharding_types: Mapping[str, str], tables: Mapping[str, TableInfo]
) -> list[nn.Parameter]:
    """Mark every non-data_parallel table for the fused optimizer; returns the marked (unsharded) params."""
    optimizer_class = _OPTIMIZER_CLASSES[config.optimizer.name]
    params = [table_parameter(module, tables[name]) for name, t in sharding_types.items() if t != "data_parallel"]
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
    table_ids = {id(table_parameter(module, table)) for table in tables.values()}
    for name, table in tables.items():
        fingerprint[f"table.{name}"] = (table.kind, table.num_embeddings, table.embedding_dim, sharding_types.get(name))
    dense = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters() if id(p) not in table_ids]
    fingerprint["dense_parameters"] = f"{len(dense)} tensors, sha1 {hashlib.sha1(repr(dense).encode()).hexdigest()[:12]}"
    if config.copy_weights:
        # The shards are filled from each rank's own copy of the table: they must be the same (same seed).
        for name, table in tables.items():
            weight = table_parameter(module, table).detach()
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
    originals = {name: table_parameter(module, table).detach() for name, table in tables.items()}
    fused = attach_sparse_optimizer(module, config, sharding_types, tables)
    # Ranks per host (torchrun sets LOCAL_WORLD_SIZE): the planner prices intra- vs inter-host traffic.
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None
    if local_world_size is None and device.type == "cuda":
        local_world_size = min(world_size, torch.cuda.device_count())
    plan = plan_resolved_sharding(
        module, config, tables, sharding_types, world_size=world_size, device=device,
        local_world_size=local_world_size, process_group=process_group,
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


def dense_named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs a normal optimizer must own: everything that trains except the tables
    that the fused sparse optimizer updates (data_parallel tables are included). Works on unsharded
    models too (then every trainable parameter)."""
    return [(n, p) for n, p in in_backward_optimizer_filter(module.named_parameters()) if p.requires_grad]


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
    """DMP.fused_optimizer: the fused optimizer(s) of the sharded tables, keyed by table path; None
    when model is not a DMP or shards no table. Its state_dict holds the per-table optimizer state
    (e.g. row-wise Adagrad accumulators), sharded like the tables; its param_groups hold the sparse
    learning rate."""
    fused = model.fused_optimizer if isinstance(model, DistributedModelParallel) else None
    return fused if fused is not None and fused.optimizers else None
