"""GPU correctness check of the TLX backend against kernels.reference (run on an H100/H200).

    PYTHONPATH=<fbtriton site-packages or nothing if installed>:. python benchmarks/gpu_check_tlx.py

Forward output and dq/dk/dv are compared with the fp32 reference on ragged batches (lengths
0, 1, 63, 64, 65, 200, full blocks, random), D = 64/128, bf16 (and a few fp16), with and without
fused rotary (and rotate_v). Gradients must also be bitwise identical across two runs. Every case
runs in its own try/except so one crash doesn't hide the rest; exits 1 if anything failed.
"""

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.reference import block_attention_reference  # noqa: E402
from kernels.rotary import Rotary, rotary_tables  # noqa: E402
from kernels.tlx_block_attention import HAS_TLX, block_attention_tlx, tlx_unsupported_reason  # noqa: E402

# Relative Frobenius error vs the fp32 reference; bf16 rounding of inputs/P/dS dominates.
TOL = {torch.bfloat16: {"out": 2e-2, "grad": 4e-2}, torch.float16: {"out": 5e-3, "grad": 1e-2}}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def make_case(lengths, heads, head_dim, dtype, rotary, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    total = int(offsets[-1])
    q, k, v, do = (torch.randn(total, heads, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(4))
    cos = sin = None
    if rotary:
        cos, sin = rotary_tables(Rotary(), offsets, total, head_dim)
    return q, k, v, do, offsets, cos, sin


def run_tlx(q, k, v, do, offsets, cos, sin, rotate_v, fn=block_attention_tlx):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, offsets, cos, sin, rotate_v)
    out.backward(do)
    torch.cuda.synchronize()
    return out.detach(), [x.grad for x in leaves]


def run_ref(q, k, v, do, offsets, cos, sin, rotate_v):
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    out = block_attention_reference(*leaves, offsets, cos, sin, rotate_v)
    out.backward(do.float())
    return out.detach(), [x.grad for x in leaves]


def check(name, lengths, heads, head_dim, dtype, rotary, rotate_v, device, seed=0, fn=block_attention_tlx):
    q, k, v, do, offsets, cos, sin = make_case(lengths, heads, head_dim, dtype, rotary, device, seed)
    t0 = time.perf_counter()
    out, grads = run_tlx(q, k, v, do, offsets, cos, sin, rotate_v, fn)
    dt = time.perf_counter() - t0
    ref_out, ref_grads = run_ref(q, k, v, do, offsets, cos, sin, rotate_v)
    errs = {"out": rel_err(out, ref_out)}
    errs.update({n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    finite = all(torch.isfinite(t).all().item() for t in (out, *grads))
    tol = TOL[dtype]
    ok = finite and errs["out"] <= tol["out"] and all(errs[n] <= tol["grad"] for n in ("dq", "dk", "dv"))
    # Determinism: a second run must give bitwise-identical output and gradients.
    out2, grads2 = run_tlx(q, k, v, do, offsets, cos, sin, rotate_v, fn)
    deterministic = torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    ok = ok and deterministic
    errs_s = " ".join(f"{n}={e:.2e}" for n, e in errs.items())
    print(f"{'PASS' if ok else 'FAIL'} {name}: {errs_s} finite={finite} deterministic={deterministic} "
          f"({dt * 1e3:.0f} ms first call)", flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="only one shape per (D, rotary) combination")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, HAS_TLX={HAS_TLX}, device={torch.cuda.get_device_name(device)}", flush=True)
    probe = torch.empty(1, 1, 64, device=device, dtype=torch.bfloat16)
    reason = tlx_unsupported_reason(probe)
    if reason:
        print(f"FAIL: TLX backend unavailable: {reason}")
        return 1

    rng = torch.Generator().manual_seed(1234)
    shapes = {
        "edge": [0, 1, 63, 64, 65, 200],
        "full": [64, 128, 256, 64],
        "single_token": [1],
        "empties": [0, 0, 130, 0],
        "random": torch.randint(0, 400, (12,), generator=rng).tolist(),
        "many_blocks": [64 * 40 + 17, 3000],  # more work items than SMs: persistent loop wraps
    }
    if args.quick:
        shapes = {k: shapes[k] for k in ("edge",)}
    cases = []
    for head_dim in (64, 128):
        for rotary, rotate_v in ((False, False), (True, False), (True, True)):
            for shape_name, lengths in shapes.items():
                cases.append((f"D{head_dim} {'rotary' if rotary else 'plain'}{'+v' if rotate_v else ''} "
                               f"{shape_name} bf16", lengths, 4, head_dim, torch.bfloat16, rotary, rotate_v))
            cases.append((f"D{head_dim} {'rotary' if rotary else 'plain'}{'+v' if rotate_v else ''} edge fp16",
                          shapes["edge"], 3, head_dim, torch.float16, rotary, rotate_v))
    results = []
    for case in cases:
        try:
            results.append(check(*case, device=device))
        except Exception:
            print(f"FAIL {case[0]}: exception", flush=True)
            traceback.print_exc()
            results.append(False)

    extra = []
    # Another device than the current one: the op must launch on the tensors' own device.
    if torch.cuda.device_count() > 1:
        extra.append(("D64 rotary edge bf16 on cuda:1", dict(device=torch.device("cuda", 1))))
    for name, kw in extra:
        try:
            results.append(check(name, shapes["edge"], 2, 64, torch.bfloat16, True, False, **kw))
        except Exception:
            print(f"FAIL {name}: exception", flush=True)
            traceback.print_exc()
            results.append(False)
    try:
        compiled = torch.compile(block_attention_tlx, fullgraph=True)
        results.append(check("D128 rotary edge bf16 torch.compile", shapes["edge"], 2, 128, torch.bfloat16, True,
                             False, device=device, fn=compiled))
    except Exception:
        print("FAIL torch.compile: exception", flush=True)
        traceback.print_exc()
        results.append(False)

    passed = sum(results)
    print(f"{passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
