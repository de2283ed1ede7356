"""GPU correctness check of the Triton backend (run on an H100/H200):

    python benchmarks/gpu_check_triton.py --out /tmp/parity_triton.json [--sweep]

On random ragged batches (bf16, and one fp16 case; D = 32/64/128; no rotary, rotary on q/k, and on
v too) every output (out, dq, dk, dv; out, dx, dw for the fused projection) must satisfy, against
the fp64 reference on the same inputs:
- max abs error <= 2 x that of the PyTorch reference run in the input dtype (+ a 1e-5 floor);
- gradients' SNR = 10 log10(|ref|^2 / |err|^2) >= 45 dB;
- a second run gives bitwise-identical output and gradients.
Each case runs in its own try/except; prints a table and PASS/FAIL, writes every number to --out,
and exits 1 if anything failed. --sweep then times fwd and fwd+bwd at the benchmark shapes for a few
(num_warps, loop stages) settings of the kernels, to pick the defaults from measurements.
"""

import argparse
import json
import math
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.triton_block_attention as triton_backend  # noqa: E402
from kernels import Rotary, block_attention, block_attention_reference, rotary_tables  # noqa: E402

MIN_GRAD_SNR_DB = 45.0
ERROR_RATIO = 2.0
ABS_FLOOR = 1e-5
HEADS = 4
EDGE_LENGTHS = [0, 1, 63, 64, 65, 200, 0, 128]
ROTARY = {"none": None, "qk": Rotary(), "qkv": Rotary(rotate_v=True)}
SWEEP_SHAPES = ("1024x512x4x128", "2048x256x4x64", "512x1024x8x64", "jagged:1152x1024x4x128", "jagged:1152x4096x4x128")
SWEEP_SETTINGS = {  # name -> (num_warps per head_dim, loop stages)
    "default": (dict(triton_backend._NUM_WARPS), triton_backend._LOOP_STAGES),
    "d128_warps8": ({**triton_backend._NUM_WARPS, 128: 8}, triton_backend._LOOP_STAGES),
    "warps8": ({32: 8, 64: 8, 128: 8}, triton_backend._LOOP_STAGES),
    "stages2": (dict(triton_backend._NUM_WARPS), 2),
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
        checks = {
            "finite": bool(torch.isfinite(result).all()),
            "error_ratio": err <= ERROR_RATIO * base + ABS_FLOOR,
            "snr": name == names[0] or snr >= MIN_GRAD_SNR_DB,  # the SNR bar is for gradients
            "deterministic": torch.equal(result, again),
        }
        row["outputs"][name] = dict(max_err=err, torch_max_err=base, snr_db=snr, **checks)
        row["ok"] &= all(checks.values())
    return row


def check_attention(lengths, head_dim, dtype, rotary_name, device, seed) -> dict:
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
        return block_attention(*x, offsets, rotary=rotary, backend="triton")

    def reference(*x, upcast=True):
        return block_attention_reference(*x, offsets, cos, sin, rotate_v, upcast=upcast)

    runs = [grads_of(kernel, (q, k, v), grad_out, dtype) for _ in range(2)]
    same_precision = grads_of(lambda *x: reference(*x, upcast=False), (q, k, v), grad_out, dtype)
    # The fp64 truth sees the inputs rounded to dtype, exactly as the kernel does.
    truth = grads_of(reference, [x.to(dtype) for x in (q, k, v)], grad_out.to(dtype), torch.float64)
    return compare(("out", "dq", "dk", "dv"), *runs, same_precision, truth)


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


def check_empty(device) -> dict:
    """Batches without tokens: empty outputs and gradients, through the API and the op itself."""
    offsets = ragged_offsets([0, 0], device)
    leaves = [torch.zeros(0, HEADS, 128, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    row = {"ok": True, "outputs": {}}
    for name, attend in (("api", block_attention), ("op", triton_backend.block_attention_triton)):
        out = attend(*leaves, offsets) if name == "op" else attend(*leaves, offsets, backend="triton")
        grads = torch.autograd.grad(out, leaves, torch.zeros_like(out), allow_unused=True)
        shapes_ok = out.shape == (0, HEADS, 128) and all(g is None or g.shape == out.shape for g in grads)
        row["outputs"][name] = {"shapes_ok": shapes_ok}
        row["ok"] &= shapes_ok
    return row


def check_compiled(device) -> dict:
    """torch.compile (inductor, fullgraph) of a layer around the kernel gives the eager result."""
    lengths = [3, 70, 200]
    offsets = ragged_offsets(lengths, device)
    generator = torch.Generator(device="cpu").manual_seed(7)
    q, k, v, grad_out = (torch.randn(sum(lengths), HEADS, 64, generator=generator).to(device) for _ in range(4))
    cos, sin = rotary_tables(Rotary(), offsets, q.shape[0], 64)

    def layer(q, k, v):
        return triton_backend.block_attention_triton(q * 2, k, v, offsets, cos, sin).relu()

    eager = grads_of(layer, (q, k, v), grad_out, torch.bfloat16)
    compiled = grads_of(torch.compile(layer, fullgraph=True), (q, k, v), grad_out, torch.bfloat16)
    row = {"ok": True, "outputs": {}}
    for name, a, b in zip(("out", "dq", "dk", "dv"), compiled, eager):
        err = (a.double() - b.double()).abs().max().item()
        row["outputs"][name] = {"max_diff_vs_eager": err}
        row["ok"] &= err <= 1e-2
    return row


def cases(device):
    rng = torch.Generator().manual_seed(1234)
    ragged = EDGE_LENGTHS + torch.randint(0, 600, (40,), generator=rng).tolist()
    for head_dim in (32, 64, 128):
        for rotary_name in ROTARY:
            yield f"D{head_dim} rotary={rotary_name} ragged bf16", lambda d=head_dim, r=rotary_name: check_attention(
                ragged, d, torch.bfloat16, r, device, seed=d)
    yield "D128 rotary=qk ragged fp16", lambda: check_attention(ragged, 128, torch.float16, "qk", device, seed=5)
    # More work items than resident programs, so every program wraps around its persistent loop.
    many = [4096 + 17, 3000, 1] * 12
    yield "D64 rotary=qkv many-items bf16", lambda: check_attention(many, 64, torch.bfloat16, "qkv", device, seed=6)
    yield "all sequences empty", lambda: check_empty(device)
    for head_dim in (64, 128):
        yield f"D{head_dim} fused projection rotary=qk bf16", lambda d=head_dim: check_fused_projection(
            ragged, d, torch.bfloat16, device, seed=10 + d)
    yield "torch.compile fullgraph inductor D64 bf16", lambda: check_compiled(device)


def run_checks(device) -> list[dict]:
    rows = []
    for name, run in cases(device):
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
            cells.append(f"{name} {o['max_err']:.2e}/{o['torch_max_err']:.2e} {o['snr_db']:5.1f}dB{' !' + flags if flags else ''}")
        else:
            cells.append(f"{name} " + " ".join(f"{key}={value:.2g}" if isinstance(value, float) else f"{key}={value}" for key, value in o.items()))
    print(f"{status}  {row['case']:<42} " + " | ".join(cells), flush=True)


def run_sweep(device) -> list[dict]:
    """fwd and fwd+bwd times of the triton backend per setting, as a fraction of copy bandwidth."""
    from benchmarks.bench_attention import (
        frac_copy_bw, make_inputs, make_timer, measure_copy_bw_tbps, min_bytes, parse_shape, time_pass,
    )

    timer = make_timer(device, warmup_ms=25, rep_ms=100)
    copy_bw = measure_copy_bw_tbps(device, 1 << 30, timer)
    print(f"copy bandwidth {copy_bw:.2f} TB/s", flush=True)
    rows = []
    defaults = (dict(triton_backend._NUM_WARPS), triton_backend._LOOP_STAGES)
    for label in SWEEP_SHAPES:
        inputs = make_inputs(parse_shape(label), device, seed=0)
        for rotary in (False, True):
            tables = Rotary(cos=inputs.cos, sin=inputs.sin) if rotary else None

            def forward(q, k, v):
                return block_attention(q, k, v, inputs.offsets, rotary=tables, backend="triton")

            for setting, (num_warps, stages) in SWEEP_SETTINGS.items():
                triton_backend._NUM_WARPS, triton_backend._LOOP_STAGES = dict(num_warps), stages
                row = {"shape": label, "rotary": rotary, "setting": setting}
                try:
                    for pass_ in ("fwd", "fwd+bwd"):
                        ms, _ = time_pass(pass_, forward, inputs, timer)
                        nbytes = min_bytes(pass_, inputs.tokens, inputs.shape.heads, inputs.shape.head_dim, 2, rotary)
                        row[pass_] = {"ms": ms, "frac_copy_bw": frac_copy_bw(nbytes, ms, copy_bw)}
                    print(f"{label:<24} rotary={rotary!s:<5} {setting:<8} " + "  ".join(
                        f"{p} {row[p]['ms']:.3f} ms {100 * row[p]['frac_copy_bw']:.0f}%" for p in ("fwd", "fwd+bwd")), flush=True)
                except Exception as error:
                    row["error"] = f"{type(error).__name__}: {error}"
                    print(f"{label:<24} rotary={rotary!s:<5} {setting:<8} ERROR {row['error']}", flush=True)
                rows.append(row)
        del inputs
        torch.cuda.empty_cache()
    triton_backend._NUM_WARPS, triton_backend._LOOP_STAGES = defaults
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="JSON file for every number")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sweep", action="store_true", help="also time a few kernel settings (minutes)")
    args = parser.parse_args()
    device = torch.device(args.device)
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(device)}
    print(env, flush=True)
    print("case: per output, max abs error kernel/torch-same-dtype vs fp64, SNR; ! flags = failed checks", flush=True)
    rows = run_checks(device)
    report = {"env": env, "min_grad_snr_db": MIN_GRAD_SNR_DB, "error_ratio": ERROR_RATIO, "cases": rows}
    failed = [row["case"] for row in rows if not row["ok"]]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    if args.sweep:
        report["sweep"] = run_sweep(device)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"{'FAIL' if failed else 'PASS'}: {len(rows) - len(failed)} passed, {len(failed)} failed {failed or ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
