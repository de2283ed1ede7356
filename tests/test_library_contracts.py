"""The private parts of Lightning, torchrec and torch this code still relies on, each checked for
the one thing the code needs of it, so a library upgrade that changes one fails here by name
instead of somewhere deep in a training run. Each use carries a comment at its site saying why no
public API serves; a use removed from the code should be removed here too."""

import inspect

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import training.callbacks
import training.pipeline
import training.strategy
from models.sharding import checkpoint as sharding_checkpoint
from models.sharding import shard as sharding_shard


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_the_code_still_uses_each_private_api_checked_here():
    """If a use below is gone from the code, its check is stale: drop both together."""
    sources = {module.__name__: inspect.getsource(module)
               for module in (training.callbacks, training.pipeline, training.strategy, sharding_checkpoint,
                              sharding_shard)}
    uses = {
        "training.callbacks": ["_should_check_val_fx", "_data_fetcher", "super()._save_checkpoint",
                               "_should_skip_saving_checkpoint", "_save_topk_checkpoint", "_monitor_candidates",
                               "metrics_keys"],
        "training.pipeline": ["_pipelined_modules", "_batches_that_stepped", "batch_progress.increment_by",
                              "optim_progress.optimizer.step", "optim_step_progress", '__dict__.pop("forward")'],
        "training.strategy": ["._apply(", "_layer_sync", "_ddp_kwargs"],
        "models.sharding.checkpoint": ["_nested_dict"],
        "models.sharding.shard": ["param_to_optim_hook_handle_map", "param_to_acc_grad_map"],
    }
    for module, names in uses.items():
        for name in names:
            assert name in sources[module], f"{module} no longer uses {name}: remove its check from this file"


def test_lightning_validation_schedule_and_data_fetcher(tmp_path):
    """LastCheckpoint.validation_follows asks the epoch loop whether a validation follows this step."""
    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    assert parameters(trainer.fit_loop.epoch_loop._should_check_val_fx) == ["data_fetcher"]
    assert hasattr(trainer.fit_loop, "_data_fetcher")


class _StepsOfLoggedMetrics(Logger):
    """A logger that keeps (step, metric names) of every log_metrics call."""

    def __init__(self):
        super().__init__()
        self.rows = []

    name, version = "steps", 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, sorted(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class _SkipsBatchesInLoggerSteps(BoringModel):
    """After its second step, counts 5 more batches in the step index loggers see, as the pipelined
    step does for the batches it trains at an epoch's end; validates at the epoch's end."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx == 1:
            self.trainer.fit_loop.epoch_loop._batches_that_stepped += 5

    def validation_step(self, batch, batch_idx):
        self.log("v", self.step(batch))


def test_batches_that_stepped_is_the_step_index_of_validation_rows_and_saved(tmp_path):
    """PipelinedTrainingStep advances epoch_loop._batches_that_stepped by the extra batches an epoch's
    last step trains: Lightning logs a validation at that index and keeps it in the checkpoint."""
    logger = _StepsOfLoggedMetrics()
    trainer = L.Trainer(default_root_dir=tmp_path, logger=logger, max_epochs=1, limit_train_batches=4,
                        limit_val_batches=1, num_sanity_val_steps=0, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_SkipsBatchesInLoggerSteps())
    assert (4 - 1 + 5, ["epoch", "v"]) in logger.rows  # the 4th step's index, plus the 5
    assert trainer.fit_loop.state_dict()["epoch_loop.state_dict"]["_batches_that_stepped"] == 4 + 5


def test_batch_progress_increment_by_counts_batches_as_finished():
    """PipelinedTrainingStep counts the extra batches of an epoch's last step with it: finished
    batches, in the epoch's (current) and the run's (total) counts."""
    from lightning.pytorch.loops.progress import _BatchProgress

    progress = _BatchProgress()
    progress.increment_ready()
    progress.increment_by(2)
    for counts in (progress.current, progress.total):
        assert (counts.ready, counts.started, counts.processed, counts.completed) == (3, 2, 2, 2)


def test_global_step_reads_the_optimizer_step_count_of_the_modules_mode(tmp_path):
    """carry_step_count copies the count of one mode into the other: global_step reads the automatic
    count for an automatic-optimization module and the manual one for a manual module."""
    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    loop = trainer.fit_loop.epoch_loop
    loop.automatic_optimization.optim_progress.optimizer.step.total.completed = 3
    loop.manual_optimization.optim_step_progress.total.completed = 5
    module = BoringModel()
    trainer.strategy.connect(module)
    assert trainer.global_step == 3
    module.automatic_optimization = False
    assert trainer.global_step == 5


def test_model_checkpoint_hooks_that_last_checkpoint_overrides_and_calls():
    assert parameters(ModelCheckpoint._save_checkpoint) == ["self", "trainer", "filepath"]
    assert parameters(ModelCheckpoint._should_skip_saving_checkpoint) == ["self", "trainer"]
    assert parameters(ModelCheckpoint._save_topk_checkpoint) == ["self", "trainer", "monitor_candidates"]
    assert parameters(ModelCheckpoint._monitor_candidates) == ["self", "trainer"]


def test_csv_logger_appends_under_its_metrics_keys(tmp_path):
    """continue_metrics hands a resumed run's writer the file's header through metrics_keys."""
    logger = CSVLogger(tmp_path, name="run", version=0)
    logger.log_metrics({"a": 1.0}, step=0)
    logger.save()
    assert logger.experiment.metrics_keys == ["a", "step"]


def test_precision_clip_gradients_is_callable_unbound():
    """configure_gradient_clipping calls Precision.clip_gradients on the plugin without the fused
    optimizer refusal of its subclasses."""
    assert parameters(Precision.clip_gradients) == ["self", "optimizer", "clip_val", "gradient_clip_algorithm"]


def test_ddp_strategy_attributes_the_torchrec_strategy_reads():
    strategy = DDPStrategy(find_unused_parameters=True)
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert hasattr(strategy, "_layer_sync")


def test_module_apply_moves_one_module_without_its_children():
    """The torchrec strategy moves every module but the embedding collections' to the device."""
    outer = nn.Sequential(nn.Linear(2, 2))
    outer.register_buffer("own", torch.zeros(1))
    outer._apply(lambda t: t.to(torch.float64), recurse=False)
    assert outer.own.dtype == torch.float64 and outer[0].weight.dtype == torch.float32


def test_dcp_flatten_state_dict_flattens_nested_keys():
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict({"model": {"w": torch.zeros(1)}, "step": 3})
    assert set(flat) == {"model.w", "step"}


def test_optimizer_in_backward_keeps_module_level_maps():
    maps = pytest.importorskip("torch.distributed.optim.apply_optimizer_in_backward")
    assert hasattr(maps.param_to_optim_hook_handle_map, "pop")
    assert hasattr(maps.param_to_acc_grad_map, "pop")


def test_torchrec_pipeline_keeps_its_pipelined_modules():
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    assert "self._pipelined_modules" in inspect.getsource(TrainPipelineSparseDist)
