"""One entry point, `block_attention`, that validates inputs once and routes by backend name.

Backend <name> is the module kernels/block_attention_<name>.py, exporting `BACKEND`
(kernels.backend.Backend); adding one is that module plus its name in `BACKEND_MODULES`. Modules are
imported on first use, so importing `kernels` never touches a GPU driver or needs Triton/TLX to be
installed.
"""

import importlib
import warnings
from typing import Literal

import torch

from .backend import Backend, launch_json
from .blocks import BlockTable, block_table
from .rotary import Rotary, apply_rotary, rotary_tables


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run on this machine (missing device, driver or package)."""


# flex is a peer, as fa2 is: never picked by `auto`.
BACKEND_MODULES = {name: f"kernels.block_attention_{name}" for name in ("reference", "fa2", "flex", "triton", "tlx")}
BACKENDS = ("auto", *BACKEND_MODULES)
# The type of a config field that names a backend (train.py's --attn, RankingModelConfig.attn_backend):
# jsonargparse lists these values in --help and rejects any other.
AttentionBackend = Literal[BACKENDS]
# What `auto` tries, fastest first, on a GPU (on a CPU it takes the reference alone: the Triton
# interpreter is for tests and runs only when asked for by name). Measured on an H200: at head_dim
# 128 the TLX kernels are faster than the Triton ones eager and replayed from CUDA graphs
# (benchmarks/results/attention_h200.md); at head_dim 64 they tie in device time, and the compiled,
# CUDA-graph training step of configs/gpu.yaml tied or favoured Triton (benchmarks/results/compare_h200.md,
# and the earlier comparisons benchmarks/results/README.md lists), so `auto` prefers Triton there.
AUTO_ORDER = ("tlx", "triton", "fa2", "reference")
AUTO_ORDER_SMALL_HEAD_DIM = ("triton", "tlx", "fa2", "reference")

_loaded: dict[str, Backend] = {}
# Whether a backend runs on a device does not change within a process; remembered, so that calls
# traced by torch.compile (every layer of a compiled model) find it without querying the driver.
_unavailable: dict[tuple[str, torch.device], str | None] = {}


def get_backend(name: str) -> Backend:
    """The Backend object of `name`, importing its module on first use."""
    if name not in BACKEND_MODULES:
        raise ValueError(f"unknown block_attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name not in _loaded:
        _loaded[name] = importlib.import_module(BACKEND_MODULES[name]).BACKEND
    return _loaded[name]


def backend_unavailable_reason(name: str, device: torch.device | str) -> str | None:
    """Why backend `name` cannot run on `device` at all, or None if it can."""
    key = (name, torch.device(device))
    if key not in _unavailable:
        try:
            _unavailable[key] = get_backend(name).unavailable_reason(key[1])
        except ImportError as error:  # e.g. the Triton backend where the `triton` package is missing
            _unavailable[key] = f"its module {BACKEND_MODULES[name]} cannot be imported ({error})"
    return _unavailable[key]


def available_backends(device: torch.device | str) -> list[str]:
    """The backends that can run on `device` here, fastest first."""
    return [name for name in AUTO_ORDER if backend_unavailable_reason(name, device) is None]


def _auto_candidates(device: torch.device, head_dim: int = 128) -> tuple[str, ...]:
    if device.type == "cpu":
        return ("reference",)
    return AUTO_ORDER if head_dim >= 128 else AUTO_ORDER_SMALL_HEAD_DIM


def check_backend(name: str, device: torch.device | str) -> None:
    """Raises BackendUnavailableError, with what is missing and how to get it, if `name` can't run.
    Also imports the backend(s) it may use, so that no import happens inside a compiled region."""
    device = torch.device(device)
    if name == "auto":
        for candidate in _auto_candidates(device):
            backend_unavailable_reason(candidate, device)
        return
    reason = backend_unavailable_reason(name, device)
    if reason is not None:
        how_to_get = get_backend(name).how_to_get if name in _loaded else f"make {BACKEND_MODULES[name]} importable"
        raise BackendUnavailableError(
            f"block_attention backend {name!r} cannot run here: {reason}. To get it: {how_to_get}. "
            f"Backends that can run on {device.type}: {', '.join(available_backends(device))}."
        )


_warned_fallbacks: set[tuple[str, str]] = set()
# The backend name each (name, device, dtype, rank, head_dim) resolved to: all that backends'
# availability and unsupported_reason depend on (kernels.backend.Backend), so a call after the
# first costs two dict look-ups. Only resolutions that succeeded are kept; a failing one raises
# every time.
_resolved: dict[tuple, str] = {}


def _resolve(name: str, q: torch.Tensor) -> Backend:
    key = (name, q.device, q.dtype, q.dim(), q.shape[-1])
    if key not in _resolved:
        _resolved[key] = _resolve_uncached(name, q).name
    return get_backend(_resolved[key])


def _resolve_uncached(name: str, q: torch.Tensor) -> Backend:
    if name != "auto":
        check_backend(name, q.device)
        backend = get_backend(name)
        reason = backend.unsupported_reason(q)
        if reason is not None:
            raise ValueError(f"block_attention backend {name!r} does not support {reason}")
        return backend
    skipped = []
    for candidate in _auto_candidates(q.device, q.shape[-1]):
        if backend_unavailable_reason(candidate, q.device) is not None:
            continue  # a missing GPU or package is expected, not worth a warning
        backend = get_backend(candidate)
        reason = backend.unsupported_reason(q)
        if reason is None:
            break
        skipped.append(f"{candidate}: {reason}")
    if skipped and (candidate, skipped[0]) not in _warned_fallbacks:
        # Only an input the faster backend rejects is worth a warning.
        _warned_fallbacks.add((candidate, skipped[0]))
        warnings.warn(f"block_attention auto: using {candidate!r}; skipped {'; '.join(skipped)}", stacklevel=3)
    return backend


def _validate_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, device: torch.device) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            raise ValueError(f"{name} must be (total_tokens, heads, head_dim), got shape {tuple(x.shape)}")
        if x.shape != q.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, q has {tuple(q.shape)}")
        if x.dtype != q.dtype:
            raise ValueError(f"{name} is {x.dtype} and q is {q.dtype}; q, k and v must share a dtype")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} and offsets on {device}; q, k, v and offsets must share a device")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.shape[-1] > 0 and x.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous (stride 1), got strides {x.stride()}")


def validate_offsets(offsets: torch.Tensor, total_tokens: int, read_values: bool = True) -> None:
    """Raises ValueError naming the problem unless offsets is int32/int64 [B+1], starts at 0, never
    decreases and ends at total_tokens. The value checks read offsets back to the host once
    (`read_values=False`, or tracing under torch.compile, skips them)."""
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"offsets must be 1-D [batch_size + 1], got shape {tuple(offsets.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets must be int32 (int64 is accepted), got {offsets.dtype}")
    if not read_values or torch.compiler.is_compiling():
        return
    # One host read for the common, valid case; the details are gathered only to report an error.
    steps = offsets[1:] - offsets[:-1]
    bad = (offsets[0] != 0) | (offsets[-1] != total_tokens) | (steps < 0).any()
    if not bool(bad):
        return
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0:
        raise ValueError(f"offsets must start at 0, got offsets[0] = {first}")
    if bool((steps < 0).any()):
        i = int(torch.nonzero(steps < 0)[0])
        raise ValueError(f"offsets must not decrease: offsets[{i}] = {int(offsets[i])} > offsets[{i + 1}] = {int(offsets[i + 1])}")
    raise ValueError(f"offsets[-1] = {last} must equal total_tokens = {total_tokens}")


def batch_block_table(offsets: torch.Tensor | BlockTable, total_tokens: int, input_name: str,
                      check_offsets: bool = True) -> BlockTable:
    """The batch's BlockTable: `offsets` itself where it is one (it must cover the `input_name`
    tensor's total_tokens), else built from offsets once validate_offsets accepts them."""
    if isinstance(offsets, BlockTable):
        if offsets.total_tokens != total_tokens:
            raise ValueError(f"the BlockTable covers {offsets.total_tokens} tokens and {input_name} has {total_tokens}")
        return offsets
    validate_offsets(offsets, total_tokens, read_values=check_offsets)
    return block_table(offsets, total_tokens)


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor | BlockTable,
    *,
    rotary: Rotary | None = None,
    backend: str = "auto",
    check_offsets: bool = True,
    launch: dict | None = None,
) -> torch.Tensor:
    """Self-attention restricted to 64-token blocks of jagged sequences.

    q, k, v: (total_tokens, heads, head_dim). offsets: int32 [B+1] cumulative sequence lengths, or
    the batch's BlockTable from `kernels.block_table(offsets, total_tokens)`, which a model builds
    once per batch and passes to every layer so no call rebuilds it.
    Each sequence is cut into 64-token blocks from its start (the last may be partial); a token
    attends, unmasked, to every token of its own block and to no other, with scale 1/sqrt(head_dim).
    `rotary` rotates q and k (and v if `rotate_v`) first; give it precomputed `cos`/`sin` to build
    those tables once per batch too. Returns (total_tokens, heads, head_dim).
    `check_offsets` reads offsets back once to reject bad values; code that builds offsets itself
    (the model, from its own lengths) turns it off so no call waits on the device.
    `launch` overrides a kernel backend's launch settings ({"fwd": {...}, "bwd": {...}}), for
    tuning sweeps; None runs the production settings.
    """
    return _block_attention((q, k, v), None, offsets, rotary, backend, check_offsets, launch)


def block_attention_qkv(
    qkv: torch.Tensor,
    offsets: torch.Tensor | BlockTable,
    *,
    rotary: Rotary | None = None,
    backend: str = "auto",
    check_offsets: bool = True,
    launch: dict | None = None,
) -> torch.Tensor:
    """`block_attention` on q, k, v packed as qkv (total_tokens, 3, heads, head_dim), e.g. one QKV
    projection's output viewed: the same result, and its gradient comes back as one dqkv of qkv's
    shape, which the tlx and triton backends write in place; the three gradients of
    `block_attention(*qkv.unbind(1), ...)` would be stacked into one by a copy. Other backends run on
    qkv's views. Arguments otherwise as `block_attention`'s."""
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be (total_tokens, 3, heads, head_dim), got shape {tuple(qkv.shape)}")
    return _block_attention(qkv.unbind(1), qkv, offsets, rotary, backend, check_offsets, launch)


def _block_attention(qkv_views, qkv, offsets, rotary, backend, check_offsets, launch) -> torch.Tensor:
    """block_attention on q, k, v = qkv_views, through the backend's packed ops where `qkv` (their
    packed tensor, or None) is given and the backend has them."""
    q, k, v = qkv_views
    if backend not in BACKENDS:
        raise ValueError(f"unknown block_attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if launch and backend == "auto":
        raise ValueError("launch overrides need a named backend, not 'auto'")
    _validate_tensors(q, k, v, offsets.device)
    table = batch_block_table(offsets, q.shape[0], "q", check_offsets)
    chosen = _resolve(backend, q)
    if launch and not chosen.has_launch_settings:
        raise ValueError(f"the {chosen.name} backend has no launch settings to override, got {launch}")
    launch = launch_json(launch)
    cos = sin = None
    rotate_v = rotary is not None and rotary.rotate_v
    if rotary is not None:
        cos, sin = rotary_tables(rotary, table.offsets, q.shape[0], q.shape[-1])
    if q.shape[0] == 0:
        return (q + k + v) * 0  # keeps the autograd graph for empty batches without launching kernels
    if qkv is not None and chosen.run_qkv is not None:
        return chosen.run_qkv(qkv, table, cos, sin, rotate_v, launch)
    if cos is not None and not chosen.fuses_rotary:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if rotate_v:
            v = apply_rotary(v, cos, sin)
        cos = sin = None
        rotate_v = False
    return chosen.run(q, k, v, table, cos, sin, rotate_v, launch)
