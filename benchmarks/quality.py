"""Model quality against published baselines: a fair tuning of every architecture (`tune`), then one
table per data protocol of test AUC and log loss (mean, std and per seed), next to RecBole's published
numbers on the same protocol.

Tuning, per protocol (the recorded commands are in benchmarks/results/quality_ml1m.md):

    python -m benchmarks.quality tune --protocol recbole_ml1m_context --attn reference --steps 1160 --seeds 3 \
        --jobs 1 --out runs/tune_ml1m [--models block_attention lr ...] [--grid KEY=V1,V2 ...] \
        [--size KEY=V,KEY=V --size ...] [--key=value ...]

  0. With --size (two or more), block_attention's size is chosen first, by the rule of 2., among those
     candidates at its config's other settings (OUT/sizes/block_attention/, trained beside the baselines'
     trials): the baselines' sizes come from RecBole's own searches, ours has no published size. Those
     trials are counted and reported apart from the grid's.

  1. Every model gets the same grid (GRID below, or the --grid lines; one point = one trial), so every
     model has the same tuning budget. Each trial is one run (seed 0) of --steps steps: a comparison
     folder OUT/trials/<model>/ with one group per grid point.
  2. A trial's score is the validation AUC of the checkpoint that train.py tests (its validation with
     the lowest val/ne, or the highest val/auc with --checkpoint.best_metric=auc); the highest score
     wins, a tie goes to the earlier point. No test number is read.
  3. OUT/final/ is one comparison with one group per model at its chosen point, seeds 0..N-1; seed 0 is
     the chosen trial's run itself (copied, not trained again: same config and seed).
  4. OUT/tuning.json holds the grid, every trial's score and the chosen points.
  Other --key=value arguments go to every run (e.g. --data.data_dir=...). Runs go --jobs at a time (the
  first alone: it prepares the data cache the rest read); a rerun reuses the finished runs.

The report, from tune folders or plain comparison folders (`python train.py compare`, one group per
architecture):

    python -m benchmarks.quality --protocol recbole_ml1m_context=runs/tune_ml1m \
        --protocol recbole_ml100k_context=runs/quality_ml100k --protocol time_split_history=runs/tune_history \
        --not-run time_split_no_history=REASON \
        --notes benchmarks/results/quality_ml1m_notes.md --out benchmarks/results/quality_ml1m

A --protocol given as an earlier report's JSON (NAME=benchmarks/results/quality_ml1m.json) keeps that report's
entry for NAME as it is: the way to add one protocol's new runs when the others' folders are gone.

writes <out>.json ({"protocols": {name: {"models": {arch: {"test_auc": {"mean", "std", "per_seed": [...],
"seeds": [...]}, "test_logloss": {...}, "chosen": {...}}}, "tuning": {...}, ...}}}) and <out>.md. Only what
the folders hold is reported; a protocol with no folder is kept with its models empty and the reason
(`--not-run NAME=REASON`) it did not run. `--notes FILE` appends a markdown file (how the runs were
budgeted, what the gaps come from). With both time_split_history and time_split_no_history (the same
samples and split, without the history feature), the report adds what the history tokens add: each
model's test scores with history minus without, seed by seed (<out>.json's "history_gain").
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shutil
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.compare.report import Run, build_report, load_comparison
from benchmarks.compare.run import (
    COMPARABLE_BACKENDS, REPO, CompareError, Settings, check_out_folder, parse_compare_args, run_name, train_runs,
)
from models.baselines import ARCHS, BLOCK_ATTENTION
from training.callbacks import BEST_METRIC_MODE, best_validation


@dataclass(frozen=True)
class Protocol:
    """A data protocol: what it is, and the train.py config files and keys that select it."""

    description: str
    configs: tuple[str, ...]
    args: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.description} ({' '.join(self.configs)}{''.join(' ' + a for a in self.args)})"

    def data_differences(self, config: dict) -> list[str]:
        """How a run's flattened resolved config trained other data than this protocol's: another dataset or
        split, or history where the protocol has none (or none where it has)."""
        chosen = {}
        for path in self.configs:
            data = (yaml.safe_load((REPO / path).read_text()) or {}).get("data") or {}
            chosen.update({f"data.{key}": value for key, value in data.items()})
        chosen.update({key.removeprefix("--"): yaml.safe_load(value)
                       for key, _, value in (arg.partition("=") for arg in self.args)})
        differences = [f"{key} = {config.get(key)!r}, not {chosen[key]!r}" for key in ("data.dataset", "data.protocol")
                       if config.get(key) != chosen[key]]
        if "data.max_history_len" in chosen and (config.get("data.max_history_len", 0) > 0) != (
                chosen["data.max_history_len"] > 0):
            differences.append(f"data.max_history_len = {config.get('data.max_history_len')!r}, where this protocol "
                               f"{'has' if chosen['data.max_history_len'] > 0 else 'has no'} history")
        return differences


# The protocols of issue 23; the first two are RecBole's, the last two ours (the same time split and
# samples, with and without the history feature: their difference is what the history tokens add).
PROTOCOLS = {
    "recbole_ml1m_context": Protocol("MovieLens-1M, RecBole's context-aware benchmark", ("configs/movielens1m.yaml",)),
    "recbole_ml100k_context": Protocol("MovieLens-100K, RecBole's context-aware quick start",
                                       ("configs/movielens100k_recbole.yaml",)),
    "time_split_history": Protocol(
        "MovieLens-1M, our time split with the user's earlier items as history", ("configs/movielens1m.yaml",),
        ("--data.protocol=time_split_history", "--data.max_history_len=256"),
    ),
    "time_split_no_history": Protocol(
        "MovieLens-1M, our time split without the history feature", ("configs/movielens1m.yaml",),
        ("--data.protocol=time_split_history", "--data.max_history_len=0"),
    ),
}
HISTORY_ABLATION = ("time_split_history", "time_split_no_history")  # (with history, without it)
# The tuning grid, one for every model (RecBole's benchmark searched each model's own grid, 6 to 216
# points; here every model gets the same 6 trials): AdamW's peak learning rate, which spans our
# model's first, untuned 0.002 and the baselines' 0.005 from RecBole's searches, and one more above
# (the first H200 tuning chose it for three models: the grid's next revision should reach higher),
# x weight decay on the weight matrices (train.py's OptimConfig; not embeddings, norms or biases),
# the one regularizer every architecture here has (none has dropout).
GRID = {"model.optim.lr": (0.002, 0.005, 0.01), "model.optim.weight_decay": (0.01, 0.1)}
TRIAL_SEED = 0  # every trial runs this seed; it is also the final comparison's seed 0
SELECTION = ("the validation AUC of the checkpoint train.py tests (its checkpoint.best_metric's best validation: "
             "the lowest val/ne unless the runs set auc); "
             "the highest wins, ties go to the earlier grid point; no test number is read")
RECBOLE = "https://github.com/RUCAIBox/RecBole/blob/master/"
# RecBole's published test results, each the trial with the best validation AUC of its search.
PUBLISHED = {
    "recbole_ml1m_context": {
        "DCNV2": (0.8998, 0.3119, "benchmark/hyper/context/DCNV2-ml-1m_context.md", "216-trial grid, 20 trials run"),
        "DeepFM": (0.8997, 0.3150, "benchmark/hyper/context/DeepFM-ml-1m.md", "12-trial grid, 10 logged"),
        "AutoInt": (0.8987, 0.3174, "benchmark/hyper/context/AutoInt-ml-1m.md", "36-trial grid, 10 logged"),
        "LR": (0.8699, 0.3488, "benchmark/hyper/context/LR-ml-1m.md", "6 learning rates"),
    },
    "recbole_ml100k_context": {
        "LR": (0.7765, 0.562, "docs/source/get_started/started/context-aware.rst",
               "one run: embedding_size 10, RecBole's default learning rate 0.001"),
    },
}


# Our architecture names (model.arch) and RecBole's for the same model.
RECBOLE_NAME = {"dcnv2": "DCNV2", "deepfm": "DeepFM", "lr": "LR"}


def seed_list(summary: dict) -> dict:
    """A comparison's per-metric summary with its per-seed values as a list in seed order."""
    seeds = sorted(summary["per_seed"], key=int)
    return {"mean": summary["mean"], "std": summary["std"], "per_seed": [summary["per_seed"][s] for s in seeds],
            "seeds": [int(s) for s in seeds]}


def resolved_config(settings: dict, label: str) -> dict:
    """A comparison group's flattened resolved config (a variant's own, else the base one)."""
    return settings.get("variant_resolved", {}).get(label) or settings["resolved_config"]


def best_metric(settings: dict, label: str) -> str:
    """The validation metric that chose a comparison group's tested checkpoint (train.py's
    checkpoint.best_metric; "ne" for runs made before it was a setting)."""
    return resolved_config(settings, label).get("checkpoint.best_metric", "ne")


def arch_of(settings: dict, label: str) -> str:
    """The architecture a comparison group trained (model.arch of its resolved config)."""
    return resolved_config(settings, label).get("model.arch", BLOCK_ATTENTION)


# The optimizer point a run trained at, recorded per model so that a difference between two protocols'
# runs (the history's gain) says when it also changed the learning rate or weight decay.
OPTIMIZER_KEYS = ("model.optim.lr", "model.optim.weight_decay")


# ---------------------------------------------------------------------------------------------- tune


def grid_points(grid: dict[str, tuple]) -> list[dict]:
    """Every combination of the grid's values, the first key varying slowest."""
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def point_label(point: dict) -> str:
    """A comparison group label for a grid point, e.g. lr0.005_weight_decay0.1."""
    label = "_".join(f"{key.rsplit('.', 1)[-1]}{value}" for key, value in point.items())
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", label):
        raise CompareError(f"grid point {point} gives the label {label!r}: use values of letters, digits, '.', '-'")
    return label


def model_configs(model: str) -> list[str]:
    """The config files that select a model over a protocol's: a baseline's configs/<arch>.yaml."""
    return [] if model == BLOCK_ATTENTION else [f"configs/{model}.yaml"]


def comparison_argv(protocol: Protocol, attn: str, groups: dict[str, tuple[str, dict]], extra: list[str],
                    steps: int, seeds: int, out: Path) -> list[str]:
    """`train.py compare`'s arguments for groups {label: (model, grid point)}: the first group is the
    comparison's own (--attn; its model's configs and point are the shared ones), the others --variant
    groups whose KEY=VALUE items follow the shared keys, so each group's point wins. Across models the
    first must be block_attention: a baseline's config file would leak its sizes into the others'."""
    (base_model, base_point), *_ = groups.values()
    argv = ["--attn", attn]
    for path in [*protocol.configs, *model_configs(base_model)]:
        argv += ["--config", path]
    argv += [*protocol.args, *extra, *(f"--{key}={value}" for key, value in base_point.items())]
    for label, (model, point) in list(groups.items())[1:]:
        argv += ["--variant", label, attn, *model_configs(model), *(f"{key}={value}" for key, value in point.items())]
    return [*argv, "--steps", str(steps), "--seeds", str(seeds), "--out", str(out)]


def open_comparison(settings: Settings) -> None:
    """Refuses an --out folder that holds another comparison, else records settings.json in it."""
    check_out_folder(settings)
    settings.out.mkdir(parents=True, exist_ok=True)
    (settings.out / "settings.json").write_text(json.dumps(settings.to_json(), indent=1) + "\n")


def trial_score(run: Run, best_metric: str = "ne") -> dict | None:
    """A finished trial's validation at the checkpoint train.py tested (its checkpoint.best_metric's best:
    lowest val/ne or highest val/auc, the first on a tie, as its BestCheckpoint keeps); None if it failed
    or never validated."""
    if run.status != "ok" or run.validation is None or run.validation[best_metric].isna().all():
        return None
    metric = run.validation[best_metric]
    step = metric.idxmin() if BEST_METRIC_MODE[best_metric] == "min" else metric.idxmax()
    row = run.validation.loc[step]
    return {"val_auc": float(row["auc"]), "val_logloss": float(row["logloss"]), "at_step": int(step)}


def select(trials: list[dict]) -> dict:
    """The trial with the highest validation AUC; a tie goes to the earlier one."""
    scored = [trial for trial in trials if trial["score"] is not None]
    if not scored:
        raise CompareError(f"no trial of {trials[0]['model']} finished with a validation: nothing to choose")
    return max(scored, key=lambda trial: (trial["score"]["val_auc"], -trials.index(trial)))


def tune(protocol_name: str, attn: str, models: list[str], grid: dict[str, tuple], steps: int, seeds: int,
         jobs: int, extra: list[str], out: Path, sizes: list[dict] = ()) -> dict:
    """Runs the grid for every model, chooses by validation, writes out/tuning.json (the grid, every
    trial's score, the choices), then trains the choices for `seeds` seeds; returns tuning.json's content.
    With `sizes`, block_attention's size is chosen first among them (at its config's other settings,
    beside the baselines' trials), and its grid runs at that size."""
    protocol = PROTOCOLS[protocol_name]
    points = grid_points(grid)
    models = [BLOCK_ATTENTION, *(m for m in models if m != BLOCK_ATTENTION)]

    def trial_comparison(job: tuple[str, list[dict], Path]) -> Settings:
        model, candidates, folder = job
        groups = {point_label(point): (model, point) for point in candidates}
        return parse_compare_args(comparison_argv(protocol, attn, groups, extra, steps, 1, folder),
                                  "python train.py compare")

    def train_trials(jobs_: list[tuple[str, list[dict], Path]]) -> dict[str, tuple[Settings, list[dict]]]:
        with ThreadPoolExecutor(jobs) as pool:  # each resolves its configs with train.py --dry_run
            comparisons = list(pool.map(trial_comparison, jobs_))
        for settings in comparisons:
            open_comparison(settings)
        train_runs(comparisons, jobs)
        return {model: (settings, candidates) for (model, candidates, _), settings in zip(jobs_, comparisons)}

    def choose(model: str, settings: Settings, candidates: list[dict]) -> dict:
        comparison = load_comparison(settings.out)
        runs = {r.label: r for r in comparison.runs}
        # The comparison names its own group (the first candidate) after the backend.
        groups = [attn, *(point_label(point) for point in candidates[1:])]
        trials = [{"model": model, "setting": point, "group": group,
                   "score": trial_score(runs[group], best_metric(comparison.settings, group))}
                  for group, point in zip(groups, candidates)]
        chosen = select(trials)
        return {"chosen": chosen["setting"], "chosen_val_auc": chosen["score"]["val_auc"],
                "chosen_run": str(settings.out / "runs" / run_name(chosen["group"], TRIAL_SEED)),
                "trials": [{"setting": t["setting"], **(t["score"] or {"status": "failed or never validated"})}
                           for t in trials]}

    first = [(model, points, out / "trials" / model) for model in models if not (sizes and model == BLOCK_ATTENTION)]
    if sizes:
        first.insert(0, (BLOCK_ATTENTION, list(sizes), out / "sizes" / BLOCK_ATTENTION))
    trials = train_trials(first)
    result = {"protocol": protocol_name, "grid": {key: list(values) for key, values in grid.items()},
              "trials_per_model": len(points), "steps": steps, "seeds": seeds, "trial_seed": TRIAL_SEED,
              "selection": SELECTION, "models": {}}
    if sizes:
        size = choose(BLOCK_ATTENTION, *trials[BLOCK_ATTENTION])
        result["size_stage"] = {"model": BLOCK_ATTENTION, "candidates": list(sizes), **size}
        trials.update(train_trials([(BLOCK_ATTENTION, [{**size["chosen"], **point} for point in points],
                                     out / "trials" / BLOCK_ATTENTION)]))
    for model in models:
        result["models"][model] = choose(model, *trials[model])

    (out / "tuning.json").write_text(json.dumps(result, indent=1) + "\n")  # the choices, before the seeds train

    final_groups = {(attn if model == models[0] else model): (model, result["models"][model]["chosen"])
                    for model in models}
    final = parse_compare_args(comparison_argv(protocol, attn, final_groups, extra, steps, seeds, out / "final"),
                               "python train.py compare")
    open_comparison(final)
    for label, (model, _) in final_groups.items():  # seed 0 is the chosen trial: same config, same seed
        reused = final.out / "runs" / run_name(label, TRIAL_SEED)
        if not reused.exists():
            shutil.copytree(result["models"][model]["chosen_run"], reused, ignore=shutil.ignore_patterns("*.ckpt"))
    train_runs([final], jobs)
    return result


# --------------------------------------------------------------------------------------------- report


def protocol_entry(folder: Path, name: str) -> dict:
    """Protocol `name`'s models and how they ran, from a comparison folder or a tune folder (its final/
    comparison, with each model's chosen grid point and the tuning's grid and rule); refused when a group
    trained other data than the protocol's."""
    tuning_path = folder / "tuning.json"
    tuning = json.loads(tuning_path.read_text()) if tuning_path.exists() else None
    comparison = load_comparison(folder / "final" if tuning else folder)
    for label in comparison.settings["labels"]:
        if differences := PROTOCOLS[name].data_differences(resolved_config(comparison.settings, label)):
            raise CompareError(f"--protocol {name}={folder}: group {label!r} trained other data than {name}'s "
                               f"({'; '.join(differences)})")
    report = build_report(comparison)
    models = {}
    for label, metrics in report["test_metrics"].items():
        name = arch_of(comparison.settings, label)
        if name in models:
            raise CompareError(f"{folder}: two groups trained {name}; give each architecture one group")
        config = resolved_config(comparison.settings, label)
        models[name] = {"test_auc": seed_list(metrics["auc"]), "test_logloss": seed_list(metrics["logloss"]),
                        "group": label, "optimizer": {key: config.get(key) for key in OPTIMIZER_KEYS},
                        "best_metric": best_metric(comparison.settings, label)}
        if tuning:
            models[name].update({key: tuning["models"][name][key] for key in ("chosen", "chosen_val_auc", "trials")})
    if not models:
        raise CompareError(f"{folder}: no run has a test score (test.json): its data holds out no test part, "
                           "or every run failed")
    missing = [r for r in report["runs"] if r["status"] != "ok"]
    return {
        "models": models,
        **({"tuning": {key: tuning[key] for key in ("grid", "trials_per_model", "steps", "trial_seed", "selection",
                                                    "size_stage") if key in tuning}}
           if tuning else {}),
        "command": report["command"],
        "config": {"files": report["config"]["files"], "passthrough": report["config"]["passthrough"],
                   "variants": report["config"]["variants"]},
        "steps": report["steps"],
        "seeds": report["seeds"],
        "device": report["device"],
        "versions": report["versions"],
        "date": report["date"],
        "runs_not_ok": [f"{r['label']} seed {r['seed']}: {r['status']}" for r in missing],
    }


def paired_difference(first: dict, second: dict) -> dict:
    """first minus second, seed by seed over the seeds both ran (seed_list's form)."""
    seeds = [seed for seed in first["seeds"] if seed in second["seeds"]]
    differences = [first["per_seed"][first["seeds"].index(seed)] - second["per_seed"][second["seeds"].index(seed)]
                   for seed in seeds]  # fmt: skip
    return {"mean": statistics.mean(differences), "std": statistics.stdev(differences) if len(seeds) > 1 else None,
            "per_seed": differences, "seeds": seeds}


def history_gain(protocols: dict) -> dict:
    """Per model that ran both time-split protocols on a common seed: its test AUC and log loss with
    the history feature minus without it, and the optimizer point of each side (None where an earlier
    report did not record it), since the two protocols may have tuned a model to different points."""
    with_history, without = (protocols[name]["models"] for name in HISTORY_ABLATION)
    paired = [model for model in with_history if model in without
              and set(with_history[model]["test_auc"]["seeds"]) & set(without[model]["test_auc"]["seeds"])]
    return {model: {**{metric: paired_difference(with_history[model][metric], without[model][metric])
                       for metric in ("test_auc", "test_logloss")},
                    "optimizer": [with_history[model].get("optimizer"), without[model].get("optimizer")]}
            for model in paired}


def earlier_entry(report: Path, name: str) -> dict:
    """A protocol's entry as an earlier report (its OUT.json) holds it, so a report regenerated from new
    folders keeps the protocols whose run folders are on another machine."""
    try:
        entry = json.loads(report.read_text()).get("protocols", {}).get(name)
    except json.JSONDecodeError as error:
        raise CompareError(f"{report}: not a report's JSON ({error})") from None
    if not (entry or {}).get("models"):
        raise CompareError(f"{report} holds no runs of protocol {name!r}: give its run folder, or --not-run")
    return entry


def build(folders: dict[str, Path], not_run: dict[str, str]) -> dict:
    """folders: per protocol, a tune or comparison folder, or an earlier report's .json file."""
    protocols = {name: (earlier_entry(folders[name], name) if folders[name].suffix == ".json"
                        else protocol_entry(folders[name], name)) if name in folders
                 else {"models": {}, "not_run": not_run.get(name, "no comparison folder was given")}
                 for name in PROTOCOLS}  # fmt: skip
    return {
        "protocols": protocols,
        "history_gain": history_gain(protocols),
        "published": {
            protocol: {model: {"test_auc": auc, "test_logloss": logloss, "source": RECBOLE + path, "search": search}
                       for model, (auc, logloss, path, search) in models.items()}
            for protocol, models in PUBLISHED.items()
        },
    }


def _cell(entry: dict, sign: str = "") -> str:
    """mean ± std (the mean alone for one seed); sign "+" writes the mean's sign (a difference)."""
    return f"{entry['mean']:{sign}.4f}" + ("" if entry["std"] is None else f" ± {entry['std']:.4f}")


def _setting(point: dict) -> str:
    return ", ".join(f"{key.rsplit('.', 1)[-1]} {value}" for key, value in point.items())


def _anchor_cell(model: str, metrics: dict, published: dict) -> str:
    """RecBole's test AUC for the same model, and ours minus it."""
    anchor = published.get(RECBOLE_NAME.get(model, ""))
    if anchor is None:
        return "-"
    return f"{anchor['test_auc']:.4f} ({metrics['test_auc']['mean'] - anchor['test_auc']:+.4f})"


def render(result: dict, notes: str = "") -> str:
    lines = ["# Model quality: test AUC and log loss against published baselines", "",
             "Mean ± sample std over seeds (seed_everything: the model's initialization; the split and the batch "
             "order are fixed by data.seed). Each run's "
             "test score comes from the checkpoint with the best validation (train.py's checkpoint.best_metric: the "
             "lowest val/ne unless a protocol's runs set auc); where a protocol was "
             "tuned, each model's grid point was chosen by validation AUC. The test part chooses nothing. "
             "Regenerate with `python -m benchmarks.quality` (its docstring).", ""]
    for name, entry in result["protocols"].items():
        lines += [f"## {name}: {PROTOCOLS.get(name, name)}", ""]
        if "not_run" in entry:
            lines += [f"Not run: {entry['not_run']}", ""]
            continue
        published = result["published"].get(name, {})
        tuning = entry.get("tuning")
        lines += [f"{len(entry['seeds'])} seeds x {entry['steps']} steps on {entry['device']}, {entry['date']}; "
                  f"torch {entry['versions'].get('torch')}. Command: `{entry['command']}`", ""]
        # Entries from before checkpoint.best_metric existed record none: they all tested the lowest val/ne.
        tested = sorted({metrics.get("best_metric", "ne") for metrics in entry["models"].values()})
        lines += ["Tested checkpoint: each run's validation with the " + " or the ".join(map(best_validation, tested))
                  + f" (checkpoint.best_metric={'/'.join(tested)}).", ""]
        if tuning:
            grid = " x ".join(f"{key} in {values}" for key, values in tuning["grid"].items())
            lines += [f"Tuned alike: {tuning['trials_per_model']} trials per model ({grid}), each "
                      f"{tuning['steps']} steps at seed {tuning['trial_seed']}; chosen by {tuning['selection']}. "
                      f"Seed {tuning['trial_seed']} below is the chosen trial's run.", ""]
            if "size_stage" in tuning:
                stage = tuning["size_stage"]
                sizes = "; ".join(f"{_setting(t['setting'])}: " + (f"{t['val_auc']:.4f}" if "val_auc" in t else t["status"])
                                  for t in stage["trials"])
                lines += [f"Before its grid, {stage['model']}'s size was chosen the same way among "
                          f"{len(stage['candidates'])} candidates at its config's other settings ({len(stage['candidates'])} "
                          f"more trials; validation AUC: {sizes}).", ""]
        chosen_column = ("| chosen (validation AUC) ", "|---") if tuning else ("", "")
        lines += [f"| model | test AUC | test log loss | per seed AUC {chosen_column[0]}| RecBole test AUC (ours minus it) |",
                  f"|---|---|---|---{chosen_column[1]}|---|"]
        for model, metrics in entry["models"].items():
            per_seed = ", ".join(f"{v:.4f}" for v in metrics["test_auc"]["per_seed"])
            chosen = ""
            if tuning:
                chosen = f"| {_setting(metrics['chosen'])} ({metrics['chosen_val_auc']:.4f}) "
            lines.append(f"| {model} | {_cell(metrics['test_auc'])} | {_cell(metrics['test_logloss'])} | {per_seed} "
                         f"{chosen}| {_anchor_cell(model, metrics, published)} |")
        if entry["runs_not_ok"]:
            lines += ["", "Runs that did not finish: " + "; ".join(entry["runs_not_ok"])]
        if published:
            lines += ["", "RecBole's published test results on this protocol (the best validation AUC of each search):",
                      "", "| model | test AUC | test log loss | search | source |", "|---|---|---|---|---|"]
            lines += [f"| {model} | {p['test_auc']:.4f} | {p['test_logloss']:.4f} | {p['search']} | {p['source']} |"
                      for model, p in published.items()]
        lines.append("")
    if result["history_gain"]:
        with_history, without = HISTORY_ABLATION
        lines += [f"## What the history tokens add: {with_history} minus {without}", "",
                  "The same samples and split with and without the history feature; each model's test scores "
                  "with it minus without it, seed by seed (mean ± sample std of the differences).", "",
                  "| model | test AUC difference | test log loss difference | per seed AUC difference | optimizer |",
                  "|---|---|---|---|---|"]
        for model, gain in result["history_gain"].items():
            auc = gain["test_auc"]
            per_seed = ", ".join(f"{value:+.4f} (seed {seed})" for value, seed in zip(auc["per_seed"], auc["seeds"]))
            lines.append(f"| {model} | {_cell(auc, '+')} | {_cell(gain['test_logloss'], '+')} | {per_seed} "
                         f"| {optimizer_pair(*gain['optimizer'])} |")
        lines.append("")
    if notes:
        lines += [notes.strip(), ""]
    return "\n".join(lines)


def optimizer_pair(with_history: dict | None, without: dict | None) -> str:
    """Both sides' optimizer point: once where they agree, both where they differ, so a row whose
    difference also moved the learning rate or weight decay says so."""
    def point(optimizer):
        return "not recorded" if optimizer is None else _setting(optimizer)
    if with_history == without and with_history is not None:
        return point(with_history)
    return f"differs: {point(with_history)} with history, {point(without)} without"


def _named(items: list[str], option: str, what: str) -> dict[str, str]:
    """NAME=VALUE items of an option, NAME one of PROTOCOLS."""
    named = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in PROTOCOLS or not value:
            raise CompareError(f"{option} {item!r}: give NAME={what} with NAME one of {', '.join(PROTOCOLS)}")
        named[name] = value
    return named


def parse_grid(lines: list[str]) -> dict[str, tuple]:
    """--grid KEY=V1,V2 lines (values read as YAML scalars) as a grid of two or more points; GRID when
    there are none."""
    grid = {}
    for line in lines:
        key, _, values = line.partition("=")
        if not key or not values or key in grid:
            raise CompareError(f"--grid {line!r}: give KEY=V1,V2,... once per train.py key")
        grid[key.removeprefix("--")] = tuple(yaml.safe_load(value) for value in values.split(","))
    if grid and len(grid_points(grid)) < 2:
        raise CompareError(f"--grid {' '.join(lines)}: one point; a tuning needs at least two")
    return grid or GRID


def parse_sizes(lines: list[str]) -> list[dict]:
    """--size KEY=V,KEY=V lines (values read as YAML scalars): none, or two or more candidates."""
    sizes = []
    for line in lines:
        items = [item.partition("=") for item in line.split(",")]
        if any(not key or not sep or not value for key, sep, value in items):
            raise CompareError(f"--size {line!r}: give KEY=VALUE items separated by commas")
        sizes.append({key.removeprefix("--"): yaml.safe_load(value) for key, _, value in items})
    if len(sizes) == 1:
        raise CompareError(f"--size {lines[0]!r}: one candidate; give two or more, or none")
    return sizes


def tune_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality tune", allow_abbrev=False,
                                     description="Tune every model on the same grid, choose by validation AUC, "
                                     "then train the choices for several seeds (this module's docstring).")
    parser.add_argument("--protocol", required=True, choices=PROTOCOLS)
    parser.add_argument("--attn", required=True, choices=COMPARABLE_BACKENDS, help="block_attention's backend")
    parser.add_argument("--models", nargs="+", default=list(ARCHS), choices=ARCHS,
                        help=f"block_attention and one or more baselines (default: {' '.join(ARCHS)})")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                        help=f"a train.py key and its values, the same for every model (default: {GRID})")
    parser.add_argument("--size", action="append", default=[], metavar="KEY=V,KEY=V",
                        help=f"one candidate size of {BLOCK_ATTENTION} (e.g. model.net.d_model=128,model.net.num_heads=2); "
                        "given two or more, its size is chosen first among them, then its grid runs at that size")
    parser.add_argument("--steps", required=True, type=int, help="training steps of every run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 of each chosen setting (default 3)")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at the same time (default 1)")
    parser.add_argument("--out", required=True, type=Path)
    args, extra = parser.parse_known_args(argv)
    if BLOCK_ATTENTION not in args.models or len(set(args.models)) < 2 or len(set(args.models)) != len(args.models):
        parser.error(f"--models {' '.join(args.models)}: give {BLOCK_ATTENTION} and at least one baseline, each once")
    if min(args.steps, args.seeds, args.jobs) < 1:
        parser.error(f"--steps, --seeds and --jobs must be >= 1, got {args.steps}, {args.seeds}, {args.jobs}")
    try:
        tune(args.protocol, args.attn, args.models, parse_grid(args.grid), args.steps, args.seeds, args.jobs, extra,
             args.out.resolve(), parse_sizes(args.size))
        not_ok = [f"{r.label} seed {r.seed}: {r.status}" for r in load_comparison(args.out / "final").runs
                  if r.status != "ok"]
    except CompareError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out / 'tuning.json'}; report: python -m benchmarks.quality --protocol {args.protocol}={args.out} "
          "... --out OUT" + "".join(f"\nnot finished: {line}" for line in not_ok))
    return 1 if not_ok else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["tune"]:
        return tune_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.split("\n\n")[0],
                                     epilog="`python -m benchmarks.quality tune --help`: the tuning.")
    parser.add_argument("--protocol", action="append", default=[], metavar="NAME=FOLDER", required=True,
                        help=f"a tune or comparison folder and the protocol its runs trained on ({', '.join(PROTOCOLS)}), "
                             "or an earlier report's OUT.json, whose entry for that protocol is kept as it is")
    parser.add_argument("--not-run", action="append", default=[], metavar="NAME=REASON",
                        help="a protocol that was not run, and why")
    parser.add_argument("--notes", type=Path, help="a markdown file appended to OUT.md")
    parser.add_argument("--out", required=True, type=Path, help="writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    try:
        folders = {name: Path(folder) for name, folder in _named(args.protocol, "--protocol", "FOLDER").items()}
        not_run = _named(args.not_run, "--not-run", "REASON")
        notes = args.notes.read_text() if args.notes else ""
        result = {**build(folders, not_run), "notes": notes}
    except (CompareError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(result, notes))
    print(f"wrote {args.out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
