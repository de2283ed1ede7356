"""Every block-attention, attention-sublayer and MLP-sublayer backend this machine can run, judged by
kernels.testing.parity (attention_sublayer_parity, mlp_parity) on the GPU.

Marked `gpu`: skipped without CUDA (CI has none). On the H200 (scripts/gpu_session.sh, step
`parity`) it runs as `python3 -m pytest -m gpu -v -s tests/test_gpu_parity.py`, and its log is
committed as benchmarks/results/parity_h200.log. Each case prints parity's summary line, so the
log holds the numbers, not only PASS/FAIL.
"""

import pytest
import torch

from kernels import (
    AUTO_ORDER, Rotary, available_backends, backend_unavailable_reason, block_attention, block_attention_qkv,
    block_table, get_backend, offsets_from_lengths, rotary_tables,
)
from kernels.attention_sublayer_dispatch import ATTENTION_SUBLAYER_KERNELS, get_attention_sublayer_backend
from kernels.mlp_dispatch import MLP_AUTO_ORDER, get_mlp_backend
from kernels.testing import EDGE_LENGTHS, attention_sublayer_parity, mlp_parity, parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KERNEL_BACKENDS = [*(name for name in AUTO_ORDER if name != "reference"), "flex"]  # flex: a peer `auto` never picks
ROTARY = {"none": None, "qk": Rotary(), "qkv": Rotary(rotate_v=True)}
_random = torch.Generator().manual_seed(1234)
# The edge lengths, then 40 random ones: several hundred blocks, so many programs take part.
RAGGED = (*EDGE_LENGTHS, 0, 128, *torch.randint(0, 600, (40,), generator=_random).tolist())
# More (block, head) items than any grid has programs: persistent programs wrap around their loop.
MANY_ITEMS = (4096 + 17, 3000, 1) * 12


def _runnable(backend: str, head_dim: int, dtype: torch.dtype) -> None:
    if backend_unavailable_reason(backend, "cuda") is not None:
        pytest.skip(f"{backend} is not available on this machine")
    reason = get_backend(backend).unsupported_reason(torch.empty(1, 1, head_dim, dtype=dtype, device="cuda"))
    if reason is not None:
        pytest.skip(f"{backend} does not take {reason}")


@pytest.mark.parametrize("rotary", ROTARY)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_parity(backend, head_dim, dtype, rotary):
    _runnable(backend, head_dim, dtype)
    for lengths in (EDGE_LENGTHS, RAGGED):
        result = parity(backend, lengths=lengths, head_dim=head_dim, dtype=dtype, rotary=ROTARY[rotary],
                        device="cuda", seed=head_dim + len(lengths))
        print(result.summary())
        assert result.ok, result.summary()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_parity_with_more_items_than_programs(backend):
    _runnable(backend, 64, torch.bfloat16)
    result = parity(backend, lengths=MANY_ITEMS, head_dim=64, rotary=Rotary(rotate_v=True), device="cuda", seed=6)
    print(result.summary())
    assert result.ok, result.summary()


@pytest.mark.parametrize("compiled", (False, True), ids=("eager", "compiled"))
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_packed_qkv_matches_its_views(backend, compiled):
    """block_attention_qkv (how the model calls it) gives block_attention's result on qkv's views, and the
    stacked gradients of the views, bit for bit: the same kernels, writing dqkv in place where packed."""
    _runnable(backend, 64, torch.bfloat16)
    offsets = offsets_from_lengths(RAGGED).cuda()
    tokens = int(offsets[-1])
    table = block_table(offsets, tokens)
    cos, sin = rotary_tables(Rotary(), offsets, tokens, 64)
    generator = torch.Generator(device="cpu").manual_seed(8)
    qkv, grad_out = (torch.randn(tokens, *shape, generator=generator).to("cuda", torch.bfloat16)
                     for shape in ((3, 4, 64), (4, 64)))
    results = []
    for attention in (lambda x: block_attention_qkv(x, table, rotary=Rotary(cos=cos, sin=sin), backend=backend),
                      lambda x: block_attention(*x.unbind(1), table, rotary=Rotary(cos=cos, sin=sin), backend=backend)):
        attention = torch.compile(attention, fullgraph=backend != "flex") if compiled else attention
        leaf = qkv.detach().requires_grad_()
        out = attention(leaf)
        results.append((out, *torch.autograd.grad(out, leaf, grad_out)))
    for name, a, b in zip(("out", "dqkv"), *results):
        assert torch.equal(a, b), f"{backend} {name}: max difference {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_compiled_layer_matches_eager(backend):
    """torch.compile (inductor, fullgraph but for flex) of a layer around the kernel gives the eager result."""
    _runnable(backend, 64, torch.bfloat16)
    lengths = [3, 70, 200]
    offsets = torch.tensor([0, 3, 73, 273], dtype=torch.int32, device="cuda")
    table = block_table(offsets, 273)
    cos, sin = rotary_tables(Rotary(), offsets, 273, 64)
    generator = torch.Generator(device="cpu").manual_seed(7)
    inputs = [torch.randn(sum(lengths), 4, 64, generator=generator).to("cuda", torch.bfloat16) for _ in range(4)]

    def layer(q, k, v):
        return block_attention(q * 2, k, v, table, rotary=Rotary(cos=cos, sin=sin), backend=backend).relu()

    def out_and_grads(fn):
        leaves = [x.detach().requires_grad_() for x in inputs[:3]]
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, inputs[3])]

    eager = out_and_grads(layer)
    # flex runs outside a compiled caller's graph by design (kernels/block_attention_flex.py): one break.
    compiled = out_and_grads(torch.compile(layer, fullgraph=backend != "flex"))
    for name, a, b in zip(("out", "dq", "dk", "dv"), compiled, eager):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_custom_ops_pass_opcheck_on_gpu(backend):
    _runnable(backend, 64, torch.bfloat16)
    ops = get_backend(backend).ops
    if ops is None:
        pytest.skip(f"{backend} is plain PyTorch ops, no custom op of ours")
    offsets = torch.tensor([0, 3, 73, 273], dtype=torch.int32, device="cuda")
    table = block_table(offsets, 273)
    cos, sin = (rotary_tables(Rotary(), offsets, 273, 64) if get_backend(backend).fuses_rotary else (None, None))
    q, k, v = (torch.randn(273, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    torch.library.opcheck(ops.forward_op, (q, k, v, *table.tensors(), cos, sin, False, ""))


MLP_KERNEL_BACKENDS = [name for name in MLP_AUTO_ORDER if name != "reference"]
# x in fp32 with bf16 matmuls is how configs/gpu.yaml runs the sublayer (bf16-mixed autocast).
MLP_DTYPES = {"bf16": (torch.bfloat16, torch.bfloat16), "fp16": (torch.float16, torch.float16),
              "fp32_x_bf16_matmul": (torch.float32, torch.bfloat16)}


def _mlp_runnable(backend: str, d_model: int, hidden: int, x_dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} is not available on this machine")
    reason = get_mlp_backend(backend).unsupported_reason(torch.empty(1, d_model, dtype=x_dtype, device="cuda"), hidden,
                                                         compute_dtype)
    if reason is not None:
        pytest.skip(f"{backend} does not take {reason}")


@pytest.mark.parametrize("approximate", ("none", "tanh"))
@pytest.mark.parametrize("dtypes", MLP_DTYPES)
@pytest.mark.parametrize("d_model,hidden", ((64, 256), (256, 1024)))
@pytest.mark.parametrize("backend", MLP_KERNEL_BACKENDS)
def test_mlp_parity(backend, d_model, hidden, dtypes, approximate):
    """The fused MLP sublayer by the project's rule, with a partial last tile and, at 5000 tokens,
    more tiles than a persistent grid has programs; with approximate="tanh", the hardware tanh
    (tanh.approx.f32) in every GELU and GELU' site against the tanh-form references."""
    x_dtype, compute_dtype = MLP_DTYPES[dtypes]
    _mlp_runnable(backend, d_model, hidden, x_dtype, compute_dtype)
    for tokens in (1, 200, 5000 + 17):
        result = mlp_parity(backend, tokens=tokens, d_model=d_model, hidden=hidden, x_dtype=x_dtype,
                            compute_dtype=compute_dtype, device="cuda", seed=tokens, approximate=approximate)
        print(result.summary())
        assert result.ok, result.summary()


@pytest.mark.parametrize("backend", MLP_KERNEL_BACKENDS)
def test_mlp_custom_ops_pass_opcheck_on_gpu(backend):
    _mlp_runnable(backend, 64, 256, torch.float32, torch.bfloat16)
    ops = get_mlp_backend(backend).ops
    x, nw, nb = (torch.randn(*shape, device="cuda", requires_grad=True) for shape in ((300, 64), (64,), (64,)))
    w1, b1, w2, b2 = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                      for shape in ((256, 64), (256,), (64, 256), (64,)))
    torch.library.opcheck(ops.forward_op, (x, nw, nb, w1, b1, w2, b2, 1e-5, "none", ""))


# The kernel backends' launch variants that the benchmark times (kernels.mlp_sublayer_tlx.FWD_KNOBS, BWD_KNOBS;
# kernels.mlp_sublayer_triton.LaunchConfig): name -> (backend, launch).
MLP_VARIANTS = {"tlx_one_consumer": ("tlx", {"fwd": {"NUM_CONSUMERS": 1}}),
                "tlx_tiles_backward": ("tlx", {"bwd": {"TRITON_BACKWARD": False}}),
                # Each GELU form's backward tiles in the other form (64 x 64 exact, 64 x 128 tanh by default).
                "triton_bwd_64x64": ("triton", {"bwd": {"block_n": 64}}),
                "triton_bwd_64x128": ("triton", {"bwd": {"block_n": 128}})}


@pytest.mark.parametrize("approximate", ("none", "tanh"))
@pytest.mark.parametrize("dtypes", ("bf16", "fp32_x_bf16_matmul"))
@pytest.mark.parametrize("d_model,hidden", ((64, 256), (256, 1024)))
@pytest.mark.parametrize("variant", MLP_VARIANTS)
def test_mlp_parity_variants(variant, d_model, hidden, dtypes, approximate):
    backend, launch = MLP_VARIANTS[variant]
    x_dtype, compute_dtype = MLP_DTYPES[dtypes]
    _mlp_runnable(backend, d_model, hidden, x_dtype, compute_dtype)
    # 1 and 200 tokens: an odd number of tiles, so one TLX consumer's last tile lies wholly past T.
    for tokens in (1, 200, 5000 + 17):
        result = mlp_parity(backend, tokens=tokens, d_model=d_model, hidden=hidden, x_dtype=x_dtype,
                            compute_dtype=compute_dtype, device="cuda", seed=tokens, launch=launch,
                            approximate=approximate)
        print(result.summary())
        assert result.ok, result.summary()


@pytest.mark.parametrize("rotary", ROTARY)
@pytest.mark.parametrize("dtypes", MLP_DTYPES)
@pytest.mark.parametrize("num_heads,head_dim", ((4, 64), (2, 128)))
@pytest.mark.parametrize("backend", ATTENTION_SUBLAYER_KERNELS)
def test_attention_sublayer_parity(backend, num_heads, head_dim, dtypes, rotary):
    """The fused attention sublayer by the project's rule on the ragged batch of block attention's GPU
    parity (several hundred blocks), d_model 256 in heads of 64 and 128."""
    x_dtype, compute_dtype = MLP_DTYPES[dtypes]
    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} is not available on this machine")
    reason = get_attention_sublayer_backend(backend).unsupported_reason(
        torch.empty(1, num_heads * head_dim, dtype=x_dtype, device="cuda"), num_heads, compute_dtype)
    if reason is not None:
        pytest.skip(f"{backend} does not take {reason}")
    result = attention_sublayer_parity(backend, lengths=RAGGED, num_heads=num_heads, head_dim=head_dim,
                                       x_dtype=x_dtype, compute_dtype=compute_dtype, rotary=ROTARY[rotary],
                                       device="cuda")
    print(result.summary())
    assert result.ok, result.summary()


def _blocks_plan_parity(backend, num_heads, head_dim, dtypes, rotary, passes):
    from kernels.attention_sublayer_tlx import tlx_blocks_unsupported_reason

    x_dtype, compute_dtype = MLP_DTYPES[dtypes]
    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} is not available on this machine")
    reason = tlx_blocks_unsupported_reason(num_heads * head_dim, head_dim, compute_dtype) if backend == "tlx" else None
    if reason is not None:
        pytest.skip(f"the tlx 'blocks' kernels do not take {reason}")
    result = attention_sublayer_parity(backend, lengths=RAGGED, num_heads=num_heads, head_dim=head_dim,
                                       x_dtype=x_dtype, compute_dtype=compute_dtype, rotary=ROTARY[rotary],
                                       device="cuda", launch={direction: {"plan": "blocks"} for direction in passes})
    print(result.summary())
    assert result.ok, result.summary()


@pytest.mark.parametrize("rotary", ROTARY)
@pytest.mark.parametrize("dtypes", MLP_DTYPES)
@pytest.mark.parametrize("num_heads,head_dim", ((4, 64), (2, 128), (2, 64), (1, 64), (1, 128)))
@pytest.mark.parametrize("backend", ("triton", "tlx"))
def test_attention_sublayer_parity_blocks_plan(backend, num_heads, head_dim, dtypes, rotary):
    """The per-block kernels, both passes, as above: the triton backend's (kernels/attention_sublayer_blocks.py)
    and the tlx backend's (kernels/attention_sublayer_tlx.py); also d_model 64 and 128 (in heads of 64 the
    TLX kernels run two consumers)."""
    _blocks_plan_parity(backend, num_heads, head_dim, dtypes, rotary, passes=("fwd", "bwd"))


@pytest.mark.parametrize("num_heads,head_dim", ((4, 64), (1, 64)))
@pytest.mark.parametrize("direction", ("fwd", "bwd"))
def test_attention_sublayer_parity_blocks_plan_one_pass(direction, num_heads, head_dim):
    """The tlx per-block kernel of one pass beside the gemms plan's other pass, which the plans' saved
    tensors allow: when both passes fail together above, this says which kernel is wrong."""
    _blocks_plan_parity("tlx", num_heads, head_dim, "bf16", "qk", passes=(direction,))


@pytest.mark.parametrize("backend", ATTENTION_SUBLAYER_KERNELS)
def test_attention_sublayer_custom_ops_pass_opcheck_on_gpu(backend):
    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} is not available on this machine")
    ops = get_attention_sublayer_backend(backend).ops
    offsets = torch.tensor([0, 3, 73, 273], dtype=torch.int32, device="cuda")
    table = block_table(offsets, 273)
    cos, sin = rotary_tables(Rotary(), offsets, 273, 64)
    x, nw, nb = (torch.randn(*shape, device="cuda", requires_grad=True) for shape in ((273, 256), (256,), (256,)))
    w_qkv, b_qkv, w_out, b_out = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                                  for shape in ((768, 256), (768,), (256, 256), (256,)))
    torch.library.opcheck(ops.forward_op, (x, nw, nb, w_qkv, b_qkv, w_out, b_out, *table.tensors(), cos, sin, 4, False,
                                           1e-5, ""))
