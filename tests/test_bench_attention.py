"""The attention benchmark harness on CPU: byte counts, shapes, speedups, the FlexAttention block
mask, markdown rendering, and one tiny end-to-end run checked against the JSON schema."""

import json
import math
import os
import warnings

import pytest
import torch

from benchmarks.attention_impls import CHECK_TOLERANCE, Impl
from benchmarks.attention_report import add_speedups, render_markdown, rotary_fusion
from benchmarks.attention_workload import (
    PASSES, SHAPES, frac_copy_bw, make_inputs, min_bytes, parse_shape, select_shapes, sequence_lengths,
)
from benchmarks.bench_attention import bench_impl, main, make_row, time_pass
from benchmarks.harness import SkipRow, cpu_median_ms, describe
from kernels import block_attention_reference

ROW_KEYS = {
    "impl", "shape", "pass", "rotary", "ms", "frac_copy_bw", "speedup_vs_fa2", "status", "skip_reason",
    "max_abs_err", "check", "bwd_timing", "tokens", "min_bytes",
    "graph_ms", "graph_frac_copy_bw", "graph_speedup_vs_fa2", "graph_skip_reason",
}


def test_min_bytes_counts_tensors_and_rotary_tables():
    tokens, heads, head_dim = 1000, 4, 128
    tensor_bytes = tokens * heads * head_dim * 2  # one bf16 [T, H, D] tensor
    table_bytes = 2 * tokens * (head_dim // 2) * 4  # fp32 cos + sin, [T, D/2] each
    assert min_bytes("fwd", tokens, heads, head_dim, 2, rotary=False) == 4 * tensor_bytes
    assert min_bytes("bwd", tokens, heads, head_dim, 2, rotary=False) == 8 * tensor_bytes
    assert min_bytes("fwd+bwd", tokens, heads, head_dim, 2, rotary=False) == 12 * tensor_bytes
    assert min_bytes("fwd", tokens, heads, head_dim, 2, rotary=True) == 4 * tensor_bytes + table_bytes
    assert min_bytes("bwd", tokens, heads, head_dim, 2, rotary=True) == 8 * tensor_bytes + table_bytes
    assert min_bytes("fwd+bwd", tokens, heads, head_dim, 2, rotary=True) == 12 * tensor_bytes + 2 * table_bytes
    assert min_bytes("fwd", tokens, heads, head_dim, 4, rotary=False) == 8 * tensor_bytes


def test_frac_copy_bw():
    # 4 TB moved in 1 s against a 5 TB/s copy: 80 %.
    assert frac_copy_bw(4 * 10**12, 1000.0, 5.0) == pytest.approx(0.8)
    assert frac_copy_bw(10**9, 0.5, 4.0) == pytest.approx(0.5)


@pytest.mark.parametrize("label", ["1024x512x4x128", "jagged:1152x4096x4x128", "2048x256x4x64"])
def test_shape_label_round_trip(label):
    assert parse_shape(label).label == label


def test_parse_shape_fields():
    shape = parse_shape("jagged:1152x1024x4x128")
    assert (shape.batch, shape.seq_len, shape.heads, shape.head_dim, shape.jagged) == (1152, 1024, 4, 128, True)
    assert not parse_shape("512x1024x8x64").jagged


@pytest.mark.parametrize(
    "label, message",
    [
        ("1024x512x4", "not BxSxHxD"),
        ("full:4x128x2x32", "not BxSxHxD"),
        ("4x100x2x32", "multiple of 64"),
        ("4x128x2x33", "even head_dim"),
        ("0x128x2x32", "positive"),
    ],
)
def test_parse_shape_rejects_bad_labels(label, message):
    with pytest.raises(ValueError, match=message):
        parse_shape(label)


def test_select_shapes_expands_kinds_per_device():
    gpu = select_shapes(["full", "jagged"], "cuda", quick=False)
    assert [s.label for s in gpu] == [*SHAPES["full"], *SHAPES["jagged"]]
    assert all(s.seq_len <= 256 for s in select_shapes(["full", "jagged"], "cpu", quick=True))
    assert [s.label for s in select_shapes(["8x64x1x16"], "cpu", quick=True)] == ["8x64x1x16"]


def test_sequence_lengths():
    full = sequence_lengths(parse_shape("3x128x2x32"), seed=0)
    assert full.tolist() == [128, 128, 128]
    shape = parse_shape("jagged:2000x1024x4x128")
    lengths = sequence_lengths(shape, seed=0)
    assert lengths.shape == (2000,)
    assert int(lengths.min()) >= math.ceil(0.4 * 1024) and int(lengths.max()) <= 1024
    assert int(lengths.min()) < 450 and int(lengths.max()) > 1000  # spans the range, not a constant
    assert torch.equal(lengths, sequence_lengths(shape, seed=0))
    assert not torch.equal(lengths, sequence_lengths(shape, seed=1))


def row(impl, ms, shape="4x128x2x32", pass_="fwd", rotary=False):
    return {"impl": impl, "shape": shape, "pass": pass_, "rotary": rotary, "ms": ms}


def test_add_speedups_matches_shape_pass_and_rotary():
    rows = [
        row("fa2", 2.0), row("triton", 0.5), row("triton", None),
        row("fa2", 4.0, rotary=True), row("triton", 1.0, rotary=True),
        row("triton", 1.0, pass_="bwd"),  # no fa2 bwd row
    ]
    add_speedups(rows)
    assert [r["speedup_vs_fa2"] for r in rows] == [1.0, 4.0, None, 1.0, 4.0, None]


def test_rotary_fusion_pairs_separate_with_fused_and_plain():
    rows = [
        row("triton", 1.0), row("triton", 1.2, rotary=True), row("triton+separate_rotary", 2.0, rotary=True),
        row("tlx+separate_rotary", None, rotary=True),
    ]
    [entry] = rotary_fusion(rows)
    assert entry["backend"] == "triton"
    assert (entry["attention_ms"], entry["fused_ms"], entry["separate_ms"]) == (1.0, 1.2, 2.0)
    assert entry["separate_over_fused"] == pytest.approx(2.0 / 1.2)
    assert entry["rotary_cost_ratio"] == pytest.approx(1.0 / 0.2)


def report_with(rows):
    return {
        "device": "cpu (test)", "versions": {"torch": "x"}, "date": "2026-01-01T00:00:00+00:00",
        "command": "python -m benchmarks.bench_attention --out x", "copy_bw_tbps": 4.0,
        "settings": {"timer": "t", "warmup_ms": 25, "rep_ms": 100, "copy_bytes": 2**32, "dtype": "bf16", "seed": 0},
        "rows": rows, "rotary_fusion": rotary_fusion(rows),
    }


def test_render_markdown_lists_each_shape_with_its_rows():
    inputs = make_inputs(parse_shape("2x64x1x16"), torch.device("cpu"), seed=0)
    rows = [
        make_row("fa2", inputs, "fwd", False, 4.0, ms=0.5, max_abs_err=0.0, correct=True),
        make_row("triton", inputs, "fwd", False, 4.0, ms=0.25, max_abs_err=0.2, check="parity FAIL: dq snr"),
        make_row("cudnn", inputs, "fwd", False, 4.0, skip_reason="cuDNN | does not support it"),
    ]
    add_speedups(rows)
    text = render_markdown(report_with(rows))
    assert "### 2x64x1x16 (T = 128 tokens)" in text
    assert "| triton | fwd | no | 0.250 |" in text
    assert "| 2.00× |" in text  # fa2 0.5 ms / triton 0.25 ms
    assert "MISMATCH" in text  # triton's 0.2 error is over the tolerance
    assert "skipped: cuDNN / does not support it" in text  # a "|" in a reason can't break the table
    for line in text.splitlines():
        if line.startswith("| "):
            assert line.count("|") == 8, line


def test_make_row_status_and_bandwidth():
    inputs = make_inputs(parse_shape("2x64x1x16"), torch.device("cpu"), seed=0)
    ok = make_row("fa2", inputs, "bwd", True, 2.0, ms=1.0, max_abs_err=1e-3, correct=True, bwd_timing="retain_graph")
    expected_bytes = 8 * 128 * 16 * 2 + 2 * 128 * 8 * 4
    assert ok["status"] == "ok" and ok["min_bytes"] == expected_bytes
    assert ok["frac_copy_bw"] == pytest.approx(expected_bytes / 1e-3 / 2e12)
    assert make_row("fa2", inputs, "fwd", True, 2.0, ms=1.0, max_abs_err=0.5, correct=False)["status"] == "mismatch"
    skipped = make_row("fa2", inputs, "fwd", True, 2.0, skip_reason="why")
    assert (skipped["status"], skipped["ms"], skipped["frac_copy_bw"]) == ("skipped", None, None)


def test_cpu_run_writes_schema_conformant_json_and_markdown(tmp_path):
    # bf16 (the default dtype): the triton rows are skipped on CPU, with or without the interpreter.
    out = tmp_path / "attention_cpu"
    impls = ["reference", "fa2", "cudnn", "flex", "triton", "triton+separate_rotary"]
    main(["--device", "cpu", "--quick", "--out", str(out), "--shapes", "2x64x1x16,jagged:3x100x1x16",
                "--impls", ",".join(impls)])
    report = json.loads((tmp_path / "attention_cpu.json").read_text())
    assert {"device", "versions", "date", "command", "copy_bw_tbps", "rows"} <= set(report)
    assert {"torch", "triton", "cuda", "python"} <= set(report["versions"])
    assert report["versions"]["triton_environment"] == {k: v for k, v in os.environ.items() if k.startswith("TRITON_")}
    assert report["copy_bw_tbps"] > 0
    rows = report["rows"]
    # 5 impls x 2 rotary + the rotary-only impl once, x 3 passes, x 2 shapes.
    assert len(rows) == (5 * 2 + 1) * 3 * 2
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["pass"] in ("fwd", "bwd", "fwd+bwd") and isinstance(r["rotary"], bool)
        assert r["shape"] in ("2x64x1x16", "jagged:3x100x1x16")
        assert r["status"] in ("ok", "mismatch", "skipped")
        if r["impl"] == "reference":
            assert r["status"] == "ok" and r["ms"] > 0 and 0 < r["frac_copy_bw"] and r["max_abs_err"] == 0.0
            assert r["speedup_vs_fa2"] is None  # fa2 can't run on CPU
            assert r["bwd_timing"] == ("retain_graph" if r["pass"] == "bwd" else None)
        else:
            assert r["status"] == "skipped" and r["ms"] is None and r["skip_reason"]
    flex = next(r for r in rows if r["impl"] == "flex")
    assert "CUDA" in flex["skip_reason"]
    assert {r["impl"] for r in rows if not r["rotary"]} == set(impls) - {"triton+separate_rotary"}
    markdown = (tmp_path / "attention_cpu.md").read_text()
    assert "### 2x64x1x16 (T = 128 tokens)" in markdown and "### jagged:3x100x1x16" in markdown


class OneShotBackward(torch.autograd.Function):
    """Identity whose backward works once per forward: a graph retain_graph can't replay."""

    @staticmethod
    def forward(ctx, x):
        ctx.used = False
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.used:
            raise RuntimeError("backward already ran")
        ctx.used = True
        return grad


def fast_timer(fn):
    return cpu_median_ms(fn, warmup_ms=0, rep_ms=0)


def tiny_inputs():
    return make_inputs(parse_shape("jagged:3x100x1x16"), torch.device("cpu"), seed=0)


def test_time_pass_falls_back_to_a_difference_when_the_graph_cannot_be_replayed():
    inputs = tiny_inputs()

    def forward(q, k, v):
        return OneShotBackward.apply(block_attention_reference(q, k, v, inputs.offsets))

    ms, how = time_pass("bwd", forward, inputs, fast_timer)
    assert how.startswith("fwd+bwd minus fwd; retain_graph failed: RuntimeError: backward already ran")
    ms, how = time_pass("bwd", lambda q, k, v: block_attention_reference(q, k, v, inputs.offsets), inputs, fast_timer)
    assert how == "retain_graph" and ms > 0


def test_bench_impl_turns_failures_into_skipped_rows():
    inputs = tiny_inputs()

    def unsupported(_inputs):
        raise SkipRow("no kernel for this shape")

    rows = bench_impl(Impl("unsupported", unsupported, fused_rotary=False), inputs, False, fast_timer, 1.0)
    assert [(r["pass"], r["status"], r["skip_reason"]) for r in rows] == [
        (p, "skipped", "no kernel for this shape") for p in PASSES
    ]

    def no_backward(_inputs):
        # fwd works and matches the reference; every backward runs out of memory.
        def attend(q, k, v):
            return OneShotBackward.apply(block_attention_reference(q, k, v, inputs.offsets))

        return attend

    class OutOfMemory(RuntimeError):
        pass

    def broken_timer(fn):
        if broken_timer.calls:
            raise OutOfMemory("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        broken_timer.calls += 1
        return 1.5

    broken_timer.calls = 0
    rows = bench_impl(Impl("oom", no_backward, fused_rotary=False), inputs, False, broken_timer, 1.0)
    assert [(r["pass"], r["status"], r["ms"]) for r in rows] == [
        ("fwd", "ok", 1.5), ("bwd", "skipped", None), ("fwd+bwd", "skipped", None)
    ]
    assert rows[2]["skip_reason"] == "OutOfMemory: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_bench_impl_flags_a_wrong_result():
    inputs = tiny_inputs()

    def full_attention(_inputs):  # ignores the 64-token blocks: attends across the whole batch
        def attend(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(
                *(x.transpose(0, 1) for x in (q, k, v))).transpose(0, 1)

        return attend

    rows = bench_impl(Impl("wrong", full_attention, fused_rotary=False), inputs, False, fast_timer, 1.0)
    assert {r["status"] for r in rows} == {"mismatch"}
    assert rows[0]["max_abs_err"] > CHECK_TOLERANCE


def test_describe_adds_warnings_only_to_sdpa_no_kernel_errors():
    warned = [warnings.WarningMessage("Flash attention kernel not used because: head_dim > 256", UserWarning, "f", 1)]
    sdpa = describe(RuntimeError("No available kernel. Aborting execution."), warned)
    assert sdpa == (
        "RuntimeError: No available kernel. Aborting execution. "
        "[warnings: Flash attention kernel not used because: head_dim > 256]"
    )
    assert describe(ValueError("bad dtype"), warned) == "ValueError: bad dtype"
    assert describe(SkipRow("needs a GPU")) == "needs a GPU"


def test_host_profile_cpu_mode_counts_the_python_path_to_the_launch(tmp_path):
    """benchmarks/host_profile.py --cpu times each layer of a call with the triton backend's launches
    stubbed and counts its Python calls, every stage without error; the same offsets' reused block
    table costs fewer calls than building one."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "host_cpu.json"
    proc = subprocess.run([sys.executable, "benchmarks/host_profile.py", "--cpu", "--backends", "triton", "--out",
                           str(out)], cwd=repo, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = json.loads(out.read_text())["backends"]["triton"]
    assert "error" not in row, row
    stages = {"block_table", "block_table_new_offsets", "backend_run", "dispatcher_table", "dispatcher_offsets",
              "dispatcher_table_grad", "dispatcher_table_fwd_bwd"}
    assert set(row) == stages
    assert all(row[s]["host_us"] > 0 and row[s]["python_calls"] > 0 for s in stages)
    # The same offsets' table is reused: fewer calls than building one for new offsets.
    assert row["block_table"]["python_calls"] < row["block_table_new_offsets"]["python_calls"]
