"""What a sharding config may say: ShardingConfig and its SparseOptimizerConfig (plain dataclasses,
read from YAML by train.py), each checking its own values when built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from models.choices import check_choices

ShardingType = Literal["table_wise", "row_wise", "column_wise", "data_parallel"]


@dataclass
class SparseOptimizerConfig:
    """The fused optimizer fbgemm applies to sharded tables inside the backward pass.

    Args:
        name: rowwise_adagrad (one accumulator per row: the recsys default), adagrad, adam (CUDA
            only) or sgd.
        lr: learning rate; under TorchrecStrategy scaled each step as the dense optimizer's is.
        lr_schedule: "dense": each step the sparse lr is lr times the dense learning rate's current
            fraction of its base (warmup, decay), as torchrec's DLRM example schedules both with one
            policy; "constant": lr throughout.
        eps: added to the denominator (adagrad, adam).
        weight_decay: 0 disables it. fbgemm implements it for rowwise_adagrad (not on CPU for pooled
            tables, whose CPU kernel drops it) and adam only.
        weight_decay_mode: l2 (added to the gradient) or decoupled (w -= lr * wd * w); default: l2
            for rowwise_adagrad, decoupled for adam (fbgemm's Adam is AdamW-style only).
        beta1, beta2: Adam's moment decays.
    """

    name: Literal["rowwise_adagrad", "adagrad", "adam", "sgd"] = "rowwise_adagrad"
    lr: float = 0.01
    lr_schedule: Literal["dense", "constant"] = "dense"
    eps: float = 1e-8
    weight_decay: float = 0.0
    weight_decay_mode: Literal["l2", "decoupled"] | None = None
    beta1: float = 0.9
    beta2: float = 0.999

    def __post_init__(self) -> None:
        check_choices(self)
        if self.weight_decay_mode is None:
            self.weight_decay_mode = "decoupled" if self.name == "adam" else "l2"
        if self.lr < 0 or self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(
                f"sparse optimizer needs lr >= 0, eps > 0, weight_decay >= 0; got lr={self.lr}, eps={self.eps}, "
                f"weight_decay={self.weight_decay}"
            )
        if self.weight_decay > 0 and self.name in ("adagrad", "sgd"):
            raise ValueError(f"fbgemm's fused {self.name} has no weight decay; use rowwise_adagrad or adam, or weight_decay 0")
        if self.weight_decay > 0 and self.name == "adam" and self.weight_decay_mode != "decoupled":
            raise ValueError("fbgemm's fused adam decays weights decoupled (AdamW) only; set weight_decay_mode: decoupled")

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for apply_optimizer_in_backward, i.e. for fbgemm's TBE constructor."""
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

        kwargs: dict[str, Any] = {"lr": self.lr, "eps": self.eps}
        if self.weight_decay > 0:
            kwargs["weight_decay"] = self.weight_decay
            if self.name == "rowwise_adagrad":
                # fbgemm ignores weight_decay unless a mode is set (its default is WeightDecayMode.NONE).
                kwargs["weight_decay_mode"] = WeightDecayMode.L2 if self.weight_decay_mode == "l2" else WeightDecayMode.DECOUPLE
        if self.name == "adam":
            kwargs.update(beta1=self.beta1, beta2=self.beta2)
        return kwargs


@dataclass
class ShardingConfig:
    """How the embedding tables are sharded and trained; every field can be set from YAML.

    Args:
        sharding_type: default for every table: table_wise, row_wise, column_wise or data_parallel.
        tables: per-table overrides, e.g. {t_item: data_parallel, history: row_wise} (a table name,
            or the name of a feature the table serves).
        compute_kernel: fused (tables in HBM on CUDA, in host memory on CPU), fused_uvm,
            fused_uvm_caching (CUDA: tables in host memory, a cache in HBM) or auto (the planner
            picks among those the device allows). data_parallel tables always use "dense".
        optimizer: the fused sparse optimizer of the non-data_parallel tables.
        column_wise_min_dim: narrowest column shard (torchrec's min_partition); a shard's width is the
            smallest multiple of 4 >= this that divides embedding_dim.
        hbm_cap_gb, ddr_cap_gb: per-rank capacity the planner may use (default: the GPU's memory for
            HBM, torchrec's 128 GB for DDR); a plan that does not fit raises ValueError naming tables
            and sizes.
        storage_reservation: share of each rank's capacity kept for everything else (activations,
            dense model, input buffers).
        planner_batch_size: per-rank batch size for the planner's cost estimates (default 512).
        average_sparse_gradients: torchrec's gradient division (process-wide): sharded rows get the
            gradient of the global-mean loss, like DDP's dense gradients; False sums over the ranks.
        copy_weights: copy the unsharded tables' values into the shards (False: torchrec's own
            initialization of the shards).
        pipeline: train through torchrec's TrainPipelineSparseDist (TorchrecStrategy; see
            training/pipeline.py): the next batch is copied to the device and its features are
            distributed on side streams while this step computes, so the host never waits for the
            device in the input all-to-all's split exchange.
    """

    sharding_type: ShardingType = "table_wise"
    tables: dict[str, ShardingType] = field(default_factory=dict)
    compute_kernel: Literal["fused", "fused_uvm", "fused_uvm_caching", "auto"] = "fused"
    optimizer: SparseOptimizerConfig = field(default_factory=SparseOptimizerConfig)
    column_wise_min_dim: int = 128
    hbm_cap_gb: float | None = None
    ddr_cap_gb: float | None = None
    storage_reservation: float = 0.15
    planner_batch_size: int | None = None
    average_sparse_gradients: bool = True
    copy_weights: bool = True
    pipeline: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, Mapping):
            self.optimizer = SparseOptimizerConfig(**self.optimizer)
        self.tables = dict(self.tables or {})
        check_choices(self)
        if self.column_wise_min_dim < 1:
            raise ValueError(f"column_wise_min_dim={self.column_wise_min_dim} must be >= 1")
        if not 0 <= self.storage_reservation < 1:
            raise ValueError(f"storage_reservation={self.storage_reservation} must be in [0, 1)")
        for name in ("hbm_cap_gb", "ddr_cap_gb", "planner_batch_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}={value} must be > 0 (or null for torchrec's default)")
