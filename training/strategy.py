"""TorchrecStrategy: Lightning's DDP strategy with the model sharded by models.sharding's shard_model
and checkpointed with its DCP checkpoints; importing this module registers it as strategy="torchrec"."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torchmetrics import Metric
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer
from torchrec.optim.optimizers import in_backward_optimizer_filter

from models.sharding import (
    ShardingConfig,
    SparseOptimizerConfig,
    load_checkpoint,
    save_checkpoint,
    shard_model,
    sparse_optimizer,
)

from .pipeline import PipelinedTrainingStep, carry_step_count, check_pipeline_supported

_SHARDED_ATTRIBUTE = "_torchrec_sharded"  # (DMP, ShardingConfig, plan) on a LightningModule sharded by the strategy


class TorchrecStrategy(DDPStrategy):
    """Lightning's DDP, with the model wrapped by torchrec's DistributedModelParallel instead of DDP:
    embedding tables sharded by shard_model (fused sparse optimizer), everything else data parallel.

        trainer = L.Trainer(strategy=TorchrecStrategy(ShardingConfig(sharding_type="row_wise")),
                            accelerator="gpu", devices=8)     # or strategy="torchrec": the defaults
        torchrun --nproc-per-node 2 train.py --trainer.strategy=torchrec --trainer.accelerator=cpu ...

    - configure_optimizers may return optimizers over all parameters: the strategy removes the fused
      table parameters from them (dense_parameters() gives the same list directly).
    - Checkpoints are torch.distributed.checkpoint folders (every rank writes its shards; the path,
      e.g. last.ckpt, is a folder) with the dense optimizers, the sparse optimizer state and
      Lightning's loop state; resuming (ckpt_path) reshards to the current world size and plan.
      load_unsharded() reads one into a plain model.
    - Each rank must see its own part of the data (DistributedSampler, as Lightning's DDP sets up,
      or the data module's own per-rank sampler). The sharded lookups exchange rows between ranks,
      so every rank must run every step: the strategy checks at the start of training, validation
      and test that the ranks have as many batches, and raises RuntimeError otherwise. Training
      batches must also have one size on all ranks (torchrec's backward all-gathers them); batches
      of different sizes are fine for validation.
    - Precision: 32-true or *-mixed (the tables stay fp32); manual optimization is not supported.
    - sharding.pipeline trains through torchrec's TrainPipelineSparseDist: while fitting, the strategy
      holds a PipelinedTrainingStep (training/pipeline.py) as `pipelined_step`, and runs the
      LightningModule's training step, which trains through it, outside the DMP's forward.
    """

    strategy_name = "torchrec"

    def __init__(
        self,
        sharding: ShardingConfig | Mapping[str, Any] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **ddp_kwargs,
        )
        self.sharding = ShardingConfig(**sharding) if isinstance(sharding, Mapping) else (sharding or ShardingConfig())
        self.plan: ShardingPlan | None = None
        self.sparse: CombinedOptimizer | None = None  # the tables' fused optimizer, once sharded
        self.sparse_lr: SparseLearningRate | None = None  # its learning rate, while fitting
        self.pipelined_step: PipelinedTrainingStep | None = None  # with sharding.pipeline, while fitting

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a checkpoint loads into the sharded model and its optimizers

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint already restored them

    def model_to_device(self) -> None:
        """Move everything but the embedding collections, which DMP places shard by shard (moving the
        whole tables to one GPU first is what sharding avoids)."""
        assert self.model is not None
        skip: set[int] = set()
        for module in self.model.modules():
            if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
                skip.update(id(m) for m in module.modules())
        device = self.root_device
        for module in self.model.modules():
            if id(module) in skip:
                continue
            if isinstance(module, Metric):  # its _apply moves its states and takes no `recurse`
                module.to(device)
            else:
                # nn.Module.to has no recurse=False: the collections' submodules must stay where sharding puts them.
                module._apply(lambda t: t.to(device), recurse=False)

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        # A module sharded by an earlier setup (this Trainer's or another's) keeps its DMP: sharding
        # replaced its collections, and a second DDP over its parameters would double their hooks.
        previous = self.model.__dict__.get(_SHARDED_ATTRIBUTE)
        if previous is not None:
            dmp, config, plan = previous
            if config != self.sharding:
                raise ValueError(
                    f"this LightningModule was sharded with {config}; a Trainer with another sharding config "
                    "needs a freshly built module"
                )
            self.model, self.plan = dmp, plan
        else:
            # DDPStrategy's own settings (sync_batchnorm, its DDP kwargs), which it exposes no other way.
            if fitting and self._layer_sync:
                self.model = self._layer_sync.apply(self.model)
            self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            module = self.model
            self.model, self.plan = shard_model(module, self.sharding, device=self.root_device, ddp_kwargs=self._ddp_kwargs)
            module.__dict__[_SHARDED_ATTRIBUTE] = (self.model, self.sharding, self.plan)  # not a submodule
        self.sparse = sparse_optimizer(self.model)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            optimizer_state_to(self.optimizers, self.root_device)
        self.sparse_lr = (SparseLearningRate(self.sparse, self.sharding.optimizer, trainer)
                          if fitting and self.sparse is not None else None)
        self.pipelined_step = None
        if fitting and self.sharding.pipeline:
            check_pipeline_supported(trainer, self)
            self.pipelined_step = PipelinedTrainingStep(self.lightning_module, self.model, self.root_device, self.sparse_lr)
            if self.lightning_module.automatic_optimization:
                raise ValueError(
                    f"sharding.pipeline: {type(self.lightning_module).__name__} does not train through the strategy's "
                    "pipelined_step (manual optimization and training_step(dataloader_iter) while it is set, as "
                    "train.RankingTask does)"
                )

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        removed = 0
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                kept = [p for _, p in in_backward_optimizer_filter(enumerate(group["params"]))]  # (index, param) pairs
                removed += len(group["params"]) - len(kept)
                group["params"] = kept
        if removed:
            rank_zero_info(f"TorchrecStrategy: {removed} fused table parameter(s) left to the sparse optimizer")

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipelined_step is not None:
            # The module's step trains through the pipeline, which calls the DMP (and its DDP) itself:
            # not inside another DDP forward, as Lightning's redirection would. It sets the sparse lr
            # before every batch's backward.
            with self.precision_plugin.train_step_context():
                return self.lightning_module.training_step(*args, **kwargs)
        if self.sparse_lr is not None:
            self.sparse_lr.apply()
        return super().training_step(*args, **kwargs)

    def _check_same_batch_counts(self, what: str, counts: Any) -> None:
        """Every sharded lookup is a collective: a rank with fewer batches leaves the others waiting
        forever. Compare the counts up front and fail on every rank instead."""
        if self.world_size < 2:
            return
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, counts)
        if any(g != gathered[0] for g in gathered):
            raise RuntimeError(
                f"TorchrecStrategy: the ranks would run different numbers of {what} batches (per rank: {gathered}); "
                "the sharded embedding lookups need every rank in every step, so the data must give each rank as "
                "many batches (and, for training, batches of one size): pad or drop the remainder"
            )

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        self._check_same_batch_counts("training", trainer.num_training_batches)
        carry_step_count(trainer, pipelined=self.pipelined_step is not None)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.pipelined_step is not None:
            self.pipelined_step.pause()
        trainer = self.lightning_module.trainer
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        self._check_same_batch_counts("validation", counts)

    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self.pipelined_step is not None:
            self.pipelined_step.resume()

    def on_test_start(self) -> None:
        super().on_test_start()
        self._check_same_batch_counts("test", self.lightning_module.trainer.num_test_batches)

    def teardown(self) -> None:
        # Keep the sharded model where it is (Strategy.teardown would move it to the CPU, which the
        # fused kernels' buffers do not survive); hand back the LightningModule itself.
        self.model = self.lightning_module
        self.pipelined_step = self.sparse_lr = None  # the fit is over: the module trains plainly again
        optimizer_state_to(self.optimizers, torch.device("cpu"))
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("TorchrecStrategy.save_checkpoint takes no storage_options: it writes with torch.distributed.checkpoint")
        path = Path(self.broadcast(str(filepath)))
        metadata = dict(checkpoint)
        metadata.pop("state_dict", None)  # the live model is saved instead, shard by shard
        with_optimizers = metadata.pop("optimizer_states", None) is not None
        save_checkpoint(path, self.model, self.optimizers if with_optimizers else None, metadata=metadata)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        return load_checkpoint(path, self.model, self.optimizers or None, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint loaded the model

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint loaded the optimizers


if "torchrec" not in StrategyRegistry:
    StrategyRegistry.register(
        "torchrec", TorchrecStrategy, description="torchrec DistributedModelParallel: sharded tables, DDP for the rest"
    )


class SparseLearningRate:
    """The learning rate of the tables' fused sparse optimizer, which fbgemm applies inside backward:
    set before each backward, from sharding.optimizer (lr_schedule "dense": lr scaled each step as the
    first dense LR scheduler scales its rate, warmup and decay; "constant": lr throughout)."""

    def __init__(self, sparse: CombinedOptimizer, config: SparseOptimizerConfig, trainer: pl.Trainer):
        self.sparse, self.config, self.trainer = sparse, config, trainer

    def apply(self) -> None:
        if self.config.lr_schedule != "dense":
            return  # the fused kernels were built with config.lr
        configs = self.trainer.lr_scheduler_configs
        fraction = 1.0
        if configs:
            scheduler = configs[0].scheduler
            base = scheduler.base_lrs[0]
            fraction = scheduler.get_last_lr()[0] / base if base else 1.0
        for group in self.sparse.param_groups:
            group["lr"] = self.config.lr * fraction
        self.sparse.step()  # only hands the lr to the fused kernels: their update runs inside backward


def optimizer_state_to(optimizers, device: torch.device) -> None:
    """Moves the optimizers' state tensors (AdamW's moments; the fused sparse optimizers' live in
    the sharded tables) to `device`, as Strategy.setup does for a plain model."""
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            optimizer.state[param] = apply_to_collection(state, torch.Tensor, lambda tensor: tensor.to(device))
