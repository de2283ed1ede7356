"""Backend comparison: train one config with several attention backends and judge speed and parity.

    python train.py compare --attn tlx fa2 --config configs/gpu.yaml --steps 2000 --seeds 3 --out runs/compare_x
    python -m benchmarks.compare_backends --attn tlx fa2 --config configs/gpu.yaml --seeds 3 --out runs/compare_x
    python -m benchmarks.compare_backends --attn reference reference --config configs/tiny.yaml --seeds 2 \\
        --out /tmp/compare_cpu --trainer.val_check_interval=10      # CPU smoke: reference against itself
    python -m benchmarks.compare_backends report runs/compare_x     # re-render the report from the folder

Every (backend, seed) pair is one `python train.py` subprocess with the same config, data and data
order; seed s sets the model initialization of every backend alike, so the spread over seeds is
the run-to-run noise that backend differences are judged against. Other `--key=value` arguments go
to every run. A run that crashes is reported with its exit code and the end of its stderr; the
other runs are kept. Rerunning the same command reuses the finished runs in --out and retries the
rest; a different config in the same --out is refused.

The --out folder:
    settings.json          what is compared (backends, seeds, resolved config, device), written first
    kernel_parity.json     out/dq/dk/dv errors of each backend against fp64 (benchmarks/kernel_parity.py)
    runs/<label>-seed<s>/  run.json (command, exit code, wall time), stdout.log, stderr.log and
                           train.py's version_N/ (config.yaml, metrics.csv, checkpoints)
    compare.json, compare.md, loss_curves.png   the report, rebuilt from the above by `report`

Exit status: 0 when parity passes, 1 when it fails (a run failed or the rule below is broken),
2 for bad input (unknown or unavailable backend, a mismatched --out folder, a missing folder).
notebooks/compare_backends.ipynb shows the same report for any such folder.
"""

import argparse
import datetime
import json
import math
import shlex
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import yaml
from matplotlib.figure import Figure

import kernels
from benchmarks.bench_attention import device_name, versions
from benchmarks.kernel_parity import UnsupportedConfigError, kernel_dtype, kernel_errors

REPO = Path(__file__).resolve().parents[1]
COMPARABLE_BACKENDS = tuple(name for name in kernels.BACKENDS if name != "auto")
# Set per run by the comparison itself, so they can't be passed through and differ between runs.
PER_RUN_KEYS = ("attn", "model.attn_backend", "seed_everything", "run_name", "runs_dir", "ckpt_path")
RESERVED_ARGS = (*PER_RUN_KEYS, "trainer.max_steps", "config")
STDERR_TAIL_LINES = 20

# Step time: the first steps compile kernels, autotune and warm the allocator.
WARMUP_MIN_STEPS = 20
WARMUP_FRACTION = 0.10
STEP_TIME_RULE = (
    f"step time (forward, backward and optimizer step; train.py synchronizes the GPU around it) excludes the "
    f"first max({WARMUP_MIN_STEPS}, {WARMUP_FRACTION:.0%} of the steps) steps, at most half of them, which compile "
    "and autotune kernels; median and p90 over the remaining logged steps of every seed together"
)

# Parity. The tolerance is the seed band (min to max over seeds) widened twice over: in time, to
# the widest band within +-10% of the logged steps (where seed curves cross, the band at one step
# nearly vanishes), and by a factor, because 2-3 seeds estimate the noise roughly and the gap is
# checked at every step. On simulated curves (random-walk seed drift) this fails identical
# backends in ~0% of comparisons with 3 seeds and ~9% with 2, and catches a shift of twice the
# typical band about 80% of the time with 3 seeds. Final metrics: 3 pooled seed stds are 3.7
# standard errors of a difference of 3-seed means, which a t test with 4 degrees of freedom exceeds
# by chance ~2% of the time. The floors keep zero-noise cases (one seed, a deterministic CPU run)
# from demanding bit-identical results.
BAND_WINDOW_FRACTION = 0.10
LOSS_BAND_FACTOR = 1.5
LOSS_FLOOR = 0.002
FINAL_METRICS = ("auc", "ne", "logloss")
FINAL_STD_FACTOR = 3.0
FINAL_FLOOR = 0.002
PARITY_RULE = (
    "Baseline: fa2 if compared, else the first backend. Each run's per-step train loss is smoothed with a "
    "centered moving average over 2*floor(n/100)+1 of its n logged steps; a backend's seed band at a step is "
    f"the widest min-max spread over its seeds within +-{BAND_WINDOW_FRACTION:.0%} of the logged steps. Pass if "
    "(1) every run finished; (2) for every other backend, at every logged step after warmup, "
    f"|mean loss - baseline mean loss| <= {LOSS_BAND_FACTOR:g} x (the wider of the two backends' seed bands) + "
    f"{LOSS_FLOOR:g}; and (3) at the last validation, |mean - baseline mean| < "
    f"max({FINAL_FLOOR:g}, {FINAL_STD_FACTOR:g} x pooled seed std) for AUC, NE and log loss. Means are over "
    "seeds; every backend uses the same seeds, data and data order. Use 3 or more seeds: with 2 the band "
    "is a poor noise estimate."
)

METRIC_COLUMNS = {
    "loss": "train/loss", "step_ms": "train/step_ms", "samples_per_s": "train/samples_per_s",
    "tokens_per_s": "train/tokens_per_s", "auc": "val/auc", "ne": "val/ne", "logloss": "val/logloss",
    "calibration": "val/calibration",
}


class CompareError(Exception):
    """Bad input: reported as one clear line and exit status 2."""


# --------------------------------------------------------------------------------------------- rules


def warmup_steps(steps: int) -> int:
    """Steps left out of step-time statistics and of the loss-curve check (see STEP_TIME_RULE)."""
    return min(max(WARMUP_MIN_STEPS, math.ceil(WARMUP_FRACTION * steps)), steps // 2)


def smooth(losses: pd.DataFrame) -> pd.DataFrame:
    """Centered moving average of each column (one per seed) over 2*floor(n/100)+1 logged steps."""
    window = 2 * (len(losses) // 100) + 1
    return losses.rolling(window, center=True, min_periods=1).mean()


def seed_band(smoothed: pd.DataFrame) -> pd.Series:
    """At each step, the widest min-max spread over seeds within +-BAND_WINDOW_FRACTION of the steps."""
    half_width = max(1, round(BAND_WINDOW_FRACTION * len(smoothed)))
    spread = smoothed.max(axis=1) - smoothed.min(axis=1)
    return spread.rolling(2 * half_width + 1, center=True, min_periods=1).max()


def loss_gap(smoothed: pd.DataFrame, smoothed_baseline: pd.DataFrame) -> tuple[pd.Series, pd.Series, pd.Series]:
    """(mean - baseline mean, seed band, tolerance) at the steps both have; inputs come from smooth()."""
    steps = smoothed.index.intersection(smoothed_baseline.index)
    a, b = smoothed.loc[steps], smoothed_baseline.loc[steps]
    band = np.maximum(seed_band(a), seed_band(b))
    return a.mean(axis=1) - b.mean(axis=1), band, LOSS_BAND_FACTOR * band + LOSS_FLOOR


def _pooled_std(*samples: pd.Series) -> float:
    variances = [s.var(ddof=1) for s in samples if len(s) >= 2]
    return float(math.sqrt(sum(variances) / len(variances))) if variances else 0.0


def parity_verdict(
    losses: dict[str, pd.DataFrame], finals: dict[str, pd.DataFrame], baseline: str, warmup: int,
    problems: list[str] = (),
) -> dict:
    """Applies PARITY_RULE.

    losses[label]: per-step train loss, index = step, one column per seed (unsmoothed).
    finals[label]: last-validation metrics, index = seed, columns FINAL_METRICS.
    problems: runs that did not finish, as sentences; any makes the verdict fail.
    """
    problems = list(problems)
    if len(losses) < 2:
        problems.append("fewer than two backends to compare")
    smoothed = {}
    for label, frame in losses.items():
        frame = frame.dropna()
        if frame.empty:
            problems.append(f"{label}: no finished run to compare")
        else:
            smoothed[label] = smooth(frame)
    per_backend = {}
    for label in losses:
        if label == baseline or label not in smoothed or baseline not in smoothed:
            continue
        gap, band, tolerance = loss_gap(smoothed[label], smoothed[baseline])
        after_warmup = gap.index >= warmup
        gap, band, tolerance = gap[after_warmup], band[after_warmup], tolerance[after_warmup]
        if gap.empty:
            problems.append(f"{label}: no logged step after warmup (step >= {warmup})")
            continue
        largest, worst = gap.abs().idxmax(), (gap.abs() / tolerance).idxmax()
        outside = gap.index[gap.abs() > tolerance]
        entry = {
            "max_loss_gap": float(gap[largest]), "at_step": int(largest),
            "band_at_step": float(band[largest]),
            "tolerance_at_step": float(tolerance[largest]),
            "worst_gap_over_tolerance": float(abs(gap[worst]) / tolerance[worst]), "worst_step": int(worst),
            "steps_checked": int(len(gap)), "steps_outside": int(len(outside)),
            "first_step_outside": int(outside[0]) if len(outside) else None,
            "loss_pass": not len(outside), "final": {},
        }
        for metric in FINAL_METRICS:
            ours = finals.get(label, pd.DataFrame()).get(metric, pd.Series(dtype=float)).dropna()
            theirs = finals.get(baseline, pd.DataFrame()).get(metric, pd.Series(dtype=float)).dropna()
            if ours.empty or theirs.empty:
                entry["final"][metric] = {"pass": False, "missing": True}
                continue
            difference = float(ours.mean() - theirs.mean())
            std = _pooled_std(ours, theirs)
            tolerance_final = max(FINAL_FLOOR, FINAL_STD_FACTOR * std)
            entry["final"][metric] = {
                "mean": float(ours.mean()), "baseline_mean": float(theirs.mean()), "diff": difference,
                "pooled_seed_std": std, "tolerance": tolerance_final, "pass": abs(difference) < tolerance_final,
            }
        entry["pass"] = entry["loss_pass"] and all(m["pass"] for m in entry["final"].values())
        per_backend[label] = entry
    seed_counts = [frame.shape[1] for frame in smoothed.values()]
    verdict = {
        "pass": not problems and bool(per_backend) and all(e["pass"] for e in per_backend.values()),
        "rule": PARITY_RULE,
        "baseline": baseline,
        "warmup_steps": warmup,
        "problems": problems,
        "backends": per_backend,
    }
    if seed_counts and min(seed_counts) < 2:
        verdict["note"] = "with one seed per backend there is no seed band: only the absolute floors apply"
    return verdict


# --------------------------------------------------------------------------------------------- setup


@dataclass
class Settings:
    """One comparison: saved as settings.json; the same resolved config and device are required to reuse --out."""

    out: Path
    config_files: list[str]
    passthrough: list[str]
    labels: dict[str, str]  # label -> backend; a backend named twice gets label <backend>_2
    seeds: list[int]
    steps: int
    device: str
    device_type: str
    kernel_dtype: str
    resolved_config: dict
    versions: dict
    date: str
    command: str

    def to_json(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


def labels_for(backends: list[str]) -> dict[str, str]:
    labels, seen = {}, {}
    for backend in backends:
        seen[backend] = seen.get(backend, 0) + 1
        labels[backend if seen[backend] == 1 else f"{backend}_{seen[backend]}"] = backend
    return labels


def run_name(label: str, seed: int) -> str:
    return f"{label}-seed{seed}"


def train_args(
    config_files: list[str], passthrough: list[str], backend: str, seed: int, steps: int | None, out: Path, label: str
) -> list[str]:
    """train.py's arguments for one run; the comparison's own keys come last so they win."""
    args = [arg for path in config_files for arg in ("--config", path)] + list(passthrough)
    args += [f"--attn={backend}", f"--seed_everything={seed}", f"--runs_dir={out / 'runs'}",
             f"--run_name={run_name(label, seed)}"]
    if steps is not None:
        args.append(f"--trainer.max_steps={steps}")
    return args


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def comparable_config(config: dict) -> dict:
    """A run's resolved config without the keys the comparison sets per run, flattened to dotted keys."""
    return {k: v for k, v in _flatten(config).items() if k not in PER_RUN_KEYS and k != "config"}


def config_differences(ours: dict, theirs: dict, ours_name: str, theirs_name: str) -> list[str]:
    """`key: value in ours_name, value in theirs_name` for each differing key of two comparable configs."""
    keys = sorted(set(ours) | set(theirs))
    missing = "(absent)"
    return [
        f"{key} = {ours.get(key, missing)!r} in {ours_name}, {theirs.get(key, missing)!r} in {theirs_name}"
        for key in keys
        if ours.get(key, missing) != theirs.get(key, missing)
    ]


def resolve_config(config_files: list[str], passthrough: list[str], backend: str, steps: int | None, out: Path):
    """Parses one run's arguments with train.py's own parser: (comparable config, parsed namespace).

    Bad keys or values end here, before anything runs.
    """
    import train  # the repository root is on sys.path both as `python train.py` and `python -m benchmarks...`

    parser = train.build_parser()
    parser.exit_on_error = False  # one clear line instead of train.py's full usage
    try:
        config = parser.parse_args(train_args(config_files, passthrough, backend, 0, steps, out, backend))
    except argparse.ArgumentError as error:
        raise CompareError(f"train.py rejects the config or extra arguments: {error}") from None
    with warnings.catch_warnings():
        # The same calls as train.py and Lightning's SaveConfigCallback (which writes each run's
        # config.yaml), whose spellings newer jsonargparse versions deprecate.
        warnings.simplefilter("ignore")
        try:
            parser.instantiate_classes(config)  # the model and data classes check their own arguments
        except ValueError as error:
            raise CompareError(f"invalid training config: {error}") from None
        dumped = parser.dump(config, skip_none=False)
    return comparable_config(yaml.safe_load(dumped)), config


def training_device(accelerator) -> torch.device:
    name = str(accelerator).lower()
    if name in ("gpu", "cuda") or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise CompareError(f"the config sets trainer.accelerator={name} but no CUDA GPU is visible here")
        return torch.device("cuda")
    if name in ("cpu", "auto"):
        return torch.device("cpu")
    raise CompareError(f"trainer.accelerator={name!r}: the comparison runs on cpu, gpu/cuda or auto")


def check_out_folder(settings: Settings) -> None:
    """Refuses an --out folder that holds something else, or runs of a different config or device."""
    out = settings.out
    saved = out / "settings.json"
    if not saved.exists():
        if out.exists() and any(out.iterdir()):
            raise CompareError(f"--out {out} is not empty and holds no settings.json: choose a new or empty folder")
        return
    previous = json.loads(saved.read_text())
    differences = config_differences(
        settings.resolved_config, previous["resolved_config"], "this command", f"{saved}"
    )
    if previous["device"] != settings.device:
        differences.append(f"device = {settings.device!r} here, {previous['device']!r} in {saved}")
    if differences:
        shown = "; ".join(differences[:8]) + (f"; and {len(differences) - 8} more" if len(differences) > 8 else "")
        raise CompareError(
            f"--out {out} holds runs of a different comparison ({shown}). Use a new --out folder, or the same settings."
        )


def parse_compare_args(argv: list[str], prog: str) -> Settings:
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0], epilog=f"Any other --key=value argument is passed to every train.py run.\n"
        f"`{prog} report OUT` re-renders the report of an existing --out folder.",
    )
    parser.add_argument("--attn", nargs="+", required=True, choices=COMPARABLE_BACKENDS, metavar="BACKEND",
                        help=f"two or more of {', '.join(COMPARABLE_BACKENDS)}; "
                        "naming one twice compares it with itself")
    parser.add_argument("--config", action="append", default=[], help="train.py config file(s), as for train.py")
    parser.add_argument("--steps", type=int, help="training steps per run (default: the config's trainer.max_steps)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 for every backend (default 3)")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    args, passthrough = parser.parse_known_args(argv)
    if len(args.attn) < 2:
        parser.error("--attn needs at least two backends (name one twice to compare it with itself)")
    if args.seeds < 1 or (args.steps is not None and args.steps < 1):
        parser.error(f"--seeds and --steps must be >= 1, got --seeds {args.seeds} --steps {args.steps}")
    if passthrough and not passthrough[0].startswith("--"):
        parser.error(f"unexpected argument {passthrough[0]!r}; extra arguments must be --key=value train.py keys")
    for arg in passthrough:
        key = arg[2:].split("=", 1)[0] if arg.startswith("--") else None
        if key in RESERVED_ARGS:
            parser.error(f"{arg}: the comparison sets --{key} itself; use --attn, --seeds, --steps, --config or --out")

    out = args.out.resolve()
    labels = labels_for(args.attn)
    resolved, config = resolve_config(args.config, passthrough, args.attn[0], args.steps, out)
    steps = args.steps if args.steps is not None else config.trainer.max_steps
    if steps is None or steps < 1:
        raise CompareError(f"the config sets no trainer.max_steps ({steps}); pass --steps")
    device = training_device(config.trainer.accelerator)
    for backend in dict.fromkeys(labels.values()):
        try:
            kernels.check_backend(backend, device)
        except kernels.BackendUnavailableError as error:
            raise CompareError(str(error)) from None
    return Settings(
        out=out, config_files=args.config, passthrough=passthrough, labels=labels, seeds=list(range(args.seeds)),
        steps=steps, device=device_name(device), device_type=device.type,
        kernel_dtype=str(kernel_dtype(config.trainer.precision)).removeprefix("torch."), resolved_config=resolved,
        versions=versions(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=f"{prog} {shlex.join(argv)}",
    )


# ----------------------------------------------------------------------------------------------- runs


def _version_folders(run_dir: Path) -> set[str]:
    return {p.name for p in run_dir.glob("version_*") if p.is_dir()}


def launch_run(command: list[str], run_dir: Path, record: dict) -> dict:
    """Runs one training command, logging to run_dir, and returns (and saves) its run.json record.

    run.json says "running" while the command runs, so a comparison cut short shows the run as
    interrupted (and the next invocation retries it) rather than as finished.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    before = _version_folders(run_dir)
    record = {**record, "command": shlex.join(command), "state": "running", "returncode": None, "version": None}
    (run_dir / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    started = time.perf_counter()
    with open(run_dir / "stdout.log", "w") as stdout, open(run_dir / "stderr.log", "w") as stderr:
        returncode = subprocess.run(command, stdout=stdout, stderr=stderr).returncode
    created = sorted(_version_folders(run_dir) - before, key=lambda name: int(name.split("_")[1]))
    record.update(
        state="finished", returncode=returncode, wall_s=round(time.perf_counter() - started, 1),
        version=created[-1] if created else None,
    )
    (run_dir / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def finished_ok(run_dir: Path) -> bool:
    path = run_dir / "run.json"
    if not path.exists():
        return False
    record = json.loads(path.read_text())
    return (
        record.get("state") == "finished" and record.get("returncode") == 0 and record.get("version") is not None
        and (run_dir / record["version"] / "metrics.csv").exists()
    )


def run_comparison(settings: Settings) -> None:
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(settings.to_json(), indent=1) + "\n")

    device = torch.device(settings.device_type)
    model = settings.resolved_config
    backends = list(dict.fromkeys(["reference", *settings.labels.values()]))  # reference: the yardstick row
    print(f"kernel parity on {settings.device} ({settings.kernel_dtype}): {', '.join(backends)}", flush=True)
    try:
        errors = kernel_errors(
            backends, device, getattr(torch, settings.kernel_dtype), model["model.num_heads"],
            model["model.d_model"] // model["model.num_heads"],
            kernels.Rotary(
                base=model["model.rotary_base"], within_block=model["model.rotary_within_block"],
                rotate_v=model["model.rotate_v"],
            ),
        )
    except UnsupportedConfigError as error:
        raise CompareError(f"this model config can't run: {error}") from None
    (out / "kernel_parity.json").write_text(json.dumps(errors, indent=1) + "\n")

    total = len(settings.seeds) * len(settings.labels)
    done = 0
    for seed in settings.seeds:  # seed-major: an interrupted comparison still has every backend at seed 0
        for label, backend in settings.labels.items():
            done += 1
            run_dir = out / "runs" / run_name(label, seed)
            prefix = f"[{done}/{total}] {label} seed {seed}:"
            if finished_ok(run_dir):
                print(f"{prefix} reusing the finished run in {run_dir}", flush=True)
                continue
            print(f"{prefix} training (log: {run_dir}/stderr.log)", flush=True)
            command = [
                sys.executable, str(REPO / "train.py"),
                *train_args(settings.config_files, settings.passthrough, backend, seed, settings.steps, out, label),
            ]
            record = launch_run(command, run_dir, {"label": label, "backend": backend, "seed": seed})
            outcome = "ok" if record["returncode"] == 0 else f"FAILED with exit code {record['returncode']}"
            print(f"{prefix} {outcome} in {record['wall_s']:.0f} s", flush=True)


# --------------------------------------------------------------------------------------------- loading


@dataclass
class Run:
    label: str
    backend: str
    seed: int
    status: str  # ok | failed | interrupted | missing
    returncode: int | None
    wall_s: float | None
    folder: Path | None  # train.py's version_N folder
    stderr_tail: list[str]
    train: pd.DataFrame | None  # per-step rows, index = step
    validation: pd.DataFrame | None  # one row per validation, index = step


@dataclass
class Comparison:
    out: Path
    settings: dict
    runs: list[Run]
    kernel_errors: dict | None


def _stderr_tail(path: Path) -> list[str]:
    if not path.exists():
        return []
    # Progress bars redraw with carriage returns: keep what each line finally showed.
    lines = [line.rsplit("\r", 1)[-1] for line in path.read_text(errors="replace").splitlines()]
    return [line for line in lines if line.strip()][-STDERR_TAIL_LINES:]


def _read_metrics(path: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    metrics = pd.read_csv(path)
    missing = [column for column in ("step", *METRIC_COLUMNS.values()) if column not in metrics.columns]
    if missing:
        raise CompareError(f"{path} has no column(s) {', '.join(missing)}; it was not written by this train.py")
    renamed = metrics.rename(columns={v: k for k, v in METRIC_COLUMNS.items()}).set_index("step")
    train = renamed.loc[renamed["loss"].notna(), ["loss", "step_ms", "samples_per_s", "tokens_per_s"]]
    validation = renamed.loc[renamed["auc"].notna(), ["auc", "ne", "logloss", "calibration"]]
    return train, validation


def _load_run(settings: dict, label: str, backend: str, seed: int) -> Run:
    run_dir = Path(settings["out"]) / "runs" / run_name(label, seed)
    record_path = run_dir / "run.json"
    if not record_path.exists():
        return Run(label, backend, seed, "missing", None, None, None, [], None, None)
    record = json.loads(record_path.read_text())
    folder = run_dir / record["version"] if record.get("version") else None
    tail = _stderr_tail(run_dir / "stderr.log")
    returncode, wall_s = record.get("returncode"), record.get("wall_s")
    if record.get("state") != "finished":
        return Run(label, backend, seed, "interrupted", None, None, folder, tail, None, None)
    if not finished_ok(run_dir):
        if returncode == 0:
            tail = [*tail, "(exit code 0 but no metrics.csv was written)"]
        return Run(label, backend, seed, "failed", returncode, wall_s, folder, tail, None, None)
    saved_config = folder / "config.yaml"
    if saved_config.exists():
        differences = config_differences(
            comparable_config(yaml.safe_load(saved_config.read_text())), settings["resolved_config"],
            str(saved_config), "settings.json",
        )
        if differences:
            raise CompareError(f"run {run_dir} was trained with a different config: {'; '.join(differences[:8])}")
    train, validation = _read_metrics(folder / "metrics.csv")
    return Run(label, backend, seed, "ok", returncode, wall_s, folder, tail, train, validation)


def load_comparison(out: str | Path) -> Comparison:
    """Reads a comparison folder (the CLI's --out). Raises CompareError if it isn't one."""
    out = Path(out).expanduser().resolve()
    if not out.is_dir():
        raise CompareError(
            f"comparison folder {out} does not exist (make one with `python train.py compare ... --out {out}`)"
        )
    if not (out / "settings.json").exists():
        contents = "is empty" if not any(out.iterdir()) else "has no settings.json"
        raise CompareError(f"{out} {contents}: it is not the --out folder of a backend comparison")
    settings = json.loads((out / "settings.json").read_text())
    settings["out"] = str(out)  # the folder may have moved since it was written
    runs = [
        _load_run(settings, label, backend, seed)
        for seed in settings["seeds"]
        for label, backend in settings["labels"].items()
    ]
    parity_path = out / "kernel_parity.json"
    errors = json.loads(parity_path.read_text()) if parity_path.exists() else None
    return Comparison(out, settings, runs, errors)


# ---------------------------------------------------------------------------------------------- report


def baseline_label(labels: list[str]) -> str:
    return "fa2" if "fa2" in labels else labels[0]


def loss_frames(comparison: Comparison) -> dict[str, pd.DataFrame]:
    """Per label: per-step train loss of its finished runs, index = step, one column per seed."""
    return {
        label: pd.DataFrame(
            {r.seed: r.train["loss"] for r in comparison.runs if r.label == label and r.status == "ok"}
        )
        for label in comparison.settings["labels"]
    }


def _final_frames(comparison: Comparison) -> dict[str, pd.DataFrame]:
    """Per label: the last validation of each finished run, index = seed, columns = metrics and its step."""
    columns = ["auc", "ne", "logloss", "calibration", "step"]
    frames = {}
    for label in comparison.settings["labels"]:
        rows = {
            r.seed: r.validation.reset_index().iloc[-1]
            for r in comparison.runs
            if r.label == label and r.status == "ok" and not r.validation.empty
        }
        frames[label] = pd.DataFrame(rows).T[columns].astype(float) if rows else pd.DataFrame(columns=columns)
    return frames


def _step_time(runs: list[Run], warmup: int) -> dict:
    timed = [r.train[r.train.index >= warmup] for r in runs]
    pooled = pd.concat(timed) if timed else pd.DataFrame()
    if pooled.empty:
        return {"median_ms": None, "p90_ms": None, "samples_per_s": None, "tokens_per_s": None, "timed_steps": 0,
                "median_ms_per_seed": {}}
    return {
        "median_ms": float(pooled["step_ms"].median()),
        "p90_ms": float(np.percentile(pooled["step_ms"], 90)),
        "samples_per_s": float(pooled["samples_per_s"].median()),
        "tokens_per_s": float(pooled["tokens_per_s"].median()),
        "timed_steps": int(len(pooled)),
        "median_ms_per_seed": {str(r.seed): float(t["step_ms"].median()) for r, t in zip(runs, timed) if not t.empty},
    }


def build_report(comparison: Comparison) -> dict:
    """compare.json's content, from a loaded comparison folder."""
    settings = comparison.settings
    labels = list(settings["labels"])
    baseline = baseline_label(labels)
    warmup = warmup_steps(settings["steps"])
    timing = {
        label: _step_time([r for r in comparison.runs if r.label == label and r.status == "ok"], warmup)
        for label in labels
    }
    base_ms = timing[baseline]["median_ms"]
    finals = _final_frames(comparison)
    problems = [
        f"{r.label} seed {r.seed}: " + {
            "failed": f"failed with exit code {r.returncode}", "interrupted": "interrupted before it finished",
            "missing": "never ran",
        }[r.status]
        for r in comparison.runs
        if r.status != "ok"
    ]
    final_metrics = {}
    for label, frame in finals.items():
        final_metrics[label] = {
            metric: {
                "mean": float(frame[metric].mean()) if len(frame) else None,
                "std": float(frame[metric].std(ddof=1)) if len(frame) >= 2 else None,
                "per_seed": {str(seed): float(value) for seed, value in frame[metric].items()},
            }
            for metric in ("auc", "ne", "logloss", "calibration")
        }
        final_metrics[label]["at_step"] = {str(seed): int(step) for seed, step in frame["step"].items()}
    return {
        "command": settings["command"],
        "date": settings["date"],
        "device": settings["device"],
        "versions": settings["versions"],
        "config": {"files": settings["config_files"], "passthrough": settings["passthrough"],
                   "resolved": settings["resolved_config"]},
        "backends": settings["labels"],
        "seeds": settings["seeds"],
        "steps": settings["steps"],
        "warmup_steps": warmup,
        "step_time_rule": STEP_TIME_RULE,
        "step_time_ms": {label: timing[label]["median_ms"] for label in labels},
        "step_time_p90_ms": {label: timing[label]["p90_ms"] for label in labels},
        "samples_per_s": {label: timing[label]["samples_per_s"] for label in labels},
        "tokens_per_s": {label: timing[label]["tokens_per_s"] for label in labels},
        "timed_steps": {label: timing[label]["timed_steps"] for label in labels},
        "step_time_ms_per_seed": {label: timing[label]["median_ms_per_seed"] for label in labels},
        "speedup_baseline": baseline,
        "speedup_note": "" if baseline == "fa2" else f"fa2 is not in this comparison: speedups are relative to {baseline}",
        "speedup_vs_fa2": {
            label: (base_ms / timing[label]["median_ms"] if base_ms and timing[label]["median_ms"] else None)
            for label in labels
        },
        "final_metrics": final_metrics,
        "parity": parity_verdict(loss_frames(comparison), finals, baseline, warmup, problems),
        "kernel_errors": comparison.kernel_errors,
        "runs": [
            {
                "label": r.label, "backend": r.backend, "seed": r.seed, "status": r.status, "returncode": r.returncode,
                "wall_s": r.wall_s, "folder": str(r.folder.relative_to(comparison.out)) if r.folder else None,
                "stderr_tail": r.stderr_tail if r.status != "ok" else [],
            }
            for r in comparison.runs
        ],
    }


def runs_table(report: dict) -> pd.DataFrame:
    return pd.DataFrame(
        [{"backend": r["label"], "seed": r["seed"], "status": r["status"], "exit code": r["returncode"],
          "wall s": r["wall_s"], "folder": r["folder"]} for r in report["runs"]]
    )


def step_time_table(report: dict) -> pd.DataFrame:
    baseline = report["speedup_baseline"]
    return pd.DataFrame(
        [
            {"backend": label, "median ms": report["step_time_ms"][label], "p90 ms": report["step_time_p90_ms"][label],
             "samples/s": report["samples_per_s"][label], "tokens/s": report["tokens_per_s"][label],
             f"speedup vs {baseline}": report["speedup_vs_fa2"][label], "timed steps": report["timed_steps"][label]}
            for label in report["backends"]
        ]
    )


def _mean_std(entry: dict) -> str:
    if entry["mean"] is None:
        return "-"
    return f"{entry['mean']:.4f}" + (f" ± {entry['std']:.4f}" if entry["std"] is not None else "")


def final_metrics_table(report: dict) -> pd.DataFrame:
    rows = []
    for label, metrics in report["final_metrics"].items():
        row = {"backend": label}
        row.update({name: _mean_std(metrics[name]) for name in ("auc", "ne", "logloss", "calibration")})
        rows.append(row)
    return pd.DataFrame(rows)


def parity_table(report: dict) -> pd.DataFrame:
    rows = []
    for label, entry in report["parity"]["backends"].items():
        row = {
            "backend": label, "max loss gap": entry["max_loss_gap"], "at step": entry["at_step"],
            "seed band there": entry["band_at_step"], "tolerance there": entry["tolerance_at_step"],
            "worst gap / tolerance": entry["worst_gap_over_tolerance"],
            "steps outside": f"{entry['steps_outside']} of {entry['steps_checked']}",
        }
        for metric, result in entry["final"].items():
            row[f"Δ {metric} (tolerance)"] = (
                "missing" if result.get("missing") else f"{result['diff']:+.4f} ({result['tolerance']:.4f})"
            )
        row["pass"] = "yes" if entry["pass"] else "NO"
        rows.append(row)
    return pd.DataFrame(rows)


def kernel_table(report: dict) -> pd.DataFrame:
    errors = report["kernel_errors"]
    if not errors:
        return pd.DataFrame()
    rows = []
    for backend, result in errors["backends"].items():
        row = {"backend": backend, "dtype": errors["settings"]["dtype"]}
        if "error" in result:
            row["error"] = result["error"]
        else:
            for tensor, error in result.items():
                row[f"{tensor} max abs"] = error["max_abs"]
                row[f"{tensor} max rel"] = error["max_rel"]
            # A tensor returned in another dtype than its inputs is measured before any rounding to it.
            row["note"] = ", ".join(
                f"{tensor} returned as {error['dtype']}" for tensor, error in result.items()
                if error.get("dtype", row["dtype"]) != row["dtype"]
            )
        rows.append(row)
    return pd.DataFrame(rows)


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:.0f}"
        return f"{value:.2e}" if abs(value) < 1e-3 else f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "(none)"
    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in frame.astype(object).itertuples(index=False)]
    return "\n".join(lines)


def verdict_markdown(report: dict) -> str:
    parity = report["parity"]
    lines = [f"**Parity: {'PASS' if parity['pass'] else 'FAIL'}** against `{parity['baseline']}`."]
    lines += [f"- {problem}" for problem in parity["problems"]]
    for label, entry in parity["backends"].items():
        if not entry["loss_pass"]:
            lines.append(
                f"- {label}: the loss gap exceeds the tolerance at {entry['steps_outside']} of "
                f"{entry['steps_checked']} "
                f"steps, first at step {entry['first_step_outside']} (worst {entry['worst_gap_over_tolerance']:.2f}x)"
            )
        for metric, result in entry["final"].items():
            if not result["pass"]:
                what = (
                    "missing" if result.get("missing")
                    else f"differs by {result['diff']:+.4f} (tolerance {result['tolerance']:.4f})"
                )
                lines.append(f"- {label}: final {metric} {what}")
    if "note" in parity:
        lines.append(f"- note: {parity['note']}")
    lines += ["", f"Rule: {parity['rule']}"]
    return "\n".join(lines)


def settings_markdown(report: dict) -> str:
    config = report["config"]
    return "\n".join([
        f"- command: `{report['command']}`",
        f"- date (UTC): {report['date']}; device: {report['device']}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}",
        f"- config: {', '.join(config['files']) or 'configs/default.yaml'}"
        + (f" with `{shlex.join(config['passthrough'])}`" if config["passthrough"] else ""),
        f"- {report['steps']} steps; seeds {', '.join(map(str, report['seeds']))} set the model initialization "
        f"(seed_everything), while the data and its order come from data.seed = "
        f"{config['resolved'].get('data.seed')}, the same for every run; "
        f"warmup: the first {report['warmup_steps']} steps",
    ])


def failures_markdown(report: dict) -> str:
    """Each run that did not finish, with its exit code and the end of its stderr."""
    lines = []
    for run in report["runs"]:
        if run["status"] != "ok":
            lines += ["", f"{run['label']} seed {run['seed']}: {run['status']}"
                      + (f", exit code {run['returncode']}" if run["returncode"] is not None else "")]
            if run["stderr_tail"]:
                lines += ["```", *run["stderr_tail"], "```"]
    return "\n".join(lines[1:]) if lines else "Every run finished."


def render_markdown(report: dict) -> str:
    kernel = report["kernel_errors"]
    lines = [
        f"# Backend comparison: {' vs '.join(report['backends'])}",
        "",
        verdict_markdown(report),
        "",
        settings_markdown(report),
        "",
        "![loss curves](loss_curves.png)",
        "",
        "## Step time",
        "",
        f"Speedup = {report['speedup_baseline']}'s median step time / the backend's. {report['speedup_note']}"
        f"{'. ' if report['speedup_note'] else ''}Rule: {report['step_time_rule']}.",
        "",
        markdown_table(step_time_table(report)),
        "",
        "## Training parity",
        "",
        "Loss gap = smoothed mean loss minus the baseline's; tolerance = "
        f"{LOSS_BAND_FACTOR:g} x seed band + {LOSS_FLOOR:g} (see the rule above). "
        "Final metrics at the last validation:",
        "",
        markdown_table(parity_table(report)),
        "",
        markdown_table(final_metrics_table(report)),
        "",
        "## Kernel parity",
        "",
    ]
    if kernel:
        s = kernel["settings"]
        lines += [
            f"One ragged batch, lengths {s['lengths']}, {s['heads']} heads x head_dim {s['head_dim']}, {s['dtype']} on "
            f"{s['device']}, rotary as in the model; errors against {s['reference']}. max rel = max abs error / max "
            "|reference|. The `reference` row is the yardstick: fp32 math on the same inputs.",
            "",
            markdown_table(kernel_table(report)),
        ]
    else:
        lines.append("(kernel_parity.json is missing: the comparison stopped before measuring it)")
    lines += ["", "## Runs", "", markdown_table(runs_table(report)), "", failures_markdown(report)]
    return "\n".join(lines) + "\n"


def plot_loss_curves(comparison: Comparison, report: dict) -> Figure:
    """Top: each backend's smoothed mean loss with its min-max seed band. Bottom: each backend's gap
    to the baseline with the parity tolerance around zero."""
    figure = Figure(figsize=(10, 7.5), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    baseline, warmup = report["parity"]["baseline"], report["warmup_steps"]
    finished = {label: frame.dropna() for label, frame in loss_frames(comparison).items()}
    smoothed = {label: smooth(frame) for label, frame in finished.items() if not frame.empty}
    colors = dict(zip(report["backends"], [f"C{i}" for i in range(len(report["backends"]))]))
    visible = []
    for label, frame in smoothed.items():
        low, high = frame.min(axis=1), frame.max(axis=1)
        top.fill_between(frame.index, low, high, color=colors[label], alpha=0.25, linewidth=0)
        top.plot(frame.index, frame.mean(axis=1), color=colors[label], label=f"{label} ({frame.shape[1]} seeds)")
        visible += [low[frame.index >= warmup], high[frame.index >= warmup]]
        if label != baseline and baseline in smoothed:
            gap, _, tolerance = loss_gap(frame, smoothed[baseline])
            bottom.fill_between(gap.index, -tolerance, tolerance, color=colors[label], alpha=0.15, linewidth=0)
            bottom.plot(gap.index, gap, color=colors[label], label=f"{label} - {baseline}")
    if visible and not pd.concat(visible).empty:
        low, high = pd.concat(visible).min(), pd.concat(visible).max()
        margin = 0.1 * (high - low) or 0.01
        top.set_ylim(low - margin, high + margin)  # the first steps' loss would flatten the rest
    for axis in (top, bottom):
        axis.axvspan(0, warmup, color="0.85", alpha=0.5, linewidth=0)
        axis.grid(alpha=0.3)
    top.set_ylabel("train loss (smoothed)")
    top.set_title(
        f"{' vs '.join(report['backends'])}: mean and min-max over seeds; grey = warmup, not judged "
        f"({'PASS' if report['parity']['pass'] else 'FAIL'})"
    )
    if top.lines:
        top.legend(loc="upper right")
    bottom.axhline(0, color="black", linewidth=0.8)
    bottom.set_ylabel(f"mean loss - {baseline} mean\n(shaded: tolerance)")
    bottom.set_xlabel("step")
    if bottom.lines[1:]:
        bottom.legend(loc="upper right")
    return figure


def write_report(out: str | Path) -> dict:
    """Loads the folder and (re)writes compare.json, compare.md and loss_curves.png in it."""
    comparison = load_comparison(out)
    report = build_report(comparison)
    (comparison.out / "compare.json").write_text(json.dumps(report, indent=1) + "\n")
    (comparison.out / "compare.md").write_text(render_markdown(report))
    plot_loss_curves(comparison, report).savefig(comparison.out / "loss_curves.png", dpi=110)
    return report


# ------------------------------------------------------------------------------------------------- cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from_train_py = Path(sys.argv[0]).name == "train.py"
    prog = "python train.py compare" if from_train_py else "python -m benchmarks.compare_backends"
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
