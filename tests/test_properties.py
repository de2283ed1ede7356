"""Property-based tests (hypothesis): block_attention on random jagged batches and random bad input,
and the data validators on random corruptions. A valid input gives the definition's result on every
backend that runs here; an invalid one gives a ValueError naming the value, never a wrong result
and never a crash inside a kernel.

The Triton backend runs in the CPU interpreter (TRITON_INTERPRET=1, as scripts/test.sh sets it).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from data.schema import LABEL, FeatureSchema  # noqa: E402
from data.validation import validate_table  # noqa: E402
from kernels import Rotary, block_attention, block_table, offsets_from_lengths  # noqa: E402

# Kernel runs are slow in the interpreter: few, small examples, no deadline.
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BACKENDS = ("reference", "triton")
lengths_strategy = st.lists(st.integers(0, 150), min_size=1, max_size=6)


def naive(q, k, v, lengths):
    """Each sequence cut into 64-token chunks from its start, plain softmax attention per chunk."""
    out, start = torch.empty_like(q), 0
    for length in lengths:
        for chunk in range(start, start + length, 64):
            end = min(chunk + 64, start + length)
            scores = torch.einsum("ihd,jhd->hij", q[chunk:end], k[chunk:end]) / math.sqrt(q.shape[-1])
            out[chunk:end] = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v[chunk:end])
        start += length
    return out


@FAST
@given(lengths=lengths_strategy, heads=st.integers(1, 3), head_dim=st.sampled_from([32, 64]),
       backend=st.sampled_from(BACKENDS), prebuilt=st.booleans(), seed=st.integers(0, 2**16))
def test_any_jagged_batch_gives_the_definition(lengths, heads, head_dim, backend, prebuilt, seed):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, generator=generator) for _ in range(3))
    offsets = offsets_from_lengths(lengths)
    blocks = block_table(offsets, total) if prebuilt else offsets
    out = block_attention(q, k, v, blocks, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    # fp32 kernels against an fp64 loop: far under any error a wrong mask or block cut would make.
    torch.testing.assert_close(out.double(), naive(q.double(), k.double(), v.double(), lengths), rtol=1e-4, atol=1e-4)


@FAST
@given(lengths=lengths_strategy, backend=st.sampled_from(("reference", "triton", "auto")), data=st.data())
def test_malformed_offsets_are_named_never_run(lengths, backend, data):
    total = sum(lengths)
    good = [0, *np.cumsum(lengths).tolist()]
    kind = data.draw(st.sampled_from(["start", "decrease", "end", "float", "2d", "empty"]))
    offsets, expected = list(good), ""
    if kind == "start":
        offsets[0] = data.draw(st.integers(1, 1000))
        expected = f"offsets[0] = {offsets[0]}"
    elif kind == "decrease" and len(good) > 2:
        i = data.draw(st.integers(1, len(good) - 2))
        offsets[i] = offsets[i + 1] + data.draw(st.integers(1, 50))
        expected = "must not decrease"
    elif kind == "end" or kind == "decrease":
        offsets[-1] = total + data.draw(st.integers(1, 50))
        expected = f"offsets[-1] = {offsets[-1]} must equal total_tokens = {total}"
    q = torch.randn(total, 2, 32)
    if kind == "float":
        tensor, expected = torch.tensor(good, dtype=torch.float32), "offsets must be int32"
    elif kind == "2d":
        tensor, expected = torch.tensor(good, dtype=torch.int32)[None], "offsets must be 1-D"
    elif kind == "empty":
        tensor, expected = torch.zeros(0, dtype=torch.int32), "offsets must be 1-D"
    else:
        tensor = torch.tensor(offsets, dtype=torch.int32)
    with pytest.raises(ValueError) as error:
        block_attention(q, q, q, tensor, rotary=Rotary(), backend=backend)
    assert expected in str(error.value)


@FAST
@given(total=st.integers(1, 130), problem=st.sampled_from(["k shape", "v dtype", "strided", "rank", "table", "int"]))
def test_malformed_tensors_are_named_never_run(total, problem):
    q = k = v = torch.randn(total, 2, 32)
    offsets = offsets_from_lengths([total])
    expected = {
        "k shape": "k has shape", "v dtype": "v is torch.float64 and q is torch.float32",
        "strided": "last dimension must be contiguous", "rank": "q must be (total_tokens, heads, head_dim)",
        "table": f"the BlockTable covers {total + 1} tokens and q has {total}",
        "int": "must be a floating-point tensor",
    }[problem]
    if problem == "k shape":
        k = torch.randn(total, 3, 32)
    elif problem == "v dtype":
        v = v.double()
    elif problem == "strided":
        q = torch.randn(total, 2, 64)[..., ::2]
    elif problem == "rank":
        q = q[0]
    elif problem == "table":
        offsets = block_table(offsets_from_lengths([total + 1]), total + 1)
    elif problem == "int":
        q = k = v = torch.ones(total, 2, 32, dtype=torch.int64)
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            block_attention(q, k, v, offsets, backend=backend)


SCHEMA = FeatureSchema(dense=("d0",), categorical=(("user", 10),), sequence=(("history", 20, 5),))


def _table(rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({
        "d0": pa.array(rng.standard_normal(rows), pa.float32()),
        "user": pa.array(rng.integers(0, 10, rows), pa.int64()),
        "history": pa.array([rng.integers(0, 20, rng.integers(0, 6)).tolist() for _ in range(rows)],
                            pa.list_(pa.int64())),
        LABEL: pa.array(rng.integers(0, 2, rows).astype(np.float32), pa.float32()),
    })


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), seed=st.integers(0, 2**16), data=st.data())
def test_any_corrupted_cell_is_named_with_its_column_row_and_value(rows, seed, data):
    table = _table(rows, seed)
    validate_table(table, SCHEMA)  # clean rows pass
    row = data.draw(st.integers(0, rows - 1))
    column, value, problem = data.draw(st.sampled_from([
        ("user", -1, "id outside [0, 10)"), ("user", 10, "id outside [0, 10)"),
        ("history", [0] * 6, "sequence length outside [0, 5]"), ("history", [3, 20], "sequence id outside [0, 20)"),
        (LABEL, 0.5, "label must be 0 or 1"), (LABEL, float("nan"), "label must be 0 or 1"),
        ("d0", float("inf"), "dense value is not finite"), ("d0", None, "missing value"), ("user", None, "missing value"),
    ]))
    values = table.column(column).to_pylist()
    values[row] = value
    bad = table.set_column(table.schema.get_field_index(column), column, pa.array(values, table.schema.field(column).type))
    with pytest.raises(ValueError) as error:
        validate_table(bad, SCHEMA, split="train")
    text = str(error.value)
    assert f"column {column!r}, row {row}: {problem}" in text and "(value " in text
