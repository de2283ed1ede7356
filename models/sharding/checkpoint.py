"""Checkpoints with torch.distributed.checkpoint: save_checkpoint writes a folder from every rank
(its shards, the fused sparse optimizer's state, the dense optimizers' state keyed by parameter
name), load_checkpoint reads one into any world size and plan (DCP reshards), load_unsharded into a
plain model in one process."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from .shard import sparse_optimizer

_METADATA_FILE = "metadata.pt"  # non-tensor extras (Lightning's loop state, ...), written by rank 0


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
    """optimizer.state_dict() keyed by parameter name instead of position, so it loads into any world size.

    Not torch.distributed.checkpoint.state_dict.get/set_optimizer_state_dict (checked on torch 2.13): they
    look DMP's names up as attributes (fail on the DMP), step an optimizer with no state on every save
    (AdamW's step count moves), and fail or skip silently on parameters a new plan adds or drops, where
    this starts those fresh and names the unknown ones; torchrec's KeyedOptimizerWrapper steps at the real lr."""
    names = _optimizer_names(optimizer, model)
    state = optimizer.state_dict()
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }


# {prefix now: prefix in older checkpoints}, for load_checkpoint and RankingTask.on_load_checkpoint (.ckpt
# files): RankingTask (train.py) held its network as `model` until 2026-12-04, as `net` since.
RENAMED_PREFIXES = {"net.": "model."}


def _saved_names(state: Mapping[str, Any], available: set[str]) -> dict[str, str]:
    """{name in this model: name in the checkpoint} for the parameters and buffers whose prefix was
    renamed since the checkpoint was saved (see RENAMED_PREFIXES); empty for a current checkpoint."""
    renames = {}
    for name in state["model"]:
        for new, old in RENAMED_PREFIXES.items():
            if name.startswith(new) and f"model.{name}" not in available and f"model.{old}{name[len(new):]}" in available:
                renames[name] = old + name[len(new):]
    return renames


def _renamed(state: dict[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """state with its model keys and dense-optimizer parameter names mapped through `names`."""
    if not names:
        return state
    state = dict(state, model={names.get(k, k): v for k, v in state["model"].items()})
    for key, value in state.items():
        if key.startswith("dense_optimizer_"):
            state[key] = {
                "state": {names.get(n, n): v for n, v in value["state"].items()},
                "param_groups": [{**g, "params": [names.get(n, n) for n in g["params"]]} for g in value["param_groups"]],
            }
    return state


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
    # DCP's own flattening (private), so the keys are the ones DCP wrote; no public function gives them.
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
    # Read under the names the checkpoint uses, then renamed back.
    saved_names = _saved_names(state, available)
    state = _renamed(state, saved_names)
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
    state = _renamed(state, {old: new for new, old in saved_names.items()})
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
    checkpoint (a Lightning checkpoint stores RankingTask's network under "model.net."): it is found automatically."""
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
