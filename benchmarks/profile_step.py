"""Where a training step's time goes: one profiled train.py run per attention backend, one table.

    python -m benchmarks.profile_step --config configs/gpu.yaml --attn tlx triton fa2 reference \
        --out benchmarks/results/profile_step_h200
    python -m benchmarks.profile_step --config configs/tiny.yaml --attn reference --steps 4 --warmup 3 --out /tmp/p
    python -m benchmarks.profile_step idle /tmp/p.reference.trace.json.gz  # after a run with --trace

Each backend trains `warmup` steps, then `steps` steps timed without torch.profiler (wall time and
Lightning's SimpleProfiler host phases, as a user's run spends them), then `steps` more under
torch.profiler (CPU and CUDA activities) for what the device does, through train.py itself
(`--trainer.callbacks+=` this module's StepProfiler), so what is measured is what a user runs. Per step:

- wall time, MFU (models/flops.py over the device's dense bf16 datasheet peak) and the speed of
  light: max(FLOPs / measured bf16 matmul rate, minimum bytes / measured copy bandwidth), both rates
  measured in the same run, so the gap to the limit is one ratio (unprofiled window);
- host time by phase (fetching the batch, forward, backward, clipping, optimizer, Lightning's own
  work), from SimpleProfiler (unprofiled window);
- device time by kernel family and the top kernels, the time the GPU was busy at all (the union of
  its kernels' intervals: against the unprofiled wall time it tells a host-bound step from a
  device-bound one), the host's waits for the device, each with the operators around it, and the
  top host operators by self time (profiled window; the profiler slows host operators, so read
  those as shares, not times).
"""

import argparse
import bisect
import gzip
import json
import re
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

REPO = Path(__file__).resolve().parents[1]
# Kernel name patterns -> family, first match wins. Names cover cuBLAS (nvjet, sm90 gemm), Triton
# (ours, inductor's fused kernels), ATen and fbgemm on H100/H200.
KERNEL_FAMILIES = (
    # First: a fused sublayer kernel is LayerNorm, GEMMs and their epilogues at once, no one family below.
    ("fused sublayers", r"_sublayer_|_hidden_grad_gemm|_bias_gemm|_residual_gemm"
                        r"|_layer_norm_(fwd_rows|bwd_tiles)"),
    ("attention", r"block_attn|block_attention|flash|fmha|_attention_"),
    ("block table", r"fill_block_table"),
    ("matmul (projections, MLPs)", r"gemm|nvjet|cutlass|xmma|cublas|wgmma|sm90_"),
    ("optimizer", r"multi_tensor|fused_adam|adamw|_foreach"),
    ("embedding lookup and backward", r"embedding|index_select|indexSelect|index_add|indexing_backward|scatter|gather"
                                      r"|segment|split_embedding|bounds_check|jagged"),
    ("norms, activations, softmax, elementwise", r"^triton_|layer_norm|LayerNorm|elementwise|vectorized|reduce|"
                                                 r"softmax|gelu|GeluCUDA|unrolled|CatArray|cat_|copy|fill"),
    ("memory copies and sets", r"^Memcpy|^Memset|memcpy|memset"),
)
# SimpleProfiler actions (regular expressions) -> host phase. Lightning's optimizer_step action
# wraps the closure (forward, backward, clipping): the optimizer's own time is what remains.
HOST_ACTIONS = {
    "fetch batch": r"train_dataloader_next$",
    "move batch to device": r"^\[Strategy\].*\.batch_to_device$",
    "forward (training_step)": r"^\[Strategy\].*\.training_step$",
    "backward": r"^\[Strategy\].*\.backward$",
    "gradient clipping": r"configure_gradient_clipping$",
    "optimizer_step action": r"^\[LightningModule\].*\.optimizer_step$",
    "zero_grad": r"optimizer_zero_grad$",
    "callbacks": r"^\[Callback\](?!StepProfiler)",  # this profiler's own hooks are not the step's
    "profiler's own hooks": r"^\[Callback\]StepProfiler",
    "run_training_batch": r"^run_training_batch$",
}
HOST_PHASES = ("fetch batch", "move batch to device", "forward (training_step)", "backward", "gradient clipping",
               "optimizer step", "zero_grad", "callbacks", "Lightning and everything else", "profiler's own hooks")
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")
# Host calls that put work on the device: the one right before an idle gap's end launched the work that ended it.
LAUNCH_OPS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
              "cudaMemcpyAsync", "cudaMemsetAsync")
# Idle stretches shorter than this are the launch latency between back-to-back kernels, not a wait for the host.
IDLE_GAP_US = 10.0


def kernel_family(name: str) -> str:
    for family, pattern in KERNEL_FAMILIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return family
    return "other kernels"


class StepProfiler(Callback):
    """Times training steps [warmup, warmup + steps) unprofiled, profiles the next `steps` steps and
    writes `out` (JSON)."""

    def __init__(self, out: str, warmup: int = 20, steps: int = 10, trace: bool = False):
        self.out, self.warmup, self.steps, self.trace = Path(out), warmup, steps, trace
        self.profiler = None
        self.marks: dict = {}

    @staticmethod
    def _sync(pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self.warmup:
            self._sync(pl_module)
            self.marks = {"start": time.perf_counter(), "host_before": self._host_durations(trainer), "flops": 0,
                          "tokens": 0, "samples": 0, "history": []}
        if step == self.warmup + self.steps:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if pl_module.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
            self.marks["profiled_start"] = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # already counts the step that just ended
        if self.warmup < step <= self.warmup + self.steps:
            for trained in pl_module.trained_steps(outputs, batch):
                tokens, flops = pl_module.step_flops(trained["batch"])
                self.marks["flops"] += flops
                self.marks["tokens"] += tokens
                self.marks["samples"] += trained["batch"].batch_size
                self.marks["history"].append(trained["batch"].history_lengths)
        if step == self.warmup + self.steps:
            self._sync(pl_module)
            self.marks["wall"] = time.perf_counter() - self.marks["start"]
            host_after = self._host_durations(trainer)
            self.marks["host"] = {action: sum(host_after[action][len(self.marks["host_before"].get(action, [])):])
                                  for action in host_after}
        elif self.profiler is not None and step == self.warmup + 2 * self.steps:
            self._sync(pl_module)
            profiled_wall = time.perf_counter() - self.marks["profiled_start"]
            self.profiler.__exit__(None, None, None)
            if self.trace:  # the profiled steps' timeline (chrome://tracing, Perfetto), gzip'd: <out>.trace.json.gz
                self.profiler.export_chrome_trace(str(self.out.with_suffix(".trace.json.gz")))
            self._write(trainer, pl_module, self.profiler, self.marks["wall"], profiled_wall, self.marks["host"])
            self.profiler = None
            trainer.should_stop = True

    @staticmethod
    def _host_durations(trainer) -> dict:
        recorded = getattr(trainer.profiler, "recorded_durations", {})
        return {action: list(durations) for action, durations in recorded.items()}

    def _write(self, trainer, pl_module, profiler, wall: float, profiled_wall: float, host: dict) -> None:
        from models.flops import peak_flops, train_step_min_bytes

        steps = self.steps
        kernels = defaultdict(lambda: [0, 0.0])  # name -> [calls, device us]
        intervals = []
        syncs = defaultdict(lambda: [0, 0.0])
        sync_sources = defaultdict(lambda: [0, 0.0])
        host_ops = defaultdict(lambda: [0, 0.0])
        launches = []
        for event in profiler.events():
            # GPU-side spans of record_function ranges (Optimizer.step#AdamW.step, ...) are not work:
            # they cover the kernels inside them and the device's idle gaps between those.
            if event.device_type == torch.autograd.DeviceType.CUDA:
                if not event.is_user_annotation:
                    kernels[event.name][0] += 1
                    kernels[event.name][1] += event.device_time
                    intervals.append((event.time_range.start, event.time_range.end))
                continue
            if event.is_user_annotation or event.name.startswith(("[pl]", "ProfilerStep")):
                continue
            host_ops[event.name][0] += 1
            host_ops[event.name][1] += event.self_cpu_time_total
            if event.name in LAUNCH_OPS:
                launches.append((event.time_range.start, event))
            if event.name in SYNC_OPS:  # with their total time: what they waited counts
                syncs[event.name][0] += 1
                syncs[event.name][1] += event.cpu_time
                source = sync_sources[operator_chain(event)]
                source[0] += 1
                source[1] += event.cpu_time
        gaps = idle_gaps(intervals, IDLE_GAP_US)
        gap_sources = defaultdict(lambda: [0, 0.0])
        for launch, (start, end) in zip(launch_before(launches, [end for _, end in gaps]), gaps):
            source = gap_sources[operator_chain(launch) if launch is not None else "(no launch recorded)"]
            source[0] += 1
            source[1] += end - start
        device_us = defaultdict(float)
        for name, (_, us) in kernels.items():
            device_us[kernel_family(name)] += us
        actions_ms = {action: seconds / steps * 1e3 for action, seconds in sorted(host.items())}
        model, device = pl_module.net, pl_module.device
        history = [h for h in self.marks["history"] if h is not None]
        num_params = sum(p.numel() for p in model.parameters())
        min_bytes = sum(train_step_min_bytes(model.config, model.schema, h, num_params) for h in history)
        dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(str(trainer.precision).split("-")[0])
        ceilings = measured_ceilings(device)
        report = {
            "backend": model.config.attn_backend, "device": torch.cuda.get_device_name(device)
            if device.type == "cuda" else "cpu", "steps": steps, "warmup": self.warmup,
            "precision": str(trainer.precision), "compile": model.config.compile,
            "compile_mode": model.config.compile_mode, "pad_tokens_to": model.config.pad_tokens_to,
            "wall_ms_per_step": wall / steps * 1e3,
            "profiled_wall_ms_per_step": profiled_wall / steps * 1e3,
            "device_busy_ms_per_step": union_length(intervals) / steps / 1e3,
            "device_ms_per_step": {family: us / steps / 1e3 for family, us in sorted(device_us.items())},
            "top_kernels": [{"name": name, "family": kernel_family(name), "calls_per_step": calls / steps,
                             "ms_per_step": us / steps / 1e3} for name, calls, us in top(kernels)],
            "top_host_ops_profiled": [{"name": name, "calls_per_step": calls / steps, "self_ms_per_step": us / steps / 1e3}
                                      for name, calls, us in top(host_ops)],
            "host_ms_per_step": host_phases(actions_ms, wall / steps * 1e3),
            "syncs_per_step": {name: {"calls": calls / steps, "host_ms": us / steps / 1e3}
                               for name, (calls, us) in syncs.items()},
            "sync_sources": [{"source": source, "calls_per_step": calls / steps, "host_ms_per_step": us / steps / 1e3}
                             for source, calls, us in top(sync_sources)],
            "idle_gaps_per_step": {"gaps": len(gaps) / steps, "ms": sum(e - s for s, e in gaps) / steps / 1e3},
            "idle_gap_sources": [{"source": source, "gaps_per_step": n / steps, "ms_per_step": us / steps / 1e3}
                                 for source, n, us in top(gap_sources)],
            "flops_per_step": self.marks["flops"] / steps, "tokens_per_step": self.marks["tokens"] / steps,
            "samples_per_step": self.marks["samples"] / steps, "min_bytes_per_step": min_bytes / max(len(history), 1),
            "peak_flops": peak_flops(device, dtype), "ceilings": ceilings,
            "host_actions_ms_per_step": actions_ms,
        }
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(report, indent=1) + "\n")


TOP = 20  # kernels and host operators listed per backend


def top(counts: dict) -> list[tuple[str, int, float]]:
    """The TOP (name, calls, time) of name -> [calls, time], longest time first."""
    return [(name, calls, time_) for name, (calls, time_) in sorted(counts.items(), key=lambda kv: -kv[1][1])[:TOP]]


SOURCE_DEPTH = 5  # enclosing operators named per sync


def operator_chain(event) -> str:
    """A host event (a wait, a launch) and the operators around it, innermost first:
    `cudaStreamSynchronize < aten::item < ...`. The backward's ops run on autograd's thread, so the
    chain names the backward node (`autograd::engine::evaluate_function: ...Backward0`) rather than a
    Python line."""
    names, parent = [event.name], event.cpu_parent
    while parent is not None and len(names) <= SOURCE_DEPTH:
        names.append(parent.name)
        parent = parent.cpu_parent
    return " < ".join(names)


def idle_gaps(intervals: list[tuple[float, float]], min_length: float) -> list[tuple[float, float]]:
    """The stretches of at least `min_length` between the first interval's start and the last's end
    that no interval covers: where the device had nothing to run."""
    gaps, end = [], None
    for start, stop in sorted(intervals):
        if end is not None and start - end >= min_length:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    return gaps


# Chrome-trace event categories: the device's work, and the host's operators and runtime calls.
TRACE_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
TRACE_HOST_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime")


def host_activity_while_idle(events: list[dict], depth: int = 2) -> dict[str, dict[str, float]]:
    """From a chrome trace's events (--trace): for each host thread, the device's idle time (gaps of at
    least IDLE_GAP_US, in the trace's µs) by what that thread ran meanwhile: its operators' chain,
    outermost first, `depth` levels deep, or "(no operator)". Where the host is behind, the chains
    that take the idle time are the host work on the step's path."""
    spans = [e for e in events if e.get("ph") == "X"]
    gaps = idle_gaps([(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") in TRACE_DEVICE_CATEGORIES],
                     IDLE_GAP_US)
    threads = defaultdict(list)
    for e in spans:
        if e.get("cat") in TRACE_HOST_CATEGORIES:
            threads[str(e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    activity = {}
    for thread, ops in threads.items():
        ops.sort(key=lambda op: (op[0], -op[1]))
        shallow, open_ends = [], []  # a thread's operators nest: the open ones' ends give each one's level
        for start, end, name in ops:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            if len(open_ends) < depth:
                shallow.append((start, end, name, len(open_ends)))
            open_ends.append(end)
        by_chain = defaultdict(float)
        for gap_start, gap_end in gaps:
            inside = sorted(((max(s, gap_start), min(e, gap_end), name, level) for s, e, name, level in shallow
                             if s < gap_end and e > gap_start), key=lambda op: op[3])
            cuts = sorted({gap_start, gap_end, *(op[0] for op in inside), *(op[1] for op in inside)})
            for left, right in zip(cuts, cuts[1:]):
                middle = (left + right) / 2
                chain = " > ".join(name for s, e, name, _ in inside if s <= middle < e)
                by_chain[chain or "(no operator)"] += right - left
        activity[thread] = dict(by_chain)
    return activity


def launch_before(launches: list[tuple[float, object]], times: list[float]) -> list:
    """For each time, the last launch (start, event) that began at or before it, or None. The launch
    right before an idle gap's end is the one whose work ended the gap, its operators what the host
    was doing while the device waited."""
    starts = sorted(launches, key=lambda item: item[0])
    keys = [start for start, _ in starts]
    found = []
    for time_ in times:
        index = bisect.bisect_right(keys, time_) - 1
        found.append(starts[index][1] if index >= 0 else None)
    return found


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals (kernels of several streams)."""
    covered, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    return covered


def host_phases(actions_ms: dict, wall_ms: float) -> dict:
    """Per-step host ms of each HOST_PHASES entry from Lightning's per-action times."""
    per = {name: sum(ms for action, ms in actions_ms.items() if re.search(pattern, action))
           for name, pattern in HOST_ACTIONS.items()}
    phases = {phase: per[phase] for phase in HOST_PHASES if phase in per}
    if per["optimizer_step action"]:  # automatic optimization: it wraps training_step, backward and clipping
        phases["optimizer step"] = per["optimizer_step action"] - sum(
            per[p] for p in ("forward (training_step)", "backward", "gradient clipping"))
    else:  # manual optimization (sharding.pipeline): training_step runs backward and the optimizer step too
        phases.update({"backward": None, "gradient clipping": None, "optimizer step": None})
    outside = ("fetch batch", "move batch to device", "run_training_batch", "callbacks", "profiler's own hooks")
    phases["Lightning and everything else"] = wall_ms - sum(per[p] for p in outside)
    return {phase: phases[phase] for phase in HOST_PHASES}


def measured_ceilings(device: torch.device) -> dict:
    """bf16 matmul rate (8192^3 on random data) and device-to-device copy bandwidth (read + write),
    do_bench medians, measured in the same process as the profile."""
    if device.type != "cuda":
        return {"matmul_tflops": None, "copy_tbps": None}
    import triton.testing

    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    src = torch.empty(2**32, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    del a, b, src, dst
    torch.cuda.empty_cache()
    return {"matmul_tflops": 2 * 8192**3 / (ms * 1e-3) / 1e12, "copy_tbps": 2 * 2**32 / (copy_ms * 1e-3) / 1e12}


def speed_of_light_ms(report: dict) -> float | None:
    ceilings = report["ceilings"]
    if not ceilings["matmul_tflops"]:
        return None
    flop_ms = report["flops_per_step"] / (ceilings["matmul_tflops"] * 1e12) * 1e3
    byte_ms = report["min_bytes_per_step"] / (ceilings["copy_tbps"] * 1e12) * 1e3
    return max(flop_ms, byte_ms)


def render_markdown(reports: dict, command: str) -> str:
    first = next(iter(reports.values()))
    backends = list(reports)
    lines = [
        "# Where the training step's time goes",
        "",
        f"- device: {first['device']}; {first['precision']}; compile {first['compile']} ({first['compile_mode']}), "
        f"pad_tokens_to {first['pad_tokens_to']}; after {first['warmup']} warmup steps, {first['steps']} steps timed "
        f"without torch.profiler, then {first['steps']} under it",
        f"- command: `{command}`",
        f"- ceilings measured in each run: bf16 matmul {first['ceilings']['matmul_tflops'] or 0:.0f} TFLOP/s "
        f"(8192³), copy {first['ceilings']['copy_tbps'] or 0:.2f} TB/s",
        "",
        "| per step | " + " | ".join(backends) + " |",
        "|---|" + "---:|" * len(backends),
    ]

    def row(label, values, fmt="{:.2f}"):
        lines.append(f"| {label} | " + " | ".join("—" if v is None else fmt.format(v) for v in values) + " |")

    row("**wall time (ms)**, unprofiled", [r["wall_ms_per_step"] for r in reports.values()])
    row("device busy (ms): union of its kernels' intervals, profiled",
        [r.get("device_busy_ms_per_step") for r in reports.values()])
    row("device busy / unprofiled wall", [r["device_busy_ms_per_step"] / r["wall_ms_per_step"] * 100
                                          if r.get("device_busy_ms_per_step") else None for r in reports.values()],
        "{:.0f}%")
    row("wall time under torch.profiler (ms)", [r.get("profiled_wall_ms_per_step") for r in reports.values()])
    row("speed of light (ms): max(FLOPs/matmul rate, min bytes/copy BW)",
        [speed_of_light_ms(r) for r in reports.values()])
    row("wall / speed of light", [r["wall_ms_per_step"] / speed_of_light_ms(r) if speed_of_light_ms(r) else None
                                   for r in reports.values()], "{:.1f}×")
    row("MFU (dense bf16 datasheet peak)", [r["flops_per_step"] / (r["wall_ms_per_step"] * 1e-3) / r["peak_flops"] * 100
                                            if r["peak_flops"] else None for r in reports.values()], "{:.1f}%")
    row("TFLOP per step (models/flops.py)", [r["flops_per_step"] / 1e12 for r in reports.values()], "{:.3f}")
    row("tokens per step", [r["tokens_per_step"] for r in reports.values()], "{:.0f}")
    families = sorted({f for r in reports.values() for f in r["device_ms_per_step"]})
    lines.append("| *device time (ms), by kernel family* |" + " |" * len(backends))
    for family in families:
        row(family, [r["device_ms_per_step"].get(family, 0.0) for r in reports.values()])
    row("all device work", [sum(r["device_ms_per_step"].values()) for r in reports.values()])
    lines.append("| *host time (ms), by phase, unprofiled* |" + " |" * len(backends))
    for phase in HOST_PHASES:
        row(phase, [r["host_ms_per_step"].get(phase) for r in reports.values()])
    lines.append("| *host waits for the device* |" + " |" * len(backends))
    for name in SYNC_OPS:
        lines.append(f"| {name}: calls (host ms) | " + " | ".join(
            "{calls:.1f} ({host_ms:.2f})".format(**r["syncs_per_step"].get(name, {"calls": 0, "host_ms": 0}))
            for r in reports.values()) + " |")
    lines += [
        "",
        "Device time sums the GPU kernels and copies of the profiled steps by name (benchmarks/profile_step.py's "
        "KERNEL_FAMILIES), whatever stream or order they ran in; when it is far below the wall time the GPU "
        "waited for the host. Host phases are Lightning's SimpleProfiler durations; with CUDA graphs the forward "
        "and backward launch whole graphs, so their host time shrinks to the replay calls. Under manual "
        "optimization (sharding.pipeline) the training_step row is the whole step: forward, backward and "
        "optimizer step (—).",
        "",
    ]
    for backend, report in reports.items():
        if report.get("top_kernels"):
            lines += [f"## Top kernels: {backend}", "", "| kernel | family | calls/step | ms/step |", "|---|---|---:|---:|"]
            lines += [f"| `{k['name'][:100]}` | {k['family']} | {k['calls_per_step']:.1f} | {k['ms_per_step']:.3f} |"
                      for k in report["top_kernels"]]
            lines.append("")
        if report.get("sync_sources"):
            lines += [f"## Where the host waits for the device (under torch.profiler): {backend}", "",
                      f"Each wait with up to {SOURCE_DEPTH} enclosing operators, innermost first.", "",
                      "| wait < enclosing operators | calls/step | host ms/step |", "|---|---:|---:|"]
            lines += [f"| `{w['source'][:300]}` | {w['calls_per_step']:.1f} | {w['host_ms_per_step']:.3f} |"
                      for w in report["sync_sources"]]
            lines.append("")
        if report.get("idle_gap_sources"):
            idle = report["idle_gaps_per_step"]
            lines += [f"## Where the device waits for the host (under torch.profiler): {backend}", "",
                      f"{idle['ms']:.2f} ms a step idle in {idle['gaps']:.1f} gaps of at least {IDLE_GAP_US:.0f} µs between "
                      f"kernels; each gap by the host launch that ended it, with up to {SOURCE_DEPTH} enclosing operators.",
                      "", "| launch < enclosing operators | gaps/step | idle ms/step |", "|---|---:|---:|"]
            lines += [f"| `{g['source'][:300]}` | {g['gaps_per_step']:.1f} | {g['ms_per_step']:.3f} |"
                      for g in report["idle_gap_sources"]]
            lines.append("")
        if report.get("top_host_ops_profiled"):
            lines += [f"## Top host operators by self time (under torch.profiler): {backend}", "",
                      "| operator | calls/step | self ms/step |", "|---|---:|---:|"]
            lines += [f"| `{o['name'][:100]}` | {o['calls_per_step']:.1f} | {o['self_ms_per_step']:.3f} |"
                      for o in report["top_host_ops_profiled"]]
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["idle"]:  # idle <out>.<backend>.trace.json.gz [depth]: what the host ran while the device idled
        if len(argv) not in (2, 3) or (len(argv) == 3 and not argv[2].isdigit()):
            print("usage: python -m benchmarks.profile_step idle <trace.json.gz from --trace> [depth, default 2]",
                  file=sys.stderr)
            return 2
        events = json.loads(gzip.decompress(Path(argv[1]).read_bytes()))["traceEvents"]
        for thread, by_chain in host_activity_while_idle(events, int(argv[2]) if len(argv) > 2 else 2).items():
            print(f"\n== host thread {thread}: {sum(by_chain.values()) / 1e3:.2f} ms of the device's idle time\n")
            for chain, us in sorted(by_chain.items(), key=lambda kv: -kv[1])[:TOP]:
                print(f"{us / 1e3:9.3f} ms  {chain[:300]}")
        return 0
    if argv[:1] == ["report"]:  # re-render <out>.md from <out>.json, e.g. after a renderer change
        saved = json.loads(Path(argv[1]).read_text())
        for report in saved["reports"].values():
            report["host_ms_per_step"] = host_phases(report["host_actions_ms_per_step"], report["wall_ms_per_step"])
        Path(argv[1]).with_suffix(".md").write_text(render_markdown(saved["reports"], saved["command"]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--attn", nargs="+", required=True)
    parser.add_argument("--config", action="append", default=[])
    parser.add_argument("--warmup", type=int, default=20, help="steps before profiling (compiles, CUDA graphs, caches)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True, help="writes <out>.json and <out>.md")
    parser.add_argument("--trace", action="store_true", help="also <out>.<backend>.trace.json.gz: the profiled "
                        "steps' timeline, host and device, for chrome://tracing or Perfetto")
    args, passthrough = parser.parse_known_args(argv)
    reports = {}
    for backend in args.attn:
        part = Path(f"{args.out}.{backend}.json")
        command = [
            sys.executable, str(REPO / "train.py"), *[a for c in args.config for a in ("--config", c)], *passthrough,
            f"--attn={backend}", f"--trainer.max_steps={args.warmup + 2 * args.steps + 1}", "--trainer.profiler=simple",
            "--trainer.val_check_interval=100000", "--trainer.limit_val_batches=0",
            "--trainer.callbacks+=benchmarks.profile_step.StepProfiler", f"--trainer.callbacks.out={part}",
            f"--trainer.callbacks.warmup={args.warmup}", f"--trainer.callbacks.steps={args.steps}",
            f"--trainer.callbacks.trace={args.trace}",
            "--run_name=profile_step", "--runs_dir=/tmp/profile_step_runs",
        ]
        print(f"== {backend}: {shlex.join(command)}", flush=True)
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0 or not part.exists():
            print(f"{backend} failed ({result.returncode}):\n{result.stderr[-3000:]}", flush=True)
            continue
        reports[backend] = json.loads(part.read_text())
        part.unlink()
    if not reports:
        return 1
    full_command = "python -m benchmarks.profile_step " + shlex.join(argv)
    Path(f"{args.out}.json").write_text(json.dumps({"command": full_command, "reports": reports}, indent=1) + "\n")
    markdown = render_markdown(reports, full_command)
    Path(f"{args.out}.md").write_text(markdown)
    print(markdown)
    return 0 if len(reports) == len(args.attn) else 1


if __name__ == "__main__":
    sys.exit(main())
