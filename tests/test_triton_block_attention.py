"""The Triton backend against the PyTorch reference, run on CPU by the Triton interpreter.

triton.jit picks the interpreter when a kernel is defined, so TRITON_INTERPRET=1 must be set before
kernels.triton_block_attention is first imported: scripts/test.sh exports it for the whole run, and
this module sets it too for when it runs alone. bf16 is not tested here: the interpreter's bf16
tl.dot is wrong (benchmarks/gpu_check_triton.py covers bf16 on a GPU).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import (  # noqa: E402
    Rotary, apply_rotary, block_attention, block_attention_reference, check_backend, offsets_from_lengths, rotary_tables,
)
from kernels.triton_block_attention import (  # noqa: E402
    block_attention_qkv_triton,
    block_attention_triton,
    triton_unsupported_reason,
)

LENGTHS = (0, 1, 63, 64, 65, 200)  # empty, single token, partial, full, one past a block, several
HEADS = 2
ROTARY_MODES = {"none": None, "qk": Rotary(), "qkv": Rotary(rotate_v=True)}
# Below this, errors are rounding noise of the comparison itself, not of either implementation.
ABS_FLOOR = {torch.float32: 1e-6, torch.float16: 1e-4}


def _inputs(lengths, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_from_lengths(lengths)
    shape = (int(offsets[-1]), HEADS, head_dim)
    q, k, v = (torch.randn(shape, generator=generator).to(dtype) for _ in range(3))
    # A strided gradient (token stride 2*H*D) checks that the backward honours grad_out's strides.
    grad_out = torch.randn((shape[0], HEADS, 2 * head_dim), generator=generator).to(dtype)[..., :head_dim]
    return q, k, v, offsets, grad_out


def _run(fn, q, k, v, grad_out, dtype):
    """fn's output and (dq, dk, dv) for grad_out, with q, k, v cast to dtype as fresh leaves."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out.to(dtype))
    return [out.detach(), *grads]


def _max_err(results, truth):
    return [(r.double() - t).abs().max().item() for r, t in zip(results, truth)]


@pytest.mark.parametrize("rotary_mode", ROTARY_MODES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=str)
@pytest.mark.parametrize("head_dim", (32, 64, 128))
def test_forward_and_gradients_match_reference(head_dim, dtype, rotary_mode):
    rotary = ROTARY_MODES[rotary_mode]
    q, k, v, offsets, grad_out = _inputs(LENGTHS, head_dim, dtype)
    cos = sin = None
    rotate_v = rotary is not None and rotary.rotate_v
    if rotary is not None:
        cos, sin = rotary_tables(rotary, offsets, q.shape[0], head_dim)

    def reference(q, k, v, upcast=True):
        return block_attention_reference(q, k, v, offsets, cos, sin, rotate_v, upcast=upcast)

    truth = _run(reference, q, k, v, grad_out, torch.float64)
    same_precision = _run(lambda *x: reference(*x, upcast=False), q, k, v, grad_out, dtype)
    kernel = _run(lambda *x: block_attention(*x, offsets, rotary=rotary, backend="triton"), q, k, v, grad_out, dtype)

    for name, err, baseline in zip(("out", "dq", "dk", "dv"), _max_err(kernel, truth), _max_err(same_precision, truth)):
        bound = 2 * baseline + ABS_FLOOR[dtype]
        assert err <= bound, f"{name}: max error {err:.3g} vs fp64 exceeds 2 x PyTorch {dtype} error + floor = {bound:.3g}"


def test_fused_rotary_matches_rotating_first():
    """Fused rotary (forward rotation, inverse-rotated gradients) equals rotating q, k, v with
    separate ops and running the kernel without rotary, gradients included."""
    q, k, v, offsets, grad_out = _inputs(LENGTHS, 64, torch.float32, seed=1)
    cos, sin = rotary_tables(Rotary(), offsets, q.shape[0], 64)
    fused = _run(lambda *x: block_attention_triton(*x, offsets, cos, sin, rotate_v=True), q, k, v, grad_out, torch.float32)
    rotated_first = _run(
        lambda q, k, v: block_attention_triton(*(apply_rotary(x, cos, sin) for x in (q, k, v)), offsets),
        q, k, v, grad_out, torch.float32,
    )
    for name, a, b in zip(("out", "dq", "dk", "dv"), fused, rotated_first):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("rotate_v", (False, True))
def test_fused_projection_matches_autograd_through_matmul(rotate_v):
    generator = torch.Generator().manual_seed(2)
    offsets = offsets_from_lengths(LENGTHS)
    total_tokens, d_in, head_dim = int(offsets[-1]), 48, 32
    x = torch.randn(total_tokens, d_in, generator=generator)
    w_qkv = torch.randn(d_in, 3 * HEADS * head_dim, generator=generator) / d_in**0.5
    grad_out = torch.randn(total_tokens, HEADS, head_dim, generator=generator)
    cos, sin = rotary_tables(Rotary(), offsets, total_tokens, head_dim)

    def grads(attention, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (x, w_qkv)]
        out = attention(*leaves)
        return [out.detach(), *torch.autograd.grad(out, leaves, grad_out.to(dtype))]

    def unfused(x, w, upcast=True):
        q, k, v = (x @ w).view(total_tokens, 3, HEADS, head_dim).unbind(1)
        return block_attention_reference(q, k, v, offsets, cos, sin, rotate_v, upcast=upcast)

    fused = grads(lambda x, w: block_attention_qkv_triton(x, w, offsets, HEADS, cos, sin, rotate_v), torch.float32)
    truth = grads(unfused, torch.float64)
    baseline = grads(lambda x, w: unfused(x, w, upcast=False), torch.float32)
    for name, err, base in zip(("out", "dx", "dw"), _max_err(fused, truth), _max_err(baseline, truth)):
        bound = 2 * base + 1e-5
        assert err <= bound, f"{name}: max error {err:.3g} vs fp64 exceeds 2 x PyTorch fp32 error + floor = {bound:.3g}"


def test_gradients_are_bitwise_repeatable():
    q, k, v, offsets, grad_out = _inputs(LENGTHS, 32, torch.float16, seed=3)
    cos, sin = rotary_tables(Rotary(), offsets, q.shape[0], 32)
    runs = [_run(lambda *x: block_attention_triton(*x, offsets, cos, sin), q, k, v, grad_out, torch.float16) for _ in range(2)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


def test_empty_batches():
    for lengths in ((), (0, 0)):
        q, k, v, offsets, grad_out = _inputs(lengths, 64, torch.float32)
        for attention in (
            lambda *x: block_attention(*x, offsets, rotary=Rotary(), backend="triton"),
            lambda *x: block_attention_triton(*x, offsets),
        ):
            out, dq, dk, dv = _run(attention, q, k, v, grad_out, torch.float32)
            assert out.shape == dq.shape == dk.shape == dv.shape == (0, HEADS, 64)
    x = torch.zeros(0, 16, requires_grad=True)
    w_qkv = torch.randn(16, 3 * HEADS * 32, requires_grad=True)
    out = block_attention_qkv_triton(x, w_qkv, offsets_from_lengths((0,)), HEADS)
    out.sum().backward()
    assert out.shape == (0, HEADS, 32) and torch.equal(w_qkv.grad, torch.zeros_like(w_qkv))


def test_unsupported_inputs_get_a_clear_error():
    offsets = offsets_from_lengths((5,))
    assert triton_unsupported_reason(torch.zeros(5, 1, 64)) is None
    cases = {
        "head_dim 48": torch.zeros(5, 1, 48),
        "dtype torch.float64": torch.zeros(5, 1, 64, dtype=torch.float64),
        "bfloat16 on CPU": torch.zeros(5, 1, 64, dtype=torch.bfloat16),
    }
    for expected, q in cases.items():
        assert expected in triton_unsupported_reason(q)
        with pytest.raises(ValueError, match=expected):
            block_attention(q, q, q, offsets, backend="triton")
    with pytest.raises(ValueError, match="cos must be float32"):
        block_attention_triton(*(torch.zeros(5, 1, 64),) * 3, offsets, torch.zeros(5, 31), torch.zeros(5, 31))
    with pytest.raises(ValueError, match="not 3 \\* heads \\* head_dim"):
        block_attention_qkv_triton(torch.zeros(5, 8), torch.zeros(8, 100), offsets, heads=2)


def _assert_compiles_like_eager(layer, q, k, v, offsets, grad_out):
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    expected = _run(lambda *x: layer(*x, offsets), q, k, v, grad_out, torch.float32)
    actual = _run(lambda *x: compiled(*x, offsets), q, k, v, grad_out, torch.float32)
    for name, a, b in zip(("out", "dq", "dk", "dv"), actual, expected):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


def test_kernel_entry_points_compile_without_graph_breaks():
    q, k, v, offsets, grad_out = _inputs((3, 70), 32, torch.float32, seed=4)
    cos, sin = rotary_tables(Rotary(), offsets, q.shape[0], 32)

    def layer(q, k, v, offsets):
        # The packed entry point, fed q, k, v through an identity projection.
        x = torch.cat((q, k, v), dim=1).flatten(1)
        packed = block_attention_qkv_triton(x, torch.eye(x.shape[1]), offsets, HEADS, cos, sin)
        return block_attention_triton(q, k, v, offsets, cos, sin, rotate_v=True) + packed

    _assert_compiles_like_eager(layer, q, k, v, offsets, grad_out)


def test_public_api_compiles_without_graph_breaks():
    q, k, v, offsets, grad_out = _inputs((3, 70), 32, torch.float32, seed=4)
    check_backend("triton", q.device)  # imports the backend before compiling, as the model does

    def layer(q, k, v, offsets):
        return block_attention(q, k, v, offsets, rotary=Rotary(rotate_v=True), backend="triton")

    _assert_compiles_like_eager(layer, q, k, v, offsets, grad_out)
