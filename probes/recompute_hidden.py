"""Probe (not for commit): the MLP backward recomputing the pre-activation from LN(x) instead of reading it."""
import json, sys
from dataclasses import replace
import torch
import triton
from triton.testing import do_bench
from kernels.backend import launch_json
from kernels import mlp_sublayer_tlx as tlxm
from kernels import mlp_sublayer_triton as trm
from kernels.sublayer_triton import layer_norm_forward, layer_norm_backward, bias_gemm

T, D, H = 155648, 256, 1024
dev, bf = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(T, D, device=dev, generator=g).to(bf)
nw = torch.rand(D, device=dev, generator=g) + 0.5
nb = torch.randn(D, device=dev, generator=g) * 0.1
w1 = (torch.randn(H, D, device=dev, generator=g) * 0.06).to(bf)
b1 = (torch.randn(H, device=dev, generator=g) * 0.1).to(bf)
w2 = (torch.randn(D, H, device=dev, generator=g) * 0.03).to(bf)
b2 = (torch.randn(D, device=dev, generator=g) * 0.1).to(bf)
grad_y = (torch.randn(T, D, device=dev, generator=g)).to(bf)
eps = 1e-5
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}

def bench(name, fn):
    fn(); torch.cuda.synchronize()
    ms = do_bench(fn, warmup=50, rep=300)
    out[name] = round(ms, 4)
    print(f"{name:50s} {ms:.4f}", flush=True)

fwd_default = launch_json(None)
fwd_nostore = launch_json({"fwd": {"STORE_HIDDEN": False}})
bench("tlx_fwd_store_hidden", lambda: tlxm._forward(x, nw, nb, w1, b1, w2, b2, eps, "tanh", fwd_default))
bench("tlx_fwd_store_normed", lambda: tlxm._forward(x, nw, nb, w1, b1, w2, b2, eps, "tanh", fwd_nostore))
y, hidden, mean, rstd = tlxm._forward(x, nw, nb, w1, b1, w2, b2, eps, "tanh", fwd_default)
normed, mean2, rstd2 = layer_norm_forward(x, nw, nb, eps, bf)
hidden_ref = bias_gemm(normed, w1, b1, 128, 128, 8, 3)
out["hidden_tlx_vs_bias_gemm_maxdiff"] = (hidden.float() - hidden_ref.float()).abs().max().item()
out["hidden_tlx_vs_bias_gemm_mismatch"] = (hidden != hidden_ref).float().mean().item()
bench("layer_norm_forward", lambda: layer_norm_forward(x, nw, nb, eps, bf))

grad_out = grad_y.contiguous()
base_cfg = trm.launch_config("bwd", D, "", "tanh")
print("default bwd config", base_cfg)
bench("hidden_grad_stored_64x128w4", lambda: trm._hidden_grad(grad_out, w2, hidden, base_cfg, "tanh"))
ref = trm._hidden_grad(grad_out, w2, hidden_ref, base_cfg, "tanh")
for bm, bn, w, st in [(64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3), (128, 128, 8, 3), (64, 128, 4, 2), (128, 64, 8, 3)]:
    cfg = replace(base_cfg, block_m=bm, block_n=bn, num_warps=w, num_stages=st)
    name = f"hidden_grad_recompute_{bm}x{bn}w{w}s{st}"
    bench(name, lambda: trm._hidden_grad(grad_out, w2, normed, cfg, "tanh", w1, b1))
    got = trm._hidden_grad(grad_out, w2, normed, cfg, "tanh", w1, b1)
    # dH and GELU's output (the column sums' rows differ with the tile height).
    out[name + "_maxdiff"] = [(a.float() - b.float()).abs().max().item() for a, b in zip(got[:2], ref[:2])]

dH, act, db1p = ref
bench("cublas_dH_w1", lambda: dH @ w1)
gn = dH @ w1
dx = torch.empty_like(x)
nrm = torch.empty_like(normed)
bench("ln_bwd_store_normed", lambda: layer_norm_backward(gn, grad_y, x, mean, rstd, nw, nb, dx, nrm))
bench("ln_bwd_no_normed", lambda: layer_norm_backward(gn, grad_y, x, mean, rstd, nw, nb, dx))
bench("cublas_dw1", lambda: dH.t() @ normed)
bench("cublas_dw2", lambda: grad_out.t() @ act)

def bwd_stored():
    r = trm._backward_gemms(grad_y, x, nw, nb, w1, w2, hidden, mean, rstd, base_cfg, "tanh")
    return r[2].t() @ r[4], r[1].t() @ r[3]

best = {}
def bwd_recompute(cfg):
    dH, act, db1p = trm._hidden_grad(grad_out, w2, normed, cfg, "tanh", w1, b1)
    gn = dH @ w1
    dx = torch.empty_like(x)
    cp = layer_norm_backward(gn, grad_y, x, mean, rstd, nw, nb, dx)
    return dH.t() @ normed, grad_out.t() @ act

bench("bwd_stored_total", bwd_stored)
for bm, bn, w in [(64, 64, 4), (64, 128, 4), (64, 128, 8)]:
    cfg = replace(base_cfg, block_m=bm, block_n=bn, num_warps=w)
    bench(f"bwd_recompute_total_{bm}x{bn}w{w}", lambda: bwd_recompute(cfg))
json.dump(out, open(sys.argv[1], "w"), indent=1)
