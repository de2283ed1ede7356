"""The private parts of Lightning, torchrec and torch this code still relies on, each checked for
the one thing the code needs of it, so a library upgrade that changes one fails here by name
instead of somewhere deep in a training run. Each use carries a comment at its site saying why no
public API serves; a use removed from the code should be removed here too."""

import inspect

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
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
        "training.pipeline": ["_pipelined_modules", "_batches_that_stepped", '__dict__.pop("forward")'],
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
    assert hasattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped")  # the pipelined step advances it


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
