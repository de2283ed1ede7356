"""Block attention benchmark: our backends against PyTorch's attention kernels on 64-token blocks.

    python -m benchmarks.bench_attention --out benchmarks/results/attention_h200
    python -m benchmarks.bench_attention --out /tmp/attention_quick --quick           # fast GPU smoke
    python -m benchmarks.bench_attention --out /tmp/attention_cpu --device cpu --quick # tiny CPU smoke
    python -m benchmarks.bench_attention --out /tmp/attention_graph --graph           # + CUDA-graph replay

With --graph, fwd and fwd+bwd are also captured in a CUDA graph and timed by replaying it: the
device time alone, without the host work of a Python call (which for a sub-millisecond forward can
be as long as the kernel); graph bwd = graph fwd+bwd - graph fwd.

Times fwd, bwd and fwd+bwd, with and without rotary, of every implementation on every shape, and
writes <out>.json (one row per impl x shape x pass x rotary) and <out>.md. benchmarks/README.md
describes the implementations, the byte counts and the JSON schema.
"""

import argparse
import datetime
import functools
import gc
import importlib.metadata
import importlib.util
import json
import math
import platform
import shlex
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kernels import (
    BLOCK_SIZE,
    BlockTable,
    Rotary,
    apply_rotary,
    block_attention,
    block_attention_reference,
    block_table,
    check_backend,
    offsets_from_lengths,
    rotary_tables,
)
from kernels.backend import launch_json
from kernels.block_attention_flex import FLEX_TILE, flex_block_attention, flex_block_mask
from kernels.testing import parity

PASSES = ("fwd", "bwd", "fwd+bwd")
# T*H*D-element tensors a pass must move at least once: fwd reads q, k, v and writes o; bwd reads
# q, k, v, o, dO and writes dq, dk, dv.
TENSORS_MOVED = {"fwd": 4, "bwd": 8, "fwd+bwd": 12}
# How many times a pass reads the fp32 cos/sin tables when rotary is on.
TABLE_READS = {"fwd": 1, "bwd": 1, "fwd+bwd": 2}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
JAGGED_MIN_FRACTION = 0.4  # jagged lengths are uniform in [0.4 * max_len, max_len], like Meta's benchmark
# Our backends are judged by kernels.testing.parity (once per backend, head_dim and rotary setting).
# The peers are not block_attention backends; each is sanity-checked against the reference on the
# batch's first sequences, so a peer that computes another function is never timed as if it didn't.
CHECK_SEQUENCES = 4
CHECK_TOLERANCE = 3e-2  # max abs error; bf16 rounding stays well below, a wrong mask or layout errs by ~0.1+
SEPARATE_ROTARY = "+separate_rotary"
# FlexAttention's sparse tile: kernels/block_attention_flex.py's (128, which inductor's default kernel configs accept);
# `--flex-tile 64` matches our blocks and asks for 64x64 kernel tiles, which inductor may reject.

SHAPES = {
    "full": ("1024x512x4x128", "2048x256x4x64", "512x1024x8x64"),
    "jagged": ("jagged:1152x1024x4x128", "jagged:1152x4096x4x128"),
}
QUICK_SHAPES = {"full": ("1024x512x4x128",), "jagged": ("jagged:1152x1024x4x128",)}
CPU_SHAPES = {"full": ("4x128x2x32",), "jagged": ("jagged:6x256x2x32",)}


def log(message: str = "") -> None:
    print(message, flush=True)


# ---------------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """B sequences of S tokens (full blocks), or of random lengths up to S (jagged); H heads of D."""

    batch: int
    seq_len: int
    heads: int
    head_dim: int
    jagged: bool = False

    def __post_init__(self):
        if min(self.batch, self.seq_len, self.heads, self.head_dim) < 1:
            raise ValueError(f"shape {self.label}: every dimension must be positive")
        if not self.jagged and self.seq_len % BLOCK_SIZE:
            raise ValueError(f"full-block shape {self.label}: S = {self.seq_len} must be a multiple of {BLOCK_SIZE}")
        if self.head_dim % 2:
            raise ValueError(f"shape {self.label}: rotary needs an even head_dim, got {self.head_dim}")

    @property
    def label(self) -> str:
        dims = f"{self.batch}x{self.seq_len}x{self.heads}x{self.head_dim}"
        return f"jagged:{dims}" if self.jagged else dims


def parse_shape(label: str) -> Shape:
    """`BxSxHxD` (full blocks) or `jagged:BxMAXLENxHxD`, the inverse of Shape.label."""
    parts = label.removeprefix("jagged:").split("x")
    if len(parts) != 4 or not all(part.isdigit() for part in parts):
        raise ValueError(f"shape {label!r} is not BxSxHxD or jagged:BxMAXLENxHxD (e.g. 1024x512x4x128)")
    return Shape(*map(int, parts), jagged=label.startswith("jagged:"))


def select_shapes(specs: list[str], device_type: str, quick: bool) -> list[Shape]:
    """Each spec is a kind ("full", "jagged"), expanded per device and mode, or an explicit label."""
    table = CPU_SHAPES if device_type == "cpu" else QUICK_SHAPES if quick else SHAPES
    return [parse_shape(label) for spec in specs for label in table.get(spec, (spec,))]


def sequence_lengths(shape: Shape, seed: int) -> torch.Tensor:
    """int64 [B] on CPU: all S for full blocks, seeded uniform in [ceil(0.4 S), S] for jagged."""
    if not shape.jagged:
        return torch.full((shape.batch,), shape.seq_len, dtype=torch.int64)
    low = math.ceil(JAGGED_MIN_FRACTION * shape.seq_len)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, shape.seq_len + 1, (shape.batch,), generator=generator)


# ----------------------------------------------------------------------------------------- bandwidth


def min_bytes(pass_: str, tokens: int, heads: int, head_dim: int, elem_size: int, rotary: bool) -> int:
    """Bytes a pass must move at the least: its T*H*D tensors, plus fp32 cos and sin with rotary."""
    moved = TENSORS_MOVED[pass_] * tokens * heads * head_dim * elem_size
    tables = TABLE_READS[pass_] * 2 * tokens * (head_dim // 2) * 4 if rotary else 0
    return moved + tables


def frac_copy_bw(nbytes: int, ms: float, copy_bw_tbps: float) -> float:
    """The fraction of the measured copy bandwidth that moving `nbytes` in `ms` achieves."""
    return nbytes / (ms * 1e-3) / (copy_bw_tbps * 1e12)


# -------------------------------------------------------------------------------------------- inputs


@dataclass
class Inputs:
    shape: Shape
    offsets: torch.Tensor  # int32 [B+1]
    table: BlockTable  # built once, as a model builds it once per batch for all its layers
    q: torch.Tensor  # [T, H, D] leaves that require grad
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor  # [T, H, D]
    cos: torch.Tensor  # fp32 [T, D/2], precomputed so no row times the table computation
    sin: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.q.shape[0]


def make_inputs(shape: Shape, device: torch.device, seed: int, dtype: torch.dtype = torch.bfloat16) -> Inputs:
    lengths = sequence_lengths(shape, seed)
    offsets = offsets_from_lengths(lengths, device)
    tokens = int(lengths.sum())
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn() -> torch.Tensor:
        return torch.randn(tokens, shape.heads, shape.head_dim, device=device, dtype=dtype, generator=generator)

    q, k, v = (randn().requires_grad_() for _ in range(3))
    cos, sin = rotary_tables(Rotary(), offsets, tokens, shape.head_dim)
    return Inputs(shape, offsets, block_table(offsets, tokens), q, k, v, randn(), cos, sin)


# ----------------------------------------------------------------------------------- implementations


class SkipRow(Exception):
    """This implementation cannot run these inputs; the message says why."""


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


# -------------------------------------------------------------------------------------------- timing


def cpu_median_ms(fn: Callable, warmup_ms: float, rep_ms: float) -> float:
    """Median wall time of fn on CPU, where do_bench's device events don't exist."""
    for budget_ms in (warmup_ms, rep_ms):  # the first round only warms up
        times = []
        while len(times) < 3 or sum(times) < budget_ms:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def make_timer(device: torch.device, warmup_ms: int, rep_ms: int) -> Callable[[Callable], float]:
    if device.type == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return lambda fn: cpu_median_ms(fn, warmup_ms, rep_ms)


def time_pass(pass_: str, forward: Callable, inputs: Inputs, timer: Callable) -> tuple[float, str | None]:
    """(ms, how bwd was timed) for one pass. bwd replays autograd.grad on one retained forward graph."""
    leaves, grad_out = (inputs.q, inputs.k, inputs.v), inputs.grad_out

    def run_forward():
        return forward(*leaves)

    def run_forward_backward():
        torch.autograd.grad(run_forward(), leaves, grad_out)

    if pass_ == "fwd":
        return timer(run_forward), None
    if pass_ == "fwd+bwd":
        return timer(run_forward_backward), None
    out = run_forward()
    try:
        return timer(lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)), "retain_graph"
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as error:  # a graph that can't be replayed: fall back to a difference of two timings
        reason = describe(error)
    finally:
        del out
    return timer(run_forward_backward) - timer(run_forward), f"fwd+bwd minus fwd; retain_graph failed: {reason}"


def replay_ms(fn: Callable, timer: Callable) -> float:
    """timer's median of fn replayed from a CUDA graph: device time without the host's work. The
    graph (and its memory pool) is released on return."""
    side = torch.cuda.Stream()  # capture wants one run first, off the capturing stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timer(graph.replay)


def time_graphs(forward: Callable, inputs: Inputs, timer: Callable) -> dict[str, float]:
    """Replay medians of fwd and fwd+bwd captured in CUDA graphs; bwd is their difference (a
    backward alone can't be captured: autograd runs it on the forward's stream, not the capture's)."""
    leaves, grad_out = (inputs.q, inputs.k, inputs.v), inputs.grad_out
    ms = {
        "fwd": replay_ms(lambda: forward(*leaves), timer),
        "fwd+bwd": replay_ms(lambda: torch.autograd.grad(forward(*leaves), leaves, grad_out), timer),
    }
    ms["bwd"] = ms["fwd+bwd"] - ms["fwd"]
    return ms


def measure_copy_bw_tbps(device: torch.device, nbytes: int, timer: Callable) -> float:
    """Device-to-device copy bandwidth, (bytes read + bytes written) / time, in TB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e12


def free_memory(device: torch.device, after_error: bool = False) -> None:
    if after_error:  # a traceback's frames may hold tensors in reference cycles; a full gc costs ~0.3 s
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- rows


def describe(error: BaseException, warned: list | tuple = ()) -> str:
    """One line for a skip reason: the error's first line, plus any warnings that explain it (SDPA)."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    text = first if isinstance(error, SkipRow) else f"{type(error).__name__}: {first}"
    # SDPA says only "No available kernel"; the reasons each backend declined come as warnings.
    notes = dict.fromkeys(str(w.message).strip().splitlines()[0] for w in warned if str(w.message).strip())
    if notes and "No available kernel" in first:
        text += " [warnings: " + " | ".join(notes) + "]"
    return text[:600]


def make_row(
    impl: str, inputs: Inputs, pass_: str, rotary: bool, copy_bw_tbps: float, ms: float | None = None,
    max_abs_err: float | None = None, correct: bool = False, check: str | None = None, bwd_timing: str | None = None,
    skip_reason: str | None = None,
) -> dict:
    shape = inputs.shape
    nbytes = min_bytes(pass_, inputs.tokens, shape.heads, shape.head_dim, inputs.q.element_size(), rotary)
    if ms is None:
        status = "skipped"
    else:
        status = "ok" if correct else "mismatch"
    return {
        "impl": impl,
        "shape": shape.label,
        "pass": pass_,
        "rotary": rotary,
        "ms": ms,
        "frac_copy_bw": None if ms is None else frac_copy_bw(nbytes, ms, copy_bw_tbps),
        "speedup_vs_fa2": None,  # filled in by add_speedups once the fa2 rows exist
        "status": status,
        "skip_reason": skip_reason,
        "max_abs_err": max_abs_err,
        "check": check,
        "bwd_timing": bwd_timing,
        "graph_ms": None,  # filled in by bench_impl under --graph
        "graph_frac_copy_bw": None,
        "graph_speedup_vs_fa2": None,
        "graph_skip_reason": None,
        "tokens": inputs.tokens,
        "min_bytes": nbytes,
    }


def warm_up(impl: Impl, inputs: Inputs, rotary: bool) -> tuple[Callable, float]:
    """(forward, its max abs error vs the reference) after one fwd+bwd that compiles and autotunes
    outside the timed region. Any failure becomes SkipRow, with the warnings that explain it."""
    leaves = (inputs.q, inputs.k, inputs.v)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            forward = build_forward(impl, inputs, rotary)
            out = forward(*leaves)
            torch.autograd.grad(out, leaves, inputs.grad_out)
        except Exception as error:
            raise SkipRow(describe(error, warned)) from None
    return forward, reference_error(out, inputs, rotary)


def bench_impl(impl: Impl, inputs: Inputs, rotary: bool, timer: Callable, copy_bw_tbps: float,
               graph: bool = False) -> list[dict]:
    """The three pass rows of one impl on one shape; failures become skipped rows with the reason."""
    device = inputs.q.device
    try:
        forward, max_abs_err = warm_up(impl, inputs, rotary)
        correct, check = judge(impl, inputs, rotary, max_abs_err)
        reason = None
    except Exception as error:
        reason = describe(error)
    free_memory(device, after_error=reason is not None)
    if reason is not None:
        return [make_row(impl.name, inputs, p, rotary, copy_bw_tbps, skip_reason=reason) for p in PASSES]
    rows = []
    for pass_ in PASSES:
        try:
            ms, bwd_timing = time_pass(pass_, forward, inputs, timer)
            row = make_row(impl.name, inputs, pass_, rotary, copy_bw_tbps, ms, max_abs_err, correct, check, bwd_timing)
        except Exception as error:
            row = make_row(impl.name, inputs, pass_, rotary, copy_bw_tbps, skip_reason=describe(error))
        rows.append(row)
        free_memory(device, after_error=row["ms"] is None)
    if graph:
        graph_ms, graph_skip_reason = {}, None
        try:
            graph_ms = time_graphs(forward, inputs, timer)
        except Exception as error:
            graph_skip_reason = describe(error)
        for row in rows:
            row["graph_ms"] = graph_ms.get(row["pass"])
            row["graph_skip_reason"] = graph_skip_reason
            if row["graph_ms"] is not None:
                row["graph_frac_copy_bw"] = frac_copy_bw(row["min_bytes"], row["graph_ms"], copy_bw_tbps)
        free_memory(device, after_error=not graph_ms)
    return rows


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_fa2 = fa2 ms / ms for the same shape, pass and rotary (None without both); the
    same for the CUDA-graph times."""
    for prefix in ("", "graph_"):
        ms = prefix + "ms"
        fa2_ms = {(r["shape"], r["pass"], r["rotary"]): r[ms] for r in rows if r["impl"] == "fa2" and r.get(ms)}
        for row in rows:
            baseline = fa2_ms.get((row["shape"], row["pass"], row["rotary"]))
            row[prefix + "speedup_vs_fa2"] = baseline / row[ms] if baseline and row.get(ms) else None


def rotary_fusion(rows: list[dict]) -> list[dict]:
    """Issue 4: each X+separate_rotary row against X fused (rotary=True) and X without rotary."""
    ms = {(r["impl"], r["shape"], r["pass"], r["rotary"]): r["ms"] for r in rows}
    summary = []
    for row in rows:
        if not row["impl"].endswith(SEPARATE_ROTARY) or row["ms"] is None:
            continue
        backend = row["impl"].removesuffix(SEPARATE_ROTARY)
        separate = row["ms"]
        fused = ms.get((backend, row["shape"], row["pass"], True))
        attention = ms.get((backend, row["shape"], row["pass"], False))
        fused_cost = fused - attention if fused and attention else None
        separate_cost = separate - attention if attention else None
        measurable = fused_cost is not None and fused_cost > 0 and separate_cost is not None
        summary.append({
            "backend": backend,
            "shape": row["shape"],
            "pass": row["pass"],
            "attention_ms": attention,  # the backend without rotary
            "fused_ms": fused,  # attention with fused rotary
            "separate_ms": separate,  # attention without rotary + compiled rotary ops
            "separate_over_fused": separate / fused if fused else None,
            # What rotary adds on top of attention, separate vs fused (None if fused adds nothing measurable).
            "rotary_cost_ratio": separate_cost / fused_cost if measurable else None,
        })
    return summary


# ------------------------------------------------------------------------------------------- reports


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _cell(text: str, limit: int = 160) -> str:
    text = text.replace("|", "/").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _note(row: dict) -> str:
    if row["status"] == "skipped":
        return "skipped: " + _cell(row["skip_reason"] or "")
    notes = []
    if row["status"] == "mismatch":
        notes.append(f"MISMATCH: {row['check']}")
    if row["bwd_timing"] and row["bwd_timing"] != "retain_graph":
        notes.append(_cell(row["bwd_timing"]))
    return "; ".join(notes)


def render_shape_table(rows: list[dict], shape_label: str) -> str:
    """One shape's rows, grouped by pass then rotary so the impls being compared sit together."""
    selected = [r for r in rows if r["shape"] == shape_label]
    selected.sort(key=lambda r: (PASSES.index(r["pass"]), r["rotary"]))  # stable: impl order kept
    tokens = selected[0]["tokens"] if selected else 0
    graphed = any(r.get("graph_ms") is not None for r in selected)
    graph_head, graph_rule = (" graph ms | graph % copy | graph vs fa2 | eager / graph |", "---:|---:|---:|---:|") if graphed else ("", "")
    lines = [
        f"### {shape_label} (T = {tokens} tokens)",
        "",
        f"| impl | pass | rotary | ms | % copy BW | speedup vs fa2 |{graph_head} note |",
        f"|---|---|---|---:|---:|---:|{graph_rule}---|",
    ]
    for r in selected:
        graph_cells = ""
        if graphed:
            frac = r.get("graph_frac_copy_bw")
            # Host cost an eager call adds beyond its device time (the graph replay has none).
            eager_over_graph = r["ms"] / r["graph_ms"] if r["ms"] and r.get("graph_ms") else None
            graph_cells = (f" {_fmt(r.get('graph_ms'), '.3f')} | {_fmt(None if frac is None else 100 * frac, '.1f', '%')} "
                           f"| {_fmt(r.get('graph_speedup_vs_fa2'), '.2f', '×')} | {_fmt(eager_over_graph, '.2f', '×')} |")
        lines.append(
            f"| {r['impl']} | {r['pass']} | {'yes' if r['rotary'] else 'no'} | {_fmt(r['ms'], '.3f')} "
            f"| {_fmt(None if r['frac_copy_bw'] is None else 100 * r['frac_copy_bw'], '.1f', '%')} "
            f"| {_fmt(r['speedup_vs_fa2'], '.2f', '×')} |{graph_cells} {_note(r)} |"
        )
    return "\n".join(lines)


def render_rotary_fusion(summary: list[dict]) -> str:
    lines = [
        "### Fused vs separate rotary (issue 4)",
        "",
        "attention = the backend without rotary; fused = with `rotary=Rotary(...)`; separate = without rotary "
        "after compiled rotary ops. rotary cost ratio = (separate − attention) / (fused − attention).",
        "",
        "| backend | shape | pass | attention ms | fused ms | separate ms | separate / fused | rotary cost ratio |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        lines.append(
            f"| {s['backend']} | {s['shape']} | {s['pass']} | {_fmt(s['attention_ms'], '.3f')} "
            f"| {_fmt(s['fused_ms'], '.3f')} | {_fmt(s['separate_ms'], '.3f')} | {_fmt(s['separate_over_fused'], '.2f', '×')} "
            f"| {_fmt(s['rotary_cost_ratio'], '.2f', '×')} |"
        )
    return "\n".join(lines)


def render_markdown(report: dict) -> str:
    settings = report["settings"]
    versions = ", ".join(f"{name} {value}" for name, value in report["versions"].items())
    lines = [
        "# Block attention benchmark",
        "",
        f"- device: {report['device']}",
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        f"- versions: {versions}",
        f"- copy ceiling: {_fmt(report['copy_bw_tbps'], '.3f')} TB/s (device-to-device copy of "
        f"{settings['copy_bytes'] / 2**30:g} GiB, bytes read + written)",
        f"- timing: {settings['timer']}, median, warmup {settings['warmup_ms']} ms, rep {settings['rep_ms']} ms; "
        "bwd replays `torch.autograd.grad(..., retain_graph=True)` on one forward graph",
        f"- data: {settings['dtype']} random normal, seed {settings['seed']}; % copy BW = minimum bytes "
        "(fwd 4, bwd 8, fwd+bwd 12 × T·H·D elements, plus the fp32 cos/sin tables per pass with rotary) "
        "/ time / copy ceiling",
        "",
    ]
    for label in dict.fromkeys(r["shape"] for r in report["rows"]):
        lines += [render_shape_table(report["rows"], label), ""]
    if report["rotary_fusion"]:
        lines += [render_rotary_fusion(report["rotary_fusion"]), ""]
    return "\n".join(lines)


def write_report(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1) + "\n")
    Path(f"{out}.md").write_text(render_markdown(report))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def versions() -> dict:
    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        found["triton"] = triton.__version__  # fbtriton installs as the `triton` module too
    except ImportError:
        found["triton"] = None
    try:
        found["tlx"] = importlib.util.find_spec("triton.language.extra.tlx") is not None
    except ImportError:
        found["tlx"] = False
    for dist in ("fbtriton", "triton-utlx", "flash-attn"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


# ----------------------------------------------------------------------------------------------- cli


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output path without extension; writes <out>.json and <out>.md")
    parser.add_argument(
        "--shapes", default="full,jagged",
        help="comma-separated: `full`, `jagged` (the standard sets) or explicit BxSxHxD / jagged:BxMAXLENxHxD labels",
    )
    parser.add_argument("--flex-tile", type=int, choices=(64, 128), default=FLEX_TILE, help="FlexAttention sparse/kernel tile")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, from: {', '.join(IMPLS)}")
    parser.add_argument("--rotary", choices=("both", "off", "on"), default="both")
    parser.add_argument("--quick", action="store_true", help="one shape per kind, short timing: a fast GPU smoke run")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny shapes, for a smoke test)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--graph", action="store_true", help="also time fwd and fwd+bwd replayed from CUDA graphs")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="bfloat16",
        help="bfloat16 (default); float16/float32 let the Triton CPU interpreter (TRITON_INTERPRET=1) run",
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.impls.split(",") if name not in IMPLS]
    if unknown:
        parser.error(f"unknown --impls {', '.join(unknown)}; choose from {', '.join(IMPLS)}")
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA GPU is available; use --device cpu --quick for the CPU smoke test")
    try:
        args.shape_list = select_shapes(args.shapes.split(","), args.device.type, args.quick)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = args.device
    # Compiled backward graphs donate their buffers by default, which forbids replaying one
    # backward (retain_graph) for the bwd-only timing; keep them replayable for every impl alike.
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False
    global FLEX_TILE
    FLEX_TILE = args.flex_tile
    warmup_ms, rep_ms = (5, 20) if args.quick else (25, 100)
    copy_bytes = 64 * 2**20 if device.type == "cpu" else 2**30 if args.quick else 4 * 2**30
    timer = make_timer(device, warmup_ms, rep_ms)
    rotary_settings = {"both": (False, True), "off": (False,), "on": (True,)}[args.rotary]
    impls = [IMPLS[name] for name in args.impls.split(",")]
    report = {
        "device": device_name(device),
        "versions": versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": f"python -m benchmarks.bench_attention {shlex.join(argv)}",
        "settings": {
            "timer": "triton.testing.do_bench" if device.type == "cuda" else "time.perf_counter",
            "warmup_ms": warmup_ms, "rep_ms": rep_ms, "copy_bytes": copy_bytes, "dtype": args.dtype, "seed": args.seed,
            "flex_tile": FLEX_TILE, "graph": args.graph,
        },
        "copy_bw_tbps": None,
        "rows": [],
        "rotary_fusion": [],
    }
    log(f"{report['device']} | {report['versions']}")
    report["copy_bw_tbps"] = measure_copy_bw_tbps(device, copy_bytes, timer)
    free_memory(device)
    log(f"copy ceiling: {report['copy_bw_tbps']:.3f} TB/s")
    for shape in args.shape_list:
        torch.compiler.reset()  # static-shape compiles per shape, never near the recompile limit
        started = time.perf_counter()
        inputs = make_inputs(shape, device, args.seed, DTYPES[args.dtype])
        log(f"\n== {shape.label}: T = {inputs.tokens} tokens")
        for impl in impls:
            for rotary in rotary_settings:
                if impl.rotary_only and not rotary:
                    continue
                rows = bench_impl(impl, inputs, rotary, timer, report["copy_bw_tbps"], args.graph and device.type == "cuda")
                report["rows"] += rows
                for r in rows:
                    result = f"{r['ms']:.3f} ms {_note(r)}" if r["ms"] is not None else f"skipped: {r['skip_reason']}"
                    if r["graph_ms"] is not None or r["graph_skip_reason"]:
                        result += f" | graph {r['graph_ms']:.3f} ms" if r["graph_ms"] is not None else f" | graph: {r['graph_skip_reason']}"
                    log(f"  {r['impl']:<24} {r['pass']:<7} rotary={'yes' if rotary else 'no':<3} {result}")
        del inputs
        free_memory(device)
        add_speedups(report["rows"])
        report["rotary_fusion"] = rotary_fusion(report["rows"])
        write_report(report, Path(args.out))  # after every shape, so a cut-short run keeps what it measured
        log(f"\n{render_shape_table(report['rows'], shape.label)}\n({time.perf_counter() - started:.0f} s)")
    if report["rotary_fusion"]:
        log("\n" + render_rotary_fusion(report["rotary_fusion"]))
    log(f"\nwrote {args.out}.json and {args.out}.md")
    return report


if __name__ == "__main__":
    main()
