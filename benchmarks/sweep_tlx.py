"""One-call H100/H200 sweep of the TLX kernels' tuning variants (kernels.tlx_aot.TUNING_VARIANTS).

    python3 benchmarks/sweep_tlx.py --out $OUT/sweep_tlx.json        # from the repo root, ~1 min
    python3 benchmarks/sweep_tlx.py --out ... --variants default,bwd_separate_t_tiles --rotary on

For each variant: correctness of the forward and of dq/dk/dv against kernels.reference on small
ragged batches, with and without rotary (tolerances of gpu_check_tlx.py), then at each benchmark
shape (bf16, random data), with and without fused rotary, the median time of fwd, bwd
(autograd.grad replayed on a retained graph) and fwd+bwd through block_attention_tlx, and the
same three passes replayed from a CUDA graph ("graph", no host work:
the block table kernels plus the attention kernel). The gap between the two is host overhead. The
default variant is also timed through kernels.block_attention (the dispatcher, with its offsets
check) and profiled once, kernel by kernel. Every variant runs in its own try/except; the table
goes to stdout and everything to the --out JSON.
"""

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_attention import measure_copy_bw_tbps, min_bytes, replay_ms  # noqa: E402
from benchmarks.gpu_check_tlx import TOL, make_case, rel_err, run_ref, run_tlx  # noqa: E402
from kernels import Rotary, block_attention, rotary_tables  # noqa: E402
from kernels.blocks import counted_block_table  # noqa: E402
from kernels.tlx_aot import TUNING_VARIANTS  # noqa: E402
from kernels.tlx_block_attention import (  # noqa: E402
    _tlx_backward_impl,
    _tlx_forward_impl,
    block_attention_tlx,
    tlx_config,
    tlx_unsupported_reason,
    tuning_overrides,
)

SHAPES = ((1024, 512, 4, 128), (2048, 256, 4, 64))  # (B, S, H, D), full 64-token blocks
# Forward-only CUDA-graph timings (--fwd-diag) that separate the batch size, head count and row
# pitch (H*D*2 bytes) of the D=64 forward: 2048x256x4x64 ran at 21% of copy, 512x1024x8x64 at 81%.
FWD_DIAG_SHAPES = ((512, 1024, 4, 64), (2048, 256, 8, 64), (512, 1024, 8, 64), (4096, 128, 2, 128))
CHECK_LENGTHS = [0, 1, 63, 64, 65, 200, 130, 64 * 5 + 7]  # empty, partial and full blocks
PASSES = ("fwd", "bwd", "fwd+bwd")


def log(msg=""):
    print(msg, flush=True)


def make_timer(warmup_ms: int, rep_ms: int):
    import triton.testing

    return lambda fn: float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def check_variant(device) -> dict:
    """Max rel errors over the check cases, and whether all are within tolerance and deterministic."""
    errs, ok = {}, True
    # bf16 with and without rotary: the variants' kernels that tests/test_tlx_aot.py compiles.
    for head_dim, rotary in ((64, False), (128, False), (64, True), (128, True)):
        q, k, v, do, offsets, cos, sin = make_case(CHECK_LENGTHS, 3, head_dim, torch.bfloat16, rotary, device, head_dim)
        out, grads = run_tlx(q, k, v, do, offsets, cos, sin, False)
        ref_out, ref_grads = run_ref(q, k, v, do, offsets, cos, sin, False)
        case_errs = {"out": rel_err(out, ref_out)}
        case_errs.update({n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
        out2, grads2 = run_tlx(q, k, v, do, offsets, cos, sin, False)
        same = torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
        tol = TOL[torch.bfloat16]
        ok = ok and same and case_errs["out"] <= tol["out"] and all(case_errs[n] <= tol["grad"] for n in ("dq", "dk", "dv"))
        for name, err in case_errs.items():
            errs[name] = max(errs.get(name, 0.0), err)
    return dict(ok=ok, **errs)


class Problem:
    """Random bf16 inputs of one full-block shape, shared by every variant."""

    def __init__(self, shape, device):
        batch, seq_len, heads, head_dim = shape
        self.shape = shape
        self.label = "x".join(map(str, shape))
        self.tokens = batch * seq_len
        gen = torch.Generator(device=device).manual_seed(0)
        self.q, self.k, self.v, self.grad_out = (
            torch.randn(self.tokens, heads, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(4))
        self.offsets = torch.arange(0, self.tokens + 1, seq_len, device=device, dtype=torch.int32)
        self.leaves = [x.requires_grad_() for x in (self.q, self.k, self.v)]
        self.tables = rotary_tables(Rotary(), self.offsets, self.tokens, head_dim)

    def rotary_args(self, rotary: bool):
        return self.tables if rotary else (None, None)

    def eager_passes(self, forward, rotary=False):
        cos, sin = self.rotary_args(rotary)

        def fwd():
            return forward(*self.leaves, self.offsets, cos, sin)

        def fwd_bwd():
            torch.autograd.grad(fwd(), self.leaves, self.grad_out)

        out = fwd()

        def bwd():
            torch.autograd.grad(out, self.leaves, self.grad_out, retain_graph=True)

        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}

    def raw_passes(self, rotary=False):
        """The ops' launches without autograd or Python checks, for CUDA-graph capture."""
        q, k, v = (x.detach() for x in self.leaves)
        cos, sin = self.rotary_args(rotary)

        def fwd():
            table = counted_block_table(self.offsets, self.tokens)
            return _tlx_forward_impl(q, k, v, *table, cos, sin, False)

        def bwd():
            table = counted_block_table(self.offsets, self.tokens)
            return _tlx_backward_impl(self.grad_out, q, k, v, *table, cos, sin, False)

        def fwd_bwd():
            table = counted_block_table(self.offsets, self.tokens)
            _tlx_forward_impl(q, k, v, *table, cos, sin, False)
            return _tlx_backward_impl(self.grad_out, q, k, v, *table, cos, sin, False)

        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


def percent_of_copy(pass_, problem, ms, copy_tbps, rotary=False):
    _, _, heads, head_dim = problem.shape
    nbytes = min_bytes(pass_, problem.tokens, heads, head_dim, 2, rotary=rotary)
    return 100.0 * nbytes / (ms * 1e-3) / (copy_tbps * 1e12)


def time_variant(problem, timer, copy_tbps, rotary=False) -> dict:
    row = {}
    for pass_, fn in problem.eager_passes(block_attention_tlx, rotary).items():
        row[f"{pass_}_ms"] = timer(fn)
    for pass_, fn in problem.raw_passes(rotary).items():
        row[f"{pass_}_graph_ms"] = replay_ms(fn, timer)
    for pass_ in PASSES:
        row[f"{pass_}_pct_copy"] = percent_of_copy(pass_, problem, row[f"{pass_}_ms"], copy_tbps, rotary)
        row[f"{pass_}_graph_pct_copy"] = percent_of_copy(pass_, problem, row[f"{pass_}_graph_ms"], copy_tbps, rotary)
    return row


def time_fwd_diag(problems, timer, copy_tbps) -> dict:
    """Forward graph ms and % of copy at each diagnostic shape."""
    diag = {}
    for problem in problems:
        ms = replay_ms(problem.raw_passes()["fwd"], timer)
        diag[problem.label] = dict(fwd_graph_ms=ms, fwd_graph_pct_copy=percent_of_copy("fwd", problem, ms, copy_tbps))
    return diag


def time_dispatch(problem, timer) -> dict:
    """The default variant through kernels.block_attention, as bench_attention.py times it."""
    def dispatched(q, k, v, offsets, cos, sin):
        rotary = None if cos is None else Rotary(cos=cos, sin=sin)
        return block_attention(q, k, v, offsets, rotary=rotary, backend="tlx")

    return {f"{pass_}_ms": timer(fn) for pass_, fn in problem.eager_passes(dispatched).items()}


def profile_fwd_bwd(problem, iters=10) -> dict:
    """Per-iteration device time of each kernel in fwd+bwd through the dispatcher, plus wall time."""
    from torch.profiler import ProfilerActivity, profile

    leaves, grad_out = problem.leaves, problem.grad_out

    def step():
        out = block_attention(*leaves, problem.offsets, backend="tlx")
        torch.autograd.grad(out, leaves, grad_out)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / iters
    from torch.autograd import DeviceType

    kernels = {}
    for evt in prof.key_averages():
        if evt.device_type != DeviceType.CUDA:  # CPU ops repeat their kernels' time
            continue
        self_us = getattr(evt, "self_device_time_total", None)
        if self_us is None:
            self_us = getattr(evt, "self_cuda_time_total", 0)
        if self_us and evt.key:
            kernels[evt.key[:90]] = kernels.get(evt.key[:90], 0.0) + self_us / 1e3 / iters
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:12])
    return dict(wall_ms_per_iter_under_profiler=wall_ms, device_ms_per_iter=sum(kernels.values()),
                kernels_ms_per_iter=top)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--variants", default="", help="comma-separated subset of TUNING_VARIANTS")
    parser.add_argument("--rotary", choices=("both", "off", "on"), default="both")
    parser.add_argument("--fwd-diag", action="store_true", help="also time the forward at FWD_DIAG_SHAPES")
    parser.add_argument("--warmup-ms", type=int, default=10)
    parser.add_argument("--rep-ms", type=int, default=60)
    args = parser.parse_args()
    t_start = time.perf_counter()
    device = torch.device("cuda")
    import triton

    probe = torch.empty(1, 1, 64, device=device, dtype=torch.bfloat16)
    reason = tlx_unsupported_reason(probe)
    if reason:
        log(f"TLX backend unavailable: {reason}")
        return 1
    timer = make_timer(args.warmup_ms, args.rep_ms)
    copy_tbps = measure_copy_bw_tbps(device, 1 << 30, timer)
    meta = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), copy_tbps=copy_tbps, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    log(f"{meta}")
    problems = [Problem(shape, device) for shape in SHAPES]
    diag_problems = [Problem(shape, device) for shape in FWD_DIAG_SHAPES] if args.fwd_diag else []
    rotary_settings = {"both": (False, True), "off": (False,), "on": (True,)}[args.rotary]
    names = [n for n in args.variants.split(",") if n] or list(TUNING_VARIANTS)
    rows, extras = [], {}
    for name in names:
        fwd_knobs, bwd_knobs = TUNING_VARIANTS[name]
        t0 = time.perf_counter()
        with tuning_overrides(fwd=fwd_knobs, bwd=bwd_knobs):
            configs = {f"{d}_d{D}{'_rotary' * r}": tlx_config(D, r, d == "bwd")
                       for d in ("fwd", "bwd") for D in (64, 128) for r in (False, True)}
            try:
                check = check_variant(device)
            except Exception as exc:
                traceback.print_exc()
                check = dict(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            for problem in problems:
                for rotary in rotary_settings:
                    row = dict(variant=name, shape=problem.label, rotary=rotary, configs=configs, check=check)
                    try:
                        row.update(time_variant(problem, timer, copy_tbps, rotary))
                    except Exception as exc:
                        traceback.print_exc()
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                    rows.append(row)
                    torch.cuda.empty_cache()
            if args.fwd_diag:
                try:
                    extras[f"fwd_diag_{name}"] = time_fwd_diag(diag_problems, timer, copy_tbps)
                except Exception as exc:
                    traceback.print_exc()
                    extras[f"fwd_diag_{name}"] = dict(error=f"{type(exc).__name__}: {exc}")
            if name == "default":
                for problem in problems[:1]:
                    try:
                        extras[f"dispatch_{problem.label}"] = time_dispatch(problem, timer)
                        extras[f"profile_fwd_bwd_{problem.label}"] = profile_fwd_bwd(problem)
                    except Exception as exc:
                        traceback.print_exc()
                        extras[f"dispatch_{problem.label}"] = dict(error=f"{type(exc).__name__}: {exc}")
        log(f"variant {name}: {time.perf_counter() - t0:.1f}s")

    head = (f"{'variant':26} {'shape':16} {'rot':3} {'ok':3} {'err out/dq':>15} | {'fwd':>6} {'bwd':>6} {'f+b':>6} ms | graph "
            f"{'fwd':>6} {'bwd':>6} {'f+b':>6} ms | % copy graph fwd/bwd/f+b (eager f+b)")
    log(f"\ncopy ceiling {copy_tbps:.3f} TB/s\n{head}\n{'-' * len(head)}")
    for row in rows:
        check = row["check"]
        err = f"{check.get('out', float('nan')):.1e}/{check.get('dq', float('nan')):.1e}"
        if "error" in row:
            log(f"{row['variant']:26} {row['shape']:16} {'yes' if row['rotary'] else 'no':3} {str(check['ok'])[0]:3} {err:>15} | ERROR {row['error']}")
            continue
        ms = " ".join(f"{row[f'{p}_ms']:6.3f}" for p in PASSES)
        graph = " ".join(f"{row[f'{p}_graph_ms']:6.3f}" for p in PASSES)
        pct = "/".join(f"{row[f'{p}_graph_pct_copy']:.0f}" for p in PASSES)
        log(f"{row['variant']:26} {row['shape']:16} {'yes' if row['rotary'] else 'no':3} {str(check['ok'])[0]:3} {err:>15} | {ms} ms | graph {graph} ms | "
            f"{pct} ({row['fwd+bwd_pct_copy']:.0f})")
    for key, value in extras.items():
        log(f"{key}: {json.dumps(value, indent=None)[:2000]}")
    log(f"total {time.perf_counter() - t_start:.0f}s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, rows=rows, extras=extras), indent=1))
    return 0 if all(r["check"]["ok"] and "error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
