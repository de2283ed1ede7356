"""benchmarks/quality.py's tuning: every model gets the same grid, the choice reads validation only, the
chosen setting trains for the seeds asked, and the report carries the grid and the choices."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from benchmarks.compare.report import Run
from benchmarks.quality import (
    GRID, best_metric, grid_points, main as quality_main, optimizer_pair, point_label, select, trial_score,
)
from tests.test_train import read_metrics

REPO = Path(__file__).resolve().parents[1]
MODELS = ["block_attention", "lr"]
TINY_GRID = ["--grid", "model.optim.lr=0.002,0.05"]


def run_tune(out: Path, cache: Path, seeds: int, protocol: str = "recbole_ml1m_context", steps: int = 12,
             val_check_interval: int = 5, more: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    # The tiny ML-1M fixture: about 10 validation and 10 test rows under RecBole's protocol, 14 and 14
    # under the time split.
    args = ["tune", "--protocol", protocol, "--attn", "reference", "--models", *MODELS, *TINY_GRID,
            "--steps", str(steps), "--seeds", str(seeds), "--out", str(out), f"--data.data_dir={cache}",
            "--data.batch_size=16", f"--trainer.val_check_interval={val_check_interval}", "--model.net.d_model=32", *more]
    return subprocess.run([sys.executable, "-m", "benchmarks.quality", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def validation_choice(trial_runs: list[Path]) -> int:
    """Independently of the tool: the trial whose tested validation (the run's checkpoint.best_metric: its
    lowest val/ne or highest val/auc) has the highest AUC."""
    scores = []
    for run in trial_runs:
        metric = yaml.safe_load((run / "config.yaml").read_text())["checkpoint"]["best_metric"]
        rows = [row for row in read_metrics(run) if row.get("val/ne")]
        # The first of equals, as the checkpointer keeps.
        best = (min(rows, key=lambda row: float(row["val/ne"])) if metric == "ne"
                else max(rows, key=lambda row: float(row["val/auc"])))
        scores.append(float(best["val/auc"]))
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def trial_folders(out: Path, model: str, groups: tuple[str, ...] = ("reference", "lr0.05"), stage: str = "trials"
                  ) -> list[Path]:
    """The model's trial runs in grid order (the first group is named after the backend)."""
    runs = [out / stage / model / "runs" / f"{group}-seed0" for group in groups]
    return [run / json.loads((run / "run.json").read_text())["version"] for run in runs]


# block_attention's size candidates: the tuning chooses among them before its grid.
SIZES = [{"model.net.num_layers": 1}, {"model.net.num_layers": 2, "model.net.num_heads": 2}]
SIZE_ARGS = tuple(arg for size in SIZES for arg in ("--size", ",".join(f"{key}={value}" for key, value in size.items())))


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> tuple[Path, Path]:
    """One tuning with a size stage, shared by the tests that read it (each tuning trains ~10 runs)."""
    root = tmp_path_factory.mktemp("tune")
    shutil.copytree(REPO / "tests" / "fixtures" / "ml-1m-tiny", root / "cache" / "raw" / "ml-1m")
    result = run_tune(root / "out", root / "cache", seeds=2, more=SIZE_ARGS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root / "out", root / "cache"


def chosen_size(out: Path) -> dict:
    """Independently of the tool: the size candidate whose validation scores highest."""
    # The comparison names its first group after the backend, the others after their settings.
    groups = ("reference", *(point_label(size) for size in SIZES[1:]))
    return SIZES[validation_choice(trial_folders(out, "block_attention", groups, stage="sizes"))]


def grid_folders(out: Path, model: str) -> list[Path]:
    """The model's grid trials; block_attention's are named after its chosen size too (the first group is
    named after the backend)."""
    if model != "block_attention":
        return trial_folders(out, model)
    return trial_folders(out, model, ("reference", point_label({**chosen_size(out), "model.optim.lr": 0.05})))


def test_every_model_gets_the_same_grid_and_the_choice_trains_for_every_seed(tuned, tmp_path):
    out, _ = tuned
    tuning = json.loads((out / "tuning.json").read_text())
    assert tuning["grid"] == {"model.optim.lr": [0.002, 0.05]} and tuning["trials_per_model"] == 2
    for model in MODELS:
        entry = tuning["models"][model]
        # block_attention's grid runs at its chosen size; the baseline's grid has no size keys.
        size = chosen_size(out) if model == "block_attention" else {}
        assert [trial["setting"] for trial in entry["trials"]] == [{**size, "model.optim.lr": lr} for lr in (0.002, 0.05)]
        chosen = validation_choice(grid_folders(out, model))
        assert entry["chosen"] == entry["trials"][chosen]["setting"]
        # Seed 0 of the final comparison is the chosen trial's run; seed 1 trained with its setting.
        trial_test = json.loads((grid_folders(out, model)[chosen] / "test.json").read_text())
        label = "reference" if model == "block_attention" else model
        finals = [out / "final" / "runs" / f"{label}-seed{seed}" for seed in (0, 1)]
        versions = [json.loads((run / "run.json").read_text())["version"] for run in finals]
        assert json.loads((finals[0] / versions[0] / "test.json").read_text()) == trial_test
        config = (finals[1] / versions[1] / "config.yaml").read_text()
        assert f"lr: {entry['chosen']['model.optim.lr']}" in config

    assert quality_main(["--protocol", f"recbole_ml1m_context={out}", "--out", str(tmp_path / "quality")]) == 0
    report = json.loads((tmp_path / "quality.json").read_text())["protocols"]["recbole_ml1m_context"]
    assert report["tuning"]["grid"] == tuning["grid"] and report["seeds"] == [0, 1]
    for model in MODELS:
        assert report["models"][model]["chosen"] == tuning["models"][model]["chosen"]
        assert report["models"][model]["test_auc"]["seeds"] == [0, 1]
    rendered = (tmp_path / "quality.md").read_text()
    assert "| chosen (validation AUC) |" in rendered
    # configs/movielens1m.yaml tests RecBole's way, and the report says so.
    assert {report["models"][model]["best_metric"] for model in MODELS} == {"auc"}
    assert "Tested checkpoint: each run's validation with the highest val/auc" in rendered


def test_the_choice_does_not_move_when_the_test_scores_say_otherwise(tuned, tmp_path):
    """Every trial's test.json rewritten so the validation's choice scores worst on test and every
    other trial best: a selection that read test scores would choose another trial."""
    out, cache = tuned
    copy = tmp_path / "out"
    for stage in ("sizes", "trials"):
        shutil.copytree(out / stage, copy / stage, ignore=shutil.ignore_patterns("*.ckpt"))
    before = json.loads((out / "tuning.json").read_text())
    for model in MODELS:
        chosen = validation_choice(grid_folders(copy, model))
        for index, folder in enumerate(grid_folders(copy, model)):
            test = json.loads((folder / "test.json").read_text())
            worst = index == chosen
            test.update({"test/auc": 0.0 if worst else 1.0, "test/logloss": 9.0 if worst else 0.01})
            (folder / "test.json").write_text(json.dumps(test))
    result = run_tune(copy, cache, seeds=1, more=SIZE_ARGS)  # the trials are reused: nothing trains again
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "training 0 runs" in result.stdout
    after = json.loads((copy / "tuning.json").read_text())
    for model in MODELS:
        assert after["models"][model]["chosen"] == before["models"][model]["chosen"]
        assert after["models"][model]["trials"] == before["models"][model]["trials"]


def test_block_attentions_size_is_chosen_first_and_its_grid_runs_at_that_size(tuned, tmp_path):
    out, _ = tuned
    tuning = json.loads((out / "tuning.json").read_text())
    stage = tuning["size_stage"]
    assert stage["candidates"] == SIZES and [t["setting"] for t in stage["trials"]] == SIZES
    size = chosen_size(out)
    assert stage["chosen"] == size
    # Its grid ran at the chosen size (the settings: the first test), and so did its final runs.
    final = out / "final" / "runs" / "reference-seed1"
    config = (final / json.loads((final / "run.json").read_text())["version"] / "config.yaml").read_text()
    assert f"num_layers: {size['model.net.num_layers']}" in config
    assert quality_main(["--protocol", f"recbole_ml1m_context={out}", "--out", str(tmp_path / "quality")]) == 0
    assert "block_attention's size was chosen the same way among 2 candidates" in (tmp_path / "quality.md").read_text()


def test_the_time_split_tunes_with_and_without_history_and_the_report_gives_the_difference(tmp_path, capsys):
    """Both time-split protocols through `tune` on the fixture (4 steps, one seed): each run trained on
    its own data (history or none), was tested on the time split's test part, and the report pairs
    each model's test scores with history against those without."""
    shutil.copytree(REPO / "tests" / "fixtures" / "ml-1m-tiny", tmp_path / "cache" / "raw" / "ml-1m")
    outs = {protocol: tmp_path / protocol for protocol in ("time_split_history", "time_split_no_history")}
    for protocol, out in outs.items():
        result = run_tune(out, tmp_path / "cache", seeds=1, protocol=protocol, steps=4, val_check_interval=2)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        for model in MODELS:
            chosen = Path(json.loads((out / "tuning.json").read_text())["models"][model]["chosen_run"])
            config = (chosen / json.loads((chosen / "run.json").read_text())["version"] / "config.yaml").read_text()
            assert "protocol: time_split_history" in config
            assert f"max_history_len: {256 if protocol == 'time_split_history' else 0}" in config

    assert quality_main([*(f"--protocol={name}={out}" for name, out in outs.items()), "--out",
                         str(tmp_path / "quality")]) == 0  # fmt: skip
    report = json.loads((tmp_path / "quality.json").read_text())
    protocols = report["protocols"]
    for model in MODELS:
        gain = report["history_gain"][model]
        for metric in ("test_auc", "test_logloss"):
            with_history, without = (protocols[name]["models"][model][metric]["per_seed"][0] for name in outs)
            assert gain[metric]["per_seed"] == [with_history - without] and gain[metric]["seeds"] == [0]
        # Each side's optimizer point is the one that protocol's tuning chose for the model.
        chosen = [json.loads((out / "tuning.json").read_text())["models"][model]["chosen"] for out in outs.values()]
        assert [side["model.optim.lr"] for side in gain["optimizer"]] == [c["model.optim.lr"] for c in chosen]
    assert "## What the history tokens add: time_split_history minus time_split_no_history" in (
        tmp_path / "quality.md").read_text()

    # A report regenerated with one protocol taken from the earlier report's JSON keeps its entry as it was.
    earlier = tmp_path / "quality.json"
    assert quality_main(["--protocol", f"time_split_history={earlier}", "--protocol",
                         f"time_split_no_history={outs['time_split_no_history']}", "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["protocols"] == protocols and again["history_gain"] == report["history_gain"]
    assert quality_main(["--protocol", f"recbole_ml1m_context={earlier}", "--out", str(tmp_path / "bad")]) == 2
    assert "holds no runs of protocol 'recbole_ml1m_context'" in capsys.readouterr().err


def test_the_history_gain_row_names_both_optimizer_points_when_they_differ():
    same = {"model.optim.lr": 0.005, "model.optim.weight_decay": 0.01}
    assert optimizer_pair(same, dict(same)) == "lr 0.005, weight_decay 0.01"
    assert optimizer_pair(same, {**same, "model.optim.weight_decay": 0.1}) == (
        "differs: lr 0.005, weight_decay 0.01 with history, lr 0.005, weight_decay 0.1 without")
    assert optimizer_pair(same, None) == "differs: lr 0.005, weight_decay 0.01 with history, not recorded without"


def test_a_tie_goes_to_the_earlier_point_and_a_failed_trial_is_skipped():
    trials = [{"model": "m", "score": None}, {"model": "m", "score": {"val_auc": 0.7}},
              {"model": "m", "score": {"val_auc": 0.7}}, {"model": "m", "score": {"val_auc": 0.6}}]
    assert select(trials) is trials[1]


def test_the_default_grid_gives_every_model_six_trials():
    assert len(grid_points(GRID)) == 6


@pytest.mark.parametrize("args, message", [
    (["--models", "lr", "dcnv2"], "give block_attention and at least one baseline"),
    (["--models", "block_attention"], "give block_attention and at least one baseline"),
    (["--grid", "model.optim.lr"], "--grid 'model.optim.lr': give KEY=V1,V2"),
    (["--grid", "model.optim.lr=0.01"], "one point; a tuning needs at least two"),
    (["--seeds", "0"], "must be >= 1"),
    (["--size", "model.net.num_layers=1"], "one candidate; give two or more"),
    (["--size", "model.net.num_layers", "--size", "model.net.num_layers=2"], "give KEY=VALUE items"),
])  # fmt: skip
def test_bad_tune_arguments_give_a_clear_error(args, message, tmp_path, capsys):
    argv = ["tune", "--protocol", "recbole_ml1m_context", "--attn", "reference", "--steps", "2",
            "--out", str(tmp_path / "out"), *args]
    try:
        code = quality_main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("metric, expected_step", [("ne", 9), ("auc", 19)])
def test_a_trial_is_scored_at_the_validation_its_best_metric_chose(metric, expected_step):
    """The lowest val/ne and the highest val/auc fall at different validations (the first of a tie wins,
    as train.py's BestCheckpoint keeps it); the score is the AUC of the one train.py tested."""
    validation = pd.DataFrame({"auc": [0.70, 0.72, 0.75, 0.75], "ne": [0.90, 0.85, 0.86, 0.85],
                               "logloss": [0.60, 0.55, 0.56, 0.55]}, index=[4, 9, 19, 24])
    run = Run(label="reference", backend="reference", seed=0, status="ok", returncode=0, wall_s=1.0, started=None,
              folder=None, stderr_tail=[], train=None, validation=validation)
    score = trial_score(run, metric)
    assert score["at_step"] == expected_step
    assert score["val_auc"] == validation.loc[expected_step, "auc"]
    settings = {"resolved_config": {"checkpoint.best_metric": metric}}
    assert best_metric(settings, "reference") == metric
    assert best_metric({"resolved_config": {}}, "reference") == "ne"  # runs made before the setting
