"""The block attention API: the reference against a naive per-block loop, rotary against its
formula, the fa2 backend against the reference (CUDA only), and every input/backend error."""

import math
import warnings

import pytest
import torch

from kernels import (
    BACKENDS,
    BackendUnavailableError,
    Rotary,
    apply_rotary,
    available_backends,
    backend_unavailable_reason,
    block_attention,
    block_attention_reference,
    block_table,
    offsets_from_lengths,
    rotary_tables,
)

RAGGED_LENGTHS = [0, 1, 63, 64, 65, 200]


def naive_block_attention(q, k, v, lengths):
    """A loop over sequences and their 64-token chunks: the definition, written as plainly as possible."""
    out = torch.empty_like(q)
    start = 0
    for length in lengths:
        for chunk in range(start, start + length, 64):
            end = min(chunk + 64, start + length)
            qs, ks, vs = q[chunk:end], k[chunk:end], v[chunk:end]  # [n, H, D]
            scores = torch.einsum("ihd,jhd->hij", qs, ks) / math.sqrt(q.shape[-1])
            out[chunk:end] = torch.einsum("hij,jhd->ihd", scores.softmax(-1), vs)
        start += length
    return out


def rotary_by_formula(x, positions, base):
    """Rotary written pair by pair from its definition."""
    out = x.clone()
    dim = x.shape[-1]
    for i in range(dim // 2):
        angle = positions.double() * base ** (-2 * i / dim)
        c, s = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
        x0, x1 = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i] = x0 * c - x1 * s
        out[..., 2 * i + 1] = x0 * s + x1 * c
    return out


def random_qkv(total, heads, dim, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(total, heads, dim, generator=g, dtype=dtype).to(device).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("lengths", [RAGGED_LENGTHS, [64, 64], [5], [9, 12, 3, 0], [0, 0, 130], [129, 0, 1]])
@pytest.mark.parametrize("heads,dim", [(1, 16), (3, 32)])
def test_reference_matches_naive_loop_forward_and_gradients(lengths, heads, dim):
    offsets = offsets_from_lengths(lengths)
    q, k, v = random_qkv(sum(lengths), heads, dim, seed=len(lengths) + dim)
    out = block_attention(q, k, v, offsets, backend="reference")
    expected = naive_block_attention(q, k, v, lengths)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)

    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    for name, got, want in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"d{name}")


def test_block_table_cuts_each_sequence_from_its_start():
    table = block_table(offsets_from_lengths(RAGGED_LENGTHS), 393)
    block_start, block_len = table.block_start, table.block_len
    # sequences start at 0, 0, 1, 64, 128, 193; the fixed-size table ends in unused empty rows
    used = 9
    assert block_start.tolist()[:used] == [0, 1, 64, 128, 192, 193, 257, 321, 385]
    assert block_len.tolist()[:used] == [1, 63, 64, 64, 1, 64, 64, 64, 8]
    assert block_len.numel() == (393 + 6 * 63) // 64
    assert set(block_len.tolist()[used:]) == {0} and set(block_start.tolist()[used:]) == {393}
    assert int(table.num_blocks) == used and table.total_tokens == 393


@pytest.mark.parametrize("lengths", [[], [0], [64] * 5, [1] * 7, [200, 0, 64, 65]])
def test_block_table_covers_every_token_once(lengths):
    total = sum(lengths)
    table = block_table(offsets_from_lengths(lengths), total)
    block_start, block_len = table.block_start, table.block_len
    covered = torch.cat([torch.arange(s, s + n) for s, n in zip(block_start.tolist(), block_len.tolist())] + [torch.zeros(0, dtype=torch.long)])
    assert covered.tolist() == list(range(total))
    row_of_token = torch.cat([torch.full((n,), row) for row, n in enumerate(block_len.tolist())] + [torch.zeros(0, dtype=torch.long)])
    assert table.block_of_token().tolist() == row_of_token.tolist()


def test_reference_low_precision_mode_runs_in_input_dtype():
    offsets = offsets_from_lengths([70])
    q, k, v = (x.detach().half() for x in random_qkv(70, 2, 32))
    upcast = block_attention_reference(q, k, v, offsets)
    same_precision = block_attention_reference(q, k, v, offsets, upcast=False)
    assert upcast.dtype == same_precision.dtype == torch.float16
    exact = block_attention_reference(q.double(), k.double(), v.double(), offsets)
    # fp32 math is closer to the fp64 truth than fp16 math; both are close.
    assert (upcast.double() - exact).abs().max() <= (same_precision.double() - exact).abs().max()
    torch.testing.assert_close(same_precision.double(), exact, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("within_block", [False, True])
def test_rotary_tables_match_formula(within_block):
    lengths = [3, 0, 130]
    offsets = offsets_from_lengths(lengths)
    x = torch.randn(sum(lengths), 2, 8, dtype=torch.float64)
    positions = torch.cat([torch.arange(n) for n in lengths])
    if within_block:
        positions = positions % 64
    cos, sin = rotary_tables(Rotary(base=500.0, within_block=within_block), offsets, x.shape[0], 8)
    torch.testing.assert_close(apply_rotary(x, cos, sin), rotary_by_formula(x, positions, 500.0), rtol=1e-6, atol=1e-6)
    # the inverse rotation undoes it
    torch.testing.assert_close(apply_rotary(apply_rotary(x, cos, sin), cos, sin, inverse=True), x)


def test_rotary_given_as_positions_or_tables_agrees():
    lengths = [10, 70]
    offsets = offsets_from_lengths(lengths)
    q, k, v = random_qkv(80, 2, 16)
    positions = torch.randint(0, 1000, (80,))
    cos, sin = rotary_tables(Rotary(positions=positions), offsets, 80, 16)
    by_positions = block_attention(q, k, v, offsets, rotary=Rotary(positions=positions, rotate_v=True))
    by_tables = block_attention(q, k, v, offsets, rotary=Rotary(cos=cos, sin=sin, rotate_v=True))
    torch.testing.assert_close(by_positions, by_tables)
    expected = naive_block_attention(
        rotary_by_formula(q, positions, 10000.0), rotary_by_formula(k, positions, 10000.0),
        rotary_by_formula(v, positions, 10000.0), lengths,
    )
    torch.testing.assert_close(by_positions, expected, rtol=1e-6, atol=1e-6)


def test_empty_batch_keeps_gradients_flowing():
    q, k, v = random_qkv(0, 2, 16)
    out = block_attention(q, k, v, offsets_from_lengths([0, 0]), rotary=Rotary())
    assert out.shape == (0, 2, 16)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_auto_on_cpu_is_reference():
    assert available_backends("cpu")[-1] == "reference"
    q, k, v = random_qkv(65, 1, 16)
    offsets = offsets_from_lengths([65])
    torch.testing.assert_close(block_attention(q, k, v, offsets), block_attention(q, k, v, offsets, backend="reference"))


def _inputs(total=10, heads=2, dim=16, dtype=torch.float32):
    return [torch.randn(total, heads, dim, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize(
    "offsets, message",
    [
        ([1, 10], "offsets must start at 0, got offsets[0] = 1"),
        ([0, 6, 4, 10], "offsets must not decrease: offsets[1] = 6 > offsets[2] = 4"),
        ([0, 9], "offsets[-1] = 9 must equal total_tokens = 10"),
    ],
)
def test_bad_offsets_name_the_value(offsets, message):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        block_attention(q, k, v, torch.tensor(offsets, dtype=torch.int32))


def test_bad_tensors_name_the_problem():
    q, k, v = _inputs()
    offsets = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="k is torch.float16 and q is torch.float32"):
        block_attention(q, k.half(), v, offsets)
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        block_attention(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, offsets)
    with pytest.raises(ValueError, match=r"q must be \(total_tokens, heads, head_dim\)"):
        block_attention(q[0], k[0], v[0], offsets)
    with pytest.raises(ValueError, match="offsets must be int32"):
        block_attention(q, k, v, offsets.float())
    with pytest.raises(ValueError, match="unknown block_attention backend 'flash'"):
        block_attention(q, k, v, offsets, backend="flash")
    with pytest.raises(ValueError, match="the reference backend has no launch settings to override"):
        block_attention(q, k, v, offsets, backend="reference", launch={"fwd": {"num_warps": 8}})
    with pytest.raises(ValueError, match=r"Rotary.cos must have shape \(10, 8\)"):
        block_attention(q, k, v, offsets, rotary=Rotary(cos=torch.ones(10, 4), sin=torch.ones(10, 4)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised on a machine without a GPU")
@pytest.mark.parametrize("backend", ["fa2", "flex", "tlx"])
def test_gpu_backend_on_cpu_raises_actionable_error(backend):
    q, k, v = _inputs()
    with pytest.raises(BackendUnavailableError) as error:
        block_attention(q, k, v, torch.tensor([0, 10], dtype=torch.int32), backend=backend)
    message = str(error.value)
    assert f"backend {backend!r} cannot run here" in message
    assert "CUDA GPU" in message and "To get it:" in message
    assert "reference" in message.split("Backends that can run on cpu: ")[1]
    if backend == "tlx":
        assert "fbtriton==3.7.4" in message and "triton-utlx" in message


@pytest.mark.parametrize("backend", ["fa2", "triton", "tlx"])
def test_kernel_backends_expose_their_custom_ops(backend):
    """Each kernel backend's ops are `block_attention::<name>_forward/_backward`, whatever wraps them."""
    from kernels.dispatch import get_backend

    ops = get_backend(backend).ops
    assert ops.forward_op._qualname == f"block_attention::{backend}_forward"
    assert ops.backward_op._qualname == f"block_attention::{backend}_backward"
    # Packed ops (block_attention_qkv) where the backend fuses rotary and its backward writes into given views.
    if backend == "fa2":
        assert not hasattr(ops, "qkv") and get_backend(backend).run_qkv is None
    else:
        assert ops.forward_qkv_op._qualname == f"block_attention::{backend}_forward_qkv"
        assert ops.backward_qkv_op._qualname == f"block_attention::{backend}_backward_qkv"
        assert get_backend(backend).run_qkv is ops.qkv


def test_check_offsets_false_skips_only_the_value_check():
    q, k, v = _inputs()
    bad = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="offsets"):
        block_attention(q, k, v, bad)
    # shape checks still run without the value check
    with pytest.raises(ValueError, match="offsets must be 1-D"):
        block_attention(q, k, v, bad[None], check_offsets=False)
    good = torch.tensor([0, 4, 10], dtype=torch.int32)
    torch.testing.assert_close(block_attention(q, k, v, good, check_offsets=False), block_attention(q, k, v, good))


@pytest.mark.parametrize("rotary", [None, Rotary(rotate_v=True)])
def test_reference_returns_the_input_dtype(rotary):
    q, k, v = (x.detach().to(torch.bfloat16) for x in random_qkv(70, 2, 16))
    assert block_attention(q, k, v, offsets_from_lengths([70]), rotary=rotary, backend="reference").dtype == torch.bfloat16


def test_auto_on_cpu_never_picks_the_triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _inputs(70, 2, 32)
    offsets = offsets_from_lengths([70])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either: reference is the plan on CPU
        out = block_attention(q, k, v, offsets)
    assert torch.equal(out, block_attention(q, k, v, offsets, backend="reference"))


def test_a_prebuilt_block_table_gives_the_same_result():
    lengths = [3, 0, 130, 64]
    offsets = offsets_from_lengths(lengths)
    q, k, v = random_qkv(sum(lengths), 2, 16)
    table = block_table(offsets, sum(lengths))
    torch.testing.assert_close(block_attention(q, k, v, table, rotary=Rotary()),
                               block_attention(q, k, v, offsets, rotary=Rotary()), rtol=0, atol=0)
    with pytest.raises(ValueError, match="the BlockTable covers 197 tokens and q has 190"):
        block_attention(q[:190], k[:190], v[:190], table)


def test_reference_compiles_without_graph_breaks_whatever_the_lengths():
    """No boolean indexing: one graph serves every batch (dynamic token count)."""
    compiled = torch.compile(lambda q, k, v, table: block_attention(q, k, v, table, backend="reference"),
                             fullgraph=True, dynamic=True)
    for lengths in ([3, 0, 130], [64, 1, 200, 5], [0]):
        offsets = offsets_from_lengths(lengths)
        q, k, v = random_qkv(sum(lengths), 2, 16)
        table = block_table(offsets, sum(lengths))
        torch.testing.assert_close(compiled(q, k, v, table), naive_block_attention(q, k, v, lengths))


@pytest.mark.parametrize("tile", [64, 128])
@pytest.mark.parametrize("lengths", [[70, 0, 200, 64, 1, 130, 300], [128, 256, 64], [5], [64] * 9, [64, 5, 70]])
def test_flex_block_mask_equals_create_block_mask(lengths, tile):
    """kernels/block_attention_flex.py's BlockMask, built from the block table, against create_block_mask's (which
    evaluates the mask_mod at every token pair), and its mask_mod against the block definition."""
    from torch.nn.attention.flex_attention import create_block_mask

    from kernels.block_attention_flex import flex_block_mask

    offsets = offsets_from_lengths(lengths)
    tokens = int(offsets[-1])
    block_mask = flex_block_mask(block_table(offsets, tokens), tile)
    expected = create_block_mask(block_mask.mask_mod, None, None, tokens, tokens, device="cpu", BLOCK_SIZE=tile)
    assert torch.equal(block_mask.to_dense(), expected.to_dense())
    # The q-side lists the backward walks: the pattern is symmetric.
    transposed = create_block_mask(lambda b, h, q, kv: block_mask.mask_mod(b, h, kv, q), None, None, tokens, tokens,
                                   device="cpu", BLOCK_SIZE=tile)
    assert torch.equal(block_mask.to_dense(), transposed.to_dense())
    if tile == 64 and lengths[0] == 64:  # a tile that is exactly one block skips the mask_mod
        assert int(block_mask.full_kv_num_blocks[0, 0, 0]) == 1 and int(block_mask.kv_num_blocks[0, 0, 0]) == 0
    # The mask_mod itself: two tokens interact iff they share a 64-token block of one sequence.
    token = torch.arange(tokens)
    seq = torch.searchsorted(offsets.long(), token, right=True) - 1
    block = seq * 10**6 + (token - offsets.long()[seq]) // 64
    assert torch.equal(block_mask.mask_mod(0, 0, token[:, None], token[None, :]), block[:, None] == block[None, :])


@pytest.mark.parametrize("tile", [64, 128])
def test_flex_block_mask_gives_block_attention(tile):
    """FlexAttention's eager CPU forward with the mask (it has no CPU backward, so the backend itself
    is CUDA only): partial blocks, one-token sequences, blocks that straddle tiles, full tiles."""
    from torch.nn.attention.flex_attention import flex_attention

    from kernels.block_attention_flex import flex_block_mask

    lengths = [64, 64, 5, 70, 0, 130, 1, 200]
    offsets = offsets_from_lengths(lengths)
    q, k, v = (x.detach() for x in random_qkv(sum(lengths), 2, 16, dtype=torch.float32, seed=tile))
    block_mask = flex_block_mask(block_table(offsets, sum(lengths)), tile)
    heads_first = [x.transpose(0, 1)[None] for x in (q, k, v)]
    with warnings.catch_warnings():  # eager flex on CPU (the unfused math path) warns that it is slow
        warnings.simplefilter("ignore")
        out = flex_attention(*heads_first, block_mask=block_mask)[0].transpose(0, 1)
    torch.testing.assert_close(out, block_attention_reference(q, k, v, offsets), atol=1e-5, rtol=1e-5)


def test_flex_is_a_peer_that_auto_never_picks():
    from kernels.dispatch import AUTO_ORDER, AUTO_ORDER_SMALL_HEAD_DIM

    assert "flex" in BACKENDS and "flex" not in AUTO_ORDER and "flex" not in AUTO_ORDER_SMALL_HEAD_DIM
    assert "FlexAttention has no backward on cpu" in backend_unavailable_reason("flex", "cpu")


def test_eager_calls_skip_the_custom_ops_only_when_nothing_traces():
    """kernels.eager.eager_call, which lets eager calls of a kernel backend skip its custom op's
    dispatch, says yes for plain tensors called eagerly and no wherever something traces or wraps
    them; this also holds the private torch calls it makes to their meaning."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from kernels.eager import eager_call

    x = torch.zeros(4)
    assert eager_call(x, None)
    assert not eager_call(x, torch.nn.Parameter(torch.zeros(1)))  # a subclass goes to the op
    with FakeTensorMode() as mode:
        assert not eager_call(mode.from_tensor(x))
        assert not eager_call(x)  # a mode on the dispatch stack, whatever the tensors
    seen = []
    make_fx(lambda t: seen.append(eager_call(t)) or t + 1)(x)
    torch.func.vmap(lambda t: seen.append(eager_call(t)) or t)(x[:, None])
    torch.func.grad(lambda t: seen.append(eager_call(t)) or t.sum())(x)
    assert seen == [False, False, False]
    compiled = torch.compile(lambda t: t + 1 if eager_call(t) else t - 1, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), x - 1)


def test_block_table_is_reused_until_its_offsets_change():
    """block_table returns the table it built for the same offsets tensor while the tensor is
    unchanged, and builds a new one after any in-place change or for another total_tokens: a stale
    table would put tokens in the wrong blocks."""
    from kernels.blocks import block_table_torch

    def assert_table_of(table, lengths):
        offsets = offsets_from_lengths(lengths)
        expected_start, expected_len = block_table_torch(offsets, int(offsets[-1]))
        assert torch.equal(table.offsets, offsets)
        assert torch.equal(table.block_start, expected_start) and torch.equal(table.block_len, expected_len)
        assert int(table.num_blocks) == int((expected_len > 0).sum())

    offsets = offsets_from_lengths([70, 10, 100])
    table = block_table(offsets, 180)
    assert block_table(offsets, 180) is table  # reused: so the checks below see the reuse rule at work
    assert_table_of(table, [70, 10, 100])
    offsets[1:] = offsets_from_lengths([10, 70, 100])[1:]  # same total, other blocks
    assert_table_of(block_table(offsets, 180), [10, 70, 100])
    with torch.no_grad():
        offsets.copy_(offsets_from_lengths([100, 10, 70]))
    assert_table_of(block_table(offsets, 180), [100, 10, 70])
    with torch.inference_mode():
        offsets.copy_(offsets_from_lengths([1, 1, 178]))
    assert_table_of(block_table(offsets, 180), [1, 1, 178])
    assert block_table(offsets, 180).total_tokens == 180 and block_table(offsets[:3], 71).total_tokens == 71
    with torch.inference_mode():  # inference tensors have no version counter: built every time
        frozen = offsets_from_lengths([5, 5])
        assert block_table(frozen, 10) is not block_table(frozen, 10)

    # Through block_attention: after an in-place change, the result is the new offsets'.
    offsets = offsets_from_lengths([70, 60])
    q, k, v = random_qkv(130, 2, 16)
    block_attention(q, k, v, offsets, backend="reference")
    offsets[1] = 60
    torch.testing.assert_close(block_attention(q, k, v, offsets, backend="reference"),
                               block_attention(q, k, v, offsets_from_lengths([60, 70]), backend="reference"),
                               rtol=0, atol=0)


@pytest.mark.parametrize("torch_noise,kernel_noise,passes", [
    (1e-4, 1e-4, True),      # PyTorch at 80 dB: the 45 dB floor applies, and the kernel is well above it
    (1e-4, 10 ** -2.2, False),  # 44 dB: below the floor
    (10 ** -1.9, 10 ** -1.9, True),  # PyTorch itself at 38 dB: the kernel may match it...
    (10 ** -1.9, 10 ** -1.7, False),  # ...but not be 4 dB worse (more than twice the noise power)
])
def test_gradient_snr_floor_is_45_db_or_pytorchs_own(torch_noise, kernel_noise, passes):
    """The SNR check of kernels.testing's rule: at least 45 dB, or, where PyTorch in the same dtype does
    not reach 45 dB itself, at most twice PyTorch's noise power."""
    from kernels.testing import ParityResult, _judge

    truth = torch.linspace(1, 2, 1000, dtype=torch.float64)
    signs = torch.where(torch.arange(1000) % 2 == 0, 1.0, -1.0).double()
    plain, got = (truth * (1 + noise * signs) for noise in (torch_noise, kernel_noise))
    result = ParityResult("test", {})
    _judge(result, ("out", "dx"), [[truth, got], [truth, got]], [truth, plain], [truth, truth], torch.float64)
    assert result.outputs["dx"]["snr"] is passes, result.outputs["dx"]
    assert ("dx snr" in " ".join(result.failures)) is not passes
