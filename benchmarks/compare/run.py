"""Running a comparison: its settings (checked before anything trains), then one `python train.py`
subprocess per (backend, seed), resumable, and each backend's kernel parity on the model's shapes."""

import argparse
import datetime
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

import kernels
from benchmarks.harness import device_name, versions
from kernels.testing import parity
from models.baselines import BLOCK_ATTENTION
from training.precision import kernel_dtype

REPO = Path(__file__).resolve().parents[2]
COMPARABLE_BACKENDS = tuple(name for name in kernels.BACKENDS if name != "auto")
# Set per run by the comparison itself, so they can't be passed through and differ between runs.
PER_RUN_KEYS = ("attn", "model.net.attn_backend", "seed_everything", "run_name", "runs_dir", "ckpt_path", "dry_run")
RESERVED_ARGS = (*PER_RUN_KEYS, "trainer.max_steps", "config")
DESCRIPTION = "Train one config with several attention backends and judge speed and parity."


class CompareError(Exception):
    """Bad input: reported as one clear line and exit status 2."""


@dataclass
class Settings:
    """One comparison: saved as settings.json; the same resolved config and device are required to reuse --out."""

    out: Path
    config_files: list[str]
    passthrough: list[str]
    labels: dict[str, str]  # label -> backend; a backend named twice gets label <backend>_2
    variant_configs: dict[str, list[str]]  # label -> config files and KEY=VALUE its runs add (--variant)
    variant_resolved: dict[str, dict]  # label -> its comparable resolved config, when a variant
    seeds: list[int]
    steps: int
    device: str
    device_type: str
    kernel_dtype: str
    resolved_config: dict
    versions: dict
    date: str
    command: str
    jobs: int = 1  # runs trained at a time; not part of what a resumed comparison must match

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
    """train.py's arguments for one run (config_files: the comparison's, then the label's variant
    files and KEY=VALUE overrides, which follow the passthrough keys so the variant's win); the
    comparison's own keys come last so they win."""
    overrides = [f"--{item}" for item in config_files if "=" in item]
    args = [arg for path in config_files if "=" not in path for arg in ("--config", path)] + list(passthrough)
    args += overrides
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
    """A run's resolved config without the keys the comparison sets per run, flattened to dotted keys.
    Only the trained architecture's sizes count: a baseline never reads model.net, block attention
    never reads model.baseline (so one group's sizes, passed to every run, do not set the others apart)."""
    flat = _flatten(config)
    unused = "model.baseline." if flat.get("model.arch", BLOCK_ATTENTION) == BLOCK_ATTENTION else "model.net."
    return {k: v for k, v in flat.items() if k not in PER_RUN_KEYS and k != "config" and not k.startswith(unused)}


def config_differences(ours: dict, theirs: dict, ours_name: str, theirs_name: str) -> list[str]:
    """`key: value in ours_name, value in theirs_name` for each differing key of two comparable configs."""
    keys = sorted(set(ours) | set(theirs))
    missing = "(absent)"
    return [
        f"{key} = {ours.get(key, missing)!r} in {ours_name}, {theirs.get(key, missing)!r} in {theirs_name}"
        for key in keys
        if ours.get(key, missing) != theirs.get(key, missing)
    ]


# Several train.py command lines in one process, one after another through train.main, each with file
# descriptors 1 and 2 sent to files of its own (every writer shares them, as a process of its own would
# give them): one import of torch and Lightning for all of them, the ~8 s of every train.py start.
_MAINS_SCRIPT = """
import json, os, sys, traceback
import train
codes = []
for argv, stdout_path, stderr_path in json.loads(sys.argv[1]):
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        os.dup2(stdout.fileno(), 1); os.dup2(stderr.fileno(), 2)
        try:
            train.main(argv)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        os.close(saved[0]); os.close(saved[1])
    codes.append(code)
print(json.dumps(codes))
"""


def run_train_mains(argvs: list[list[str]], timeout: float | None = None) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of `python train.py ARGV` for each ARGV, all run in one process."""
    with tempfile.TemporaryDirectory() as folder:
        jobs = [(argv, f"{folder}/{i}.out", f"{folder}/{i}.err") for i, argv in enumerate(argvs)]
        result = subprocess.run([sys.executable, "-c", _MAINS_SCRIPT, json.dumps(jobs)], cwd=REPO,
                                capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"train.py's command lines did not run: {result.stderr.strip()[-3000:]}")
        codes = json.loads(result.stdout.strip().splitlines()[-1])
        return [(code, Path(out).read_text(), Path(err).read_text()) for code, (_, out, err) in zip(codes, jobs)]


def resolve_configs(groups: list[tuple[list[str], str]], passthrough: list[str], steps: int | None,
                    out: Path) -> list[dict]:
    """Each group's run config, for groups of (config files, backend), resolved and checked by train.py
    itself (`--dry_run`: it builds the model, data module and trainer, then prints the config): bad keys
    or values end here, before anything runs; the first group's error is the one reported."""
    argvs = [[*train_args(config_files, passthrough, backend, 0, steps, out, backend), "--dry_run=true"]
             for config_files, backend in groups]
    resolved = []
    for code, stdout, stderr in run_train_mains(argvs):
        if code != 0:
            lines = [line for line in stderr.splitlines() if line.strip()]
            reason = next((line for line in reversed(lines) if "error:" in line), lines[-1] if lines else "no output")
            raise CompareError(f"train.py rejects the config or extra arguments: {reason.strip()}")
        resolved.append(yaml.safe_load(stdout))
    return resolved


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
    # A variant group kept under its label must be the same group (one may be dropped or added).
    for label, resolved in settings.variant_resolved.items():
        if label in previous.get("variant_resolved", {}):
            if previous["labels"].get(label) != settings.labels[label]:
                differences.append(f"--variant {label}'s backend = {settings.labels[label]!r} here, "
                                   f"{previous['labels'].get(label)!r} in {saved}")
            differences += config_differences(resolved, previous["variant_resolved"][label],
                                              f"--variant {label} here", f"{saved}")
    if differences:
        shown = "; ".join(differences[:8]) + (f"; and {len(differences) - 8} more" if len(differences) > 8 else "")
        raise CompareError(
            f"--out {out} holds runs of a different comparison ({shown}). Use a new --out folder, or the same settings."
        )


def parse_compare_args(argv: list[str], prog: str) -> Settings:
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=DESCRIPTION, epilog=f"Any other --key=value argument is passed to every train.py run.\n"
        f"`{prog} report OUT` re-renders the report of an existing --out folder.",
    )
    parser.add_argument("--attn", nargs="+", required=True, choices=COMPARABLE_BACKENDS, metavar="BACKEND",
                        help=f"one or more of {', '.join(COMPARABLE_BACKENDS)} (two or more groups of runs with "
                        "--variant); naming one twice compares it with itself")
    parser.add_argument("--config", action="append", default=[], help="train.py config file(s), as for train.py")
    parser.add_argument(
        "--variant", action="append", nargs="+", default=[], metavar="LABEL BACKEND CONFIG",
        help="one more group of runs, named LABEL: BACKEND with these config files and/or KEY=VALUE train.py "
        "keys applied over --config's and the extra arguments (e.g. `--variant tlx_sharded tlx configs/sharded.yaml`, "
        "`--variant tlx_unfused tlx model.net.fused_mlp=false`), judged like a backend; repeatable",
    )
    parser.add_argument("--steps", type=int, help="training steps per run (default: the config's trainer.max_steps)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 for every backend (default 3)")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs trained at a time (default 1); runs sharing a device slow each other, so only "
                        "their losses and scores compare, not their step times")
    args, passthrough = parser.parse_known_args(argv)
    if len(args.attn) + len(args.variant) < 2:
        parser.error("--attn and --variant need at least two groups of runs between them "
                     "(name one backend twice to compare it with itself)")
    if args.seeds < 1 or args.jobs < 1 or (args.steps is not None and args.steps < 1):
        parser.error(f"--seeds, --jobs and --steps must be >= 1, got --seeds {args.seeds} --jobs {args.jobs} "
                     f"--steps {args.steps}")
    if passthrough and not passthrough[0].startswith("--"):
        parser.error(f"unexpected argument {passthrough[0]!r}; extra arguments must be --key=value train.py keys")
    for arg in passthrough:
        key = arg[2:].split("=", 1)[0] if arg.startswith("--") else None
        if key in RESERVED_ARGS:
            parser.error(f"{arg}: the comparison sets --{key} itself; use --attn, --seeds, --steps, --config or --out")

    out = args.out.resolve()
    labels = labels_for(args.attn)
    variant_configs = {}
    for variant in args.variant:
        if len(variant) < 3:
            parser.error(f"--variant {' '.join(variant)}: give LABEL BACKEND CONFIG [CONFIG ...]")
        label, backend, files = variant[0], variant[1], variant[2:]
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", label) or label in labels:
            parser.error(f"--variant label {label!r} must be new (not {', '.join(labels)}) and of letters, digits, '_', '.', '-'")
        if backend not in COMPARABLE_BACKENDS:
            parser.error(f"--variant {label}: backend {backend!r} is not one of {', '.join(COMPARABLE_BACKENDS)}")
        reserved = [item for item in files if item.split("=", 1)[0].removeprefix("--") in RESERVED_ARGS]
        if reserved:
            parser.error(f"--variant {label}: {reserved[0]}: the comparison sets it itself")
        labels[label], variant_configs[label] = backend, files
    config, *variants = resolve_configs(
        [(args.config, args.attn[0]), *(([*args.config, *files], labels[label]) for label, files in variant_configs.items())],
        passthrough, args.steps, out)
    variant_resolved = {label: comparable_config(resolved) for label, resolved in zip(variant_configs, variants)}
    steps = args.steps if args.steps is not None else config["trainer"]["max_steps"]
    if steps is None or steps < 1:
        raise CompareError(f"the config sets no trainer.max_steps ({steps}); pass --steps")
    interval = config["trainer"].get("val_check_interval")
    if isinstance(interval, int) and interval > steps:  # a float is a fraction of an epoch: it validates
        raise CompareError(f"trainer.val_check_interval={interval} is more than a run's {steps} steps: no run would "
                           f"validate, and the verdict compares the last validation; pass "
                           f"--trainer.val_check_interval={steps} (or fewer)")
    device = training_device(config["trainer"]["accelerator"])
    for backend in dict.fromkeys(labels.values()):
        try:
            kernels.check_backend(backend, device)
        except kernels.BackendUnavailableError as error:
            raise CompareError(str(error)) from None
    return Settings(
        out=out, config_files=args.config, passthrough=passthrough, labels=labels, variant_configs=variant_configs,
        variant_resolved=variant_resolved, seeds=list(range(args.seeds)),
        steps=steps, device=device_name(device), device_type=device.type,
        kernel_dtype=str(kernel_dtype(config["trainer"]["precision"])).removeprefix("torch."),
        resolved_config=comparable_config(config),
        versions=versions(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=f"{prog} {shlex.join(argv)}", jobs=args.jobs,
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
    # The start time tells apart the runs of a comparison resumed in a later session (another machine).
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = {**record, "command": shlex.join(command), "started": started, "state": "running", "returncode": None,
              "version": None}
    (run_dir / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    start = time.perf_counter()
    with open(run_dir / "stdout.log", "w") as stdout, open(run_dir / "stderr.log", "w") as stderr:
        returncode = subprocess.run(command, stdout=stdout, stderr=stderr).returncode
    created = sorted(_version_folders(run_dir) - before, key=lambda name: int(name.split("_")[1]))
    record.update(
        state="finished", returncode=returncode, wall_s=round(time.perf_counter() - start, 1),
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

    net = {key.removeprefix("model.net."): value for key, value in settings.resolved_config.items()
           if key.startswith("model.net.")}
    backends = list(dict.fromkeys(["reference", *settings.labels.values()]))  # reference: the yardstick row
    print(f"kernel parity on {settings.device} ({settings.kernel_dtype}): {', '.join(backends)}", flush=True)
    results = {}
    for backend in backends:
        try:
            result = parity(
                backend, heads=net["num_heads"], head_dim=net["d_model"] // net["num_heads"],
                dtype=getattr(torch, settings.kernel_dtype), device=settings.device_type,
                rotary=kernels.Rotary(base=net["rotary_base"], within_block=net["rotary_within_block"],
                                      rotate_v=net["rotate_v"]),
            )
        except ValueError as error:  # the inputs are valid by construction: the backend rejected them
            raise CompareError(f"this model config can't run: {error}") from None
        except Exception as error:  # a kernel crash is a finding to report, not a reason to stop
            results[backend] = {"error": f"{type(error).__name__}: {error}"}
            continue
        results[backend] = {"ok": result.ok, "failures": result.failures, "case": result.case,
                            "outputs": result.outputs}
    (out / "kernel_parity.json").write_text(json.dumps(results, indent=1, default=str) + "\n")

    train_runs([settings], settings.jobs)


def train_runs(comparisons: list[Settings], jobs: int) -> None:
    """Trains every (label, seed) run of these comparisons, seed-major (a comparison cut short still has
    every label at seed 0), `jobs` at a time; the first runs alone, since it prepares the data cache
    the others read. A finished run is reused, so a rerun resumes."""
    runs = [(settings, label, seed) for settings in comparisons for seed in settings.seeds for label in settings.labels]
    pending = []
    for number, (settings, label, seed) in enumerate(runs, start=1):
        run_dir = settings.out / "runs" / run_name(label, seed)
        prefix = f"[{number}/{len(runs)}] {run_dir.relative_to(settings.out.parent)}:"
        if finished_ok(run_dir):
            print(f"{prefix} reusing the finished run", flush=True)
        else:
            pending.append((prefix, run_dir, settings, label, seed))

    def train(job: tuple[str, Path, Settings, str, int]) -> None:
        prefix, run_dir, settings, label, seed = job
        print(f"{prefix} training (log: {run_dir}/stderr.log)", flush=True)
        backend = settings.labels[label]
        command = [
            sys.executable, str(REPO / "train.py"),
            *train_args([*settings.config_files, *settings.variant_configs.get(label, [])], settings.passthrough,
                        backend, seed, settings.steps, settings.out, label),
        ]
        record = launch_run(command, run_dir, {"label": label, "backend": backend, "seed": seed})
        outcome = "ok" if record["returncode"] == 0 else f"FAILED with exit code {record['returncode']}"
        print(f"{prefix} {outcome} in {record['wall_s']:.0f} s", flush=True)

    print(f"training {len(pending)} runs, {jobs} at a time", flush=True)
    for job in pending[:1]:
        train(job)
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(train, pending[1:]))
