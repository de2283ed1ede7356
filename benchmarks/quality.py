"""Model quality against published baselines: one table per data protocol, test AUC and log loss of
every architecture (mean, std and per seed), from comparison folders (`python train.py compare`,
one group per architecture), next to RecBole's published numbers on the same protocol.

    A=(--attn reference --variant lr reference configs/lr.yaml --variant dlrm reference configs/dlrm.yaml
       --variant dcnv2 reference configs/dcnv2.yaml --variant deepfm reference configs/deepfm.yaml --seeds 3)
    python train.py compare "${A[@]}" --config configs/movielens1m.yaml --steps 145 --out runs/quality_ml1m
    python train.py compare "${A[@]}" --config configs/movielens100k_recbole.yaml --steps 80 --out runs/quality_ml100k
    python -m benchmarks.quality --protocol recbole_ml1m_context=runs/quality_ml1m \
        --protocol recbole_ml100k_context=runs/quality_ml100k --not-run time_split_history=REASON \
        --notes benchmarks/results/quality_ml1m_notes.md --out benchmarks/results/quality_ml1m

writes <out>.json ({"protocols": {name: {"models": {arch: {"test_auc": {"mean", "std", "per_seed": [...],
"seeds": [...]}, "test_logloss": {...}}}, ...}}}) and <out>.md. Only what the folders hold is reported; a
protocol with no folder is kept with its models empty and the reason (`--not-run NAME=REASON`) it did not
run. `--notes FILE` appends a markdown file (how the runs were budgeted, what the gaps come from).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.compare.report import build_report, load_comparison
from benchmarks.compare.run import CompareError

# The protocols of issue 23 and what each means; the first two are RecBole's, the third ours.
PROTOCOLS = {
    "recbole_ml1m_context": "MovieLens-1M, RecBole's context-aware benchmark (configs/movielens1m.yaml)",
    "recbole_ml100k_context": "MovieLens-100K, RecBole's context-aware quick start (configs/movielens100k_recbole.yaml)",
    "time_split_history": "MovieLens-1M, our time split with the user's earlier items as history "
    "(configs/movielens1m.yaml with --data.protocol=time_split_history --data.max_history_len=256)",
}
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


def arch_of(settings: dict, label: str) -> str:
    """The architecture a comparison group trained (model.arch of its resolved config)."""
    resolved = settings.get("variant_resolved", {}).get(label) or settings["resolved_config"]
    return resolved.get("model.arch", "block_attention")


def protocol_entry(folder: Path) -> dict:
    comparison = load_comparison(folder)
    report = build_report(comparison)
    models = {}
    for label, metrics in report["test_metrics"].items():
        name = arch_of(comparison.settings, label)
        if name in models:
            raise CompareError(f"{folder}: two groups trained {name}; give each architecture one group")
        models[name] = {"test_auc": seed_list(metrics["auc"]), "test_logloss": seed_list(metrics["logloss"]),
                        "group": label}
    missing = [r for r in report["runs"] if r["status"] != "ok"]
    return {
        "models": models,
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


def build(folders: dict[str, Path], not_run: dict[str, str]) -> dict:
    protocols = {name: protocol_entry(folders[name]) if name in folders
                 else {"models": {}, "not_run": not_run.get(name, "no comparison folder was given")}
                 for name in PROTOCOLS}  # fmt: skip
    return {
        "protocols": protocols,
        "published": {
            protocol: {model: {"test_auc": auc, "test_logloss": logloss, "source": RECBOLE + path, "search": search}
                       for model, (auc, logloss, path, search) in models.items()}
            for protocol, models in PUBLISHED.items()
        },
    }


def _cell(entry: dict) -> str:
    if entry["std"] is None:
        return f"{entry['mean']:.4f}"
    return f"{entry['mean']:.4f} ± {entry['std']:.4f}"


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
             "test score comes from the checkpoint with the best validation (lowest val/ne); the test part "
             "chooses nothing. Regenerate with `python -m benchmarks.quality` (its docstring).", ""]
    for name, entry in result["protocols"].items():
        lines += [f"## {name}: {PROTOCOLS.get(name, name)}", ""]
        if "not_run" in entry:
            lines += [f"Not run: {entry['not_run']}", ""]
            continue
        published = result["published"].get(name, {})
        lines += [f"{len(entry['seeds'])} seeds x {entry['steps']} steps on {entry['device']}, {entry['date']}; "
                  f"torch {entry['versions'].get('torch')}. Command: `{entry['command']}`", "",
                  "| model | test AUC | test log loss | per seed AUC | RecBole test AUC (ours minus it) |",
                  "|---|---|---|---|---|"]
        for model, metrics in entry["models"].items():
            per_seed = ", ".join(f"{v:.4f}" for v in metrics["test_auc"]["per_seed"])
            lines.append(f"| {model} | {_cell(metrics['test_auc'])} | {_cell(metrics['test_logloss'])} | {per_seed} "
                         f"| {_anchor_cell(model, metrics, published)} |")
        if entry["runs_not_ok"]:
            lines += ["", "Runs that did not finish: " + "; ".join(entry["runs_not_ok"])]
        if published:
            lines += ["", "RecBole's published test results on this protocol (the best validation AUC of each search):",
                      "", "| model | test AUC | test log loss | search | source |", "|---|---|---|---|---|"]
            lines += [f"| {model} | {p['test_auc']:.4f} | {p['test_logloss']:.4f} | {p['search']} | {p['source']} |"
                      for model, p in published.items()]
        lines.append("")
    if notes:
        lines += [notes.strip(), ""]
    return "\n".join(lines)


def _named(items: list[str], option: str, what: str) -> dict[str, str]:
    """NAME=VALUE items of an option, NAME one of PROTOCOLS."""
    named = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in PROTOCOLS or not value:
            raise CompareError(f"{option} {item!r}: give NAME={what} with NAME one of {', '.join(PROTOCOLS)}")
        named[name] = value
    return named


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", action="append", default=[], metavar="NAME=FOLDER", required=True,
                        help=f"a comparison folder and the protocol its runs trained on ({', '.join(PROTOCOLS)})")
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
