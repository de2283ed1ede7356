"""The implementations the attention benchmark times: our block_attention backends and PyTorch's
attention kernels (FlashAttention-2, cuDNN, memory-efficient SDPA, FlexAttention), each with rotary
fused or as separate compiled ops, and how each one's output is judged correct."""

import functools
import json
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.attention_workload import Inputs
from benchmarks.harness import SkipRow
from kernels import BLOCK_SIZE, Rotary, apply_rotary, block_attention, block_attention_reference, check_backend
from kernels.backend import launch_json
from kernels.block_attention_flex import FLEX_TILE, flex_block_attention, flex_block_mask
from kernels.testing import parity

# Our backends are judged by kernels.testing.parity (once per backend, head_dim and rotary setting).
# The peers are not block_attention backends; each is sanity-checked against the reference on the
# batch's first sequences, so a peer that computes another function is never timed as if it didn't.
CHECK_SEQUENCES = 4
CHECK_TOLERANCE = 3e-2  # max abs error; bf16 rounding stays well below, a wrong mask or layout errs by ~0.1+
SEPARATE_ROTARY = "+separate_rotary"
# FLEX_TILE, FlexAttention's sparse tile, is kernels/block_attention_flex.py's (128, which inductor's default kernel
# configs accept); bench_attention's `--flex-tile 64` rebinds it to match our blocks and asks for 64x64 kernel tiles,
# which inductor may reject.


def _require_cuda(inputs: Inputs, what: str) -> None:
    if inputs.q.device.type != "cuda":
        raise SkipRow(f"{what} needs a CUDA GPU")


def ours(backend: str, launch: dict | None = None) -> Callable:
    """kernels.block_attention with one backend and the batch's BlockTable (built once, outside the
    timed call, as the model does); it takes rotary=Rotary(cos=..., sin=...) and fuses it.
    `launch` overrides the backend's launch settings (benchmarks/sweep.py's variants)."""

    def make(inputs: Inputs) -> Callable:
        check_backend(backend, inputs.q.device)  # before anything compiles for it

        def attend(q, k, v, rotary=None):
            return block_attention(q, k, v, inputs.table, rotary=rotary, backend=backend, launch=launch)

        return attend

    return make


def folded_sdpa(backend_name: str) -> Callable:
    """SDPA restricted to one backend, on the blocks folded into the batch: [T/64, H, 64, D]."""

    def make(inputs: Inputs) -> Callable:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        _require_cuda(inputs, f"SDPA {backend_name}")
        if inputs.shape.jagged:
            raise SkipRow("folding blocks into the batch needs every block full; jagged sequences end in partial blocks")
        backend = getattr(SDPBackend, backend_name)

        def fold(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(0, (-1, BLOCK_SIZE)).transpose(1, 2)

        def attend(q, k, v):
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(fold(q), fold(k), fold(v))
            return out.transpose(1, 2).flatten(0, 1)

        return attend

    return make


def fa2(inputs: Inputs) -> Callable:
    """PyTorch's FlashAttention-2: varlen over the blocks (our fa2 backend) when jagged, else folded SDPA."""
    if inputs.shape.jagged:
        return ours("fa2")(inputs)
    return folded_sdpa("FLASH_ATTENTION")(inputs)


def flex(inputs: Inputs) -> Callable:
    """Compiled FlexAttention with the block-diagonal BlockMask of kernels/block_attention_flex.py (the flex backend's),
    built once outside the timed call, at sparse tile FLEX_TILE."""
    _require_cuda(inputs, "FlexAttention's backward")
    block_mask = flex_block_mask(inputs.table, FLEX_TILE)

    def attend(q, k, v):
        return flex_block_attention(q, k, v, block_mask)

    return attend


def rotate_qk(q, k, cos, sin):
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


@functools.cache
def compiled_rotate_qk() -> Callable:
    """Rotary as separate compiled ops (q and k in one graph): the best a user of a peer kernel can do."""
    return torch.compile(rotate_qk, dynamic=False)


@dataclass(frozen=True)
class Impl:
    name: str
    make: Callable[[Inputs], Callable]  # inputs -> attend(q, k, v); raises SkipRow if it can't run them
    fused_rotary: bool  # attend takes rotary=Rotary(...); otherwise compiled ops rotate q and k first
    rotary_only: bool = False
    backend: str | None = None  # ours: the block_attention backend, judged by kernels.testing.parity
    launch: str = ""  # ours: its launch overrides as kernels.backend.launch_json gives them


def our_impl(backend: str, name: str | None = None, launch: dict | None = None, separate_rotary: bool = False) -> Impl:
    """The Impl of one of our backends: named after it (with SEPARATE_ROTARY when rotary runs as
    separate compiled ops before it) unless `name` is given."""
    name = name or backend + (SEPARATE_ROTARY if separate_rotary else "")
    return Impl(name, ours(backend, launch), fused_rotary=not separate_rotary, rotary_only=separate_rotary,
                backend=backend, launch=launch_json(launch))


IMPLS = {
    impl.name: impl
    for impl in (
        our_impl("reference"),
        Impl("fa2", fa2, fused_rotary=False),
        Impl("cudnn", folded_sdpa("CUDNN_ATTENTION"), fused_rotary=False),
        Impl("mem_efficient", folded_sdpa("EFFICIENT_ATTENTION"), fused_rotary=False),
        Impl("flex", flex, fused_rotary=False),
        our_impl("triton"),
        our_impl("tlx"),
        # Issue 4: our kernel without rotary after compiled rotary ops, against the same kernel fused.
        our_impl("triton", separate_rotary=True),
        our_impl("tlx", separate_rotary=True),
    )
}


def build_forward(impl: Impl, inputs: Inputs, rotary: bool) -> Callable:
    """forward(q, k, v) -> [T, H, D]: the impl's attention, with rotary from the precomputed tables."""
    attend = impl.make(inputs)
    if not rotary:
        return attend
    if impl.fused_rotary:
        tables = Rotary(cos=inputs.cos, sin=inputs.sin)
        return lambda q, k, v: attend(q, k, v, rotary=tables)
    rotate = compiled_rotate_qk()
    cos, sin = inputs.cos, inputs.sin
    return lambda q, k, v: attend(*rotate(q, k, cos, sin), v)


def reference_error(out: torch.Tensor, inputs: Inputs, rotary: bool) -> float:
    """Max abs difference from the fp32 reference on the first sequences, which don't see the rest."""
    offsets = inputs.offsets[: min(CHECK_SEQUENCES, inputs.shape.batch) + 1]
    end = int(offsets[-1])
    tables = (inputs.cos[:end], inputs.sin[:end]) if rotary else (None, None)
    q, k, v = (x.detach()[:end] for x in (inputs.q, inputs.k, inputs.v))
    expected = block_attention_reference(q, k, v, offsets, *tables)
    return (out.detach()[:end].float() - expected.float()).abs().max().item()


@functools.cache
def _parity(backend: str, launch: str, heads: int, head_dim: int, dtype: torch.dtype, rotary: bool,
            device: torch.device):
    return parity(backend, heads=heads, head_dim=head_dim, dtype=dtype, rotary=Rotary() if rotary else None,
                  device=device, launch=json.loads(launch) if launch else None)


def judge(impl: Impl, inputs: Inputs, rotary: bool, max_abs_err: float) -> tuple[bool, str]:
    """(correct, how it was judged): parity for our backends, the sanity check for peers."""
    if impl.backend is None:
        return max_abs_err <= CHECK_TOLERANCE, f"max abs err {max_abs_err:.3g} vs reference (tolerance {CHECK_TOLERANCE})"
    result = _parity(impl.backend, impl.launch, inputs.shape.heads, inputs.shape.head_dim, inputs.q.dtype,
                     rotary and impl.fused_rotary, inputs.q.device)
    return result.ok, "parity " + ("PASS" if result.ok else "FAIL: " + "; ".join(result.failures))
