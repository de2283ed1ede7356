"""benchmarks/compare: a tiny CPU comparison end to end (the reference backend against itself), the
parity rule on synthetic curves, bad input, and the notebook."""

import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import numpy as np
import pandas as pd
import pytest
import yaml
from nbclient import NotebookClient

from benchmarks.compare import report as compare_report
from benchmarks.compare import run
from benchmarks.compare import verdict as compare_verdict
from benchmarks.compare.__main__ import main as compare_main
from benchmarks.compare.run import CompareError
from benchmarks.quality import main as quality_main

REPO = Path(__file__).resolve().parents[1]
STEPS = 24  # warmup_steps(24) = 12, so 12 timed steps per run and two validations at 12 and 24
TINY = ["--config", "configs/tiny.yaml", "--steps", str(STEPS), "--seeds", "2", "--trainer.val_check_interval=12"]


def call_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """Runs the CLI in-process: (exit status, stdout, stderr). argparse errors exit through SystemExit."""
    try:
        code = compare_main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, list[str]]:
    """One `reference reference` comparison, run as a user would; (its --out folder, its arguments)."""
    root = tmp_path_factory.mktemp("compare")
    args = ["--attn", "reference", "reference", *TINY, "--out", str(root / "out"), f"--data.data_dir={root / 'cache'}"]
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", *args], cwd=REPO, capture_output=True, text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Parity: PASS" in result.stdout
    return root / "out", args


@pytest.fixture
def tiny_copy(tiny, tmp_path) -> Path:
    copy = tmp_path / "out"
    shutil.copytree(tiny[0], copy, ignore=shutil.ignore_patterns("*.ckpt"))
    return copy


def test_identical_backends_write_every_file_and_pass(tiny):
    out, _ = tiny
    for name in ("compare.json", "compare.md", "loss_curves.png", "settings.json", "kernel_parity.json"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "compare.json").read_text())
    for key in ("step_time_ms", "speedup_vs_fa2", "parity", "kernel_parity", "config", "backends", "seeds", "steps",
                "device", "versions", "date", "command", "runs"):
        assert key in report, key
    assert report["backends"] == {"reference": "reference", "reference_2": "reference"}
    assert report["seeds"] == [0, 1] and report["steps"] == STEPS and report["warmup_steps"] == 12
    assert [(r["label"], r["seed"], r["status"]) for r in report["runs"]] == [
        ("reference", 0, "ok"), ("reference_2", 0, "ok"), ("reference", 1, "ok"), ("reference_2", 1, "ok")
    ]
    assert all(datetime.datetime.fromisoformat(r["started"]).tzinfo for r in report["runs"])  # UTC start times
    assert all(report["step_time_ms"][label] > 0 for label in report["backends"])
    assert report["timed_steps"] == {"reference": 24, "reference_2": 24}  # 12 steps after warmup x 2 seeds
    assert report["speedup_vs_fa2"]["reference"] == 1.0
    assert all(report["step_time_p10_ms"][label] <= report["step_time_ms"][label] for label in report["backends"])
    assert report["mfu"] == {"reference": None, "reference_2": None}  # no peak FLOP/s known on a CPU
    assert report["speedup_baseline"] == "reference" and "fa2 is not in this comparison" in report["speedup_note"]

    parity = report["parity"]
    assert parity["pass"] is True and isinstance(parity["rule"], str) and parity["problems"] == []
    # Same seed, same data order, deterministic CPU kernels: the two backends train identically.
    entry = parity["backends"]["reference_2"]
    assert entry["max_loss_gap"] == 0 and entry["steps_checked"] == STEPS - 12
    assert entry["band_at_step"] > 0  # the seeds differ, so the band is real noise
    assert all(result["diff"] == 0 for result in entry["final"].values())
    assert 0.3 < report["final_metrics"]["reference"]["auc"]["mean"] < 1

    reference = report["kernel_parity"]["reference"]  # kernels.testing.parity on the model's head shape
    assert reference["ok"] and reference["case"]["dtype"] == "torch.float32"
    assert reference["case"]["heads"] == 2 and reference["case"]["head_dim"] == 16
    assert all(0 < reference["outputs"][t]["max_err"] < 1e-5 for t in ("out", "dq", "dk", "dv"))

    markdown = (out / "compare.md").read_text()
    assert "**Parity: PASS**" in markdown and "| reference_2 |" in markdown and "loss_curves.png" in markdown
    assert "started (UTC)" in markdown


def test_rerun_reuses_finished_runs_and_report_rerenders(tiny, capsys):
    out, args = tiny
    (out / "compare.md").unlink()
    code, stdout, _ = call_main(args, capsys)
    assert code == 0
    assert stdout.count("reusing the finished run") == 4 and "training 0 runs" in stdout and "training (log" not in stdout
    assert (out / "compare.md").exists()
    (out / "loss_curves.png").unlink()
    assert call_main(["report", str(out)], capsys)[0] == 0
    assert (out / "loss_curves.png").exists()


def test_crashed_run_is_reported_and_the_others_are_kept(tiny_copy):
    run_dir = tiny_copy / "runs" / "reference_2-seed1"
    shutil.rmtree(run_dir)
    crash = "import sys; print('RuntimeError: the kernel exploded', file=sys.stderr); sys.exit(3)"
    identity = {"label": "reference_2", "backend": "reference", "seed": 1}
    record = run.launch_run([sys.executable, "-c", crash], run_dir, identity)
    assert record["returncode"] == 3 and record["version"] is None

    report = compare_report.write_report(tiny_copy)
    crashed = [r for r in report["runs"] if r["status"] != "ok"]
    assert [(r["label"], r["seed"], r["status"], r["returncode"]) for r in crashed] == [("reference_2", 1, "failed", 3)]
    assert crashed[0]["stderr_tail"] == ["RuntimeError: the kernel exploded"]
    assert report["parity"]["pass"] is False
    assert "reference_2 seed 1: failed with exit code 3" in report["parity"]["problems"]
    assert report["timed_steps"] == {"reference": 24, "reference_2": 12}  # seed 0 of reference_2 still counts
    markdown = (tiny_copy / "compare.md").read_text()
    assert "**Parity: FAIL**" in markdown and "exit code 3" in markdown and "the kernel exploded" in markdown


# ------------------------------------------------------------------------------------- parity rule


def synthetic_losses(rng: np.random.Generator, seeds: int = 3, steps: int = 300, shift: float = 0.0) -> pd.DataFrame:
    """Loss curves sharing one batch-noise sequence (same data order), each seed with its own slow drift."""
    step = np.arange(steps)
    base = 0.45 + 0.3 * np.exp(-step / 60) + 0.02 * np.random.default_rng(0).standard_normal(steps)
    curves = {}
    for seed in range(seeds):
        drift = np.cumsum(rng.standard_normal(steps)) * 0.0005
        curves[seed] = base + drift + 0.003 * rng.standard_normal(steps) + np.where(step >= 100, shift, 0.0)
    return pd.DataFrame(curves, index=step)


def synthetic_finals(rng: np.random.Generator, seeds: int = 3, auc_shift: float = 0.0) -> pd.DataFrame:
    return pd.DataFrame(
        {"auc": 0.75 + auc_shift + 0.001 * rng.standard_normal(seeds), "ne": 0.85 + 0.001 * rng.standard_normal(seeds),
         "logloss": 0.48 + 0.001 * rng.standard_normal(seeds)}
    )


def test_verdict_passes_backends_that_differ_only_by_seed_noise_almost_always():
    verdicts = []
    for trial in range(40):
        rng = np.random.default_rng(trial)
        losses = {"fa2": synthetic_losses(rng), "tlx": synthetic_losses(rng)}
        finals = {"fa2": synthetic_finals(rng), "tlx": synthetic_finals(rng)}
        verdicts.append(compare_verdict.parity_verdict(losses, finals, "fa2", warmup=30))
    assert all(v["backends"]["tlx"]["max_loss_gap"] != 0 for v in verdicts)
    # The rule trades power for few false alarms: ~1% from the curves, ~2% per final metric.
    assert sum(v["backends"]["tlx"]["loss_pass"] for v in verdicts) >= 38
    assert sum(v["pass"] for v in verdicts) >= 34


def test_verdict_fails_a_shifted_loss_curve_from_where_it_shifts():
    rng = np.random.default_rng(1)
    losses = {"fa2": synthetic_losses(rng), "tlx": synthetic_losses(rng, shift=0.05)}
    finals = {"fa2": synthetic_finals(rng), "tlx": synthetic_finals(rng)}
    verdict = compare_verdict.parity_verdict(losses, finals, "fa2", warmup=30)
    entry = verdict["backends"]["tlx"]
    assert not verdict["pass"] and not entry["loss_pass"]
    assert 95 <= entry["first_step_outside"] <= 105  # the shift starts at step 100 (smoothing blurs it by 2 steps)
    assert entry["max_loss_gap"] > 0.04
    assert all(result["pass"] for result in entry["final"].values())
    for trial in range(10):
        rng = np.random.default_rng(100 + trial)
        losses = {"fa2": synthetic_losses(rng), "tlx": synthetic_losses(rng, shift=0.05)}
        assert not compare_verdict.parity_verdict(losses, finals, "fa2", warmup=30)["backends"]["tlx"]["loss_pass"]


def test_verdict_fails_a_final_auc_gap_beyond_seed_noise():
    rng = np.random.default_rng(2)
    losses = {"ref": synthetic_losses(rng), "triton": synthetic_losses(rng)}
    finals = {"ref": synthetic_finals(rng), "triton": synthetic_finals(rng, auc_shift=-0.01)}
    verdict = compare_verdict.parity_verdict(losses, finals, "ref", warmup=30)
    final = verdict["backends"]["triton"]["final"]
    assert not verdict["pass"] and verdict["backends"]["triton"]["loss_pass"]
    assert not final["auc"]["pass"] and final["ne"]["pass"] and final["logloss"]["pass"]
    assert final["auc"]["diff"] == pytest.approx(-0.01, abs=0.003)


def test_verdict_fails_when_a_run_is_missing_and_notes_a_single_seed():
    rng = np.random.default_rng(3)
    losses = {"fa2": synthetic_losses(rng, seeds=1), "tlx": synthetic_losses(rng, seeds=1)}
    finals = {"fa2": synthetic_finals(rng, seeds=1), "tlx": synthetic_finals(rng, seeds=1)}
    losses["tlx"] = losses["fa2"].copy()
    finals["tlx"] = finals["fa2"].copy()
    assert compare_verdict.parity_verdict(losses, finals, "fa2", warmup=30)["pass"]
    assert "no seed band" in compare_verdict.parity_verdict(losses, finals, "fa2", warmup=30)["note"]
    verdict = compare_verdict.parity_verdict(losses, finals, "fa2", warmup=30, problems=["tlx seed 1: failed with exit code 1"])
    assert not verdict["pass"]
    verdict = compare_verdict.parity_verdict({"fa2": losses["fa2"], "tlx": pd.DataFrame()}, finals, "fa2", warmup=30)
    assert not verdict["pass"] and "tlx: no finished run to compare" in verdict["problems"]


def test_warmup_rule():
    assert [compare_verdict.warmup_steps(n) for n in (2000, 1000, 100, 24, 1)] == [200, 100, 20, 12, 0]


def test_step_time_reports_p10_and_mfu_of_the_timed_steps():
    """compare.json's step_time_p10_ms and mfu per backend: over the steps after warmup, pooled over seeds;
    mfu is None when train.py knew no peak (no train/mfu column, as on a CPU)."""
    def run_of(seed: int, step_ms: list[float], mfu: list[float]) -> compare_report.Run:
        train = pd.DataFrame({"loss": 1.0, "step_ms": step_ms, "samples_per_s": 1.0, "tokens_per_s": 1.0, "mfu": mfu})
        return compare_report.Run("tlx", "tlx", seed, "ok", 0, 1.0, None, None, [], train, None)

    # Steps 0-1 are warmup (a 1000 ms compile step); 10 timed steps per seed: 1..10 ms and 11..20 ms.
    runs = [run_of(seed, [1000.0, 1000.0, *(10.0 * seed + np.arange(1, 11))], [0.0, 0.0, *np.full(10, 0.1 + seed / 10)])
            for seed in (0, 1)]
    timing = compare_report._step_time(runs, warmup=2)
    assert timing["p10_ms"] == pytest.approx(np.percentile(np.arange(1, 21), 10))  # 2.9, not the warmup's
    assert timing["median_ms"] == pytest.approx(10.5) and timing["mfu"] == pytest.approx(0.15)
    for run_ in runs:
        run_.train["mfu"] = np.nan
    assert compare_report._step_time(runs, warmup=2)["mfu"] is None


def test_variant_runs_its_backend_with_more_config_files_and_is_judged_like_one(tmp_path):
    """--variant: the torchrec-sharded path (one gloo process) next to the plain one, as on the H200. (A backend
    named twice is the `tiny` fixture's comparison: not repeated here, where each run costs a process.)"""
    out = tmp_path / "out"
    args = ["--attn", "reference", "--variant", "reference_sharded", "reference", "configs/sharded.yaml",
            *TINY, "--out", str(out), f"--data.data_dir={tmp_path / 'cache'}"]
    result = subprocess.run([sys.executable, "-m", "benchmarks.compare", *args], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "compare.json").read_text())
    assert report["backends"] == {"reference": "reference", "reference_sharded": "reference"}
    assert all(r["status"] == "ok" for r in report["runs"]) and len(report["runs"]) == 4
    for seed in (0, 1):
        config = yaml.safe_load((out / "runs" / f"reference_sharded-seed{seed}" / "version_0" / "config.yaml").read_text())
        assert config["trainer"]["strategy"] == "torchrec" and config["seed_everything"] == seed
        plain = yaml.safe_load((out / "runs" / f"reference-seed{seed}" / "version_0" / "config.yaml").read_text())
        assert plain["trainer"]["strategy"] == "auto"
    assert "reference_sharded" in report["parity"]["backends"]
    assert "- variant reference_sharded: reference with configs/sharded.yaml" in (out / "compare.md").read_text()


def test_architectures_side_by_side_report_the_test_split_over_seeds(tmp_path, capsys):
    """model.arch as a --variant, on a protocol with a test split (the MovieLens-1M fixture): compare.md
    and compare.json give each group's test AUC and log loss, mean and std over the seeds."""
    (tmp_path / "cache" / "raw").mkdir(parents=True)
    shutil.copytree(REPO / "tests" / "fixtures" / "ml-1m-tiny", tmp_path / "cache" / "raw" / "ml-1m")
    out = tmp_path / "out"
    args = ["--attn", "reference", "--variant", "lr", "reference", "configs/lr.yaml", "--config", "configs/tiny.yaml",
            "--steps", "10", "--seeds", "2", "--trainer.val_check_interval=5", "--data.dataset=movielens1m",
            "--data.protocol=recbole_context", "--data.num_train=0", "--data.num_val=0", "--data.batch_size=16",
            "--jobs", "2", "--out", str(out), f"--data.data_dir={tmp_path / 'cache'}"]  # fmt: skip
    result = subprocess.run([sys.executable, "-m", "benchmarks.compare", *args], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode in (0, 1), result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "compare.json").read_text())
    assert sorted(report["test_metrics"]) == ["lr", "reference"]
    # --jobs 2: the first run alone (it prepares the data), then the other three two at a time.
    assert result.stdout.count(" ok in ") == 4 and result.stdout.index("[1/4]") < result.stdout.index("[2/4]")
    for label, metrics in report["test_metrics"].items():
        scores = [json.loads((out / "runs" / f"{label}-seed{seed}" / "version_0" / "test.json").read_text())
                  for seed in (0, 1)]  # fmt: skip
        assert metrics["auc"]["per_seed"] == {str(seed): s["test/auc"] for seed, s in enumerate(scores)}
        assert metrics["logloss"]["mean"] == pytest.approx(np.mean([s["test/logloss"] for s in scores]))
        assert metrics["auc"]["std"] == pytest.approx(np.std([s["test/auc"] for s in scores], ddof=1))
    config = yaml.safe_load((out / "runs" / "lr-seed1" / "version_0" / "config.yaml").read_text())
    assert config["model"]["arch"] == "lr" and config["seed_everything"] == 1
    assert "## Test split" in (out / "compare.md").read_text()
    assert "**Parity: not judged**: the groups are different architectures (reference: block_attention, lr: lr)" in (
        out / "compare.md").read_text()
    assert report["parity"]["judged"] is False and report["parity"]["pass"] and result.returncode == 0

    assert quality_main(["--protocol", f"recbole_ml1m_context={out}", "--not-run", "time_split_history=too slow",
                         "--out", str(tmp_path / "quality")]) == 0  # fmt: skip
    quality = json.loads((tmp_path / "quality.json").read_text())
    models = quality["protocols"]["recbole_ml1m_context"]["models"]
    assert sorted(models) == ["block_attention", "lr"]
    lr_auc = report["test_metrics"]["lr"]["auc"]
    assert models["lr"]["test_auc"] == {"mean": lr_auc["mean"], "std": lr_auc["std"], "seeds": [0, 1],
                                        "per_seed": [lr_auc["per_seed"]["0"], lr_auc["per_seed"]["1"]]}
    assert models["block_attention"]["test_logloss"]["mean"] == report["test_metrics"]["reference"]["logloss"]["mean"]
    assert quality["protocols"]["time_split_history"] == {"models": {}, "not_run": "too slow"}
    assert quality["protocols"]["recbole_ml100k_context"]["not_run"] == "no comparison folder was given"
    markdown = (tmp_path / "quality.md").read_text()
    assert "| lr |" in markdown and "Not run: too slow" in markdown
    assert f"0.8699 ({lr_auc['mean'] - 0.8699:+.4f})" in markdown  # next to RecBole's LR on this protocol
    # The same folder given as another protocol's (another dataset, or history) is refused, not reported as it.
    for protocol, difference in (("recbole_ml100k_context", "data.dataset = 'movielens1m', not 'movielens100k'"),
                                 ("time_split_history", "data.protocol = 'recbole_context', not 'time_split_history'")):
        assert quality_main(["--protocol", f"{protocol}={out}", "--out", str(tmp_path / "wrong")]) == 2
        assert f"trained other data than {protocol}'s ({difference}" in capsys.readouterr().err

    # Rerun with the variant changed under its label: refused before settings.json (which `report` reads) is rewritten.
    saved = (out / "settings.json").read_bytes()
    changed = [*args[:6], "model.baseline.embedding_dim=8", *args[6:]]
    code, _, err = call_main(changed, capsys)
    assert code == 2 and "model.baseline.embedding_dim = 8 in --variant lr here" in err, err
    assert (out / "settings.json").read_bytes() == saved


def test_variant_key_value_overrides_follow_the_passthrough_keys():
    """A --variant item KEY=VALUE (the unfused tower next to the fused one, say) reaches its runs as
    --KEY=VALUE after the comparison's extra arguments, so the variant's value wins; files stay --config."""
    args = run.train_args(["configs/gpu.yaml", "configs/sharded.yaml", "model.net.num_layers=1"],
                          ["--model.net.num_layers=2"], "tlx", 1, 10, Path("/o"), "tlx_one_layer")
    assert args[:6] == ["--config", "configs/gpu.yaml", "--config", "configs/sharded.yaml", "--model.net.num_layers=2",
                        "--model.net.num_layers=1"]
    assert args[6:] == ["--attn=tlx", "--seed_everything=1", "--runs_dir=/o/runs", "--run_name=tlx_one_layer-seed1",
                        "--trainer.max_steps=10"]


# ------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--attn", "bogus", "reference"], "invalid choice: 'bogus'"),
        (["--attn", "reference"], "at least two groups of runs"),
        (["--attn", "reference", "reference", "--jobs", "0"], "--jobs and --steps must be >= 1"),
        (["--attn", "tlx", "reference", "--config", "configs/tiny.yaml"], "'tlx' cannot run here"),
        (["--attn", "reference", "reference", "--seed_everything=3"], "sets --seed_everything itself"),
        (["--attn", "reference", "reference", "--model.net.num_heads=3"], "d_model=64 is not divisible by num_heads=3"),
        (["--attn", "reference", "reference", "--model.net.bogus=3"], "bogus"),
        (["--attn", "reference", "reference", "--config", "configs/tiny.yaml", "--steps", "10"],
         "trainer.val_check_interval=20 is more than a run's 10 steps"),
        (["--attn", "reference", "reference", "--variant", "x", "reference"], "give LABEL BACKEND CONFIG"),
        (["--attn", "reference", "reference", "--variant", "reference", "reference", "configs/tiny.yaml"],
         "--variant label 'reference' must be new"),
        (["--attn", "reference", "reference", "--variant", "x", "bogus", "configs/tiny.yaml"], "backend 'bogus'"),
        (["--attn", "reference", "reference", "--variant", "x", "reference", "configs/missing.yaml"], "missing.yaml"),
        (["--attn", "reference", "reference", "--variant", "x", "reference", "seed_everything=3"],
         "--variant x: seed_everything=3: the comparison sets it itself"),
    ],
)
def test_bad_arguments_give_a_clear_error_before_anything_runs(argv, message, tmp_path, capsys):
    code, _, err = call_main([*argv, "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert message in err
    assert not (tmp_path / "out").exists()


def test_reused_out_folder_with_another_config_is_refused(tiny, capsys):
    out, args = tiny
    changed = [("20" if a == str(STEPS) else a) for a in args]  # --steps 20
    code, _, err = call_main(changed, capsys)
    assert code == 2
    assert "trainer.max_steps = 20 in this command, 24 in" in err


def test_run_trained_with_another_config_is_refused(tiny_copy, capsys):
    saved = tiny_copy / "runs" / "reference-seed1" / "version_0" / "config.yaml"
    config = yaml.safe_load(saved.read_text())
    config["model"]["net"]["d_model"] = 48
    saved.write_text(yaml.safe_dump(config))
    code, _, err = call_main(["report", str(tiny_copy)], capsys)
    assert code == 2
    assert "was trained with a different config: model.net.d_model = 48" in err


def test_out_folder_that_is_not_a_comparison_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    argv = ["--attn", "reference", "reference", "--config", "configs/tiny.yaml", "--out", str(tmp_path)]
    code, _, err = call_main(argv, capsys)
    assert code == 2 and "is not empty and holds no settings.json" in err


@pytest.mark.parametrize("make, message", [(False, "does not exist"), (True, "is empty")])
def test_report_on_a_missing_or_empty_folder_is_refused(make, message, tmp_path, capsys):
    folder = tmp_path / "out"
    if make:
        folder.mkdir()
    code, _, err = call_main(["report", str(folder)], capsys)
    assert code == 2 and message in err
    with pytest.raises(CompareError, match=message):  # what the notebook sees
        compare_report.load_comparison(folder)


def test_train_py_compare_hook():
    result = subprocess.run(
        [sys.executable, "train.py", "compare", "report", "/nonexistent/compare"], cwd=REPO, capture_output=True,
        text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "comparison folder /nonexistent/compare does not exist" in result.stderr


# -------------------------------------------------------------------------------------- notebook


def test_notebook_executes_on_the_comparison_folder(tiny, monkeypatch):
    monkeypatch.setenv("COMPARE_DIR", str(tiny[0]))
    notebook = nbformat.read(REPO / "notebooks" / "compare_backends.ipynb", as_version=4)
    NotebookClient(
        notebook, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(REPO / "notebooks")}}
    ).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    markdown = "".join(o["data"].get("text/markdown", "") for o in outputs if "data" in o)
    assert "**Parity: PASS**" in markdown
