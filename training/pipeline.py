"""Pipelined training (ShardingConfig.pipeline): torchrec's TrainPipelineSparseDist as the training step
of a Lightning fit, so the next batch's copy to the device and its input all-to-all overlap this step.

TorchrecStrategy (training/strategy.py) builds a PipelinedTrainingStep when it sets up a fit with
sharding.pipeline and keeps it as `strategy.pipelined_step`; the LightningModule trains through it
while it is there (RankingTask in train.py: manual optimization, training_step(dataloader_iter)).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torchrec.distributed.types import ShardedModule

if TYPE_CHECKING:
    from .strategy import SparseLearningRate, TorchrecStrategy


class PipelinedTrainingStep:
    """A Lightning training step run by torchrec's TrainPipelineSparseDist (ShardingConfig.pipeline).

    The pipeline runs forward, backward and the optimizer step itself, and fetches two batches ahead:
    while batch i trains, batch i+1's features are distributed and batch i+2 is copied to the device,
    each on its own stream. So the LightningModule trains under manual optimization, taking Lightning's
    data iterator (training_step(dataloader_iter)), and its forward(batch) must return (loss, a dict of
    outputs), as the pipeline calls the model (the DMP) on each batch. A call trains one batch per
    Lightning step, except at the end of an epoch's batches: the batches still in flight train in that
    same step (each one an optimizer step and a batch in Lightning's loop counters), so an epoch ends
    with all of its batches trained and a checkpoint at its end resumes exactly. What differs from
    automatic optimization: no fp16 gradient scaler (32-true or bf16-mixed), no gradient accumulation,
    and Lightning validates at every epoch's end (its rule for a step that takes the iterator).
    """

    def __init__(self, module: pl.LightningModule, dmp: nn.Module, device: torch.device,
                 sparse_lr: "SparseLearningRate | None"):
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        self.module, self.dmp = module, dmp
        self.pipeline = TrainPipelineSparseDist(dmp, _PipelineOptimizer(module, sparse_lr), device)
        self._epoch_iterator: Any = None  # Lightning's iterator of the current epoch
        self._batches: _EpochBatches | None = None
        self._paused: list[tuple[nn.Module, Any]] = []
        self._announced = False

    def __call__(self, dataloader_iter: Any) -> list[dict[str, Any]]:
        """Trains the next batch, or at the end of the epoch's batches every one left; returns, per
        trained batch, the forward's outputs with "lr", the rate its optimizer step used."""
        trainer = self.module.trainer
        epoch_loop = trainer.fit_loop.epoch_loop
        if dataloader_iter is not self._epoch_iterator:  # a new (or resumed) epoch
            # Lightning has counted this step's batch already; limit_train_batches may end the epoch early.
            remaining = trainer.num_training_batches - (epoch_loop.batch_progress.current.ready - 1)
            self._epoch_iterator, self._batches = dataloader_iter, _EpochBatches(dataloader_iter, remaining)
        # Lightning's validation leaves the DMP in eval mode (it restores the LightningModule's mode
        # only), and the pipeline skips backward and the optimizer step for a model in eval mode.
        # Compared first: train() walks every submodule, host work this step need not pay otherwise.
        if self.dmp.training != self.module.training:
            self.dmp.train(self.module.training)
        steps = [self._train_one()]
        if not self._announced:  # the first step traced the model and chose the modules to pipeline
            self._announced = True
            # torchrec's own list (private); no public accessor says which modules it pipelines.
            pipelined = len(self.pipeline._pipelined_modules)
            rank_zero_info(f"sharding.pipeline: TrainPipelineSparseDist pipelines {pipelined} sharded module(s)")
            if not pipelined:
                rank_zero_warn("sharding.pipeline pipelines no sharded module: their features do not come straight from "
                               "the batch, so every input all-to-all still runs inside its step")
        if self._batches.exhausted:
            while trainer.max_steps < 0 or trainer.global_step < trainer.max_steps:
                try:
                    steps.append(self._train_one())
                except StopIteration:
                    break
            # Lightning counts one batch per step; this one trained len(steps). Its batch progress drives
            # the validation schedule, the epoch's end and a resume's position: advanced with the loop's
            # own method. The step index loggers see (a validation row's) has no public way in: a
            # validation after this step would otherwise be logged len(steps) - 1 steps early.
            epoch_loop.batch_progress.increment_by(len(steps) - 1)
            epoch_loop._batches_that_stepped += len(steps) - 1
        return steps

    def _train_one(self) -> dict[str, Any]:
        lr = self.module.trainer.optimizers[0].param_groups[0]["lr"]
        outputs = self.pipeline.progress(self._batches)
        if not isinstance(outputs, Mapping):
            raise TypeError("with sharding.pipeline, the LightningModule's forward must return (loss, dict of outputs); "
                            f"its second item was a {type(outputs).__name__}")
        return {**outputs, "lr": lr}

    def pause(self) -> None:
        """Gives the sharded modules back their own forwards (for validation): the pipeline replaced
        them with ones that read features it distributed ahead, which a validation batch never is.
        Not pipeline.detach(): re-attaching restarts the input all-to-all of the batch in flight."""
        self._paused = [(module, module.__dict__.pop("forward"))
                        for module in _sharded_modules_and_input_dists(self.dmp) if "forward" in module.__dict__]

    def resume(self) -> None:
        for module, forward in self._paused:
            module.forward = forward
        self._paused = []


def _sharded_modules_and_input_dists(model: nn.Module) -> Iterable[nn.Module]:
    """The modules whose forwards the pipeline replaces: the sharded modules, and the all-to-alls of
    their input dists (held in plain lists, out of modules()' reach)."""
    for sharded in model.modules():
        if isinstance(sharded, ShardedModule):
            for module in sharded.modules():
                yield module
                for input_dist in getattr(module, "_input_dists", None) or []:
                    yield from input_dist.modules()


class _EpochBatches:
    """The Batches of Lightning's (batch, batch_idx, dataloader_idx) iterator, at most `remaining`
    of them; `exhausted` once the pipeline has taken the last."""

    def __init__(self, dataloader_iter: Any, remaining: int):
        self.dataloader_iter, self.remaining, self.exhausted = dataloader_iter, remaining, False

    def __iter__(self) -> "_EpochBatches":
        return self

    def __next__(self) -> Any:
        if self.remaining <= 0:
            self.exhausted = True
            raise StopIteration
        try:
            batch, _, _ = next(self.dataloader_iter)
        except StopIteration:
            self.exhausted = True
            raise
        self.remaining -= 1
        if self.remaining == 0 or getattr(self.dataloader_iter, "done", False):
            self.exhausted = True
        return batch


class _PipelineOptimizer:
    """What TrainPipelineSparseDist steps once per batch: the LightningModule's one optimizer, through
    Lightning's manual-optimization interface, doing what automatic optimization would around it."""

    def __init__(self, module: pl.LightningModule, sparse_lr: "SparseLearningRate | None"):
        self.module, self.sparse_lr = module, sparse_lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The first thing of each step, before its backward (where the fused table update runs).
        if self.sparse_lr is not None:
            self.sparse_lr.apply()
        self.module.optimizers().zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        trainer = self.module.trainer
        optimizer = self.module.optimizers()  # the LightningOptimizer: its step counts the global step
        if trainer.gradient_clip_val:
            self.module.configure_gradient_clipping(optimizer.optimizer, trainer.gradient_clip_val,
                                                    trainer.gradient_clip_algorithm)
        optimizer.step()
        for config in trainer.lr_scheduler_configs:
            config.scheduler.step()


def check_pipeline_supported(trainer: pl.Trainer, strategy: "TorchrecStrategy") -> None:
    problems = []
    if getattr(strategy.precision_plugin, "scaler", None) is not None:
        problems.append(f"precision {trainer.precision!r} scales the loss, which the pipeline's backward does not: use 32-true or bf16-mixed")
    if trainer.accumulate_grad_batches != 1:
        problems.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches}: the pipeline steps the optimizer every batch")
    if len(strategy.optimizers) != 1:
        problems.append(f"{len(strategy.optimizers)} optimizers: the pipeline steps one")
    for config in trainer.lr_scheduler_configs:
        if config.interval != "step" or config.frequency != 1 or config.reduce_on_plateau:
            problems.append(f"LR scheduler {type(config.scheduler).__name__} (interval {config.interval!r}, frequency "
                            f"{config.frequency}): the pipeline steps schedulers every step")
    if problems:
        raise ValueError("sharding.pipeline cannot train this setup: " + "; ".join(problems))


def carry_step_count(trainer: pl.Trainer, pipelined: bool) -> None:
    """Lightning counts optimizer steps separately under automatic and manual optimization (global_step
    reads the one of the module's current mode, and no public API sets either); a run resumed with
    sharding.pipeline switched continues the count the checkpoint's mode kept."""
    loop = trainer.fit_loop.epoch_loop
    automatic, manual = loop.automatic_optimization.optim_progress.optimizer.step, loop.manual_optimization.optim_step_progress
    source, target = (automatic, manual) if pipelined else (manual, automatic)
    if source.total.completed > target.total.completed:
        target.load_state_dict(source.state_dict())
