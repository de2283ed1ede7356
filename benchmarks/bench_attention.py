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

This module is the CLI and the measuring of one implementation's rows; attention_workload.py holds
the shapes, inputs and byte floors, attention_impls.py the implementations and their correctness
checks, attention_report.py the speedups, the rotary summary and the markdown, and harness.py the
timers and the rest the other benchmarks share.
"""

import argparse
import datetime
import shlex
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from benchmarks import attention_impls
from benchmarks.attention_impls import IMPLS, Impl, build_forward, judge, reference_error
from benchmarks.attention_report import (
    add_speedups, render_rotary_fusion, render_shape_table, rotary_fusion, row_note, write_report,
)
from benchmarks.attention_workload import DTYPES, PASSES, Inputs, frac_copy_bw, make_inputs, min_bytes, select_shapes
from benchmarks.harness import (
    SkipRow, describe, device_name, free_memory, make_timer, measure_copy_bw_tbps, replay_ms, versions,
)


def log(message: str = "") -> None:
    print(message, flush=True)


# -------------------------------------------------------------------------------------------- timing


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


# ---------------------------------------------------------------------------------------------- rows


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


# ----------------------------------------------------------------------------------------------- cli


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output path without extension; writes <out>.json and <out>.md")
    parser.add_argument(
        "--shapes", default="full,jagged",
        help="comma-separated: `full`, `jagged` (the standard sets) or explicit BxSxHxD / jagged:BxMAXLENxHxD labels",
    )
    parser.add_argument(
        "--flex-tile", type=int, choices=(64, 128), default=attention_impls.FLEX_TILE, help="FlexAttention sparse/kernel tile",
    )
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
    attention_impls.FLEX_TILE = args.flex_tile  # the tile attention_impls.flex builds its BlockMask at
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
            "flex_tile": attention_impls.FLEX_TILE, "graph": args.graph,
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
                    result = f"{r['ms']:.3f} ms {row_note(r)}" if r["ms"] is not None else f"skipped: {r['skip_reason']}"
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
