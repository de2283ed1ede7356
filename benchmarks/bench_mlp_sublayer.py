"""MLP sublayer benchmark: the fused kernels against today's unfused path, eager and compiled.

    python -m benchmarks.bench_mlp_sublayer --out benchmarks/results/mlp_sublayer_h200
    python -m benchmarks.bench_mlp_sublayer --out /tmp/mlp_cpu --device cpu --tokens 256 --d-model 32 --hidden 64 \
        --impls unfused_eager triton                                   # CPU smoke (TRITON_INTERPRET=1)

The sublayer is y = x + W2·GELU(W1·LN(x) + b1) + b2 as configs/gpu.yaml trains it: x and the
parameters in fp32, the matmuls in bf16 under autocast, 155,648 tokens (a batch of 2048 padded to a
multiple of 4096), d_model 256, hidden 1024. Every implementation is timed forward and
forward+backward (gradients of x and of all six parameters) by do_bench medians, called eagerly and
replayed from a CUDA graph (device time alone, as the compiled, CUDA-graph training step runs it).
TFLOP/s counts the sublayer's matmul FLOPs (2 GEMMs forward, 4 backward), set against a bf16 GEMM
of the sublayer's own first-matmul shape and an 8192^3 GEMM timed in the same run: the ceiling.
Writes <out>.json and <out>.md.
"""

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path
from typing import Callable

import torch

from benchmarks.harness import describe, device_name, make_timer, replay_ms, versions
from kernels import available_backends, mlp_sublayer, mlp_sublayer_reference

IMPLS = ("unfused_eager", "unfused_compiled", "triton", "tlx")
PASSES = ("fwd", "fwd+bwd")
# Loose on purpose: bf16 matmuls err by ~1e-2 relative; a wrong tile or mask errs by O(1).
CHECK_REL_TOLERANCE = 5e-2


def sublayer_flops(tokens: int, d_model: int, hidden: int, pass_: str) -> float:
    forward = 2 * 2 * tokens * d_model * hidden
    return forward if pass_ == "fwd" else 3 * forward


def make_inputs(tokens: int, d_model: int, hidden: int, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    """x and the six parameters, fp32 leaves as the model holds them (nn.Linear / nn.LayerNorm scales)."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=generator) * scale + shift).to(device).requires_grad_()

    return [draw(tokens, d_model), draw(d_model, scale=0.1, shift=1.0), draw(d_model, scale=0.1),
            draw(hidden, d_model, scale=d_model ** -0.5), draw(hidden, scale=0.1),
            draw(d_model, hidden, scale=hidden ** -0.5), draw(d_model, scale=0.1)]


def build_impl(name: str, device: torch.device, launch: dict | None = None) -> Callable:
    """The sublayer as `name` runs it; raises with the reason where it can't run here."""
    if name == "unfused_eager":
        return lambda *t: mlp_sublayer_reference(*t, compute_dtype=torch.get_autocast_dtype(device.type)
                                                 if torch.is_autocast_enabled(device.type) else None)
    if name == "unfused_compiled":
        # What the compiled DenseTower does with the unfused layer: inductor fuses the elementwise
        # ops it can around the cuBLAS matmuls.
        return torch.compile(build_impl("unfused_eager", device), dynamic=False)
    if name not in available_backends(device):
        raise RuntimeError(f"backend {name} is not available on {device}")
    return lambda *t: mlp_sublayer(*t, backend=name, launch=launch)


def run_pass(fn: Callable, leaves: list[torch.Tensor], grad_y: torch.Tensor, pass_: str, dtype: torch.dtype) -> Callable:
    device_type = leaves[0].device.type

    def forward():
        with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
            return fn(*leaves)

    if pass_ == "fwd":
        return lambda: forward()
    return lambda: torch.autograd.grad(forward(), leaves, grad_y)


def gemm_tflops(m: int, k: int, n: int, device: torch.device, dtype: torch.dtype, timer: Callable) -> float:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    return 2 * m * k * n / (timer(lambda: a @ b) * 1e-3) / 1e12


def kernel_times(fn: Callable, iterations: int = 5) -> list[dict]:
    """Device time per call of fn by kernel (torch.profiler, CUDA activity), largest first: where
    a row's time goes."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(iterations):
            fn()
        torch.cuda.synchronize()
    totals = {}
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation:
            calls, us = totals.get(event.name, (0, 0.0))
            totals[event.name] = (calls + 1, us + event.device_time)
    return [dict(name=name, calls=calls / iterations, ms=us / iterations / 1e3)
            for name, (calls, us) in sorted(totals.items(), key=lambda item: -item[1][1])]


def bench(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    timer = make_timer(device, args.warmup_ms, args.rep_ms)
    leaves = make_inputs(args.tokens, args.d_model, args.hidden, device)
    grad_y = torch.randn(args.tokens, args.d_model, device=device)
    ceiling = {}
    if device.type == "cuda":
        ceiling = {
            "gemm_sublayer_shape_tflops": gemm_tflops(args.tokens, args.d_model, args.hidden, device, dtype, timer),
            "gemm_8192_tflops": gemm_tflops(8192, 8192, 8192, device, dtype, timer),
        }
    reference_y = run_pass(build_impl("unfused_eager", device), leaves, grad_y, "fwd", dtype)().detach()
    rows = []
    runs = [(name, name, args.launch.get(name)) for name in args.impls]
    runs += [(label, impl, json.loads(launch)) for label, impl, launch in args.variant]
    for label, name, launch in runs:
        row = dict(impl=label, launch=launch)
        if label != name:
            row["backend"] = name
        try:
            fn = build_impl(name, device, launch)
            y = run_pass(fn, leaves, grad_y, "fwd", dtype)().detach()
            rel_err = ((y.float() - reference_y.float()).norm() / reference_y.float().norm()).item()
            row["check_rel_err"] = rel_err
            if not rel_err <= CHECK_REL_TOLERANCE:
                raise RuntimeError(f"output differs from the unfused path by {rel_err:.3g} (relative)")
            for pass_ in PASSES:
                step = run_pass(fn, leaves, grad_y, pass_, dtype)
                step()  # compile / autotune outside the timing
                row[f"{pass_}_ms"] = timer(step)
                if device.type == "cuda":
                    row[f"{pass_}_graph_ms"] = replay_ms(step, timer)
                if args.profile and device.type == "cuda":
                    row[f"{pass_}_kernels"] = kernel_times(step)
                best = row.get(f"{pass_}_graph_ms", row[f"{pass_}_ms"])
                row[f"{pass_}_tflops"] = sublayer_flops(args.tokens, args.d_model, args.hidden, pass_) / (best * 1e-3) / 1e12
        except Exception as error:  # a row that can't run says why; the others still run
            row["error"] = describe(error)
        rows.append(row)
        print(json.dumps(row), flush=True)
    baseline = next((r for r in rows if r["impl"] == "unfused_compiled" and "error" not in r), None)
    for row in rows:
        for pass_ in PASSES:
            key = f"{pass_}_graph_ms" if f"{pass_}_graph_ms" in row else f"{pass_}_ms"
            if baseline and key in row and key in baseline:
                row[f"{pass_}_speedup_vs_unfused_compiled"] = baseline[key] / row[key]
            if ceiling and f"{pass_}_tflops" in row:
                row[f"{pass_}_fraction_of_gemm_ceiling"] = row[f"{pass_}_tflops"] / ceiling["gemm_sublayer_shape_tflops"]
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=device_name(device), versions=versions(),
        command="python -m benchmarks.bench_mlp_sublayer " + shlex.join(sys.argv[1:]),
        shape=dict(tokens=args.tokens, d_model=args.d_model, hidden=args.hidden, dtype=args.dtype),
        ceiling=ceiling, rows=rows,
    )


def render_markdown(report: dict) -> str:
    shape = report["shape"]
    lines = [
        "# MLP sublayer: fused kernels against the unfused path",
        "",
        f"{report['device']}, {report['date']}; `{report['command']}`",
        f"versions: {json.dumps(report['versions'])}",
        "",
        f"x [{shape['tokens']}, {shape['d_model']}] fp32, hidden {shape['hidden']}, matmuls in {shape['dtype']} "
        "(autocast). ms are do_bench medians; graph = replayed from a CUDA graph (device time). TFLOP/s from the "
        "graph time where there is one.",
    ]
    if report["ceiling"]:
        lines += ["", "Matmul ceiling in this run: " + ", ".join(f"{k} {v:.0f}" for k, v in report["ceiling"].items())]
    lines += ["", "| impl | fwd ms | fwd graph ms | fwd+bwd ms | fwd+bwd graph ms | fwd+bwd TFLOP/s | of GEMM ceiling "
              "| fwd+bwd speedup vs unfused compiled | note |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]

    def cell(row, key, spec):
        return format(row[key], spec) if key in row else ""

    for row in report["rows"]:
        label = row["impl"] + (f" `{json.dumps(row['launch'])}`" if row.get("launch") else "")
        lines.append(
            f"| {label} | {cell(row, 'fwd_ms', '.3f')} | {cell(row, 'fwd_graph_ms', '.3f')} | "
            f"{cell(row, 'fwd+bwd_ms', '.3f')} | {cell(row, 'fwd+bwd_graph_ms', '.3f')} | "
            f"{cell(row, 'fwd+bwd_tflops', '.0f')} | {cell(row, 'fwd+bwd_fraction_of_gemm_ceiling', '.0%')} | "
            f"{cell(row, 'fwd+bwd_speedup_vs_unfused_compiled', '.2f')} | {row.get('error', '')[:160]} |")
    for row in report["rows"]:
        if row.get("fwd+bwd_kernels"):
            lines += ["", f"### Kernels of `{row['impl']}`, fwd+bwd (device ms per call, torch.profiler)", "",
                      "| kernel | calls | ms |", "|---|---:|---:|"]
            lines += [f"| `{k['name'][:110]}` | {k['calls']:g} | {k['ms']:.3f} |" for k in row["fwd+bwd_kernels"][:14]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_mlp_sublayer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output path without extension; writes <out>.json and <out>.md")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=155648)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--launch", type=json.loads, default={},
                        help='launch overrides per kernel impl, e.g. \'{"triton": {"fwd": {"block_m": 128}}}\'')
    parser.add_argument("--variant", nargs=3, action="append", default=[], metavar=("LABEL", "IMPL", "LAUNCH_JSON"),
                        help="an extra row: IMPL (a kernel backend) with these launch settings, e.g. "
                             "--variant triton_tiles_bwd triton '{\"bwd\": {\"plan\": \"tiles\"}}'")
    parser.add_argument("--profile", action="store_true", help="also record each row's device time per kernel")
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=500)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report = bench(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1) + "\n")
    Path(f"{out}.md").write_text(render_markdown(report))
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
