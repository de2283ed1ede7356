"""Probe: _layer_norm_bwd_tiles's launch (rows a block, blocks a program, warps) at configs/gpu.yaml's MLP shape."""
import itertools, json, sys
import torch, triton
from triton.testing import do_bench
from kernels.sublayer_triton import _layer_norm_bwd_tiles, layer_norm_backward, launch

import os
T, D = (155648, 256) if not os.environ.get("PROBE_SMOKE") else (100, 32)
dev = "cpu" if os.environ.get("PROBE_SMOKE") else "cuda"
if dev == "cpu":
    do_bench = lambda fn, **kw: (fn(), 0.0)[1]
    torch.cuda.synchronize = lambda: None
    torch.cuda.get_device_name = lambda: "cpu"
g = torch.Generator(device=dev).manual_seed(0)
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "rows": []}
for x_dtype in (torch.bfloat16,):
    x = torch.randn(T, D, device=dev, generator=g).to(x_dtype)
    grad_y = torch.randn(T, D, device=dev, generator=g).to(x_dtype)
    grad_normed = torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16)
    mean = torch.randn(T, device=dev, generator=g)
    rstd = torch.rand(T, device=dev, generator=g) + 0.5
    nw = torch.rand(D, device=dev, generator=g) + 0.5
    nb = torch.randn(D, device=dev, generator=g)
    dx = torch.empty_like(x)
    normed = torch.empty(T, D, device=dev, dtype=torch.bfloat16)
    ref_parts = layer_norm_backward(grad_normed, grad_y, x, mean, rstd, nw, nb, dx, normed)
    ref_dx = dx.clone()
    grid = itertools.product((8, 16, 32), (2, 4, 8, 16), (1, 2, 4)) if dev == "cuda" else [(16, 8, 2), (8, 2, 4)]
    for rows, chunks, warps in grid:
        if rows * chunks > 512 or rows * D // (32 * warps) > 256:
            continue
        tiles = triton.cdiv(T, rows * chunks)
        parts = torch.zeros((tiles, 3, D), dtype=torch.float32, device=dev)
        args = (grad_normed, grad_y, x, mean, rstd, nw, nb, dx, normed, parts, T, x.stride(0), grad_y.stride(0))
        ce = dict(D=D, BLOCK_M=rows, CHUNKS=chunks, STORE_NORMED=True)
        fn = lambda: launch(_layer_norm_bwd_tiles, tiles, x.device, args, ce, num_warps=warps)
        try:
            fn(); torch.cuda.synchronize()
            ms = do_bench(fn, warmup=25, rep=200)
        except Exception as exc:  # out of resources
            print("skip", rows, chunks, warps, type(exc).__name__, flush=True)
            continue
        ok = torch.equal(dx, ref_dx) and torch.allclose(parts.sum(0), ref_parts.sum(0), rtol=1e-4, atol=1e-2)
        row = dict(x_dtype=str(x_dtype), rows=rows, chunks=chunks, warps=warps, ms=round(ms, 4), ok=ok)
        out["rows"].append(row)
        print(row, flush=True)
    best = min((r for r in out["rows"] if r["x_dtype"] == str(x_dtype)), key=lambda r: r["ms"])
    print("best", best, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
