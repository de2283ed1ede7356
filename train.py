"""Train the block-attention ranking model (models/ranking.py) on a CTR dataset (data/).

    python train.py                                    # configs/default.yaml: CPU, about two minutes
    python train.py --config configs/gpu.yaml          # one H200, bf16-mixed, compiled, CUDA graphs
    python train.py --attn=triton                      # shortcut for --model.net.attn_backend=triton
    python train.py --trainer.max_steps=50 --model.net.num_layers=1 --data.batch_size=128
    python train.py --ckpt_path runs/default/version_0/checkpoints/last.ckpt   # resume in that folder
    python train.py --ckpt_path last                   # resume the newest last.ckpt of run_name
    python train.py --help                             # every key
    python train.py compare ...                        # train several backends and compare (benchmarks/compare)

configs/default.yaml is always loaded first; --config files and command-line keys override it.
Each run writes runs/<run_name>/version_N/: config.yaml (the resolved config), metrics.csv,
TensorBoard events and checkpoints/. A resumed run continues in its checkpoint's folder.
"""

import os

# fbtriton's C launch path (the kernel lookup and the launch in C, not Python): called eagerly, the fused
# attention sublayer's forward+backward took 1.03x its CUDA-graph time with it and 1.42x without (H100,
# benchmarks/results/host_c_cache_h100.md), and the GPU parity tests pass under it. fbtriton reads the first
# name when a kernel is defined, so both are set before anything imports the kernels; a value already in the
# environment wins (0 turns the path off), and other Triton builds ignore both names.
C_LAUNCH_ENVIRONMENT = {"TRITON_ENABLE_C_CACHE": "1", "TRITON_USE_C_DISPATCHER": "1"}
for _name, _value in C_LAUNCH_ENVIRONMENT.items():
    os.environ.setdefault(_name, _value)

import json  # noqa: E402 (the environment above must come first)
import math
import signal
import sys
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ProgressBar, Timer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAUROC

import kernels
import models.sharding as sharding
from data.baseline import logistic_regression_auc
from data.batch import Batch
from data.datamodule import CTRDataModule
from data.schema import FeatureSchema
from models import RankingModel, RankingModelConfig
from models.baselines import ARCHS, BLOCK_ATTENTION, BaselineConfig, BaselineModel
from models.flops import sample_token_counts, train_step_flops
from models import memory
from training.callbacks import (
    BestCheckpoint, CheckpointConfig, LastCheckpoint, RunProgressBar, StepMetrics, continue_metrics,
)
from training.graphed_optimizer import CUDAGraphAdamW
from training.pipeline import PipelinedTrainingStep
from training.precision import kernel_dtype
from training.resume import config_differences, plan_resume
from training.strategy import TorchrecStrategy  # importing it registers strategy="torchrec"

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "default.yaml"


# The learning-rate schedule's length, which a checkpoint keeps: a resume with another max_steps restretches it.
SCHEDULE_STEPS_KEY = "lr_schedule_steps"


@dataclass
class OptimConfig:
    """AdamW with linear warmup, then cosine decay.

    Args:
        lr: peak learning rate.
        weight_decay: applied to weight matrices only, not to embeddings, norms or biases.
        warmup_steps: linear warmup, then cosine decay to min_lr_ratio * lr at the last step.
        min_lr_ratio: final learning rate as a fraction of lr.
        fused: AdamW's fused CUDA kernel: one launch updates every parameter, where the default
            multi-tensor AdamW issues a dozen launches and a host loop over the parameters each step.
            None = fused when every parameter is on a GPU and the precision is not "16-mixed" (whose
            gradient scaler must unscale before clipping, which a fused AdamW does inside its step).
        cuda_graph: the gradient clipping and the fused AdamW update replayed from one CUDA graph
            (training/graphed_optimizer.py) from the second step on: one launch of host time a step
            instead of milliseconds; the learning rate reaches the update as a float32. Needs a CUDA
            device, a precision other than "16-mixed", fused not False, and the plain strategy (not
            torchrec's).
    """

    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    fused: bool | None = None
    cuda_graph: bool = False

    def __post_init__(self):
        problems = {"lr": self.lr > 0, "weight_decay": self.weight_decay >= 0, "warmup_steps": self.warmup_steps >= 0,
                    "min_lr_ratio": 0 <= self.min_lr_ratio <= 1}
        bad = [f"{name}={getattr(self, name)}" for name, ok in problems.items() if not ok]
        if bad:
            raise ValueError(f"model.optim needs lr > 0, weight_decay >= 0, warmup_steps >= 0 and 0 <= min_lr_ratio <= 1; "
                             f"got {', '.join(bad)}")

    def lr_factor(self, step: int, total_steps: int) -> float:
        """The learning rate at `step` of a `total_steps` schedule, as a fraction of lr."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min((step - self.warmup_steps) / max(total_steps - self.warmup_steps, 1), 1.0)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_config_error(optim: OptimConfig, trainer: L.Trainer) -> str | None:
    """Why this optimizer config cannot train on this trainer, or None."""
    if not optim.cuda_graph:
        return None
    problems = {
        "the device is not a CUDA GPU": trainer.strategy.root_device.type != "cuda",
        "trainer.precision is 16-mixed, whose gradient scaler unscales on the host":
            str(trainer.precision) == "16-mixed",
        "model.optim.fused is false: the graph captures the fused update": optim.fused is False,
        "trainer.strategy is torchrec, whose pipelined step drives the optimizer itself": isinstance(
            trainer.strategy, TorchrecStrategy),
    }
    reasons = [reason for reason, applies in problems.items() if applies]
    return f"model.optim.cuda_graph=true cannot train here: {'; '.join(reasons)}" if reasons else None


class RankingTask(L.LightningModule):
    """The network plus its loss, metrics and optimizer: the LightningModule, `model` in the config.

    Args:
        schema: the dataset's features, FeatureSchema.to_dict's form (linked from the data module, never
            set in a config). Plain data, so checkpoints hold no classes and load with weights_only=True.
        net: the block-attention network's sizes, attention backend and compilation (`model.net`).
        optim: optimizer and learning-rate schedule.
        peak_flops: the FLOP/s MFU is measured against; None = the device's dense bf16/fp16 datasheet
            peak when training runs in bf16/fp16 on a known GPU (H100, H200, A100), else no MFU.
        arch: the architecture: block_attention (models/ranking.py, sized by `net`) or a baseline
            (models/baselines.py, sized by `baseline`): lr, dlrm, dcnv2, deepfm.
        baseline: the baselines' sizes.

    The network (an nn.Module) is `self.net`: a RankingModel built from `net`, or a BaselineModel.
    """

    def __init__(
        self,
        schema: dict,
        net: RankingModelConfig = RankingModelConfig(),
        optim: OptimConfig = OptimConfig(),
        peak_flops: float | None = None,
        arch: Literal[ARCHS] = BLOCK_ATTENTION,
        baseline: BaselineConfig = BaselineConfig(),
    ):
        super().__init__()
        # The resolved config.yaml in the run folder is the readable record; the
        # checkpoint keeps these so RankingTask.load_from_checkpoint rebuilds the network.
        self.save_hyperparameters(logger=False)
        self.optim_config = optim
        schema = FeatureSchema.from_dict(schema)
        self.net = RankingModel(schema, net) if arch == BLOCK_ATTENTION else BaselineModel(schema, arch, baseline)
        self.val_logloss = MeanMetric()
        self.val_ctr = MeanMetric()
        self.val_mean_prediction = MeanMetric()
        self.val_auc = BinaryAUROC()
        self.schedule_steps: int | None = None  # the learning-rate schedule's length, set by configure_optimizers
        self.resumed_schedule: tuple | None = None  # a checkpoint's (step, schedule length, optim settings)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Restored before configure_optimizers runs, which compares the schedule's length with this run's.
        if SCHEDULE_STEPS_KEY in checkpoint:
            saved_optim = (checkpoint.get("hyper_parameters") or {}).get("optim")
            self.resumed_schedule = (int(checkpoint["global_step"]), int(checkpoint[SCHEDULE_STEPS_KEY]), saved_optim)
        state = checkpoint.get("state_dict")
        for new, old in sharding.RENAMED_PREFIXES.items():  # a checkpoint from before a rename
            if state and not any(key.startswith(new) for key in state):
                checkpoint["state_dict"] = state = {new + key.removeprefix(old) if key.startswith(old) else key: value
                                                    for key, value in state.items()}

    def step_flops(self, batch: Batch) -> tuple[int, int]:
        """(tokens, training FLOPs) of a batch, from its host-side lengths: no device read."""
        if isinstance(self.net, BaselineModel):  # no tokens; FLOPs per sample
            return 0, self.net.train_step_flops(batch.batch_size)
        history = batch.history_lengths
        if history is None:  # a Batch built by hand rather than by the collate: read the lengths
            lengths = batch.sequence.lengths().view(-1, batch.batch_size) if batch.sequence.keys() else None
            history = lengths.sum(0).cpu().numpy() if lengths is not None else [0] * batch.batch_size
        config, schema = self.net.config, self.net.schema
        return int(sample_token_counts(config, schema, history).sum()), train_step_flops(config, schema, history)

    # How the task trains follows the strategy's config: with sharding.pipeline the TorchrecStrategy
    # holds a PipelinedTrainingStep (training/pipeline.py) while it fits, and the task trains through
    # it: manual optimization (the pipeline steps the optimizer) and a step that takes Lightning's data
    # iterator (Lightning reads the step's signature). Computed rather than set in __init__: Lightning
    # refuses Trainer(gradient_clip_val) for a manual-optimization module before the strategy is set
    # up, and the pipelined step clips as that setting says.

    @property
    def pipelined_step(self) -> PipelinedTrainingStep | None:
        """The strategy's pipelined training step while a fit runs with sharding.pipeline, else None."""
        try:
            strategy = self.trainer.strategy
        except RuntimeError:  # not attached to a Trainer
            return None
        return strategy.pipelined_step if isinstance(strategy, TorchrecStrategy) else None

    @property
    def replays_cuda_graphs(self) -> bool:
        """Whether the compiled tower replays CUDA graphs: torch.compile's modes "reduce-overhead" and
        "max-autotune" both record them ("max-autotune-no-cudagraphs" does not)."""
        config = self.net.config
        return config.compile and config.compile_mode in ("reduce-overhead", "max-autotune")

    @property
    def automatic_optimization(self) -> bool:
        return self.pipelined_step is None

    @property
    def training_step(self):
        """The step Lightning runs: plain_training_step, or pipelined_training_step through the pipeline."""
        return self.plain_training_step if self.pipelined_step is None else self.pipelined_training_step

    def forward(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """The training loss, and the step's outputs: what torchrec's TrainPipelineSparseDist calls."""
        if self.replays_cuda_graphs:
            # CUDA-graph trees reuse their output memory from step to step: tell them a new one starts.
            torch.compiler.cudagraph_mark_step_begin()
        logits, _ = self.net(batch)
        loss = self.net.loss(logits, batch.labels)
        return loss, {"loss": loss.detach(), "batch": batch}

    def plain_training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        # Logged by StepMetrics, a window of steps at a time: a per-step self.log of a tensor would
        # read it back to the host (the progress bar does) and stall the device queue every step.
        loss, _ = self(batch)
        return loss

    def pipelined_training_step(self, dataloader_iter) -> dict:
        """One batch, or at the end of an epoch's batches every one still in flight, trained by the
        pipeline. "steps" holds each trained batch's outputs (forward's, with "lr")."""
        steps = self.pipelined_step(dataloader_iter)
        if isinstance(self.trainer.datamodule, CTRDataModule):
            for step in steps:  # counted once trained: the pipeline fetched it two steps earlier
                self.trainer.datamodule.count_trained(step["batch"])
        return {"loss": steps[-1]["loss"], "steps": steps}

    @staticmethod
    def trained_steps(outputs: dict, batch: Batch) -> list[dict]:
        """What a training step trained, one dict ("loss", "batch", ...) per batch. A pipelined step
        trains a batch fetched two steps earlier, and at the end of an epoch's batches all that are left:
        its outputs list them. Otherwise it is the batch Lightning's hooks are given."""
        return outputs.get("steps") or [{"loss": outputs["loss"], "batch": batch}]

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.score(batch)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self.score(batch)

    def score(self, batch: Batch) -> None:
        """Adds a validation or test batch's predictions to the metrics."""
        if self.replays_cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        logits, _ = self.net(batch)
        logits, labels = logits.float(), batch.labels.float()
        predictions = torch.sigmoid(logits)
        self.val_logloss.update(F.binary_cross_entropy_with_logits(logits, labels, reduction="none"))
        self.val_ctr.update(labels)
        self.val_mean_prediction.update(predictions)
        self.val_auc.update(predictions, labels.long())

    def on_validation_epoch_end(self) -> None:
        self.log_scores("val")

    def on_test_epoch_end(self) -> None:
        self.log_scores("test")

    def log_scores(self, prefix: str) -> None:
        """Logs <prefix>/logloss, ne, auc and calibration of the batches scored since the last call."""
        # torchmetrics reduces across processes (every rank's predictions count once).
        logloss, ctr = self.val_logloss.compute(), self.val_ctr.compute()
        # Normalized entropy: log loss over that of always predicting the scored split's CTR
        # (the label entropy); below 1 means the model beats the base rate.
        p = ctr.clamp(1e-7, 1 - 1e-7)
        base_rate_logloss = -(p * torch.log(p) + (1 - p) * torch.log(1 - p))
        self.log_dict(
            {
                f"{prefix}/logloss": logloss,
                f"{prefix}/ne": logloss / base_rate_logloss,
                f"{prefix}/auc": self.val_auc.compute(),
                f"{prefix}/calibration": self.val_mean_prediction.compute() / ctr,
            },
            prog_bar=True,
        )
        for metric in (self.val_logloss, self.val_ctr, self.val_mean_prediction, self.val_auc):
            metric.reset()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """trainer.gradient_clip_val, clipped here without a gradient scaler (fp32, bf16): Lightning's
        own clipping refuses any fused optimizer under mixed precision, although only fp16's scaled
        gradients need the optimizer to unscale first."""
        plugin = self.trainer.precision_plugin
        algorithm = GradClipAlgorithmType(gradient_clip_algorithm or "norm")  # Lightning's default, as it sets it
        if gradient_clip_val and isinstance(optimizer, CUDAGraphAdamW):  # clipped inside its (graphed) step
            optimizer.clip_gradients(algorithm.value, gradient_clip_val)
            return
        if not gradient_clip_val or getattr(plugin, "scaler", None) is not None:
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        # Lightning's clipping itself (by norm or value, over the optimizer's parameters), minus the
        # mixed-precision plugin's refusal.
        Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)

    def configure_optimizers(self):
        # Under the torchrec strategy the sharded tables train with their fused sparse optimizer
        # inside backward: the dense optimizer owns everything else (data_parallel tables included).
        embedding_ids = sharding.embedding_parameter_ids(self.net)
        decay, no_decay = [], []
        for parameter in sharding.dense_parameters(self.net):
            is_matrix = parameter.dim() >= 2 and id(parameter) not in embedding_ids
            (decay if is_matrix else no_decay).append(parameter)
        optim = self.optim_config
        groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if optim.cuda_graph:
            if (error := optimizer_config_error(optim, self.trainer)) is not None:
                raise MisconfigurationException(error)
            optimizer = CUDAGraphAdamW(groups, lr=optim.lr)
        else:
            fused = optim.fused
            if fused is None:
                fused = all(p.is_cuda for p in decay + no_decay) and str(self.trainer.precision) != "16-mixed"
            optimizer = torch.optim.AdamW(groups, lr=optim.lr, fused=fused)
        self.schedule_steps = total_steps = max(int(self.trainer.estimated_stepping_batches), 1)
        if self.resumed_schedule is not None and self.global_rank == 0:
            # The schedule's position is restored, its shape is this run's: the rate jumps where they differ.
            step, saved_steps, saved_optim = self.resumed_schedule
            if isinstance(saved_optim, dict):  # as a checkpoint of train.py holds it
                known = {field.name for field in fields(OptimConfig)}
                saved_optim = OptimConfig(**{k: v for k, v in saved_optim.items() if k in known})
            elif not isinstance(saved_optim, OptimConfig):
                saved_optim = optim
            before = saved_optim.lr * saved_optim.lr_factor(step, saved_steps)
            now = optim.lr * optim.lr_factor(step, total_steps)
            if not math.isclose(before, now, rel_tol=1e-6):
                print(f"note: the checkpoint's learning-rate schedule ran over {saved_steps} steps, this run's over "
                      f"{total_steps} (trainer.max_steps, and model.optim's warmup_steps and min_lr_ratio shape it): "
                      f"at step {step} the learning rate goes from {before:.3g} to {now:.3g}")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: optim.lr_factor(step, total_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[SCHEDULE_STEPS_KEY] = self.schedule_steps


class RankingArgumentParser(LightningArgumentParser):
    """A config error is the error and a pointer to --help, not argparse's usage line of every key."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:  # jsonargparse trying an alternative: it handles the error itself
            return super().error(message, ex)
        message = " ".join(message.split())  # jsonargparse wraps some messages over several lines
        print(f"error: {message} (python train.py --help lists every key)", file=sys.stderr)
        raise SystemExit(2)


class RankingCLI(LightningCLI):
    """LightningCLI without subcommands: the config keys are run_name, runs_dir, attn, ckpt_path,
    dry_run, baseline, seed_everything, checkpoint (CheckpointConfig), model (RankingTask), data
    (CTRDataModule), sharding (models.sharding.ShardingConfig, used with trainer.strategy: torchrec)
    and trainer."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--run_name", type=str, default="default", help="runs go to <runs_dir>/<run_name>/version_N/")
        parser.add_argument("--runs_dir", type=str, default="runs")
        parser.add_argument(
            # Not `| None`: jsonargparse's error for a union lists every member's failure; None = not given.
            "--attn", type=kernels.AttentionBackend, default=None,
            help="shortcut for --model.net.attn_backend",
        )
        parser.add_argument("--ckpt_path", type=str | None, default=None,
                            help="checkpoint to resume training from, with the settings it was trained with; the "
                            "run continues in its folder (in a new version of the run when that folder's last.ckpt is "
                            "further on). 'last': the newest last.ckpt under <runs_dir>/<run_name>/")
        parser.add_argument(
            "--dry_run", type=bool, default=False,
            help="check the config (build the model, data module and trainer), print it resolved as YAML and "
            "exit, preparing no data and training nothing",
        )
        parser.add_argument(
            "--baseline", type=bool, default=False,
            help="after training, fit a logistic regression (no feature interactions) on the same split "
            "and report both validation AUCs in <run folder>/baseline.json",
        )
        parser.add_argument(
            "--memory_limit_gib", type=float | None, default=None,
            help="refuse to train when the estimated training memory (weights, gradients, AdamW state, "
            "activations) exceeds this; default: what the device has available; 0: no check",
        )
        parser.add_class_arguments(CheckpointConfig, "checkpoint", instantiate=False)
        parser.add_class_arguments(sharding.ShardingConfig, "sharding", instantiate=False)
        # The model's features are the dataset's: set by the data module, never in a config.
        parser.link_arguments("data", "model.schema", compute_fn=lambda data: data.schema.to_dict(),
                              apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        config = self.config
        if config.attn is not None:
            config.model.net.attn_backend = config.attn
        if config.trainer.max_steps == 0:
            raise ValueError("trainer.max_steps=0 trains nothing (-1: no step limit, train max_epochs)")
        if problems := trainer_setting_problems(config.trainer):
            raise ValueError("; ".join(problems))
        self.resume_plan = None
        if config.ckpt_path:
            self.resume_plan = plan = plan_resume(config.ckpt_path, Path(config.runs_dir) / config.run_name)
            config.ckpt_path = plan.ckpt_path
            if 0 < (config.trainer.max_steps or -1) <= plan.step:
                raise ValueError(f"--ckpt_path {config.ckpt_path} is at step {plan.step} and trainer.max_steps="
                                 f"{config.trainer.max_steps}: nothing is left to train; raise trainer.max_steps")
            if config.trainer.max_time is not None:  # Lightning's Timer goes on from the checkpoint's training time
                timer = Timer(duration=config.trainer.max_time)
                timer.load_state_dict((plan.metadata.get("callbacks") or {}).get(timer.state_key) or {})
                if timer.time_remaining() <= 0:
                    raise ValueError(f"--ckpt_path {config.ckpt_path} has trained {timer.time_elapsed():.0f} s and "
                                     f"trainer.max_time={config.trainer.max_time}: nothing is left to train; raise "
                                     f"trainer.max_time")
            if plan.run_folder is not None:  # the run keeps its own name and runs folder, whatever the flags say
                runs_dir = plan.run_folder.parent.parent
                if Path(config.runs_dir).resolve() != runs_dir:
                    config.runs_dir = str(runs_dir)
                config.run_name = plan.run_folder.parent.name
        check_runs_dir(Path(config.runs_dir))

    def instantiate_trainer(self, **kwargs) -> L.Trainer:
        config, plan = self.config, self.resume_plan
        version = None
        if plan is not None:
            # Before anything is written to the run's folder (its metrics below, config.yaml when fit starts).
            differences = config_differences(plan.metadata, self.model.hparams, self.datamodule.data_stream)
            if differences:
                shown = "; ".join(differences[:4]) + (f"; ... ({len(differences)} in all)" if len(differences) > 4 else "")
                raise ValueError(f"--ckpt_path {config.ckpt_path} was trained with other settings: {shown}. Resume with "
                                 f"the checkpoint's (its run folder's config.yaml), or train a new run")
            if plan.in_place:  # As a number, as a fresh run's: the progress bar shows a string's last 4 characters.
                suffix = plan.run_folder.name.removeprefix("version_")
                version = int(suffix) if suffix.isdigit() else plan.run_folder.name
        csv_logger = CSVLogger(config.runs_dir, name=config.run_name, version=version)
        if plan is not None and plan.run_folder is not None and rank_zero_only.rank == 0:
            continue_metrics(csv_logger, plan.step, plan.run_folder / "metrics.csv")
            if plan.rewind_of is not None:
                print(f"--ckpt_path is at step {plan.step} of {plan.run_folder}, whose last.ckpt is at step "
                      f"{plan.rewind_of}: training on from step {plan.step} in {csv_logger.log_dir}, which starts "
                      f"with that run's metrics up to step {plan.step}; {plan.run_folder.name} stays as it was")
        loggers = [
            csv_logger,
            TensorBoardLogger(config.runs_dir, name=config.run_name, version=csv_logger.version,
                              default_hp_metric=False),
        ]
        callbacks = [
            # Two checkpointers: Lightning 2.6 only refreshes a monitoring checkpointer's last.ckpt
            # when the monitored metric improved, and resuming wants the latest state.
            BestCheckpoint(config.checkpoint.best_metric),
            LastCheckpoint(CheckpointConfig(**config.checkpoint.as_dict())),
            StepMetrics(config.model.peak_flops),
            *(self.config_init.get("trainer.callbacks") or []),  # the config's own
        ]
        if config.trainer.enable_progress_bar is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(RunProgressBar())
        if config.trainer.strategy == "torchrec":  # with this config's sharding, not the defaults
            kwargs["strategy"] = TorchrecStrategy(sharding.ShardingConfig(**config.sharding.as_dict()))
        # The data module shards rows by rank itself (ShardedSampler), without repeating any.
        return super().instantiate_trainer(logger=loggers, callbacks=callbacks, use_distributed_sampler=False,
                                           **kwargs)


# Lightning's precision settings the model trains under: the "-true" ones other than fp32 cast the weights
# but not the batch's dense features, and the first step fails on mixed dtypes.
TRAINABLE_PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16", "16-mixed", "16")


def trainer_setting_problems(trainer) -> list[str]:
    """What in the trainer's settings (LightningCLI's namespace) this training path cannot honour."""
    problems = []
    if trainer.precision is not None and str(trainer.precision) not in TRAINABLE_PRECISIONS:
        problems.append(f"trainer.precision={trainer.precision} is not one this model trains under "
                        f"({', '.join(TRAINABLE_PRECISIONS[::2])})")
    if (trainer.accumulate_grad_batches or 1) != 1:
        problems.append(f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported: the logged "
                        f"loss would be divided by it, and the step metrics and val_check_interval would count "
                        f"batches, not optimizer steps; raise data.batch_size instead")
    if trainer.log_every_n_steps is not None and trainer.log_every_n_steps < 1:
        problems.append(f"trainer.log_every_n_steps={trainer.log_every_n_steps} must be >= 1")
    if isinstance(trainer.val_check_interval, (int, float)) and trainer.val_check_interval <= 0:
        problems.append(f"trainer.val_check_interval={trainer.val_check_interval} must be > 0")
    return problems


def check_runs_dir(runs_dir: Path) -> None:
    """ValueError naming runs_dir when runs cannot be written there (before any data is prepared)."""
    if runs_dir.exists() and not runs_dir.is_dir():
        raise ValueError(f"runs_dir={runs_dir} is a file, not a folder: give a folder for the runs")
    existing = next(folder for folder in (runs_dir, *runs_dir.absolute().parents) if folder.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"runs_dir={runs_dir}: cannot write there ({existing} is not a writable folder)")


def main(argv: list[str] | None = None) -> None:
    # The data module saves and restores its sampler's place in the epoch itself (CTRDataModule.state_dict),
    # which Lightning's resumable-loader test cannot see: its warning on every mid-epoch resume is wrong here.
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
    try:
        cli = RankingCLI(
            RankingTask, CTRDataModule, run=False, args=argv, seed_everything_default=0,
            parser_class=RankingArgumentParser,
            auto_configure_optimizers=False, save_config_kwargs={"overwrite": True},
            parser_kwargs={"default_config_files": [str(DEFAULT_CONFIG)], "parser_mode": "yaml",
                           "description": __doc__.split("\n\n")[0]},
        )
    except (ValueError, MisconfigurationException) as error:  # a model/data/trainer setting rejected
        if "No supported gpu backend found" in str(error):  # Lightning's words for accelerator "gpu" without one
            error = ("trainer.accelerator is 'gpu' (configs/gpu.yaml sets it) but this machine has no CUDA GPU: "
                     "leave that config out, or pass --trainer.accelerator=cpu")
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    trainer, task, datamodule = cli.trainer, cli.model, cli.datamodule
    if trainer.strategy.root_device.type == "cuda":
        # Lets the matmuls that bf16-mixed keeps in fp32 use TF32 tensor cores (CPU numerics stay exact).
        torch.set_float32_matmul_precision("high")
    # Fail before any data is prepared if the chosen kernel cannot run on this device, or not in the
    # dtype this precision gives it (else the first step fails, after the data and the compile).
    try:
        if isinstance(task.net, RankingModel):
            net, device = task.net.config, trainer.strategy.root_device
            kernels.check_backend(net.attn_backend, device)
            if net.fused_attention:
                kernels.check_attention_sublayer_backend(net.attention_sublayer_backend, device)
            if net.fused_mlp:
                kernels.check_mlp_backend(net.mlp_backend, device)
            if net.attn_backend != "auto":
                q = torch.empty(0, net.num_heads, net.head_dim, dtype=kernel_dtype(trainer.precision), device=device)
                reason = kernels.get_backend(net.attn_backend).unsupported_reason(q)
                if reason is not None:
                    raise kernels.BackendUnavailableError(
                        f"block_attention backend {net.attn_backend!r} does not support {reason}, as this model "
                        f"(model.net.d_model={net.d_model}, num_heads={net.num_heads}) under "
                        f"trainer.precision={trainer.precision} would call it: change them or the backend")
    except kernels.BackendUnavailableError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if (error := optimizer_config_error(task.optim_config, trainer)) is not None:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2)
    try:
        check_training_memory(task.net, datamodule.batch_size, trainer, cli.config)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if cli.config.dry_run:
        print(cli.parser.dump(cli.config, skip_none=False), end="")  # as SaveConfigCallback writes it
        return
    if trainer.world_size == 1:  # several processes prepare the data in Lightning's order, inside fit
        try:  # the data's errors name the file, row and value: no traceback to add to them
            datamodule.prepare_data()
            datamodule.setup("fit")
        except (ValueError, OSError) as error:
            if isinstance(error, OSError) and error.strerror:  # the system's words: say whose folder it is
                error = f"data.data_dir={datamodule.args.data_dir}: {error.strerror}: {error.filename}"
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
    try:
        trainer.fit(task, datamodule=datamodule, ckpt_path=cli.config.ckpt_path, weights_only=True)
    except SIGTERMException:
        print(f"stopped by SIGTERM at step {trainer.global_step}; resume with --ckpt_path last", file=sys.stderr)
        raise SystemExit(128 + signal.SIGTERM) from None
    except SystemExit:  # Lightning's own exit after a Ctrl-C (LastCheckpoint saved the step it stopped at)
        if not trainer.interrupted:
            raise
        print(f"stopped by Ctrl-C at step {trainer.global_step}; resume with --ckpt_path last", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    if trainer.fast_dev_run:  # Lightning's smoke run: no loggers, no checkpoints, no run folder to report
        print(f"fast_dev_run: {trainer.global_step} step(s) trained and validated; nothing was written")
        return
    # Read now: test scoring below restores the callbacks' state from the best checkpoint, which may predate
    # the newest last.ckpt.
    summary = run_summary(trainer)
    if cli.config.baseline:
        report_baseline(trainer, task, datamodule, Path(trainer.loggers[0].log_dir))
    if datamodule.has_test_split:
        report_test(trainer, task, datamodule, Path(trainer.loggers[0].log_dir))
    if trainer.is_global_zero:
        print(summary)


def check_training_memory(net: torch.nn.Module, batch_size: int, trainer: L.Trainer, config) -> None:
    """ValueError when the network's dense training state and activations (models/memory.py) exceed
    --memory_limit_gib, by default what the device has available; the weights already built on the
    CPU count as held."""
    if config.memory_limit_gib == 0 or config.trainer.strategy == "torchrec":  # fused sparse optimizers
        return
    device = trainer.strategy.root_device
    if isinstance(net, RankingModel):
        sizes = net.config
        tokens_per_sample = net.tower.num_fixed_tokens + sum(max_len for _, _, max_len in net.schema.sequence)
        estimate = memory.estimate_training_memory(net, batch_size * tokens_per_sample, sizes.d_model,
                                                   sizes.num_layers, sizes.mlp_ratio)
    else:  # a baseline: no tokens, and activations of a few hundred values a sample
        estimate = memory.estimate_training_memory(net, 0, 0, 0, 0)
    held = 4 * estimate.parameters if device.type == "cpu" else 0  # fp32 weights, built on the CPU
    if config.memory_limit_gib is not None:
        limit, where = int(config.memory_limit_gib * memory.GIB) - held, "--memory_limit_gib"
    else:
        limit, where = memory.available_bytes(device), f"this machine's {device.type} memory"
        if limit is None:
            return
    memory.check_fits(estimate, limit, held, where)


def best_checkpoint(trainer: L.Trainer) -> BestCheckpoint:
    """The run's best-validation checkpointer (train.py puts exactly one into every run)."""
    return next(c for c in trainer.checkpoint_callbacks if isinstance(c, BestCheckpoint))


def run_summary(trainer: L.Trainer) -> str:
    """Where the run went: its folder, metrics, checkpoints and how to look at it."""
    run_dir = Path(trainer.loggers[0].log_dir)
    best = best_checkpoint(trainer)
    last = next((c.best_model_path for c in trainer.checkpoint_callbacks if isinstance(c, LastCheckpoint)), "")
    return (f"run folder: {run_dir}\n  metrics: {run_dir / 'metrics.csv'}\n"
            f"  best checkpoint ({best.description}): {best.best_model_path or 'none (no validation ran)'}\n"
            f"  last checkpoint: {last or 'none'} (resume: --ckpt_path last)\n"
            f"  tensorboard --logdir {run_dir.parent}")


def report_test(trainer: L.Trainer, task: RankingTask, datamodule: CTRDataModule, run_dir: Path) -> None:
    """Scores the test split once, with the checkpoint of the best validation (checkpoint.best_metric's:
    lowest val/ne by default): the test part plays no role in choosing it. test.json holds the scores and
    which checkpoint made them."""
    best = best_checkpoint(trainer).best_model_path
    (scores,) = trainer.test(task, datamodule=datamodule, ckpt_path=best or None, weights_only=True, verbose=False)
    result = {"checkpoint": best or "the final weights (no validation ran)", **{k: float(v) for k, v in scores.items()}}
    if trainer.is_global_zero:
        (run_dir / "test.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"test AUC {result['test/auc']:.4f}, log loss {result['test/logloss']:.4f} ({result['checkpoint']})")


def report_baseline(trainer: L.Trainer, task: RankingTask, datamodule: CTRDataModule, run_dir: Path) -> None:
    """The bar the interaction model must clear: an additive logistic regression, same split. The
    model's side is its last validation, or, where fit ran none (max_steps below val_check_interval),
    one validation of the final weights."""
    baseline_auc = logistic_regression_auc(
        datamodule.schema, datamodule.train_dataloader(), datamodule.val_dataloader(), seed=0
    )
    if "val/auc" in trainer.callback_metrics:
        model_auc, source = float(trainer.callback_metrics["val/auc"]), "the last validation of fit"
    else:
        (scores,) = trainer.validate(task, datamodule=datamodule, verbose=False)
        model_auc, source = float(scores["val/auc"]), "the final weights (fit ran no validation)"
    result = {"model_val_auc": model_auc, "model_val_auc_from": source, "logistic_regression_val_auc": baseline_auc}
    (run_dir / "baseline.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"validation AUC: model {model_auc:.4f} ({source}), logistic regression {baseline_auc:.4f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        from benchmarks.compare.__main__ import main as compare_main

        sys.exit(compare_main(sys.argv[2:]))
    main()
