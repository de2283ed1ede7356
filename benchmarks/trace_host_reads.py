"""Which Python lines read device tensors back to the host during a train.py run, and how often.

    python -m benchmarks.trace_host_reads [--device-type cuda] [--top 25] -- <train.py arguments>

On CUDA each such read (`.item()`, `.tolist()`, `float(t)`, `bool(t)`, `.cpu()` ...) makes the host
wait until the device has finished everything queued before it, so a read in every step stops the
host from queueing the next step while this one runs. torch.profiler shows such waits as
`aten::item` with no enclosing operator (benchmarks/profile_step.py's "where the host waits"); this
names the Python lines. It wraps those Tensor methods for the whole run, then prints each calling
stack (innermost frame first) with its count. `--device-type cpu` counts CPU tensors instead, which
only the tests want.
"""

import argparse
import collections
import runpy
import sys
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu")
FRAMES = 6  # frames named per stack


def trace(device_type: str) -> collections.Counter:
    """Wraps the READS methods of torch.Tensor; returns the counter they fill, stack -> reads."""
    counts = collections.Counter()

    def wrap(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if self.device.type == device_type:
                stack = traceback.extract_stack()[:-1][-FRAMES:]
                counts[" <- ".join(f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno}({f.name})"
                                   for f in reversed(stack))] += 1
            return original(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)

    for name in READS:
        wrap(name)
    return counts


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trace_host_reads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-type", default="cuda")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: train.py's arguments")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    counts = trace(args.device_type)
    sys.argv = [str(REPO / "train.py"), *train_args]
    try:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    finally:
        print(f"\n== host reads of {args.device_type} tensors, by calling stack (innermost first)")
        for stack, count in counts.most_common(args.top):
            print(count, stack)
    return 0


if __name__ == "__main__":
    sys.exit(main())
