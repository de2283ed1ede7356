"""One entry point, `block_attention`, that validates inputs once and routes by backend name.

Adding a backend is one kernel file plus one `_BACKENDS` entry. Kernel modules are imported
lazily, so importing `kernels` never touches a GPU driver or needs Triton/TLX to be installed.
"""

import importlib
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .rotary import Rotary, rotary_tables


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run on this machine (missing device, driver or package)."""


@dataclass(frozen=True)
class Backend:
    name: str
    module: str  # kernels.<module>, imported on first use
    function: str  # the backend's public function in that module
    unsupported_reason: str  # a function (q) -> str | None in that module; None means "any input"
    how_to_get: str
    needs: Callable[[torch.device], str | None]  # why this device/stack can't run it, or None

    def load(self, attribute: str):
        # torch.compile cannot trace import_module; once check_backend has imported the module
        # (outside any compiled region), the sys.modules lookup is all that runs under compile.
        name = f"kernels.{self.module}"
        module = sys.modules.get(name) or importlib.import_module(name)
        return getattr(module, attribute)


def _needs_nothing(device: torch.device) -> str | None:
    return None


def _needs_cuda(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"it needs a CUDA GPU and the tensors are on {device.type}"
    return None


def _needs_triton_gpu(device: torch.device) -> str | None:
    import os

    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None  # the Triton interpreter runs the same kernels on CPU tensors, for tests
    reason = _needs_cuda(device)
    if reason:
        return reason + " (or TRITON_INTERPRET=1 for the slow CPU interpreter)"
    if importlib.util.find_spec("triton") is None:
        return "the `triton` package is not installed"
    return None


def _needs_tlx_hopper(device: torch.device) -> str | None:
    reason = _needs_cuda(device)
    if reason:
        return reason + " (an sm_90 Hopper GPU such as the H100/H200)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"it needs an sm_90 Hopper GPU and {torch.cuda.get_device_name(device)} is sm_{major}{minor}"
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.language.extra.tlx") is None:
        return "TLX (triton.language.extra.tlx) is not installed"
    return None


_BACKENDS = {
    "reference": Backend(
        "reference", "reference", "block_attention_reference", "", "it is pure PyTorch and always available", _needs_nothing
    ),
    "fa2": Backend(
        "fa2", "fa2", "block_attention_fa2", "fa2_unsupported_reason",
        "run on an NVIDIA GPU with a CUDA build of PyTorch (optionally `pip install flash-attn`)", _needs_cuda,
    ),
    "triton": Backend(
        "triton", "triton_block_attention", "block_attention_triton", "triton_unsupported_reason",
        "run on a GPU Triton supports with `pip install triton`, or set TRITON_INTERPRET=1 on CPU", _needs_triton_gpu,
    ),
    "tlx": Backend(
        "tlx", "tlx_block_attention", "block_attention_tlx", "tlx_unsupported_reason",
        "run on an sm_90 GPU (H100/H200) with TLX: `pip uninstall -y triton && pip install fbtriton==3.7.4`, "
        "or `pip install triton-utlx==3.8.0.post16` with Triton 3.8 / torch 2.14",
        _needs_tlx_hopper,
    ),
}
BACKENDS = ("auto", *_BACKENDS)
# Fastest first; `auto` takes the first that can run the given inputs.
_AUTO_ORDER = ("tlx", "triton", "fa2", "reference")
# Measured on an H200 (benchmarks/results/attention_h200.md): at head_dim 64 the TLX kernels' device
# time beats the Triton ones' with rotary (fwd+bwd 0.944 vs 1.060 ms replayed from a CUDA graph at
# 2048x256x4x64) and ties them without, but an eager TLX call costs the host about 0.3 ms more
# (host_profile_stages_h200.log), so eager, as the model trains, Triton is faster there (fwd+bwd
# with rotary 1.161 vs 1.326 ms); `auto` prefers it below head_dim 128. At head_dim 128 TLX is
# faster either way (fwd+bwd with rotary 1.769 vs 2.700 ms eager).
_AUTO_ORDER_SMALL_HEAD_DIM = ("triton", "tlx", "fa2", "reference")


def _auto_candidates(device: torch.device, head_dim: int) -> tuple[str, ...]:
    """What `auto` may pick, in order. On CPU that is the reference alone: the Triton interpreter
    is for tests and runs only when asked for by name."""
    if device.type == "cpu":
        return ("reference",)
    return _AUTO_ORDER if head_dim >= 128 else _AUTO_ORDER_SMALL_HEAD_DIM


def backend_unavailable_reason(name: str, device: torch.device | str) -> str | None:
    """Why backend `name` cannot run on `device` at all, or None if it can."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown block_attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return _BACKENDS[name].needs(torch.device(device))


def available_backends(device: torch.device | str) -> list[str]:
    """The backends that can run on `device` here, fastest first."""
    return [name for name in _AUTO_ORDER if backend_unavailable_reason(name, device) is None]


def check_backend(name: str, device: torch.device | str) -> None:
    """Raises BackendUnavailableError, with what is missing and how to get it, if `name` can't run.
    Also imports the backend(s) it may use, so that no import happens inside a compiled region."""
    device = torch.device(device)
    if name == "auto":
        names = [c for c in _auto_candidates(device, 128) if backend_unavailable_reason(c, device) is None]
    else:
        names = [name]
        reason = backend_unavailable_reason(name, device)
        if reason is not None:
            raise BackendUnavailableError(
                f"block_attention backend {name!r} cannot run here: {reason}. "
                f"To get it: {_BACKENDS[name].how_to_get}. "
                f"Backends that can run on {device.type}: {', '.join(available_backends(device))}."
            )
    for candidate in names:
        _BACKENDS[candidate].load(_BACKENDS[candidate].function)


def _unsupported_reason(backend: Backend, q: torch.Tensor) -> str | None:
    return backend.load(backend.unsupported_reason)(q) if backend.unsupported_reason else None


_warned_fallbacks: set[tuple[str, str]] = set()


def _resolve(name: str, q: torch.Tensor) -> Backend:
    if name != "auto":
        check_backend(name, q.device)
        backend = _BACKENDS[name]
        reason = _unsupported_reason(backend, q)
        if reason is not None:
            raise ValueError(f"block_attention backend {name!r} does not support {reason}")
        return backend
    skipped = []
    for candidate in _auto_candidates(q.device, q.shape[-1]):
        backend = _BACKENDS[candidate]
        reason = backend.needs(q.device)
        if reason is None:
            reason = _unsupported_reason(backend, q)
            if reason is None:
                break
            skipped.append(f"{candidate}: {reason}")
    if skipped and (candidate, skipped[0]) not in _warned_fallbacks:
        # Only an input the faster backend rejects is worth a warning; a missing GPU is expected.
        _warned_fallbacks.add((candidate, skipped[0]))
        warnings.warn(f"block_attention auto: using {candidate!r}; skipped {'; '.join(skipped)}", stacklevel=3)
    return backend


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, check_offsets: bool) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            raise ValueError(f"{name} must be (total_tokens, heads, head_dim), got shape {tuple(x.shape)}")
        if x.shape != q.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, q has {tuple(q.shape)}")
        if x.dtype != q.dtype:
            raise ValueError(f"{name} is {x.dtype} and q is {q.dtype}; q, k and v must share a dtype")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} and q is on {q.device}; q, k, v and offsets must share a device")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.shape[-1] > 0 and x.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous (stride 1), got strides {x.stride()}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"offsets must be 1-D [batch_size + 1], got shape {tuple(offsets.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets must be int32 (int64 is accepted), got {offsets.dtype}")
    if offsets.device != q.device:
        raise ValueError(f"offsets is on {offsets.device} and q is on {q.device}")
    if not check_offsets or torch.compiler.is_compiling():
        return  # value checks force a host sync (and a graph break inside compiled models)
    # One host read for the common, valid case; the details are gathered only to report an error.
    steps = offsets[1:] - offsets[:-1]
    bad = (offsets[0] != 0) | (offsets[-1] != q.shape[0]) | (steps < 0).any()
    if not bool(bad):
        return
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0:
        raise ValueError(f"offsets must start at 0, got offsets[0] = {first}")
    if bool((steps < 0).any()):
        i = int(torch.nonzero(steps < 0)[0])
        raise ValueError(f"offsets must not decrease: offsets[{i}] = {int(offsets[i])} > offsets[{i + 1}] = {int(offsets[i + 1])}")
    raise ValueError(f"offsets[-1] = {last} must equal total_tokens = {q.shape[0]}")


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    rotary: Rotary | None = None,
    backend: str = "auto",
    check_offsets: bool = True,
) -> torch.Tensor:
    """Self-attention restricted to 64-token blocks of jagged sequences.

    q, k, v: (total_tokens, heads, head_dim); offsets: int32 [B+1] cumulative sequence lengths.
    Each sequence is cut into 64-token blocks from its start (the last may be partial); a token
    attends, unmasked, to every token of its own block and to no other, with scale 1/sqrt(head_dim).
    `rotary` rotates q and k (and v if `rotate_v`) first. Returns (total_tokens, heads, head_dim).
    `check_offsets` reads offsets back once to reject bad values; code that builds offsets itself
    (the model, from its own lengths) turns it off so no call waits on the device.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown block_attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    _validate(q, k, v, offsets, check_offsets)
    offsets = offsets.to(torch.int32)
    chosen = _resolve(backend, q)
    cos = sin = None
    if rotary is not None:
        cos, sin = rotary_tables(rotary, offsets, q.shape[0], q.shape[-1])
    if q.shape[0] == 0:
        return (q + k + v) * 0  # keeps the autograd graph for empty batches without launching kernels
    rotate_v = rotary is not None and rotary.rotate_v
    return chosen.load(chosen.function)(q, k, v, offsets, cos, sin, rotate_v)
