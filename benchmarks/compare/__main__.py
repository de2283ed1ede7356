"""Backend comparison: train one config with several attention backends and judge speed and parity.

    python train.py compare --attn tlx fa2 --config configs/gpu.yaml --steps 2000 --seeds 3 --out runs/compare_x
    python -m benchmarks.compare --attn tlx fa2 --config configs/gpu.yaml --seeds 3 --out runs/compare_x
    python -m benchmarks.compare --attn reference reference --config configs/tiny.yaml --seeds 2 \\
        --out /tmp/compare_cpu --trainer.val_check_interval=10      # CPU smoke: reference against itself
    python train.py compare --attn tlx fa2 --variant tlx_sharded tlx configs/sharded.yaml --config configs/gpu.yaml \
        --out runs/compare_y                               # also tlx with torchrec-sharded tables
    python train.py compare --attn tlx fa2 flex --variant tlx_unfused tlx model.net.fused_mlp=false \
        --config configs/gpu.yaml --out runs/compare_z     # also tlx with another key's value
    python -m benchmarks.compare report runs/compare_x     # re-render the report from the folder

Every (backend, seed) pair is one `python train.py` subprocess with the same config, data and data
order; seed s sets the model initialization of every backend alike, so the spread over seeds is
the run-to-run noise that backend differences are judged against. A --variant adds a group of
runs of one backend with more config files or KEY=VALUE keys (sharded tables, the unfused MLP), judged
against the same baseline.
Other `--key=value` arguments go to every run. A run that crashes is reported with its exit code and
the end of its stderr; the other runs are kept. `--jobs N` trains N runs at a time (for scores and
losses, e.g. architectures side by side; their step times then share the device and do not compare). Rerunning the same command reuses the finished runs in --out and retries the
rest; a different config in the same --out is refused.

The --out folder:
    settings.json          what is compared (backends, seeds, resolved config, device), written first
    kernel_parity.json     kernels.testing.parity of each backend on the model's head shape and dtype
    runs/<label>-seed<s>/  run.json (command, exit code, wall time), stdout.log, stderr.log and
                           train.py's version_N/ (config.yaml, metrics.csv, checkpoints)
    compare.json, compare.md, loss_curves.png   the report, rebuilt from the above by `report`

Exit status: 0 when parity passes, 1 when it fails (a run failed or the rule is broken),
2 for bad input (unknown or unavailable backend, a mismatched --out folder, a missing folder).
"""

import sys
import time
from pathlib import Path

from benchmarks.compare.report import markdown_table, step_time_table, verdict_markdown, write_report
from benchmarks.compare.run import CompareError, check_out_folder, parse_compare_args, run_comparison


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from_train_py = Path(sys.argv[0]).name == "train.py"
    prog = "python train.py compare" if from_train_py else "python -m benchmarks.compare"
    try:
        if argv[:1] == ["report"]:
            if len(argv) != 2 or argv[1].startswith("-"):
                print(f"usage: {prog} report OUT_FOLDER", file=sys.stderr)
                return 2
            folder = Path(argv[1])
        else:
            settings = parse_compare_args(argv, prog)
            check_out_folder(settings)
            started = time.perf_counter()
            run_comparison(settings)
            print(f"comparison took {time.perf_counter() - started:.0f} s")
            folder = settings.out
        report = write_report(folder)
    except CompareError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to finish (finished runs are reused)", file=sys.stderr)
        return 130
    print(verdict_markdown(report).split("\n\nRule:")[0])
    print(markdown_table(step_time_table(report)))
    print(f"report: {folder / 'compare.md'}")
    return 0 if report["parity"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
