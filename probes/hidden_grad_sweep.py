"""Probe: _hidden_grad_gemm's launch (tile, warps, stages, K step) at configs/gpu.yaml's MLP shape, tanh GELU."""
import itertools, json, os, sys
import torch, triton
from triton.testing import do_bench
from kernels.mlp_sublayer_triton import _hidden_grad_gemm
from kernels.sublayer_triton import launch

smoke = bool(os.environ.get("PROBE_SMOKE"))
T, D, H = (155648, 256, 1024) if not smoke else (100, 64, 256)
dev = "cpu" if smoke else "cuda"
dtype = torch.bfloat16 if not smoke else torch.float32
g = torch.Generator(device=dev).manual_seed(0)
grad_out = torch.randn(T, D, device=dev, generator=g).to(dtype)
w2 = (torch.randn(D, H, device=dev, generator=g) * 0.05).to(dtype)
hidden = torch.randn(T, H, device=dev, generator=g).to(dtype)
out = {"device": "cpu" if smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
       "triton": triton.__version__, "rows": []}
ref = None
tiles_warps = ((64, 64, 4), (64, 128, 4), (64, 128, 8), (64, 256, 4), (64, 256, 8), (128, 64, 4), (128, 128, 8))
grid = [(bm, bn, w, st, bk) for (bm, bn, w) in tiles_warps for st in (2, 3, 4) for bk in (64, 128)] if not smoke else [
    (64, 128, 4, 3, 64), (64, 64, 4, 2, 32)]
for bm, bn, warps, stages, bk in grid:
    if bm * bn // (32 * warps) > 128 or (bm == 128 and bn == 256):
        continue
    tiles = triton.cdiv(T, bm) * triton.cdiv(H, bn)
    grad_hidden = torch.empty(T, H, device=dev, dtype=dtype)
    activation = torch.empty_like(grad_hidden)
    parts = torch.zeros(triton.cdiv(T, bm), H, device=dev, dtype=torch.float32)
    args = (grad_out, w2, hidden, grad_hidden, activation, parts, T, H)
    ce = dict(D=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION="tf32" if not smoke else "ieee", TANH_GELU=True)
    fn = lambda: launch(_hidden_grad_gemm, tiles, grad_out.device, args, ce, num_warps=warps, num_stages=stages)
    try:
        fn()
        if not smoke:
            torch.cuda.synchronize()
        ms = do_bench(fn, warmup=25, rep=200) if not smoke else 0.0
    except Exception as exc:  # out of shared memory or registers
        print("skip", bm, bn, warps, stages, bk, type(exc).__name__, flush=True)
        continue
    if ref is None:
        ref = (grad_hidden.clone(), activation.clone())
    ok = torch.equal(activation, ref[1]) and torch.allclose(grad_hidden.float(), ref[0].float(), rtol=2e-2, atol=1e-2)
    row = dict(block_m=bm, block_n=bn, warps=warps, stages=stages, block_k=bk, ms=round(ms, 4), ok=ok)
    out["rows"].append(row)
    print(row, flush=True)
print("best", sorted(out["rows"], key=lambda r: r["ms"])[:5], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
