"""train.py end to end, run as `python train.py ...` in a subprocess exactly as a user would."""

import csv
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]


def run_train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def read_metrics(run_folder: Path) -> list[dict[str, str]]:
    with open(run_folder / "metrics.csv") as f:
        return list(csv.DictReader(f))


def column(rows: list[dict[str, str]], name: str) -> list[float]:
    return [float(row[name]) for row in rows if row.get(name)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """One 40-step tiny run shared by the tests that inspect its outputs."""
    root = tmp_path_factory.mktemp("tiny")
    args = ["--config", "configs/tiny.yaml", f"--runs_dir={root / 'runs'}", f"--data.data_dir={root / 'cache'}"]
    result = run_train(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "runs" / "tiny" / "version_0", args


def test_tiny_config_trains_and_loss_falls(tiny_run):
    run_folder, _ = tiny_run
    rows = read_metrics(run_folder)
    losses = column(rows, "train/loss")
    assert len(losses) == 40
    assert statistics.mean(losses[-5:]) < statistics.mean(losses[:5]) - 0.02
    for name in ("train/step_ms", "train/samples_per_s", "train/tokens_per_s"):
        values = column(rows, name)
        assert len(values) == 40 and all(v > 0 for v in values), name
    # Every sample has at least its dense and categorical tokens: 1 + 6 per sample at batch 64.
    assert all(t / s >= 7 for t, s in zip(column(rows, "train/tokens_per_s"), column(rows, "train/samples_per_s")))
    assert len(column(rows, "val/auc")) == 2  # val_check_interval 20 over 40 steps
    for name in ("val/logloss", "val/ne", "val/calibration"):
        assert all(v > 0 for v in column(rows, name)), name


def test_run_folder_holds_resolved_config_and_checkpoints(tiny_run):
    run_folder, _ = tiny_run
    config = yaml.safe_load((run_folder / "config.yaml").read_text())
    assert config["model"]["d_model"] == 32  # from tiny.yaml
    assert config["trainer"]["gradient_clip_val"] == 1.0  # from default.yaml, under tiny.yaml
    assert list(run_folder.glob("events.out.tfevents.*"))
    assert len(list((run_folder / "checkpoints").glob("best-step*-ne*.ckpt"))) == 1
    # A notebook rebuilds the trained model from the checkpoint alone.
    from train import RankingTask

    last = run_folder / "checkpoints" / "last.ckpt"
    task = RankingTask.load_from_checkpoint(last)
    assert task.model.config.d_model == 32 and task.hparams.lr == 0.005
    # last.ckpt holds the latest validation's state (step 40), whichever step scored the best NE.
    assert torch.load(last, weights_only=True)["global_step"] == 40


def test_resume_continues_from_checkpoint(tiny_run):
    run_folder, args = tiny_run
    result = run_train(*args, f"--ckpt_path={run_folder / 'checkpoints' / 'last.ckpt'}", "--trainer.max_steps=45")
    assert result.returncode == 0, result.stderr[-3000:]
    resumed_steps = [int(row["step"]) for row in read_metrics(run_folder.parent / "version_1") if row["train/loss"]]
    assert resumed_steps == list(range(40, 45))


def test_unavailable_backend_fails_fast_with_clean_message(tmp_path):
    result = run_train("--config", "configs/tiny.yaml", "--attn=tlx", f"--runs_dir={tmp_path}/runs",
                       f"--data.data_dir={tmp_path}/cache", timeout=120)
    assert result.returncode == 2
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: ") and "'tlx'" in message
    assert "reference" in message  # names the backends that can run
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "cache").exists()  # failed before preparing any data


def test_help_lists_every_config_key():
    result = run_train("--help", timeout=120)
    assert result.returncode == 0
    for key in ("--attn", "--ckpt_path", "--config", "--model.num_layers", "--model.attn_backend",
                "--optim.lr", "--data.batch_size", "--data.max_history_len", "--trainer.max_steps",
                "--trainer.precision"):
        assert key in result.stdout, key


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.num_layerz=1"], "num_layerz"),
        (["--model.num_heads=3"], "d_model=64 is not divisible by num_heads=3"),
        (["--attn=cuda"], "cuda"),
    ],
)
def test_bad_arguments_give_a_clear_error(args, message):
    result = run_train(*args, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_key_in_config_file_gives_a_clear_error(tmp_path):
    bad_config = tmp_path / "bad.yaml"
    bad_config.write_text("model:\n  d_modle: 32\n")
    result = run_train("--config", str(bad_config), timeout=120)
    assert result.returncode == 2
    assert "d_modle" in result.stderr
    assert "Traceback" not in result.stderr
