"""The Triton backend, run on CPU by the Triton interpreter, judged by kernels.testing.parity.

triton.jit picks the interpreter when a kernel is defined, so TRITON_INTERPRET=1 must be set before
kernels.block_attention_triton is first imported: scripts/test.sh exports it for the whole run, and
this module sets it too for when it runs alone. bf16 is not tested here: the interpreter's bf16
tl.dot is wrong (tests/test_gpu_parity.py covers bf16 on a GPU).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import (  # noqa: E402
    Rotary, apply_rotary, block_attention, block_attention_qkv, block_table, check_backend, get_backend,
    offsets_from_lengths, rotary_tables,
)
from kernels.testing import parity  # noqa: E402
from tests.test_model import RecordOps  # noqa: E402

LENGTHS = (0, 1, 63, 64, 65, 200)  # empty, single token, partial, full, one past a block, several
HEADS = 2
ROTARY_MODES = {"none": None, "qk": Rotary(), "qkv": Rotary(rotate_v=True)}


def _inputs(lengths, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_from_lengths(lengths)
    shape = (int(offsets[-1]), HEADS, head_dim)
    q, k, v, grad_out = (torch.randn(shape, generator=generator).to(dtype) for _ in range(4))
    return q, k, v, offsets, grad_out


def _run(fn, q, k, v, grad_out):
    """fn's output and (dq, dk, dv) for grad_out, with q, k, v as fresh leaves."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


@pytest.mark.parametrize("rotary_mode", ROTARY_MODES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=str)
@pytest.mark.parametrize("head_dim", (32, 64, 128))
def test_parity_with_the_reference(head_dim, dtype, rotary_mode):
    result = parity("triton", lengths=LENGTHS, heads=HEADS, head_dim=head_dim, dtype=dtype,
                    rotary=ROTARY_MODES[rotary_mode])
    assert result.ok, result.summary()


def test_fused_rotary_matches_rotating_first():
    """Fused rotary (forward rotation, inverse-rotated gradients) equals rotating q, k, v with
    separate ops and running the kernel without rotary, gradients included."""
    q, k, v, offsets, grad_out = _inputs(LENGTHS, 64, torch.float32, seed=1)
    cos, sin = rotary_tables(Rotary(), offsets, q.shape[0], 64)
    fused = _run(lambda *x: block_attention(*x, offsets, rotary=Rotary(rotate_v=True), backend="triton"),
                 q, k, v, grad_out)
    rotated_first = _run(
        lambda q, k, v: block_attention(*(apply_rotary(x, cos, sin) for x in (q, k, v)), offsets, backend="triton"),
        q, k, v, grad_out,
    )
    for name, a, b in zip(("out", "dq", "dk", "dv"), fused, rotated_first):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("rotary_mode", ["none", "qkv"])
def test_packed_qkv_matches_its_views_and_writes_one_gradient(rotary_mode):
    """block_attention_qkv on a [T, 3, H, D] projection gives block_attention's result on its views bit for
    bit, gradients included, eagerly and through its custom ops; its backward is one op writing dqkv, where
    the views' gradients need a stack (a copy of dqkv) after the backward op."""
    q, k, v, offsets, grad_out = _inputs(LENGTHS, 32, torch.float32, seed=2)
    rotary = ROTARY_MODES[rotary_mode]
    packed = torch.stack((q, k, v), dim=1)

    def run(attention, mode=None):
        leaf = packed.detach().requires_grad_()
        if mode is None:
            out = attention(leaf)
            return out.detach(), torch.autograd.grad(out, leaf, grad_out)[0]
        with mode:
            out = attention(leaf)
            backward_start = len(mode.names)
            (dqkv,) = torch.autograd.grad(out, leaf, grad_out)
        return out.detach(), dqkv, mode.names[backward_start:]

    packed_call = lambda x: block_attention_qkv(x, offsets, rotary=rotary, backend="triton")  # noqa: E731
    views_call = lambda x: block_attention(*x.unbind(1), offsets, rotary=rotary, backend="triton")  # noqa: E731
    out, dqkv = run(packed_call)
    out_views, dqkv_views = run(views_call)
    assert torch.equal(out, out_views) and torch.equal(dqkv, dqkv_views)
    out_op, dqkv_op, backward_ops = run(packed_call, RecordOps())
    assert torch.equal(out_op, out) and torch.equal(dqkv_op, dqkv)
    assert "block_attention.triton_backward_qkv" in backward_ops
    assert not {"aten.stack", "aten.cat", "aten.copy_"} & set(backward_ops), backward_ops
    *_, views_backward_ops = run(views_call, RecordOps())
    assert "block_attention.triton_backward" in views_backward_ops
    assert {"aten.stack", "aten.cat"} & set(views_backward_ops), views_backward_ops
    with pytest.raises(ValueError, match="qkv must be \\(total_tokens, 3, heads, head_dim\\)"):
        block_attention_qkv(q, offsets, backend="triton")


def test_packed_qkv_on_a_backend_without_packed_ops_runs_its_views():
    """The reference (plain PyTorch ops) has no packed ops: block_attention_qkv runs it on qkv's views."""
    q, k, v, offsets, grad_out = _inputs(LENGTHS, 32, torch.float32, seed=6)
    packed = torch.stack((q, k, v), dim=1)
    assert get_backend("reference").run_qkv is None and get_backend("fa2").run_qkv is None
    assert get_backend("triton").run_qkv is not None
    results = []
    for attention in (lambda x: block_attention_qkv(x, offsets, rotary=Rotary(), backend="reference"),
                      lambda x: block_attention(*x.unbind(1), offsets, rotary=Rotary(), backend="reference")):
        leaf = packed.detach().requires_grad_()
        out = attention(leaf)
        results.append((out.detach(), *torch.autograd.grad(out, leaf, grad_out)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_inputs_of_different_strides_are_copied_before_the_op():
    """q contiguous with k and v views of a packed projection: the backend copies them once, before
    its op (whose kernels take one stride pair), and gives the contiguous inputs' result."""
    q, k, v, offsets, grad_out = _inputs(LENGTHS, 32, torch.float32, seed=4)
    kv = torch.stack((k, v), dim=1).detach().requires_grad_()
    q_leaf = q.detach().requires_grad_()
    out = block_attention(q_leaf, *kv.unbind(1), offsets, rotary=Rotary(), backend="triton")
    dq, dkv = torch.autograd.grad(out, (q_leaf, kv), grad_out)
    expected = _run(lambda *x: block_attention(*x, offsets, rotary=Rotary(), backend="triton"), q, k, v, grad_out)
    torch.testing.assert_close(out.detach(), expected[0])
    torch.testing.assert_close(dq, expected[1])
    torch.testing.assert_close(dkv, torch.stack(expected[2:], dim=1))
    table = block_table(offsets, q.shape[0])
    with pytest.raises(ValueError, match="must share strides"):
        get_backend("triton").ops.forward_op(q, *kv.unbind(1), *table.tensors(), None, None, False, "")


def test_launch_overrides_are_explicit_and_checked():
    q, k, v, offsets, grad_out = _inputs(LENGTHS, 32, torch.float32, seed=3)
    default = _run(lambda *x: block_attention(*x, offsets, backend="triton"), q, k, v, grad_out)
    eight_warps = _run(lambda *x: block_attention(*x, offsets, backend="triton",
                                                   launch={"fwd": {"num_warps": 8}, "bwd": {"num_warps": 8}}),
                       q, k, v, grad_out)
    for a, b in zip(default, eight_warps):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="unknown Triton fwd launch settings \\['persistent'\\]"):
        block_attention(q, k, v, offsets, backend="triton", launch={"fwd": {"persistent": True}})
    with pytest.raises(ValueError, match="keyed by pass"):
        block_attention(q, k, v, offsets, backend="triton", launch={"forward": {}})
    with pytest.raises(ValueError, match="need a named backend"):
        block_attention(q, k, v, offsets, launch={"fwd": {"num_warps": 8}})


def test_empty_batches():
    for lengths in ((), (0, 0)):
        q, k, v, offsets, grad_out = _inputs(lengths, 64, torch.float32)
        out, dq, dk, dv = _run(lambda *x: block_attention(*x, offsets, rotary=Rotary(), backend="triton"),
                               q, k, v, grad_out)
        assert out.shape == dq.shape == dk.shape == dv.shape == (0, HEADS, 64)


def test_unsupported_inputs_get_a_clear_error():
    offsets = offsets_from_lengths((5,))
    reason = get_backend("triton").unsupported_reason
    assert reason(torch.zeros(5, 1, 64)) is None
    cases = {
        "head_dim 48": torch.zeros(5, 1, 48),
        "dtype torch.float64": torch.zeros(5, 1, 64, dtype=torch.float64),
        "bfloat16 on CPU": torch.zeros(5, 1, 64, dtype=torch.bfloat16),
    }
    for expected, q in cases.items():
        assert expected in reason(q)
        with pytest.raises(ValueError, match=expected):
            block_attention(q, q, q, offsets, backend="triton")


def test_custom_ops_pass_opcheck():
    """Schemas, fake (meta) implementations against the real kernels, and autograd registration."""
    q, k, v, offsets, grad_out = _inputs((3, 70), 32, torch.float32, seed=4)
    table = block_table(offsets, q.shape[0])
    cos, sin = rotary_tables(Rotary(), offsets, q.shape[0], 32)
    backend = get_backend("triton")
    for leaves in ((q, k, v), tuple(x.requires_grad_() for x in (q.clone(), k.clone(), v.clone()))):
        torch.library.opcheck(backend.ops.forward_op, (*leaves, *table.tensors(), cos, sin, True, ""))
    out = backend.run(q, k, v, table, cos, sin, True, "")
    torch.library.opcheck(backend.ops.backward_op, (grad_out, q, k, v, *table.tensors(), cos, sin, True, "", [out]))
    qkv = torch.stack((q, k, v), dim=1)
    for packed in (qkv, qkv.clone().requires_grad_()):
        torch.library.opcheck(backend.ops.forward_qkv_op, (packed, *table.tensors(), cos, sin, True, ""))
    torch.library.opcheck(backend.ops.backward_qkv_op, (grad_out, qkv, *table.tensors(), cos, sin, True, "", [out]))


def test_public_api_compiles_without_graph_breaks():
    q, k, v, offsets, grad_out = _inputs((3, 70), 32, torch.float32, seed=4)
    check_backend("triton", q.device)  # imports the backend before compiling, as the model does
    table = block_table(offsets, q.shape[0])
    cos, sin = rotary_tables(Rotary(), offsets, q.shape[0], 32)

    def layer(q, k, v):
        return block_attention(q, k, v, table, rotary=Rotary(rotate_v=True, cos=cos, sin=sin), backend="triton")

    def packed_layer(q, k, v):
        return block_attention_qkv(torch.stack((q, k, v), dim=1), table, rotary=Rotary(rotate_v=True, cos=cos, sin=sin),
                                   backend="triton")

    for fn in (layer, packed_layer):
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
        for name, a, b in zip(("out", "dq", "dk", "dv"), _run(compiled, q, k, v, grad_out), _run(layer, q, k, v, grad_out)):
            torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


def test_eager_calls_run_the_launchers_the_custom_ops_run():
    """An eager call skips the custom op's dispatch (kernels/eager.py) and gives the op's result,
    gradients included, bit for bit; a call under a dispatch mode goes through the op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, offsets, grad_out = _inputs((3, 70), 32, torch.float32, seed=5)
    table = block_table(offsets, q.shape[0])
    cos, sin = rotary_tables(Rotary(), offsets, q.shape[0], 32)
    backend = get_backend("triton")
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    eager = backend.run(*leaves, table, cos, sin, True, "")
    assert type(eager.grad_fn).__name__ == "EagerCallBackward"
    through_op = backend.ops.forward_op(*leaves, *table.tensors(), cos, sin, True, "")[0]
    assert type(through_op.grad_fn).__name__ != "EagerCallBackward"
    assert torch.equal(eager, through_op)
    for a, b in zip(torch.autograd.grad(eager, leaves, grad_out), torch.autograd.grad(through_op, leaves, grad_out)):
        assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(backend.run(q, k, v, table, cos, sin, True, ""), eager)
    with FakeTensorMode(allow_non_fake_inputs=True):  # the op's fake implementation, no kernel
        fake = backend.run(q, k, v, table, cos, sin, True, "")
    assert type(fake).__name__ == "FakeTensor" and fake.shape == q.shape


def test_backward_writes_into_views_of_one_gradient():
    """`into`: the backward writes dq, dk, dv into given tensors sharing one stride (the attention
    sublayer's [T, 3, H, D] gradient), the same values as into its own; other shapes are refused."""
    q, k, v, offsets, grad_out = _inputs((70, 3), 32, torch.float32)
    table = block_table(offsets, q.shape[0])
    launcher = get_backend("triton").ops.backward_launcher
    args = (grad_out, q, k, v, *table.tensors(), None, None, False, "", None)
    expected = launcher(*args)
    packed = torch.full((q.shape[0], 3, *q.shape[1:]), float("nan"))
    returned = launcher(*args, into=packed.unbind(1))
    for got, want, view in zip(returned, expected, packed.unbind(1)):
        assert torch.equal(got, want) and torch.equal(view, want)
    with pytest.raises(ValueError, match="gradient outputs must be three"):
        launcher(*args, into=(packed[:, 0], packed[:, 1], packed[:-1, 2]))
