"""benchmarks/profile_step.py on the CPU: the two windows, the report's fields and its arithmetic."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.profile_step import (SOURCE_DEPTH, SYNC_OPS, host_activity_while_idle, host_phases, idle_gaps,
                                    kernel_family, launch_before, main, operator_chain, union_length)

REPO = Path(__file__).resolve().parents[1]


def test_union_length_counts_overlaps_once():
    assert union_length([]) == 0
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_length([(0, 10), (2, 3), (4, 5)]) == 10
    assert union_length([(3, 4), (0, 1)]) == 2


class _Event:
    def __init__(self, name, parent=None):
        self.name, self.cpu_parent = name, parent


@pytest.mark.parametrize("kernel, family", [
    # Names as an H100 profile of the fused MLP step listed them (profile_step_mlp_gelu_tanh_fused_mlp_true_h100.md).
    ("_tlx_mlp_sublayer_fwd", "fused sublayers"),
    ("_hidden_grad_gemm", "fused sublayers"),
    ("_layer_norm_bwd_tiles", "fused sublayers"),
    ("_tlx_attention_sublayer_bwd", "fused sublayers"),
    ("_attention_sublayer_fwd_blocks", "fused sublayers"),
    ("_tlx_block_attn_bwd", "attention"),
    ("nvjet_sm90_tst_128x128_64x6_2x1_v_bz_splitK_NTT", "matmul (projections, MLPs)"),
    ("triton_per_fused__to_copy_native_layer_norm_23", "norms, activations, softmax, elementwise"),
    ("some_new_kernel", "other kernels"),
])
def test_kernel_families(kernel, family):
    assert kernel_family(kernel) == family


def test_operator_chain_names_the_enclosing_operators_innermost_first():
    outer = _Event("autograd::engine::evaluate_function: EmbeddingBackward0")
    wait = _Event("cudaStreamSynchronize", _Event("aten::_local_scalar_dense", _Event("aten::item", outer)))
    assert operator_chain(wait) == ("cudaStreamSynchronize < aten::_local_scalar_dense < aten::item"
                                    " < autograd::engine::evaluate_function: EmbeddingBackward0")
    deep = _Event("leaf")
    for _ in range(9):
        deep = _Event("leaf", deep)
    assert operator_chain(deep).count(" < ") == SOURCE_DEPTH


def test_idle_gaps_are_the_uncovered_stretches_between_kernels():
    assert idle_gaps([], 1) == []
    # Overlapping kernels (two streams) leave no gap; the 1-unit stretch is below the threshold.
    assert idle_gaps([(0, 5), (2, 8), (9, 10), (30, 31), (12, 20)], 2) == [(10, 12), (20, 30)]
    assert idle_gaps([(0, 10), (2, 3), (4, 5)], 1) == []


def test_launch_before_takes_the_last_launch_at_or_before_each_time():
    a, b = _Event("cudaGraphLaunch"), _Event("cudaLaunchKernel")
    assert launch_before([(5.0, b), (1.0, a)], [0.5, 1.0, 4.9, 7.0]) == [None, a, a, b]
    assert launch_before([], [3.0]) == [None]


def _span(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


IDLE_TRACE = [
    # The device runs [0, 10), [30, 40), [100, 110): idle 10-30 and 40-100.
    _span("kernel", "k1", 0, 10, tid=7), _span("gpu_memcpy", "copy", 30, 10, tid=7), _span("kernel", "k2", 100, 10, tid=7),
    # Thread 1: A holds B (and B a launch, one level too deep to name), then C.
    _span("cpu_op", "A", 5, 30), _span("cpu_op", "B", 12, 8), _span("cuda_runtime", "cudaLaunchKernel", 14, 2),
    _span("cpu_op", "C", 40, 65),
    _span("user_annotation", "D", 0, 200, tid=2),
    {"ph": "i", "name": "instant", "ts": 50, "tid": 1},
]


def test_host_activity_while_idle_splits_each_gap_by_what_each_thread_ran():
    activity = host_activity_while_idle(IDLE_TRACE, depth=2)
    assert activity["1"] == {"A": 12, "A > B": 8, "C": 60}
    assert activity["2"] == {"D": 80}
    assert host_activity_while_idle(IDLE_TRACE, depth=1)["1"] == {"A": 20, "C": 60}
    assert host_activity_while_idle(IDLE_TRACE, depth=3)["1"]["A > B > cudaLaunchKernel"] == 2
    # Where a thread ran nothing, the gap still counts, as such.
    assert host_activity_while_idle(IDLE_TRACE[:3] + [_span("cpu_op", "E", 45, 5)])["1"] == {"(no operator)": 75, "E": 5}


def test_idle_command_prints_each_thread(tmp_path, capsys):
    trace = tmp_path / "p.reference.trace.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": IDLE_TRACE}).encode()))
    assert main(["idle", str(trace)]) == 0
    printed = capsys.readouterr().out
    assert "host thread 1: 0.08 ms" in printed and "A > B" in printed and "host thread 2" in printed
    assert main(["idle"]) == main(["idle", str(trace), "deep"]) == 2
    assert "usage: python -m benchmarks.profile_step idle" in capsys.readouterr().err


def test_host_phases_take_the_closure_out_of_the_optimizer_step():
    actions = {"[Strategy]X.training_step": 3.0, "[Strategy]X.backward": 4.0,
               "[LightningModule]T.configure_gradient_clipping": 1.0, "[LightningModule]T.optimizer_step": 10.0,
               "run_training_batch": 10.5, "[_TrainingEpochLoop].train_dataloader_next": 0.5}
    phases = host_phases(actions, wall_ms=12.0)
    assert phases["optimizer step"] == pytest.approx(2.0)
    assert phases["Lightning and everything else"] == pytest.approx(12.0 - 10.5 - 0.5)


def test_host_phases_under_manual_optimization_leave_the_whole_step_to_training_step():
    """sharding.pipeline's step runs backward and the optimizer step inside training_step; Lightning
    profiles no optimizer_step around it, so no phase may come out negative."""
    actions = {"[Strategy]X.training_step": 13.0, "optimizer_step": 0.7, "run_training_batch": 13.1,
               "[_TrainingEpochLoop].train_dataloader_next": 0.2}
    phases = host_phases(actions, wall_ms=14.0)
    assert phases["forward (training_step)"] == pytest.approx(13.0)
    assert phases["backward"] is phases["optimizer step"] is phases["gradient clipping"] is None


def test_profile_of_the_tiny_config(tmp_path):
    out = tmp_path / "profile"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.profile_step", "--config", "configs/tiny.yaml", "--attn", "reference",
         "--warmup", "2", "--steps", "3", "--out", str(out), "--trace", f"--data.data_dir={tmp_path / 'cache'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())["reports"]["reference"]
    assert report["steps"] == 3 and report["samples_per_step"] == 64  # the tiny batch
    assert report["wall_ms_per_step"] > 0 and report["profiled_wall_ms_per_step"] > 0
    host = report["host_ms_per_step"]
    assert host["forward (training_step)"] > 0 and host["backward"] > 0
    # The phases split the unprofiled window's wall time: they add up to it.
    assert sum(host.values()) == pytest.approx(report["wall_ms_per_step"], rel=0.05)
    names = [op["name"] for op in report["top_host_ops_profiled"]]
    assert any(name.startswith("aten::") for name in names)
    assert report["device_ms_per_step"] == {} and report["device_busy_ms_per_step"] == 0  # no GPU here
    # .item() on CPU tensors still goes through aten::_local_scalar_dense, so even the CPU run has sources.
    sources = [w["source"] for w in report["sync_sources"]]
    assert sources and all(source.split(" < ")[0] in SYNC_OPS for source in sources)
    markdown = out.with_suffix(".md").read_text()
    assert "Where the host waits" in markdown
    # No device, no kernels: nothing idles, and the section is left out.
    assert report["idle_gaps_per_step"] == {"gaps": 0, "ms": 0} and report["idle_gap_sources"] == []
    assert "Where the device waits" not in markdown
    # --trace keeps the profiled steps' timeline beside the report.
    trace = json.loads(gzip.decompress((tmp_path / "profile.reference.trace.json.gz").read_bytes()))
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    assert "unprofiled" in markdown and "Top host operators" in markdown
