"""The comparison's report: loads an --out folder, applies the rules (verdict.py), and writes
compare.json, compare.md and loss_curves.png. notebooks/compare_backends.ipynb uses the same functions."""

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from matplotlib.figure import Figure

from benchmarks.compare.run import CompareError, comparable_config, config_differences, finished_ok, run_name
from benchmarks.compare.verdict import (
    LOSS_BAND_FACTOR, LOSS_FLOOR, STEP_TIME_RULE, loss_gap, parity_verdict, smooth, warmup_steps,
)

STDERR_TAIL_LINES = 20
METRIC_COLUMNS = {
    "loss": "train/loss", "step_ms": "train/step_ms", "samples_per_s": "train/samples_per_s",
    "tokens_per_s": "train/tokens_per_s", "auc": "val/auc", "ne": "val/ne", "logloss": "val/logloss",
    "calibration": "val/calibration",
}


@dataclass
class Run:
    label: str
    backend: str
    seed: int
    status: str  # ok | failed | interrupted | missing
    returncode: int | None
    wall_s: float | None
    started: str | None  # UTC; None for runs recorded before run.json kept it
    folder: Path | None  # train.py's version_N folder
    stderr_tail: list[str]
    train: pd.DataFrame | None  # per-step rows, index = step
    validation: pd.DataFrame | None  # one row per validation, index = step
    test: dict | None = None  # train.py's test.json: the held-out split, scored by the best validation's checkpoint


@dataclass
class Comparison:
    out: Path
    settings: dict
    runs: list[Run]
    kernel_parity: dict | None


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
    if "train/mfu" not in metrics.columns:  # StepMetrics logs MFU only against a known peak (not on a CPU)
        renamed["mfu"] = np.nan
    else:
        renamed = renamed.rename(columns={"train/mfu": "mfu"})
    train = renamed.loc[renamed["loss"].notna(), ["loss", "step_ms", "samples_per_s", "tokens_per_s", "mfu"]]
    validation = renamed.loc[renamed["auc"].notna(), ["auc", "ne", "logloss", "calibration"]]
    return train, validation


def _load_run(settings: dict, label: str, backend: str, seed: int) -> Run:
    run_dir = Path(settings["out"]) / "runs" / run_name(label, seed)
    record_path = run_dir / "run.json"
    if not record_path.exists():
        return Run(label, backend, seed, "missing", None, None, None, None, [], None, None)
    record = json.loads(record_path.read_text())
    folder = run_dir / record["version"] if record.get("version") else None
    tail = _stderr_tail(run_dir / "stderr.log")
    returncode, wall_s, started = record.get("returncode"), record.get("wall_s"), record.get("started")
    if record.get("state") != "finished":
        return Run(label, backend, seed, "interrupted", None, None, started, folder, tail, None, None)
    if not finished_ok(run_dir):
        if returncode == 0:
            tail = [*tail, "(exit code 0 but no metrics.csv was written)"]
        return Run(label, backend, seed, "failed", returncode, wall_s, started, folder, tail, None, None)
    saved_config = folder / "config.yaml"
    if saved_config.exists():
        expected = settings.get("variant_resolved", {}).get(label, settings["resolved_config"])
        differences = config_differences(
            comparable_config(yaml.safe_load(saved_config.read_text())), expected, str(saved_config), "settings.json",
        )
        if differences:
            raise CompareError(f"run {run_dir} was trained with a different config: {'; '.join(differences[:8])}")
    train, validation = _read_metrics(folder / "metrics.csv")
    test = json.loads((folder / "test.json").read_text()) if (folder / "test.json").exists() else None
    return Run(label, backend, seed, "ok", returncode, wall_s, started, folder, tail, train, validation, test)


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
        return {"median_ms": None, "p10_ms": None, "p90_ms": None, "samples_per_s": None, "tokens_per_s": None,
                "mfu": None, "timed_steps": 0, "median_ms_per_seed": {}}
    mfu = pooled["mfu"].median() if "mfu" in pooled else math.nan
    return {
        "median_ms": float(pooled["step_ms"].median()),
        "p10_ms": float(np.percentile(pooled["step_ms"], 10)),
        "p90_ms": float(np.percentile(pooled["step_ms"], 90)),
        "mfu": None if math.isnan(mfu) else float(mfu),  # the median step's, against train.py's peak
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
            metric: _seed_summary(frame[metric]) for metric in ("auc", "ne", "logloss", "calibration")
        }
        final_metrics[label]["at_step"] = {str(seed): int(step) for seed, step in frame["step"].items()}
    test_metrics = {}
    for label in labels:
        tests = {r.seed: r.test for r in comparison.runs if r.label == label and r.status == "ok" and r.test}
        if tests:
            test_metrics[label] = {
                metric: _seed_summary(pd.Series({seed: test[f"test/{metric}"] for seed, test in tests.items()}))
                for metric in ("auc", "logloss")
            }
    return {
        "command": settings["command"],
        "date": settings["date"],
        "device": settings["device"],
        "versions": settings["versions"],
        "config": {"files": settings["config_files"], "passthrough": settings["passthrough"],
                   "variants": settings.get("variant_configs", {}),
                   "resolved": settings["resolved_config"]},
        "backends": settings["labels"],
        "seeds": settings["seeds"],
        "steps": settings["steps"],
        "warmup_steps": warmup,
        "step_time_rule": STEP_TIME_RULE,
        "step_time_ms": {label: timing[label]["median_ms"] for label in labels},
        "step_time_p10_ms": {label: timing[label]["p10_ms"] for label in labels},
        "step_time_p90_ms": {label: timing[label]["p90_ms"] for label in labels},
        "mfu": {label: timing[label]["mfu"] for label in labels},
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
        # Only for data whose protocol holds out a test split (data.protocol=recbole_context).
        "test_metrics": test_metrics,
        "parity": architecture_aware(parity_verdict(loss_frames(comparison), finals, baseline, warmup, problems),
                                     settings, labels),
        "kernel_parity": comparison.kernel_parity,
        "runs": [
            {
                "label": r.label, "backend": r.backend, "seed": r.seed, "status": r.status, "returncode": r.returncode,
                "wall_s": r.wall_s, "started": r.started, "folder": str(r.folder.relative_to(comparison.out)) if r.folder else None,
                "stderr_tail": r.stderr_tail if r.status != "ok" else [],
            }
            for r in comparison.runs
        ],
    }


def _seed_summary(values: pd.Series) -> dict:
    """Mean, sample std (from two seeds) and the per-seed values of one metric, seeds as the index."""
    return {
        "mean": float(values.mean()) if len(values) else None,
        "std": float(values.std(ddof=1)) if len(values) >= 2 else None,
        "per_seed": {str(seed): float(value) for seed, value in values.items()},
    }


def runs_table(report: dict) -> pd.DataFrame:
    return pd.DataFrame(
        [{"backend": r["label"], "seed": r["seed"], "status": r["status"], "exit code": r["returncode"],
          "wall s": r["wall_s"], "started (UTC)": r.get("started") or "-", "folder": r["folder"]}
         for r in report["runs"]]
    )


def step_time_table(report: dict) -> pd.DataFrame:
    baseline = report["speedup_baseline"]
    return pd.DataFrame(
        [
            {"backend": label, "median ms": report["step_time_ms"][label], "p10 ms": report["step_time_p10_ms"][label],
             "p90 ms": report["step_time_p90_ms"][label], "MFU": report["mfu"][label],
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


def test_metrics_table(report: dict) -> pd.DataFrame:
    return pd.DataFrame([{"backend": label, "test AUC": _mean_std(metrics["auc"]),
                          "test log loss": _mean_std(metrics["logloss"]), "seeds": len(metrics["auc"]["per_seed"])}
                         for label, metrics in report.get("test_metrics", {}).items()])  # fmt: skip


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
    """One row per backend: kernels.testing.parity's max errors (the backend's / PyTorch's in the same
    dtype, both against fp64), gradient SNRs, and the verdict."""
    rows = []
    for backend, result in (report["kernel_parity"] or {}).items():
        row = {"backend": backend}
        if "error" in result:
            row["parity"] = f"crashed: {result['error']}"
        else:
            for tensor, numbers in result["outputs"].items():
                row[f"{tensor} err / torch err"] = f"{_cell(numbers['max_err'])} / {_cell(numbers['torch_max_err'])}"
            for tensor in ("dq", "dk", "dv"):
                row[f"{tensor} SNR dB"] = result["outputs"][tensor]["snr_db"]
            row["parity"] = "PASS" if result["ok"] else "FAIL: " + "; ".join(result["failures"])
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


def architecture_aware(parity: dict, settings: dict, labels: list[str]) -> dict:
    """Groups of different architectures (model.arch) are not expected to train alike: no parity
    verdict for them, and the comparison passes when every run finished."""
    resolved = {label: settings.get("variant_resolved", {}).get(label, settings["resolved_config"]) for label in labels}
    architectures = {label: config.get("model.arch", "block_attention") for label, config in resolved.items()}
    if len(set(architectures.values())) < 2:
        return parity
    return {**parity, "judged": False, "pass": not parity["problems"], "architectures": architectures}


def parity_word(parity: dict) -> str:
    if parity.get("judged") is False:
        return "not judged"
    return "PASS" if parity["pass"] else "FAIL"


def verdict_markdown(report: dict) -> str:
    parity = report["parity"]
    if parity.get("judged") is False:
        archs = ", ".join(f"{label}: {arch}" for label, arch in parity["architectures"].items())
        lines = [f"**Parity: not judged**: the groups are different architectures ({archs}), so their losses "
                 "are not expected to match; compare them by the metrics below."]
        lines += [f"- {problem}" for problem in parity["problems"]]
        return "\n".join(lines)
    lines = [f"**Parity: {parity_word(parity)}** against `{parity['baseline']}`."]
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
        *(f"- variant {label}: {report['backends'][label]} with {', '.join(files)} applied over that config"
          for label, files in config.get("variants", {}).items()),
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
    kernel = report["kernel_parity"]
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
    ]
    if report.get("test_metrics"):
        lines += [
            "## Test split",
            "",
            "The held-out test part of the data's protocol, scored once per run by the checkpoint with the best "
            "validation (train.py's checkpoint.best_metric: the lowest val/ne unless the runs set auc); mean ± "
            "sample std over seeds:",
            "",
            markdown_table(test_metrics_table(report)),
            "",
        ]
    lines += [
        "## Kernel parity",
        "",
    ]
    if kernel:
        case = next((result["case"] for result in kernel.values() if "case" in result), {})
        lines += [
            f"kernels.testing.parity on one ragged batch (lengths {case.get('lengths')}), {case.get('heads')} heads x "
            f"head_dim {case.get('head_dim')}, {case.get('dtype')} on {case.get('device')}, rotary as in the model: "
            "max abs error against fp64 on the same inputs, next to PyTorch's own in that dtype (the rule: at "
            "most 2x it), gradient SNR (at least 45 dB, or 3 dB under PyTorch's own where that is lower), "
            "bitwise repeatable.",
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
        f"({parity_word(report['parity'])})"
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
