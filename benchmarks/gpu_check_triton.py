"""GPU correctness check of the Triton or TLX backend (run on an H100/H200):

    python benchmarks/gpu_check_triton.py --out /tmp/parity_triton.json [--sweep]
    python benchmarks/gpu_check_triton.py --backend tlx --out /tmp/parity_tlx.json

On random ragged batches (bf16, and one fp16 case; D = 32/64/128; no rotary, rotary on q/k, and on
v too) every output (out, dq, dk, dv; out, dx, dw for the fused projection) must satisfy, against
the fp64 reference on the same inputs:
- max abs error <= 2 x that of the PyTorch reference run in the input dtype (+ a 1e-5 floor);
- gradients' SNR = 10 log10(|ref|^2 / |err|^2) >= 45 dB;
- a second run gives bitwise-identical output and gradients.
Each case runs in its own try/except; prints a table and PASS/FAIL, writes every number to --out,
and exits 1 if anything failed. Where FA2 can run the case (no rotary, bf16/fp16, CUDA) its max
errors on the same inputs are recorded too, with the kernel/FA2 ratio (issue 4's dq target: <= 0.5).
The fused projection is Triton-only; TLX takes head_dim 64 and 128.

    python benchmarks/gpu_check_triton.py --sweep --out /tmp/triton.json   # ~4 min on an H200

--sweep instead checks each launch variant (VARIANTS) on two ragged cases and times fwd, bwd and
fwd+bwd at SWEEP_SHAPES, as % of a copy ceiling measured in the same run; the default variant is
also timed through the public block_attention API, whose input validation syncs with the host.

    python benchmarks/gpu_check_triton.py --aot     # no GPU: sm_90 registers/spills per variant
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.triton_block_attention as triton_backend  # noqa: E402
from kernels import Rotary, block_attention, block_attention_reference, rotary_tables  # noqa: E402
from kernels.dispatch import _BACKENDS  # noqa: E402

MIN_GRAD_SNR_DB = 45.0
ERROR_RATIO = 2.0
ABS_FLOOR = 1e-5
HEADS = 4
EDGE_LENGTHS = [0, 1, 63, 64, 65, 200, 0, 128]
ROTARY = {"none": None, "qk": Rotary(), "qkv": Rotary(rotate_v=True)}
SWEEP_SHAPES = ("1024x512x4x128", "2048x256x4x64", "jagged:1152x1024x4x128")
SWEEP_ROTARY_SHAPE = "1024x512x4x128"  # rotary timed here only, to keep the sweep within minutes
# Launch variants: name -> (forward, backward) LaunchConfig fields over the production defaults
# (kernels.triton_block_attention._LAUNCH_CONFIGS); NOTES_triton.md predicts each one.
VARIANTS = {
    "default": ({}, {}),
    # The colleague's launch: occupancy-sized persistent grid, 4 warps, no register cap.
    "persistent": (dict(persistent=True, maxnreg=None), dict(persistent=True, maxnreg=None)),
    "flat_w4": (dict(persistent=False, num_warps=4, maxnreg=None), dict(persistent=False, num_warps=4, maxnreg=None)),
    "flat_w8": (dict(persistent=False, num_warps=8, maxnreg=None), dict(persistent=False, num_warps=8, maxnreg=None)),
    "flat_w4_cap128_168": (dict(persistent=False, num_warps=4, maxnreg=128), dict(persistent=False, num_warps=4, maxnreg=168)),
    "persistent_stages2": (dict(persistent=True, loop_stages=2), dict(persistent=True, loop_stages=2)),
    "persistent_stages3": (dict(persistent=True, loop_stages=3), dict(persistent=True, loop_stages=3)),
    "persistent_w8_stages2": (dict(persistent=True, num_warps=8, loop_stages=2, maxnreg=None),
                              dict(persistent=True, num_warps=8, loop_stages=2, maxnreg=None)),
}


def ragged_offsets(lengths, device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def snr_db(result: torch.Tensor, truth: torch.Tensor) -> float:
    noise = (result.double() - truth).pow(2).sum().item()
    signal = truth.pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def grads_of(fn, leaves, grad_out, dtype):
    """fn(*leaves cast to dtype) and its gradients for grad_out, as [out, *grads]."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in leaves]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out.to(dtype))
    return [out.detach(), *grads]


def compare(names, kernel, kernel_again, same_precision, truth) -> dict:
    row = {"ok": True, "outputs": {}}
    for name, result, again, baseline, exact in zip(names, kernel, kernel_again, same_precision, truth):
        err = (result.double() - exact).abs().max().item()
        base = (baseline.double() - exact).abs().max().item()
        snr = snr_db(result, exact)
        # No output in this dtype can beat the truth rounded to it: half an ulp of its largest entry.
        floor = (exact.to(result.dtype).double() - exact).abs().max().item()
        checks = {
            "finite": bool(torch.isfinite(result).all()),
            "error_ratio": err <= ERROR_RATIO * base + ABS_FLOOR,
            "snr": name == names[0] or snr >= MIN_GRAD_SNR_DB,  # the SNR bar is for gradients
            "deterministic": torch.equal(result, again),
        }
        row["outputs"][name] = dict(max_err=err, torch_max_err=base, rounding_floor=floor, snr_db=snr, **checks)
        row["ok"] &= all(checks.values())
    return row


def backend_function(backend: str):
    """The backend's own function (q, k, v, offsets, cos, sin, rotate_v), below the dispatcher."""
    return _BACKENDS[backend].load(_BACKENDS[backend].function)


def check_attention(lengths, head_dim, dtype, rotary_name, device, seed, backend="triton") -> dict:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    offsets = ragged_offsets(lengths, device)
    shape = (int(offsets[-1]), HEADS, head_dim)
    q, k, v, grad_out = (torch.randn(shape, generator=generator).to(device) for _ in range(4))
    rotary = ROTARY[rotary_name]
    cos = sin = None
    rotate_v = rotary is not None and rotary.rotate_v
    if rotary is not None:
        cos, sin = rotary_tables(rotary, offsets, shape[0], head_dim)

    def kernel(*x):
        return block_attention(*x, offsets, rotary=rotary, backend=backend)

    def reference(*x, upcast=True):
        return block_attention_reference(*x, offsets, cos, sin, rotate_v, upcast=upcast)

    runs = [grads_of(kernel, (q, k, v), grad_out, dtype) for _ in range(2)]
    same_precision = grads_of(lambda *x: reference(*x, upcast=False), (q, k, v), grad_out, dtype)
    # The fp64 truth sees the inputs rounded to dtype, exactly as the kernel does.
    truth = grads_of(reference, [x.to(dtype) for x in (q, k, v)], grad_out.to(dtype), torch.float64)
    row = compare(("out", "dq", "dk", "dv"), *runs, same_precision, truth)
    if rotary is None and backend != "fa2":
        fa2 = grads_of(lambda *x: block_attention(*x, offsets, backend="fa2"), (q, k, v), grad_out, dtype)
        for name, result, exact in zip(("out", "dq", "dk", "dv"), fa2, truth):
            fa2_err = (result.double() - exact).abs().max().item()
            output = row["outputs"][name]
            output.update(fa2_max_err=fa2_err, vs_fa2=output["max_err"] / fa2_err if fa2_err else math.inf)
    return row


def check_fused_projection(lengths, head_dim, dtype, device, seed, d_in=256) -> dict:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    offsets = ragged_offsets(lengths, device)
    tokens = int(offsets[-1])
    x = torch.randn(tokens, d_in, generator=generator).to(device)
    w_qkv = (torch.randn(d_in, 3 * HEADS * head_dim, generator=generator) / math.sqrt(d_in)).to(device)
    grad_out = torch.randn(tokens, HEADS, head_dim, generator=generator).to(device)
    cos, sin = rotary_tables(Rotary(), offsets, tokens, head_dim)

    def fused(x, w):
        return triton_backend.block_attention_qkv_triton(x, w, offsets, HEADS, cos, sin)

    def unfused(x, w, upcast=True):
        q, k, v = (x @ w).view(tokens, 3, HEADS, head_dim).unbind(1)
        return block_attention_reference(q, k, v, offsets, cos, sin, upcast=upcast)

    runs = [grads_of(fused, (x, w_qkv), grad_out, dtype) for _ in range(2)]
    same_precision = grads_of(lambda *a: unfused(*a, upcast=False), (x, w_qkv), grad_out, dtype)
    truth = grads_of(unfused, [t.to(dtype) for t in (x, w_qkv)], grad_out.to(dtype), torch.float64)
    return compare(("out", "dx", "dw"), *runs, same_precision, truth)


def check_empty(device, backend="triton") -> dict:
    """Batches without tokens: empty outputs and gradients, through the API and the op itself."""
    offsets = ragged_offsets([0, 0], device)
    leaves = [torch.zeros(0, HEADS, 128, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    row = {"ok": True, "outputs": {}}
    for name, attend in (("api", block_attention), ("op", backend_function(backend))):
        out = attend(*leaves, offsets) if name == "op" else attend(*leaves, offsets, backend=backend)
        grads = torch.autograd.grad(out, leaves, torch.zeros_like(out), allow_unused=True)
        shapes_ok = out.shape == (0, HEADS, 128) and all(g is None or g.shape == out.shape for g in grads)
        row["outputs"][name] = {"shapes_ok": shapes_ok}
        row["ok"] &= shapes_ok
    return row


def check_compiled(device, backend="triton") -> dict:
    """torch.compile (inductor, fullgraph) of a layer around the kernel gives the eager result."""
    lengths = [3, 70, 200]
    offsets = ragged_offsets(lengths, device)
    generator = torch.Generator(device="cpu").manual_seed(7)
    q, k, v, grad_out = (torch.randn(sum(lengths), HEADS, 64, generator=generator).to(device) for _ in range(4))
    cos, sin = rotary_tables(Rotary(), offsets, q.shape[0], 64)

    def layer(q, k, v):
        return backend_function(backend)(q * 2, k, v, offsets, cos, sin).relu()

    eager = grads_of(layer, (q, k, v), grad_out, torch.bfloat16)
    compiled = grads_of(torch.compile(layer, fullgraph=True), (q, k, v), grad_out, torch.bfloat16)
    row = {"ok": True, "outputs": {}}
    for name, a, b in zip(("out", "dq", "dk", "dv"), compiled, eager):
        err = (a.double() - b.double()).abs().max().item()
        row["outputs"][name] = {"max_diff_vs_eager": err}
        row["ok"] &= err <= 1e-2
    return row


def cases(device, backend):
    rng = torch.Generator().manual_seed(1234)
    ragged = EDGE_LENGTHS + torch.randint(0, 600, (40,), generator=rng).tolist()
    head_dims = (64, 128) if backend == "tlx" else (32, 64, 128)
    for head_dim in head_dims:
        for rotary_name in ROTARY:
            yield f"D{head_dim} rotary={rotary_name} ragged bf16", lambda d=head_dim, r=rotary_name: check_attention(
                ragged, d, torch.bfloat16, r, device, seed=d, backend=backend)
    yield "D128 rotary=qk ragged fp16", lambda: check_attention(ragged, 128, torch.float16, "qk", device, seed=5,
                                                               backend=backend)
    yield "D64 rotary=none ragged fp16", lambda: check_attention(ragged, 64, torch.float16, "none", device, seed=8,
                                                                backend=backend)
    # More work items than resident programs, so every program wraps around its persistent loop.
    many = [4096 + 17, 3000, 1] * 12
    yield "D64 rotary=qkv many-items bf16", lambda: check_attention(many, 64, torch.bfloat16, "qkv", device, seed=6,
                                                                   backend=backend)
    yield "all sequences empty", lambda: check_empty(device, backend)
    if backend == "triton":
        for head_dim in (64, 128):
            yield f"D{head_dim} fused projection rotary=qk bf16", lambda d=head_dim: check_fused_projection(
                ragged, d, torch.bfloat16, device, seed=10 + d)
    yield "torch.compile fullgraph inductor D64 bf16", lambda: check_compiled(device, backend)


def run_checks(device, backend="triton") -> list[dict]:
    rows = []
    for name, run in cases(device, backend):
        try:
            row = run()
        except Exception as error:
            row = {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        row["case"] = name
        rows.append(row)
        print_row(row)
    return rows


def print_row(row: dict) -> None:
    status = "PASS" if row["ok"] else "FAIL"
    if "error" in row:
        print(f"{status}  {row['case']}: {row['error']}\n{row['traceback']}", flush=True)
        return
    cells = []
    for name, o in row["outputs"].items():
        if "max_err" in o:
            flags = "".join(k[0] for k in ("finite", "error_ratio", "snr", "deterministic") if not o[k])
            vs_fa2 = f" fa2x{o['vs_fa2']:.2f}" if "vs_fa2" in o else ""
            cells.append(f"{name} {o['max_err']:.2e}/{o['torch_max_err']:.2e}/{o['rounding_floor']:.2e} {o['snr_db']:5.1f}dB"
                         f"{vs_fa2}{' !' + flags if flags else ''}")
        else:
            cells.append(f"{name} " + " ".join(f"{key}={value:.2g}" if isinstance(value, float) else f"{key}={value}" for key, value in o.items()))
    print(f"{status}  {row['case']:<42} " + " | ".join(cells), flush=True)


def variant_config(variant: str, direction: str, head_dim: int, rotary: bool):
    """The LaunchConfig a variant's `direction` kernel runs with."""
    fwd, bwd = VARIANTS[variant]
    with triton_backend.launch_overrides(fwd, bwd):
        return triton_backend.launch_config(direction, head_dim, rotary)


def sweep_correctness(device) -> dict:
    """Two ragged cases per variant: D128 with rotary (the register-heaviest kernels) and D64 plain."""
    rng = torch.Generator().manual_seed(99)
    ragged = EDGE_LENGTHS + torch.randint(0, 600, (24,), generator=rng).tolist()
    rows = {}
    for head_dim, rotary in ((128, "qk"), (64, "none")):
        row = check_attention(ragged, head_dim, torch.bfloat16, rotary, device, seed=head_dim)
        rows[f"D{head_dim}_{rotary}"] = row["ok"]
    return rows


def run_sweep(device) -> list[dict]:
    """Per variant: a quick correctness check, then fwd, bwd, fwd+bwd ms and % of copy bandwidth."""
    from benchmarks.bench_attention import (
        PASSES, frac_copy_bw, make_inputs, make_timer, measure_copy_bw_tbps, min_bytes, parse_shape, time_pass,
    )

    torch._functorch.config.donated_buffer = False  # as bench_attention: bwd replays one graph
    timer = make_timer(device, warmup_ms=10, rep_ms=40)
    copy_bw = measure_copy_bw_tbps(device, 1 << 30, timer)
    print(f"copy ceiling {copy_bw:.2f} TB/s; cells: ms (% of copy ceiling over minimum bytes)", flush=True)
    rows = []
    for label in SWEEP_SHAPES:
        started = time.perf_counter()
        inputs = make_inputs(parse_shape(label), device, seed=0)
        print(f"\n== {label} (T = {inputs.tokens})\n{'variant':<24} {'rotary':<6} " + "".join(f"{p:>18}" for p in PASSES), flush=True)
        for variant, (fwd, bwd) in [*VARIANTS.items(), ("default+api", ({}, {}))]:
            for rotary in (False, True) if label == SWEEP_ROTARY_SHAPE else (False,):
                row = {"shape": label, "variant": variant, "rotary": rotary}
                try:
                    with triton_backend.launch_overrides(fwd, bwd):
                        if label == SWEEP_SHAPES[0] and not rotary and variant != "default+api":
                            row["correct"] = sweep_correctness(device)
                        cos, sin = (inputs.cos, inputs.sin) if rotary else (None, None)
                        if variant == "default+api":  # the public entry point, validation and all
                            tables = Rotary(cos=inputs.cos, sin=inputs.sin) if rotary else None
                            forward = lambda q, k, v: block_attention(q, k, v, inputs.offsets, rotary=tables, backend="triton")  # noqa: E731
                        else:
                            forward = lambda q, k, v: triton_backend.block_attention_triton(q, k, v, inputs.offsets, cos, sin)  # noqa: E731
                        for pass_ in PASSES:
                            ms, _ = time_pass(pass_, forward, inputs, timer)
                            nbytes = min_bytes(pass_, inputs.tokens, inputs.shape.heads, inputs.shape.head_dim, 2, rotary)
                            row[pass_] = {"ms": ms, "frac_copy_bw": frac_copy_bw(nbytes, ms, copy_bw)}
                    cells = "".join(f"{row[p]['ms']:>10.3f} ({100 * row[p]['frac_copy_bw']:3.0f}%)" for p in PASSES)
                    bad = [case for case, ok in row.get("correct", {}).items() if not ok]
                    print(f"{variant:<24} {str(rotary):<6} {cells}{'  WRONG: ' + ','.join(bad) if bad else ''}", flush=True)
                except Exception as error:
                    row["error"] = f"{type(error).__name__}: {error}"
                    print(f"{variant:<24} {str(rotary):<6} ERROR {row['error'][:300]}", flush=True)
                rows.append(row)
        del inputs
        torch.cuda.empty_cache()
        print(f"({time.perf_counter() - started:.0f} s)", flush=True)
    return rows


def aot_resources(direction: str, head_dim: int, rotary: bool, config) -> dict:
    """Compiles one kernel for sm_90 without a GPU (bf16, the specialization a real launch gets)
    and reads its registers, spill stack and shared memory from the cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = triton_backend._block_attention_fwd if direction == "fwd" else triton_backend._block_attention_bwd
    constexprs = dict(BLOCK=64, HEAD_DIM=head_dim, ROTARY=rotary, ROTATE_V=False, DOT_PRECISION="tf32",
                      LOOP_STAGES=config.loop_stages if config.persistent else 1)
    signature, divisible = {}, []
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("cos_ptr", "sin_ptr"):
            signature[name] = "*fp32" if rotary else "constexpr"  # a None argument is a constexpr
        elif name == "num_blocks_ptr":
            signature[name] = "*i64"
        elif name.startswith("block_"):
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = "*bf16"
        elif "scale" in name:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
        # Pointers from torch's allocator and strides (multiples of D) are 16-divisible at launch.
        if signature[name] != "constexpr" and (name.endswith("_ptr") or "stride" in name):
            divisible.append(name)
    if not rotary:
        constexprs.update(cos_ptr=None, sin_ptr=None)
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    options = dict(num_warps=config.num_warps, num_stages=1)
    if config.maxnreg is not None:
        options["maxnreg"] = config.maxnreg
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    smem = compiled.metadata.shared
    threads = 32 * config.num_warps
    per_sm = min(65536 // (-(-regs * 32 // 256) * 256 * config.num_warps), 233472 // (smem + 1024), 2048 // threads)
    return dict(regs=regs, spill_stack_bytes=stack, smem=smem, programs_per_sm=per_sm, warps_per_sm=per_sm * config.num_warps)


def run_aot() -> int:
    """Registers and spills of every variant's kernels (bf16; D 64/128; rotary off/q,k) on sm_90."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter does not compile kernels")
    done, failed = {}, 0
    print(f"{'variant':<22} {'kernel':<14} {'config':<60} regs spill smem  progs/SM warps/SM")
    for variant in VARIANTS:
        for direction in ("fwd", "bwd"):
            for head_dim in (64, 128):
                for rotary in (False, True):
                    config = variant_config(variant, direction, head_dim, rotary)
                    key = (direction, head_dim, rotary, config)
                    name = f"{direction} D{head_dim}{' rot' if rotary else ''}"
                    try:
                        if key not in done:
                            done[key] = aot_resources(direction, head_dim, rotary, config)
                        r = done[key]
                        knobs = f"w{config.num_warps} {'persist' if config.persistent else 'flat'} st{config.loop_stages} cap{config.maxnreg}"
                        print(f"{variant:<22} {name:<14} {knobs:<60} {r['regs']:>4} {r['spill_stack_bytes']:>5} {r['smem']:>6} {r['programs_per_sm']:>5} {r['warps_per_sm']:>8}", flush=True)
                    except Exception as error:
                        failed += 1
                        print(f"{variant:<22} {name:<14} FAIL {type(error).__name__}: {str(error)[:300]}", flush=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="JSON file for every number (needed unless --aot)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="triton", choices=("triton", "tlx"))
    parser.add_argument("--sweep", action="store_true", help="time the launch variants instead of the full check (~4 min)")
    parser.add_argument("--aot", action="store_true", help="no GPU: compile every variant for sm_90, print registers/spills")
    args = parser.parse_args()
    if args.aot:
        return run_aot()
    if args.out is None:
        parser.error("--out is required (unless --aot)")
    device = torch.device(args.device)
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(device),
           "backend": args.backend}
    print(env, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        report = {"env": env, "variants": {name: [repr(variant_config(name, d, 128, False)) for d in ("fwd", "bwd")] for name in VARIANTS}}
        report["sweep"] = run_sweep(device)
        args.out.write_text(json.dumps(report, indent=1, default=str))
        wrong = [f"{r['variant']}" for r in report["sweep"] if "error" in r or not all(r.get("correct", {}).values())]
        print(f"{'FAIL' if wrong else 'PASS'}: variants with errors or wrong results: {sorted(set(wrong)) or 'none'}")
        return 1 if wrong else 0
    print("case: per output, max abs error kernel/torch-same-dtype/rounding floor vs fp64, SNR; ! flags = failed checks",
          flush=True)
    rows = run_checks(device, args.backend)
    report = {"env": env, "min_grad_snr_db": MIN_GRAD_SNR_DB, "error_ratio": ERROR_RATIO, "cases": rows}
    failed = [row["case"] for row in rows if not row["ok"]]
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"{'FAIL' if failed else 'PASS'}: {len(rows) - len(failed)} passed, {len(failed)} failed {failed or ''}")
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
