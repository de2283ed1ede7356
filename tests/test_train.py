"""train.py end to end, run as `python train.py ...` in a subprocess exactly as a user would."""

import csv
import json
import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import train
from training.callbacks import StepMetrics

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
    for name in ("train/step_ms", "train/samples_per_s", "train/tokens_per_s", "train/tflops"):
        values = column(rows, name)
        assert len(values) == 40 and all(v > 0 for v in values), name
    assert [int(row["step"]) for row in rows if row["train/loss"]] == list(range(40))  # one row per step
    assert not column(rows, "train/mfu")  # no bf16 peak to measure a CPU against
    # Every sample has at least its dense and categorical tokens: 1 + 6 per sample at batch 64.
    assert all(t / s >= 7 for t, s in zip(column(rows, "train/tokens_per_s"), column(rows, "train/samples_per_s")))
    assert [int(row["step"]) for row in rows if row["val/auc"]] == [19, 39]  # val_check_interval 20
    for name in ("val/logloss", "val/ne", "val/calibration"):
        assert all(v > 0 for v in column(rows, name)), name


def test_run_folder_holds_resolved_config_and_checkpoints(tiny_run):
    run_folder, _ = tiny_run
    config = yaml.safe_load((run_folder / "config.yaml").read_text())
    assert config["model"]["net"]["d_model"] == 32  # from tiny.yaml
    assert config["trainer"]["gradient_clip_val"] == 1.0  # from default.yaml, under tiny.yaml
    assert list(run_folder.glob("events.out.tfevents.*"))
    assert len(list((run_folder / "checkpoints").glob("best-step*-ne*.ckpt"))) == 1
    # A notebook rebuilds the trained model from the checkpoint alone.
    last = run_folder / "checkpoints" / "last.ckpt"
    task = train.RankingTask.load_from_checkpoint(last, weights_only=True)
    assert task.net.config.d_model == 32 and task.optim_config.lr == 0.005
    # last.ckpt holds the latest validation's state (step 40), whichever step scored the best NE.
    assert torch.load(last, weights_only=True)["global_step"] == 40


# 50 tiny steps, validations after steps 20 and 40, last.ckpt every 5 steps (the ones at 20 and 40 after
# the validation): 32 batches an epoch, so checkpoints fall mid-epoch and on both sides of each validation.
# A constant learning rate, so that a finished shorter run can be continued to 50 steps.
RESUME_ARGS = ["--config", "configs/tiny.yaml", "--trainer.max_steps=50", "--checkpoint.every_n_steps=5",
               "--model.optim.min_lr_ratio=1.0"]


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory) -> tuple[Path, Path]:
    """(the data cache, the run folder) of the 50-step run the killed and resumed runs must equal."""
    root = tmp_path_factory.mktemp("uninterrupted")
    result = run_train(*RESUME_ARGS, f"--runs_dir={root / 'runs'}", f"--data.data_dir={root / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "cache", root / "runs" / "tiny" / "version_0"


def kill_switch(**init_args) -> str:
    return "--trainer.callbacks+=" + json.dumps({"class_path": "tests.kill_switch.KillSwitch", "init_args": init_args})


@pytest.mark.parametrize(
    "first_run, returncode, checkpoint_step",
    [
        pytest.param(kill_switch(step=12), -signal.SIGKILL, 10, id="kill -9 before the first validation"),
        pytest.param(kill_switch(step=33), -signal.SIGKILL, 30, id="kill -9 between validations"),
        pytest.param(kill_switch(step=40, during_validation=True), -signal.SIGKILL, 35,
                     id="kill -9 during a validation"),
        pytest.param(kill_switch(step=13, signal_name="SIGTERM"), 128 + signal.SIGTERM, 13, id="SIGTERM"),
        pytest.param(kill_switch(step=13, signal_name="SIGINT"), 128 + signal.SIGINT, 13, id="Ctrl-C"),
        pytest.param("--trainer.max_steps=23", 0, 23, id="a finished run continued"),
    ],
)
def test_killed_run_resumes_with_the_same_losses_and_no_lost_or_repeated_rows(
    uninterrupted_run, tmp_path, first_run, returncode, checkpoint_step
):
    """Killed at any point (or finished early), then resumed with --ckpt_path last: the losses and
    validation metrics equal the uninterrupted run's bit for bit (CPU, same seed: the same batches in
    the same order reach the same weights), and metrics.csv holds each step once. SIGTERM, Ctrl-C and
    the end of a fit save a checkpoint at the step they stopped."""
    cache, uninterrupted = uninterrupted_run
    expected = read_metrics(uninterrupted)
    runs = tmp_path / "runs"
    common = [*RESUME_ARGS, f"--runs_dir={runs}", f"--data.data_dir={cache}"]
    first = run_train(*common, first_run)
    assert first.returncode == returncode, first.stderr[-3000:]
    run_folder = runs / "tiny" / "version_0"
    assert torch.load(run_folder / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == checkpoint_step
    for signal_name, stop in (("SIGTERM", "SIGTERM"), ("SIGINT", "Ctrl-C")):
        if signal_name in first_run:
            assert first.stderr.strip().splitlines()[-1] == f"stopped by {stop} at step 13; resume with --ckpt_path last"

    resumed = run_train(*common, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "learning-rate schedule" not in resumed.stdout  # constant after warmup: no jump, whatever max_steps was
    assert f"last checkpoint: {run_folder / 'checkpoints' / 'last.ckpt'}" in resumed.stdout  # the run's summary
    assert not (runs / "tiny" / "version_1").exists()  # continued in its own folder
    rows = read_metrics(run_folder)
    train_steps = [int(row["step"]) for row in rows if row["train/loss"]]
    assert train_steps == list(range(50)), train_steps
    # A validation row carries the index of the step it follows.
    assert [int(row["step"]) for row in rows if row["val/auc"]] == [19, 39]
    assert column(rows, "train/loss") == column(expected, "train/loss")
    assert column(rows, "val/auc") == column(expected, "val/auc")
    assert torch.load(run_folder / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 50


def test_resuming_an_earlier_checkpoint_trains_a_new_version_and_leaves_the_run_as_it_was(uninterrupted_run, tmp_path):
    """A rewind: resumed from a step-20 checkpoint while the folder's last.ckpt is at step 40, the run
    trains into version_1, whose metrics start with version_0's rows before step 20 and then equal them
    bit for bit (same weights, same batches); version_0's checkpoints and rows stay as they were. It
    used to write last-v1.ckpt beside the stale last.ckpt, which --ckpt_path last then resumed, and to
    cut version_0's rows after step 20."""
    cache, _ = uninterrupted_run
    runs = tmp_path / "runs"
    common = [*RESUME_ARGS, f"--runs_dir={runs}", f"--data.data_dir={cache}"]
    first = run_train(*common, "--trainer.max_steps=20")
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = runs / "tiny" / "version_0" / "checkpoints"
    early = checkpoints / "step20.ckpt"
    early.write_bytes((checkpoints / "last.ckpt").read_bytes())
    assert run_train(*common, "--ckpt_path=last", "--trainer.max_steps=40").returncode == 0
    kept = {path.name: path.read_bytes() for path in [*checkpoints.iterdir(), checkpoints.parent / "metrics.csv"]}

    rewound = run_train(*common, f"--ckpt_path={early}", "--trainer.max_steps=30")
    assert rewound.returncode == 0, rewound.stderr[-3000:]
    assert "whose last.ckpt is at step 40" in rewound.stdout
    # Its best checkpoint is among its own validations, of which it ran none (the next is at step 40).
    assert "best checkpoint (lowest val/ne): none (no validation ran)" in rewound.stdout
    assert {path.name: path.read_bytes() for path in [*checkpoints.iterdir(), checkpoints.parent / "metrics.csv"]} == kept
    original, rows = read_metrics(runs / "tiny" / "version_0"), read_metrics(runs / "tiny" / "version_1")
    assert [int(row["step"]) for row in rows if row["train/loss"]] == list(range(30))
    assert column(rows, "train/loss") == column(original, "train/loss")[:30]
    assert torch.load(runs / "tiny" / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 30

    # Resumed in place from a copy of the newest state, not last.ckpt itself: last.ckpt moves on, no last-v1.ckpt.
    newest = checkpoints / "step40.ckpt"
    newest.write_bytes((checkpoints / "last.ckpt").read_bytes())
    assert run_train(*common, f"--ckpt_path={newest}", "--trainer.max_steps=45").returncode == 0
    assert not list(checkpoints.glob("last-v*.ckpt"))
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 45


def test_a_checkpoint_resumes_in_its_own_run_folder_whatever_runs_dir_says(uninterrupted_run, tmp_path):
    """Its folder's run name and runs folder win over --run_name and --runs_dir: it used to continue in
    <runs_dir>/<run_name>/version_N when the names matched, cutting another run's metrics there."""
    cache, _ = uninterrupted_run
    mine, other = tmp_path / "mine", tmp_path / "other"
    common = [*RESUME_ARGS, f"--data.data_dir={cache}", "--trainer.max_steps=20"]
    assert run_train(*common, f"--runs_dir={mine}").returncode == 0
    assert run_train(*common, f"--runs_dir={other}", "--seed_everything=1").returncode == 0
    others = (other / "tiny" / "version_0" / "metrics.csv").read_bytes()
    resumed = run_train(*common, f"--runs_dir={other}", "--run_name=elsewhere", "--trainer.max_steps=25",
                        f"--ckpt_path={mine / 'tiny' / 'version_0' / 'checkpoints' / 'last.ckpt'}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"run folder: {mine / 'tiny' / 'version_0'}" in resumed.stdout
    assert (other / "tiny" / "version_0" / "metrics.csv").read_bytes() == others
    assert not (other / "elsewhere").exists()
    assert len(column(read_metrics(mine / "tiny" / "version_0"), "train/loss")) == 25


def test_resuming_with_other_settings_is_refused_before_anything_is_written(uninterrupted_run, tmp_path):
    """A different network, data stream or optimizer setting (which the checkpoint's optimizer state would
    silently override) is one line naming each, exit 2, and the run's folder unchanged; a checkpoint past
    max_steps or max_time likewise. How the same network is computed (here its padding) may change."""
    cache, _ = uninterrupted_run
    runs = tmp_path / "runs"
    common = [*RESUME_ARGS, f"--runs_dir={runs}", f"--data.data_dir={cache}"]
    assert run_train(*common, "--trainer.max_steps=20").returncode == 0
    run_folder = runs / "tiny" / "version_0"
    before = {path: path.read_bytes() for path in run_folder.rglob("*") if path.is_file()}

    changed = run_train(*common, "--ckpt_path=last", "--model.net.d_model=64", "--model.optim.lr=0.1",
                        "--data.seed=3", "--data.batch_size=32", timeout=120)
    assert changed.returncode == 2 and "Traceback" not in changed.stderr, changed.stderr[-3000:]
    message = changed.stderr.strip().splitlines()[-1]
    for difference in ("model.net.d_model: 32 in the checkpoint, 64 now", "model.optim.lr: 0.005 in the checkpoint, 0.1 now",
                       "data.seed: 0 in the checkpoint, 3 now", "data.batch_size: 64 in the checkpoint, 32 now"):
        assert difference in message, message
    finished = run_train(*common, "--ckpt_path=last", "--trainer.max_steps=20", timeout=120)
    assert finished.returncode == 2 and "is at step 20 and trainer.max_steps=20" in finished.stderr
    # Lightning's Timer counts on from the checkpoint's training time: a run stopped by max_time, resumed with
    # the same limit, has nothing left to train (it trained nothing, rewrote last.ckpt and exited 0).
    timed = [*common, "--run_name=timed", "--trainer.max_steps=100000", "--trainer.max_time=00:00:00:02"]
    assert run_train(*timed).returncode == 0
    timed_out = run_train(*timed, "--ckpt_path=last", timeout=120)
    assert timed_out.returncode == 2 and "and trainer.max_time=00:00:00:02: nothing is left to train" in timed_out.stderr, (
        timed_out.stderr[-2000:])
    assert {path: path.read_bytes() for path in run_folder.rglob("*") if path.is_file()} == before
    assert sorted(p.name for p in (runs / "tiny").iterdir()) == ["version_0"]

    # A schedule of another shape (here its floor) is allowed, and said: the learning rate jumps.
    padded = run_train(*common, "--ckpt_path=last", "--trainer.max_steps=25", "--model.net.pad_tokens_to=64",
                       "--model.optim.min_lr_ratio=0.5")
    assert padded.returncode == 0, padded.stderr[-3000:]
    assert ("schedule ran over 20 steps, this run's over 25 (trainer.max_steps, and model.optim's warmup_steps and "
            "min_lr_ratio shape it): at step 20 the learning rate goes from 0.005 to 0.00") in padded.stdout


def test_resume_compares_what_defines_the_run_and_lets_the_rest_change():
    """config_differences on hand-made metadata: the network's own settings (model.net for the block-attention
    model, model.baseline for a baseline), the learning rate and weight decay, the data stream; not how the
    network is computed, the schedule's shape, or a data stream an old checkpoint did not save."""
    from dataclasses import asdict, fields

    from models import RankingModelConfig
    from training.resume import config_differences

    assert set(RankingModelConfig.EXECUTION_FIELDS) <= {field.name for field in fields(RankingModelConfig)}
    net, optim, baseline = asdict(RankingModelConfig()), asdict(train.OptimConfig()), {"hidden": 64}
    stream = {"dataset": "synthetic", "batch_size": 64, "seed": 0}
    saved = {"hyper_parameters": {"arch": "block_attention", "net": net, "optim": optim, "baseline": baseline},
             "CTRDataModule": {"data_stream": stream}}

    def now(arch="block_attention", net=net, optim=optim, baseline=baseline, stream=stream, metadata=saved):
        return config_differences(metadata, {"arch": arch, "net": net, "optim": optim, "baseline": baseline}, stream)

    assert now() == []
    assert now(net={**net, "attn_backend": "triton", "compile": True, "pad_tokens_to": 4096}) == []
    assert now(optim={**optim, "warmup_steps": 7, "min_lr_ratio": 1.0}) == []
    assert now(net={**net, "num_layers": 3}) == ["model.net.num_layers: 2 in the checkpoint, 3 now"]
    assert now(optim={**optim, "weight_decay": 0.5}) == ["model.optim.weight_decay: 0.01 in the checkpoint, 0.5 now"]
    assert now(stream={**stream, "batch_size": 32}) == ["data.batch_size: 64 in the checkpoint, 32 now"]
    assert now(arch="dcnv2") == ["model.arch: 'block_attention' in the checkpoint, 'dcnv2' now"]
    assert now(stream={**stream, "seed": 1}, metadata={**saved, "CTRDataModule": {}}) == []  # saved before data_stream
    baseline_run = {**saved, "hyper_parameters": {**saved["hyper_parameters"], "arch": "dcnv2"}}
    assert now("dcnv2", net={**net, "num_layers": 3}, metadata=baseline_run) == []  # a baseline has no model.net
    assert now("dcnv2", baseline={"hidden": 32}, metadata=baseline_run) == [
        "model.baseline.hidden: 64 in the checkpoint, 32 now"]


def test_unavailable_backend_fails_fast_with_clean_message(tmp_path):
    result = run_train("--config", "configs/tiny.yaml", "--attn=tlx", f"--runs_dir={tmp_path}/runs",
                       f"--data.data_dir={tmp_path}/cache", timeout=120)
    assert result.returncode == 2
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: ") and "'tlx'" in message
    assert "reference" in message  # names the backends that can run
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "cache").exists()  # failed before preparing any data


@pytest.mark.parametrize("steps, source", [(5, "the final weights"), (20, "the last validation of fit")])
def test_baseline_report_works_with_or_without_a_validation_during_fit(tmp_path, steps, source):
    """--baseline compares the model's validation AUC with logistic regression's: a run too short to
    validate (max_steps below val_check_interval) validates its final weights for it."""
    result = run_train("--config", "configs/tiny.yaml", "--baseline=true", f"--trainer.max_steps={steps}",
                       f"--runs_dir={tmp_path}/runs", f"--data.data_dir={tmp_path}/cache")
    assert result.returncode == 0, result.stderr[-3000:]
    run_folder = tmp_path / "runs" / "tiny" / "version_0"
    report = json.loads((run_folder / "baseline.json").read_text())
    assert report["model_val_auc_from"].startswith(source)
    assert 0.0 < report["model_val_auc"] < 1.0 and 0.0 < report["logistic_regression_val_auc"] < 1.0
    if steps == 20:  # the last validation's AUC, as logged
        assert report["model_val_auc"] == pytest.approx(column(read_metrics(run_folder), "val/auc")[-1])
    assert "run folder:" in result.stdout  # the rest of the run's report still came


def test_c_launch_environment_is_set_before_the_kernels_are_imported_and_a_users_value_wins():
    """fbtriton reads TRITON_ENABLE_C_CACHE when a kernel is defined: what matters is its value at the moment
    `kernels` is first imported, recorded here by an import hook."""
    probe = """
import importlib.abc, json, os, sys
seen = {}
class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "kernels" and not seen:
            seen.update({key: os.environ.get(key) for key in ("TRITON_ENABLE_C_CACHE", "TRITON_USE_C_DISPATCHER")})
sys.meta_path.insert(0, Spy())
import train
print(json.dumps(seen))
"""
    environment = {k: v for k, v in os.environ.items() if k not in train.C_LAUNCH_ENVIRONMENT}
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**environment, "TRITON_ENABLE_C_CACHE": "0"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"TRITON_ENABLE_C_CACHE": "0",
                                                                  "TRITON_USE_C_DISPATCHER": "1"}


def test_help_lists_every_config_key():
    result = run_train("--help", timeout=120)
    assert result.returncode == 0
    for key in ("--attn", "--ckpt_path", "--config", "--model.net.num_layers", "--model.net.attn_backend",
                "--model.net.compile", "--model.optim.lr", "--model.optim.fused", "--model.peak_flops",
                "--data.batch_size", "--data.max_history_len", "--trainer.max_steps", "--trainer.precision"):
        assert key in result.stdout, key
    # Every data and model key says what it is: argparse puts a key's description before "(type: ...".
    entries = re.findall(r"^  (--(?:data|model)\.[\w.]+)(?: \S+)?\s+(.*?)(?=^  --|\Z)", result.stdout, re.M | re.S)
    assert len(entries) > 20
    undescribed = [key for key, text in entries if " ".join(text.split()).startswith("(type:")]
    assert not undescribed, undescribed


def test_fast_dev_run_trains_a_step_and_writes_nothing(tmp_path):
    """Lightning's smoke run has no loggers or checkpoints: the run report after fit must not look for them."""
    result = run_train("--config", "configs/tiny.yaml", "--trainer.fast_dev_run=true", f"--runs_dir={tmp_path / 'runs'}",
                       f"--data.data_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "fast_dev_run: 1 step(s) trained and validated; nothing was written"
    assert not (tmp_path / "runs").exists()


def test_checkpoints_load_with_weights_only(tiny_run):
    run_folder, _ = tiny_run
    checkpoint = torch.load(run_folder / "checkpoints" / "last.ckpt", weights_only=True)
    assert {"state_dict", "optimizer_states", "global_step", "CTRDataModule"} <= set(checkpoint)
    assert checkpoint["CTRDataModule"]["train_sampler"] == {"epoch": 1, "consumed": 8 * 64}  # 40 = 32 + 8 batches


class FakeCudaEvent:
    """A CUDA event on the CPU: records when it was recorded (a fake clock, 10 ms a step) and which
    reads reached it."""

    clock = 0.0
    read: list["FakeCudaEvent"] = []

    def __init__(self, enable_timing: bool = False):
        self.time = None

    def record(self):
        self.time = FakeCudaEvent.clock

    def synchronize(self):
        FakeCudaEvent.read.append(self)

    def elapsed_time(self, end: "FakeCudaEvent") -> float:
        FakeCudaEvent.read += [self, end]
        return (end.time - self.time) * 1e3


def drive_step_metrics(monkeypatch, num_steps: int, log_every: int, on_step_end=lambda step, events: None,
                       logger_class=SimpleNamespace):
    """Runs StepMetrics' hooks for num_steps steps of 10 ms (losses 0, 1, 2, ...) with fake CUDA events;
    returns the rows it logged (to a logger_class instance) and the progress bar's losses, in order."""
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    FakeCudaEvent.clock, FakeCudaEvent.read = 0.0, []
    rows, shown = [], []
    logger = logger_class.__new__(logger_class)
    logger.log_metrics = lambda metrics, step: rows.append(dict(metrics, step=step))
    module = SimpleNamespace(device=SimpleNamespace(type="cuda"), trained_steps=train.RankingTask.trained_steps,
                             step_flops=lambda batch: (8, 16), log=lambda name, value, **kwargs: shown.append(value))
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=log_every, loggers=[logger],
                              optimizers=[SimpleNamespace(param_groups=[{"lr": 0.1}])])
    metrics = StepMetrics(peak_flops=None)
    events = []  # (start, end) per step
    for step in range(num_steps):
        trainer.global_step = step
        metrics.on_train_batch_start(trainer, module, None, step)
        FakeCudaEvent.clock += 0.004
        trainer.global_step = step + 1
        metrics.on_train_batch_end(trainer, module, {"loss": torch.tensor(float(step))},
                                   SimpleNamespace(batch_size=4), step)
        events.append((metrics.pending[-1]["start"], metrics.pending[-1]["end"]))
        on_step_end(step, events)
        FakeCudaEvent.clock += 0.006
    metrics.on_train_end(trainer, module)
    return rows, shown


def test_step_metrics_reads_only_the_events_of_finished_windows(monkeypatch):
    """The host never waits on the current logging window's CUDA events: only on events at least a
    window old (issue 21: reading the current one made every 10th step 25-37 ms on the H200). Every
    step still gets its row, with the start-to-start interval."""
    log_every = 4

    def check(step, events):
        window_first = step - step % log_every if (step + 1) % log_every else step + 1 - log_every
        current = {id(e) for start_end in events[window_first:] for e in start_end}
        assert not current & {id(e) for e in FakeCudaEvent.read}, f"step {step} read its own window's events"

    rows, shown = drive_step_metrics(monkeypatch, num_steps=14, log_every=log_every, on_step_end=check)
    assert [row["step"] for row in rows] == list(range(14))
    assert [row["train/loss"] for row in rows] == [float(step) for step in range(14)]
    assert [round(row["train/step_ms"], 6) for row in rows] == [10.0] * 13 + [4.0]  # the last ends at its end
    assert rows[0]["train/samples_per_s"] == pytest.approx(400) and rows[0]["train/tflops"] == pytest.approx(16e-10)
    assert [float(loss) for loss in shown] == [2.0, 6.0]  # at steps 8 and 12: the newest row of the windows before


def test_tensorboard_gets_the_newest_row_of_each_window(monkeypatch):
    """A TensorBoardLogger row costs ~0.8 ms of host time (metrics.csv's: ~0.02): TensorBoard gets one
    row per flush, the newest, where the other loggers get every step's."""
    from lightning.pytorch.loggers import TensorBoardLogger

    rows, _ = drive_step_metrics(monkeypatch, num_steps=14, log_every=4, logger_class=TensorBoardLogger)
    # Flushes at steps 8 and 12 (the windows before the current one), then the rest at the end.
    assert [row["step"] for row in rows] == [2, 6, 13]
    assert [row["train/loss"] for row in rows] == [2.0, 6.0, 13.0]


def test_progress_bar_loss_is_handed_to_lightning_on_the_host(monkeypatch):
    """StepMetrics shows the loss through `pl_module.log` as a CPU tensor. Lightning puts a logged
    float on the module's device and converts it back for the progress bar after every step: on the
    H200 that was a host wait per step (profile_step_waits_*_h200.md, committed in 70f4175, now in git history)."""
    _, shown = drive_step_metrics(monkeypatch, num_steps=8, log_every=2)
    assert shown and all(isinstance(loss, torch.Tensor) and loss.device.type == "cpu" for loss in shown)


@pytest.mark.parametrize("precision,fused", [("bf16-mixed", True), ("32-true", False)])
def test_gradient_clipping_reaches_the_optimizer_also_when_it_is_fused(tmp_path, precision, fused):
    """trainer.gradient_clip_val bounds the gradient norm each optimizer step sees, with the fused
    AdamW under bf16-mixed too (which Lightning's own clipping refuses)."""
    import lightning as L

    from data.datamodule import CTRDataModule
    from models import RankingModelConfig

    clip = 1e-3
    data = CTRDataModule(data_dir=str(tmp_path), num_train=256, num_val=64, batch_size=32, vocab_size=50,
                         num_items=50, max_history_len=16)
    net = RankingModelConfig(d_model=16, num_heads=2, num_layers=1, mlp_ratio=2, embedding_dim=8,
                             n_dense_tokens=1, attn_backend="reference")
    task = train.RankingTask(data.schema.to_dict(), net, train.OptimConfig(fused=fused))
    norms = {"before": [], "stepped": []}

    def total_norm(parameters) -> float:
        return float(torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in parameters if p.grad is not None])))

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            optimizer = trainer.optimizers[0]
            assert all(group["fused"] is fused for group in optimizer.param_groups)
            # After the step: Lightning passes the closure (forward, backward) to step(), so a
            # pre-hook would run before the gradients exist; the step leaves them as it used them.
            optimizer.register_step_post_hook(
                lambda opt, *_: norms["stepped"].append(total_norm([p for g in opt.param_groups for p in g["params"]])))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # runs before the clipping
            norms["before"].append(total_norm(pl_module.parameters()))

    trainer = L.Trainer(accelerator="cpu", precision=precision, max_steps=3, gradient_clip_val=clip, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[Record()])
    trainer.fit(task, datamodule=data)
    assert len(norms["stepped"]) == 3
    assert min(norms["before"]) > 10 * clip  # the clipping had something to do
    assert max(norms["stepped"]) <= clip * 1.001


def test_two_same_seed_runs_are_bitwise_equal(tmp_path):
    """The default model's sizes and batch (large enough for CPU ops to split work between threads),
    run twice with the same seed: every loss and validation metric is bitwise equal."""
    common = ["--trainer.max_steps=24", "--trainer.val_check_interval=12", "--data.num_train=8192",
              "--data.num_val=512", "--trainer.enable_progress_bar=false", f"--data.data_dir={tmp_path / 'cache'}"]
    runs = []
    for name in ("first", "second"):
        result = run_train(*common, f"--runs_dir={tmp_path / name}")
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(read_metrics(tmp_path / name / "default" / "version_0"))
    for name in ("train/loss", "val/logloss", "val/auc"):
        assert column(runs[0], name) == column(runs[1], name), name


def test_progress_bar_after_a_resume_shows_the_epoch_and_version(tmp_path):
    """A run resumed inside an epoch continues in version_0 and its bar reads "Epoch 1: ... 12/32 ...
    v_num=0", as a fresh run's would (it read "Training: 12/? ... v_num=on_0": Lightning skips
    on_train_epoch_start mid-epoch and shows a string version's last 4 characters), in the TQDM bar
    (never RichProgressBar's "Epoch 0/-2" of a max_steps run)."""
    args = ["--config", "configs/tiny.yaml", f"--runs_dir={tmp_path / 'runs'}", f"--data.data_dir={tmp_path / 'cache'}"]
    first = run_train(*args, "--trainer.max_steps=40")  # tiny: 32 batches an epoch, so step 40 is inside epoch 1
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_train(*args, "--ckpt_path=last", "--trainer.max_steps=44", "--trainer.enable_progress_bar=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    bar = [line for line in resumed.stdout.replace("\r", "\n").splitlines() if "it/s" in line]  # TQDM: stdout
    assert bar and re.match(r"Epoch 1: .*\| 12/32 .*v_num=0\b", bar[-1]), bar[-1]
    assert not any("on_0" in line or "/-2" in line for line in bar), bar
    assert sorted(p.name for p in (tmp_path / "runs" / "tiny").iterdir()) == ["version_0"]


def test_task_trains_through_the_strategys_pipelined_step_while_it_has_one(tmp_path):
    """sharding.pipeline reaches Lightning through the task: while the torchrec strategy holds a
    pipelined step, manual optimization and a step that takes the data iterator (Lightning reads its
    signature); otherwise, and off a Trainer, the plain step under automatic optimization."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    from data.datamodule import CTRDataModule
    from training.strategy import TorchrecStrategy

    data = CTRDataModule(data_dir=str(tmp_path), num_train=64, num_val=32, batch_size=32, vocab_size=50,
                         num_items=50, max_history_len=16)
    task = train.RankingTask(data.schema.to_dict())

    def takes_iterator() -> bool:
        return is_param_in_hook_signature(task.training_step, "dataloader_iter", explicit=True)

    assert task.automatic_optimization and not takes_iterator()
    strategy = TorchrecStrategy()
    task.trainer = SimpleNamespace(strategy=strategy)
    assert task.automatic_optimization and not takes_iterator()
    strategy.pipelined_step = object()  # what TorchrecStrategy.setup builds for a fit with sharding.pipeline
    assert not task.automatic_optimization and takes_iterator()
    strategy.pipelined_step = None
    assert task.automatic_optimization and not takes_iterator()


def test_checkpoint_from_before_the_network_was_named_net_loads(tmp_path):
    """Checkpoints written while RankingTask kept its network as `model` hold "model." keys."""
    from data.datamodule import CTRDataModule

    data = CTRDataModule(data_dir=str(tmp_path), num_train=64, num_val=32, batch_size=32, vocab_size=50,
                         num_items=50, max_history_len=16)
    saved, fresh = (train.RankingTask(data.schema.to_dict()) for _ in range(2))
    state = saved.state_dict()
    old = {f"model.{k.removeprefix('net.')}" if k.startswith("net.") else k: v for k, v in state.items()}
    assert any(k.startswith("model.") for k in old) and not any(k.startswith("net.") for k in old)
    checkpoint = {"state_dict": old}
    fresh.on_load_checkpoint(checkpoint)  # as Lightning and load_from_checkpoint call it, before loading
    fresh.load_state_dict(checkpoint["state_dict"])
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)


@pytest.mark.parametrize("compile,mode,replays", [
    (False, "reduce-overhead", False), (True, "default", False), (True, "reduce-overhead", True),
    (True, "max-autotune", True), (True, "max-autotune-no-cudagraphs", False),
])
def test_steps_are_marked_for_cuda_graphs_in_the_modes_that_record_them(tmp_path, compile, mode, replays, monkeypatch):
    """torch.compile's reduce-overhead and max-autotune modes record CUDA graphs, whose outputs the next replay
    overwrites: every training and scoring step then starts with cudagraph_mark_step_begin, and only then."""
    from data.datamodule import CTRDataModule

    data = CTRDataModule(data_dir=str(tmp_path), num_train=64, num_val=32, batch_size=32, vocab_size=50,
                         num_items=50, max_history_len=16)
    net = train.RankingModelConfig(d_model=32, embedding_dim=8, num_layers=1, compile=compile, compile_mode=mode)
    task = train.RankingTask(data.schema.to_dict(), net)
    assert task.replays_cuda_graphs == replays
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    monkeypatch.setattr(task.net, "forward", lambda batch: (torch.zeros(2), 0))
    task.forward(SimpleNamespace(labels=torch.zeros(2)))
    assert len(marks) == int(replays)
