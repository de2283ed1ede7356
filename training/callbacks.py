"""The training run's callbacks: step metrics, the last-checkpoint schedule, the progress bar.

Lightning objects that train.py puts into every run; the model's code never imports them.
"""

import csv
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from data.batch import Batch
from models.flops import peak_flops
from training.precision import kernel_dtype


@dataclass
class CheckpointConfig:
    """When checkpoints/last.ckpt is refreshed, besides after every validation, at the end of every fit
    and when SIGTERM stops the run: it bounds the work a kill -9 can lose.

    Also which validation metric picks the best checkpoint, the one the test part is scored with.

    Args:
        every_n_steps: after every this many training steps; 0 = not on a step count.
        every_minutes: after the first step this many minutes past the last save; 0 = not on a clock.
            With several processes the clock is read every log_every_n_steps steps (rank 0's decides).
        best_metric: "ne", the validation with the lowest val/ne (log loss over the base rate's), or "auc",
            the highest val/auc, as RecBole's context-aware benchmarks choose (their valid_metric: AUC).
            The first of equal validations is kept.
    """

    every_n_steps: int = 500
    every_minutes: float = 5.0
    best_metric: Literal["ne", "auc"] = "ne"

    def __post_init__(self):
        if self.every_n_steps < 0 or self.every_minutes < 0:
            raise ValueError(f"checkpoint.every_n_steps and checkpoint.every_minutes must be >= 0 (0: off); got "
                             f"{self.every_n_steps} and {self.every_minutes}")


class StepMetrics(Callback):
    """Logs, for every training step: loss, learning rate, step time (ms), samples/s, tokens/s,
    achieved TFLOP/s and MFU (models/flops.py's count over the peak; when one is known).

    Step time is the interval between the starts of consecutive steps, so it includes data
    loading and Lightning's own work; the step before a validation, or the last, ends at its own
    end. On CUDA it comes from events recorded on the stream, and each loss is copied to pinned host
    memory before its step's end event. Every `log_every_n_steps` steps the rows of the windows before
    the current one are logged: their events finished a window ago, so reading them (and the losses)
    does not make the host wait; reading the current window's would drain the device queue (25-37 ms
    steps on the H200, issue 21). Before a validation or checkpoint and at the end, where the host
    waits anyway, every row is logged. Lightning's ThroughputMonitor synchronizes the device every
    step instead, which stops the host from queueing the next step's kernels while this one runs.
    TensorBoard gets the newest row of each flush, the other loggers (metrics.csv) every row: in a
    one-off timing on the 2-core dev CPU (200 log_metrics calls each) a TensorBoardLogger row of these
    7 metrics cost 757 us of host time, a CSVLogger row 24 us. Ten TensorBoard rows a tick may be why
    every 10th step was the slow one where the host is the bottleneck (tlx on the H200, 2026-12-04:
    steps 9 mod 10 took 22.7 ms against ~16). With these changes, on an H100 (compare_h100.md), each
    step index mod 10 has a median within 0.06 ms of the others for tlx (17.61-17.66 ms), triton and fa2;
    whether the H200's faster tlx step is as flat is not yet measured.
    """

    def __init__(self, peak_flops: float | None = None):
        self.peak_flops = peak_flops
        self.pending: list[dict] = []
        self.window_start = 0  # index in pending of the current logging window's first step

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.peak_flops is None:
            self.peak_flops = peak_flops(trainer.strategy.root_device, kernel_dtype(trainer.precision))

    def _mark(self, device: torch.device):
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def _seconds(start, end) -> float:
        if isinstance(start, float):
            return end - start
        return start.elapsed_time(end) / 1e3

    def on_train_batch_start(self, trainer, pl_module, batch: Batch, batch_idx: int) -> None:
        self.pending.append(dict(step=trainer.global_step, start=self._mark(pl_module.device),
                                 lr=trainer.optimizers[0].param_groups[0]["lr"]))  # the rate this step uses

    def on_train_batch_end(self, trainer, pl_module, outputs, batch: Batch, batch_idx: int) -> None:
        record = self.pending[-1]
        steps = pl_module.trained_steps(outputs, batch)
        # Queued before the end event, so every loss is on the host once that event has finished.
        losses = [step["loss"].detach().to("cpu", non_blocking=True) for step in steps]
        record.update(end=self._mark(pl_module.device), steps=[])
        for step, loss in zip(steps, losses):
            tokens, flops = pl_module.step_flops(step["batch"])
            record["steps"].append(dict(loss=loss, lr=step.get("lr", record["lr"]),
                                        samples=step["batch"].batch_size, tokens=tokens, flops=flops))
        if trainer.global_step % trainer.log_every_n_steps < len(steps):  # passed a multiple this step
            shown = self.flush(trainer, keep_last=True, upto=self.window_start)
            self.window_start = len(self.pending)  # the next step opens a new window
            if shown is not None:
                # As a CPU tensor: Lightning would put a float on the module's device and read it back
                # for the progress bar at the end of every step, a host wait per step.
                pl_module.log("train/loss", torch.tensor(shown), prog_bar=True, logger=False, batch_size=1)

    def flush(self, trainer, keep_last: bool, upto: int | None = None) -> float | None:
        """Logs the pending steps before index `upto` (all if None), all but the newest of them if
        keep_last (its interval ends when the next step starts); returns the newest logged loss. A
        step that trained several batches shares its time equally among them, one row each."""
        finished = [r for r in self.pending[:upto] if "end" in r]
        logged = finished[:-1] if keep_last else finished
        if not logged:
            return None
        # The newest event read: every loss copy of the logged steps was queued before it.
        newest_event = finished[len(logged)]["start"] if keep_last else logged[-1]["end"]
        if not isinstance(newest_event, float):
            newest_event.synchronize()  # a wait only when it is the current step's (validation, checkpoint, end)
        every_row = [logger for logger in trainer.loggers if not isinstance(logger, TensorBoardLogger)]
        newest_row = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        for record, following in zip(logged, [*finished[1:], None]):
            seconds = self._seconds(record["start"], following["start"] if following else record["end"])
            seconds /= len(record["steps"])
            for offset, step in enumerate(record["steps"]):
                metrics = {
                    "train/loss": float(step["loss"]), "train/lr": step["lr"], "train/step_ms": seconds * 1e3,
                    "train/samples_per_s": step["samples"] / seconds, "train/tokens_per_s": step["tokens"] / seconds,
                    "train/tflops": step["flops"] / seconds / 1e12,
                }
                if self.peak_flops:
                    metrics["train/mfu"] = step["flops"] / seconds / self.peak_flops
                for logger in every_row:
                    logger.log_metrics(metrics, step=record["step"] + offset)
                last_row = metrics, record["step"] + offset
        for logger in newest_row:
            logger.log_metrics(last_row[0], step=last_row[1])
        self.pending = self.pending[len(logged):]  # the logged records are the oldest ones
        self.window_start = max(self.window_start - len(logged), 0)
        return last_row[0]["train/loss"]

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit":  # the step before a validation ends at its own end
            self.flush(trainer, keep_last=False)

    def on_train_end(self, trainer, pl_module) -> None:
        self.flush(trainer, keep_last=False)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # Every row up to the checkpoint is on disk when the checkpoint is: a run killed after it and
        # resumed from it neither loses nor repeats a row (continue_metrics drops the rest).
        self.flush(trainer, keep_last=False)
        for logger in trainer.loggers:
            logger.save()


# Each best_metric's direction: ModelCheckpoint replaces its kept checkpoint only on a strict improvement.
BEST_METRIC_MODE = {"ne": "min", "auc": "max"}


def best_validation(best_metric: str) -> str:
    """Which validation a best_metric picks, in words: 'lowest val/ne' or 'highest val/auc'."""
    return f"{'lowest' if BEST_METRIC_MODE[best_metric] == 'min' else 'highest'} val/{best_metric}"


class BestCheckpoint(ModelCheckpoint):
    """checkpoints/best-step<N>-<metric><value>.ckpt: the validation that CheckpointConfig.best_metric ranks
    best, which train.py scores the test part with."""

    def __init__(self, best_metric: str):
        super().__init__(monitor=f"val/{best_metric}", mode=BEST_METRIC_MODE[best_metric],
                         filename=f"best-step{{step}}-{best_metric}{{val/{best_metric}:.4f}}",
                         auto_insert_metric_name=False)
        self.description = best_validation(best_metric)  # how this checkpoint is chosen

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        if state_dict.get("dirpath", self.dirpath) != self.dirpath:
            # A rewound run (training/resume.py) trains in a new folder and picks its best among its own
            # validations; Lightning would keep the earlier folder's best, which that run may have replaced since.
            self.best_model_path = ""


class LastCheckpoint(ModelCheckpoint):
    """checkpoints/last.ckpt, the newest state of the run: after every validation (ModelCheckpoint's
    default trigger), on CheckpointConfig's step count and clock, at the end of every fit, and when
    SIGTERM (preemption, `timeout`, a scheduler) stops training. Each save is written beside the last
    one, then renamed over it, so a kill mid-write leaves the previous checkpoint whole."""

    def __init__(self, schedule: CheckpointConfig):
        # No version counter: a resume that starts from another checkpoint of the folder still writes
        # last.ckpt (not last-v1.ckpt beside it), which --ckpt_path last then finds.
        super().__init__(filename="last", enable_version_counter=False)
        self.schedule = schedule
        self.saved_at = time.monotonic()

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self.saved_at = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        every_n_steps, every_minutes = self.schedule.every_n_steps, self.schedule.every_minutes
        # The step that ends the fit saves here rather than in on_train_end: by then Lightning has closed
        # the epoch, and a run resumed from that state would start a new one.
        last_step = 0 < trainer.max_steps <= trainer.global_step
        due = last_step or (every_n_steps > 0 and trainer.global_step % every_n_steps == 0)
        if every_minutes > 0 and (trainer.world_size == 1 or trainer.global_step % trainer.log_every_n_steps == 0):
            late = time.monotonic() - self.saved_at >= every_minutes * 60
            due = due or (trainer.strategy.broadcast(late) if trainer.world_size > 1 else late)
        if due and not self.validation_follows(trainer):
            self.save_now(trainer)

    def on_train_end(self, trainer, pl_module) -> None:  # a fit that ended on max_epochs, max_time or a stop
        self.save_now(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # A scheduler's SIGTERM, or Ctrl-C (SIGINT, which Lightning turns into an exit after this hook).
        if not isinstance(exception, (SIGTERMException, KeyboardInterrupt)) or trainer.state.fn != "fit":
            return
        if trainer.validating or self.validation_follows(trainer):
            # A checkpoint before a validation would resume past it and skip it; one during it would
            # lose the metrics it has gathered. The last one saved stays.
            stop = "SIGTERM" if isinstance(exception, SIGTERMException) else "Ctrl-C"
            rank_zero_only(print)(f"{stop} before the step-{trainer.global_step} validation finished: "
                                  f"{self.dirpath}/last.ckpt is from step {self._last_global_step_saved}",
                                  file=sys.stderr)
            return
        self.save_now(trainer)

    @staticmethod
    def validation_follows(trainer) -> bool:
        """Whether Lightning validates right after this training step. Lightning's own test, private:
        a step-count checkpoint taken before a validation would resume past it without running it
        (tests/test_train.py's kill-and-resume tests fail if this stops matching Lightning)."""
        return trainer.fit_loop.epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)

    def save_now(self, trainer) -> None:
        # ModelCheckpoint's own save path (private; no public method saves on demand): it names the
        # file, keeps last_model_path for the next resume and calls _save_checkpoint below.
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        partial = f"{filepath}.partial"
        super()._save_checkpoint(trainer, partial)  # every rank; ends at a barrier
        if trainer.is_global_zero:
            replace_checkpoint(partial, filepath)
        trainer.strategy.barrier()
        self._last_checkpoint_saved = filepath
        self.saved_at = time.monotonic()


def replace_checkpoint(source: str, target: str) -> None:
    """Renames the checkpoint `source` (a .ckpt file, or the torchrec strategy's folder) over `target`."""
    if os.path.isdir(target):  # a folder cannot be renamed over a non-empty one: move it aside first
        stale = f"{target}.stale"
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(target, stale)
        os.replace(source, target)
        shutil.rmtree(stale)
    else:
        os.replace(source, target)


def continue_metrics(csv_logger: CSVLogger, checkpoint_step: int, source: Path) -> None:
    """Lets a resumed run append to its metrics.csv: it starts with `source`'s rows of the steps before
    the checkpoint (a validation is logged at the index of the step it follows). In the run's own
    folder (source is its metrics.csv) that drops what a killed run logged after the checkpoint; a
    rewound run's new folder gets the earlier run's rows up to it."""
    path = Path(csv_logger.log_dir) / "metrics.csv"
    header, rows = [], []
    if source.exists():
        with open(source, newline="") as f:
            reader = csv.DictReader(f)
            header, rows = list(reader.fieldnames or []), list(reader)
    with warnings.catch_warnings():  # its "previous log files will be deleted": the rows are written back below
        warnings.filterwarnings("ignore", message=".*Previous log files in this directory will be deleted.*")
        writer = csv_logger.experiment  # Lightning's CSV writer deletes an existing metrics.csv on opening
    if not header:
        return
    kept = [row for row in rows if int(row["step"]) < checkpoint_step]
    with open(path, "w", newline="") as f:
        rewriter = csv.DictWriter(f, fieldnames=header)
        rewriter.writeheader()
        rewriter.writerows(kept)
    # It appends under the keys it has seen: give it the file's, or its first append would rewrite
    # the file under only the columns logged since.
    writer.metrics_keys = header


class RunProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar, titled "Epoch N" and counted against the epoch's batches also when a
    resumed run starts inside an epoch: Lightning then skips on_train_epoch_start, and the bar read
    "Training: 12/?" (its count is the batch's index in the epoch, its total the run's remaining
    steps). Chosen over Lightning's default where rich is installed, RichProgressBar, which titles
    a max_steps run "Epoch 0/-2" (max_epochs - 1 of the unbounded -1)."""

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self.on_train_epoch_start(trainer, pl_module)  # a fresh epoch calls it again, with Lightning's total
        self.train_progress_bar.total = convert_inf(trainer.num_training_batches)
