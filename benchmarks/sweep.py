"""Launch-setting sweep of one kernel backend: every variant judged by kernels.testing.parity, then
timed (fwd, bwd, fwd+bwd; eager and replayed from a CUDA graph) exactly as bench_attention times
the production settings. A variant is nothing but `block_attention(..., launch=variant)`: no module
state changes, so every variant and the default run the same code.

    python -m benchmarks.sweep --backend tlx --out benchmarks/results/sweep_tlx_h200          # ~2 min, H200
    python -m benchmarks.sweep --backend triton --variants default,w8 --shapes 2048x256x4x64 --out /tmp/sweep

TLX variants are kernels.tlx_aot.TUNING_VARIANTS (CI compiles every one of them for sm_90, so a
variant never first fails to build here); Triton's are TRITON_VARIANTS below.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.attention_impls import Impl, our_impl
from benchmarks.attention_workload import DTYPES, PASSES, make_inputs, parse_shape
from benchmarks.bench_attention import bench_impl
from benchmarks.harness import device_name, free_memory, make_timer, measure_copy_bw_tbps, versions
from kernels.tlx_aot import TUNING_VARIANTS

# name -> (fwd, bwd) LaunchConfig fields over the production ones (kernels.block_attention_triton).
TRITON_VARIANTS = {
    "default": ({}, {}),
    "w8": (dict(num_warps=8), dict(num_warps=8)),
    "no_register_cap": (dict(maxnreg=None), dict(maxnreg=None)),
    "cap128_168": (dict(maxnreg=128), dict(maxnreg=168)),
}
VARIANTS = {"tlx": TUNING_VARIANTS, "triton": TRITON_VARIANTS}
SHAPES = ("1024x512x4x128", "2048x256x4x64", "jagged:1152x1024x4x128")


def variant_impl(backend: str, variant: str) -> Impl:
    fwd, bwd = VARIANTS[backend][variant]
    launch = {"fwd": fwd, "bwd": bwd} if fwd or bwd else None
    return our_impl(backend, f"{backend}@{variant}", launch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=sorted(VARIANTS), required=True)
    parser.add_argument("--variants", default="", help="comma-separated; default: all of the backend's")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rotary", choices=("both", "off", "on"), default="both")
    parser.add_argument("--device", default="cuda", help="cpu runs the Triton interpreter (a smoke test)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--out", type=Path, required=True, help="writes <out>.json")
    args = parser.parse_args(argv)
    variants = args.variants.split(",") if args.variants else list(VARIANTS[args.backend])
    unknown = [v for v in variants if v not in VARIANTS[args.backend]]
    if unknown:
        parser.error(f"unknown {args.backend} variants {unknown}; choose from {list(VARIANTS[args.backend])}")
    device = torch.device(args.device)
    graph = device.type == "cuda"
    timer = make_timer(device, warmup_ms=10, rep_ms=40)
    copy_bw = measure_copy_bw_tbps(device, 2**30 if graph else 2**24, timer)
    report = {"device": device_name(device), "versions": versions(), "command": "python -m benchmarks.sweep " +
              " ".join(sys.argv[1:] if argv is None else argv), "copy_bw_tbps": copy_bw, "rows": []}
    print(f"{report['device']}; copy ceiling {copy_bw:.2f} TB/s; cells: eager ms / graph ms (graph % of copy)",
          flush=True)
    for label in args.shapes.split(","):
        started = time.perf_counter()
        inputs = make_inputs(parse_shape(label), device, seed=0, dtype=DTYPES[args.dtype])
        print(f"\n== {label} (T = {inputs.tokens})\n{'variant':<34} {'rotary':<6}" +
              "".join(f"{p:>26}" for p in PASSES), flush=True)
        for variant in variants:
            for rotary in {"both": (False, True), "off": (False,), "on": (True,)}[args.rotary]:
                rows = bench_impl(variant_impl(args.backend, variant), inputs, rotary, timer, copy_bw, graph)
                report["rows"] += rows
                cells = "".join(
                    f"{r['ms'] or float('nan'):>9.3f} / {r['graph_ms'] or float('nan'):.3f} "
                    f"({100 * (r['graph_frac_copy_bw'] or 0):3.0f}%)" for r in rows)
                status = rows[0]["status"] + (f" {rows[0]['skip_reason'] or rows[0]['check']}" if rows[0]["status"] != "ok" else "")
                print(f"{variant:<34} {str(rotary):<6} {cells}  {status}", flush=True)
        del inputs
        free_memory(device)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"({time.perf_counter() - started:.0f} s)", flush=True)
    wrong = sorted({r["impl"] for r in report["rows"] if r["status"] != "ok"})
    print(f"{'FAIL' if wrong else 'PASS'}: variants that failed parity or could not run: {wrong or 'none'}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
