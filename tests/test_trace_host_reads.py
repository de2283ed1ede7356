"""benchmarks/trace_host_reads.py on the CPU: it names the lines that read tensors back."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_trace_names_the_lines_that_read_tensors(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.trace_host_reads", "--device-type", "cpu", "--top", "50", "--",
         "--config", "configs/tiny.yaml", "--trainer.max_steps=4", f"--runs_dir={tmp_path / 'runs'}",
         f"--data.data_dir={tmp_path / 'cache'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    listing = result.stdout.split("== host reads of cpu tensors")[1].splitlines()[1:]
    counts = {line.split(" ", 1)[1]: int(line.split(" ", 1)[0]) for line in listing if line}
    # StepMetrics reads each step's loss once, in flush (from on_train_batch_end, and on_train_end for the last).
    flush = [stack for stack in counts if stack.split(" <- ")[0].endswith("(flush)") and "callbacks.py:" in stack]
    assert sum(counts[stack] for stack in flush) == 4
