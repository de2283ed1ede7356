"""Fused-sublayer benchmark: the fused kernels of one sublayer against today's unfused path, eager
and compiled.

    python -m benchmarks.bench_sublayer --sublayer mlp --out benchmarks/results/mlp_sublayer_h200
    python -m benchmarks.bench_sublayer --sublayer attention --out benchmarks/results/attention_sublayer_h200
    python -m benchmarks.bench_sublayer --sublayer attention --out /tmp/sublayer_cpu --device cpu --tokens 256 \
        --d-model 64 --num-heads 2 --dtype float32 --impls unfused_eager triton  # CPU smoke (TRITON_INTERPRET=1)

Each sublayer as configs/gpu.yaml trains it: x and the parameters in fp32, the matmuls in bf16 under
autocast, 155,648 tokens (a batch of 2048 padded to a multiple of 4096), d_model 256:
- mlp: y = x + W2·GELU(W1·LN(x) + b1) + b2, hidden 1024 (--hidden), GELU exact or in its tanh form
  (--mlp-gelu, model.net.mlp_gelu) in every row;
- attention: y = x + Wo·blockattn(rotary(split(Wqkv·LN(x) + bqkv))) + bo, 4 heads (--num-heads),
  over jagged sequences of 1 to 151 tokens (mean 76, the gpu config's), rotary on q and k; its
  unfused rows run block attention's --unfused-attn kernel, as the model's unfused layer does.
Every implementation is timed forward and forward+backward (gradients of x and of all six parameters)
by do_bench medians, called eagerly and replayed from a CUDA graph (device time alone, as the
compiled, CUDA-graph training step runs it). TFLOP/s counts the sublayer's matmul FLOPs (the
attention's at full 64-token blocks; fwd+bwd as 3x the forward), set against a bf16 GEMM of the
sublayer's first-matmul shape and an 8192^3 GEMM timed in the same run: the ceiling.
Writes <out>.json and <out>.md. (Before the attention sublayer it was bench_mlp_sublayer.py, MLP only.)
"""

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.harness import describe, device_name, make_timer, replay_ms, versions
from kernels import (
    Rotary,
    attention_sublayer,
    available_backends,
    block_attention_qkv,
    block_table,
    mlp_sublayer,
    mlp_sublayer_reference,
    offsets_from_lengths,
    rotary_tables,
)
from kernels.sublayer_dispatch import GELU_APPROXIMATIONS

SUBLAYERS = ("mlp", "attention")
IMPLS = ("unfused_eager", "unfused_compiled", "triton", "tlx")
PASSES = ("fwd", "fwd+bwd")
# Loose on purpose: bf16 matmuls err by ~1e-2 relative; a wrong tile or mask errs by O(1).
CHECK_REL_TOLERANCE = 5e-2
# The gpu config's tokens per sample: 76 on average (benchmarks/results/profile_step_h200.md's batch).
MAX_SEQUENCE_TOKENS = 151


def sublayer_flops(args: argparse.Namespace, pass_: str) -> float:
    tokens, d_model = args.tokens, args.d_model
    if args.sublayer == "mlp":
        forward = 2 * 2 * tokens * d_model * args.hidden
    else:
        # The projections (3d and d wide), then QKᵀ and PV over full 64-token blocks.
        forward = 2 * tokens * d_model * 4 * d_model + 2 * 2 * tokens * 64 * d_model
    return forward if pass_ == "fwd" else 3 * forward


def first_gemm_shape(args: argparse.Namespace) -> tuple[int, int, int]:
    return args.tokens, args.d_model, args.hidden if args.sublayer == "mlp" else 3 * args.d_model


def make_inputs(args: argparse.Namespace, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    """x and the six parameters, fp32 leaves as the model holds them (nn.Linear / nn.LayerNorm scales)."""
    generator = torch.Generator().manual_seed(seed)
    d_model = args.d_model
    # The two linears' output and input widths beyond d_model: [H, D] and [D, H]; [3D, D] and [D, D].
    widths = (args.hidden, args.hidden) if args.sublayer == "mlp" else (3 * d_model, d_model)

    def draw(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=generator) * scale + shift).to(device).requires_grad_()

    return [draw(args.tokens, d_model), draw(d_model, scale=0.1, shift=1.0), draw(d_model, scale=0.1),
            draw(widths[0], d_model, scale=d_model ** -0.5), draw(widths[0], scale=0.1),
            draw(d_model, widths[1], scale=widths[1] ** -0.5), draw(d_model, scale=0.1)]


def jagged_batch(tokens: int, device: torch.device, seed: int = 0) -> tuple:
    """A batch of `tokens` in sequences of 1..MAX_SEQUENCE_TOKENS: its BlockTable (built once, as the
    model builds it per batch) and offsets."""
    generator = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(int(torch.randint(1, MAX_SEQUENCE_TOKENS + 1, (1,), generator=generator)),
                           tokens - sum(lengths)))
    offsets = offsets_from_lengths(torch.tensor(lengths, device=device))
    return block_table(offsets, tokens), offsets


def build_impl(name: str, args: argparse.Namespace, device: torch.device, launch: dict | None = None) -> Callable:
    """The sublayer as `name` runs it; raises with the reason where it can't run here."""
    if name == "unfused_compiled":
        # What the compiled DenseTower does with the unfused layer: inductor fuses the elementwise
        # ops it can around the cuBLAS matmuls (and, for attention, the block-attention custom op).
        return torch.compile(build_impl("unfused_eager", args, device), dynamic=False)
    if name != "unfused_eager" and name not in available_backends(device):
        raise RuntimeError(f"backend {name} is not available on {device}")
    if args.sublayer == "mlp":
        if name == "unfused_eager":
            return lambda *t: mlp_sublayer_reference(*t, compute_dtype=torch.get_autocast_dtype(device.type)
                                                     if torch.is_autocast_enabled(device.type) else None,
                                                     approximate=args.mlp_gelu)
        return lambda *t: mlp_sublayer(*t, approximate=args.mlp_gelu, backend=name, launch=launch)
    table, offsets = jagged_batch(args.tokens, device)
    head_dim = args.d_model // args.num_heads
    cos, sin = rotary_tables(Rotary(), offsets, args.tokens, head_dim)
    rotary = Rotary(cos=cos, sin=sin)
    if name == "unfused_eager":
        def unfused(x, norm_weight, norm_bias, w_qkv, b_qkv, w_out, b_out):
            # The model's unfused layer (models/ranking.py, AttentionLayer), as autocast runs it.
            qkv = F.linear(F.layer_norm(x, x.shape[-1:], norm_weight, norm_bias), w_qkv, b_qkv)
            qkv = qkv.view(args.tokens, 3, args.num_heads, head_dim)
            attn = block_attention_qkv(qkv, table, rotary=rotary, backend=args.unfused_attn)
            return x + F.linear(attn.reshape(args.tokens, args.d_model), w_out, b_out)

        return unfused
    return lambda x, *params: attention_sublayer(x, table, *params, num_heads=args.num_heads, rotary=rotary,
                                                 backend=name, launch=launch)


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
    leaves = make_inputs(args, device)
    grad_y = torch.randn(args.tokens, args.d_model, device=device)
    ceiling = {}
    if device.type == "cuda":
        ceiling = {
            "gemm_sublayer_shape_tflops": gemm_tflops(*first_gemm_shape(args), device, dtype, timer),
            "gemm_8192_tflops": gemm_tflops(8192, 8192, 8192, device, dtype, timer),
        }
    reference_y = run_pass(build_impl("unfused_eager", args, device), leaves, grad_y, "fwd", dtype)().detach()
    rows = []
    runs = [(name, name, args.launch.get(name)) for name in args.impls]
    runs += [(label, impl, json.loads(launch)) for label, impl, launch in args.variant]
    for label, name, launch in runs:
        row = dict(impl=label, launch=launch)
        if label != name:
            row["backend"] = name
        try:
            fn = build_impl(name, args, device, launch)
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
                row[f"{pass_}_tflops"] = sublayer_flops(args, pass_) / (best * 1e-3) / 1e12
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
        command="python -m benchmarks.bench_sublayer " + shlex.join(sys.argv[1:]),
        sublayer=args.sublayer,
        shape=dict(tokens=args.tokens, d_model=args.d_model, dtype=args.dtype,
                   **({"hidden": args.hidden, "gelu": args.mlp_gelu} if args.sublayer == "mlp" else
                      {"num_heads": args.num_heads, "unfused_attn": args.unfused_attn})),
        ceiling=ceiling, rows=rows,
    )


def render_markdown(report: dict) -> str:
    shape = report["shape"]
    if report["sublayer"] == "mlp":
        gelu = {"none": "exact GELU", "tanh": "GELU in its tanh form"}[shape.get("gelu", "none")]
        title, width = "MLP", f"hidden {shape['hidden']}, {gelu}"
    else:
        title = "Attention"
        width = (f"{shape['num_heads']} heads, jagged sequences of 1-{MAX_SEQUENCE_TOKENS} tokens, rotary on q and k, "
                 f"unfused rows on the {shape['unfused_attn']} block-attention kernel")
    lines = [
        f"# {title} sublayer: fused kernels against the unfused path",
        "",
        f"{report['device']}, {report['date']}; `{report['command']}`",
        f"versions: {json.dumps(report['versions'])}",
        "",
        f"x [{shape['tokens']}, {shape['d_model']}] fp32, {width}, matmuls in {shape['dtype']} "
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
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_sublayer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sublayer", default="mlp", choices=SUBLAYERS)
    parser.add_argument("--out", required=True, help="output path without extension; writes <out>.json and <out>.md")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=155648)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024, help="the MLP's hidden width")
    parser.add_argument("--mlp-gelu", default="none", choices=GELU_APPROXIMATIONS,
                        help="the MLP's GELU in every row, F.gelu's approximate (model.net.mlp_gelu)")
    parser.add_argument("--num-heads", type=int, default=4, help="the attention's heads")
    parser.add_argument("--unfused-attn", default="tlx", help="the block-attention backend of the attention's unfused rows")
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
