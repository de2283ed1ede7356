"""Train the block-attention ranking model (models/ranking.py) on a CTR dataset (data/).

    python train.py                                    # configs/default.yaml: CPU, about two minutes
    python train.py --config configs/gpu.yaml          # one H200, bf16-mixed
    python train.py --attn=triton                      # shortcut for --model.attn_backend=triton
    python train.py --trainer.max_steps=50 --model.num_layers=1 --data.batch_size=128
    python train.py --ckpt_path runs/default/version_0/checkpoints/last.ckpt   # resume
    python train.py --help                             # every key

configs/default.yaml is always loaded first; --config files and command-line keys override it.
Each run writes runs/<run_name>/version_N/: config.yaml (the resolved config), metrics.csv,
TensorBoard events and checkpoints/.
"""

import json
import math
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAUROC

import kernels
from data.batch import Batch
from data.baseline import logistic_regression_auc
from data.datamodule import CTRDataModule
from data.schema import FeatureSchema
from models import RankingModel, RankingModelConfig

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "default.yaml"


# Checkpoints keep these in their hyperparameters; torch.load(weights_only=True), which
# resuming uses, unpickles only allowlisted classes.
torch.serialization.add_safe_globals([FeatureSchema, RankingModelConfig])


class RankingTask(L.LightningModule):
    """The model plus its loss, metrics and optimizer.

    Args:
        lr: peak AdamW learning rate.
        weight_decay: applied to weight matrices only, not to embeddings, norms or biases.
        warmup_steps: linear warmup, then cosine decay to min_lr_ratio * lr at the last step.
        min_lr_ratio: final learning rate as a fraction of lr.
    """

    def __init__(
        self,
        schema: FeatureSchema,
        model: RankingModelConfig,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
    ):
        super().__init__()
        # The resolved config.yaml in the run folder is the readable record; the
        # checkpoint keeps these so RankingTask.load_from_checkpoint rebuilds the model.
        self.save_hyperparameters(logger=False)
        self.model = RankingModel(schema, model)
        self.val_logloss = MeanMetric()
        self.val_ctr = MeanMetric()
        self.val_mean_prediction = MeanMetric()
        self.val_auc = BinaryAUROC()
        self._step_start = 0.0
        self._step_tokens = 0

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        logits, tokens = self.model(batch)
        loss = self.model.loss(logits, batch.labels)
        self._step_tokens = tokens.num_tokens
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.batch_size)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], batch_size=batch.batch_size)
        return loss

    # Step time spans forward, backward and the optimizer step, not data loading.
    # On CUDA we synchronize so the interval measures the GPU work, not kernel launches.
    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        self._synchronize()
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, outputs, batch: Batch, batch_idx: int) -> None:
        self._synchronize()
        seconds = time.perf_counter() - self._step_start
        self.log_dict(
            {
                "train/step_ms": seconds * 1e3,
                "train/samples_per_s": batch.batch_size / seconds,
                "train/tokens_per_s": self._step_tokens / seconds,
            },
            batch_size=batch.batch_size,
        )

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        logits, _ = self.model(batch)
        logits, labels = logits.float(), batch.labels.float()
        predictions = torch.sigmoid(logits)
        self.val_logloss.update(F.binary_cross_entropy_with_logits(logits, labels, reduction="none"))
        self.val_ctr.update(labels)
        self.val_mean_prediction.update(predictions)
        self.val_auc.update(predictions, labels.long())

    def on_validation_epoch_end(self) -> None:
        logloss, ctr = self.val_logloss.compute(), self.val_ctr.compute()
        # Normalized entropy: log loss over that of always predicting the validation CTR
        # (the label entropy); below 1 means the model beats the base rate.
        p = ctr.clamp(1e-7, 1 - 1e-7)
        base_rate_logloss = -(p * torch.log(p) + (1 - p) * torch.log(1 - p))
        self.log_dict(
            {
                "val/logloss": logloss,
                "val/ne": logloss / base_rate_logloss,
                "val/auc": self.val_auc.compute(),
                "val/calibration": self.val_mean_prediction.compute() / ctr,
            },
            prog_bar=True,
        )
        for metric in (self.val_logloss, self.val_ctr, self.val_mean_prediction, self.val_auc):
            metric.reset()

    def configure_optimizers(self):
        tables = (torch.nn.Embedding, torch.nn.EmbeddingBag)  # what torchrec's EBC/EC hold
        embedding_ids = {id(p) for m in self.model.modules() if isinstance(m, tables) for p in m.parameters()}
        decay, no_decay = [], []
        for parameter in self.model.parameters():
            is_matrix = parameter.dim() >= 2 and id(parameter) not in embedding_ids
            (decay if is_matrix else no_decay).append(parameter)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
        )
        total_steps = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup, floor = self.hparams.warmup_steps, self.hparams.min_lr_ratio

        def lr_factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min((step - warmup) / max(total_steps - warmup, 1), 1.0)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def build_parser() -> LightningArgumentParser:
    parser = LightningArgumentParser(
        description="Train the block-attention ranking model.", default_config_files=[str(DEFAULT_CONFIG)]
    )
    parser.add_argument("--config", action="config", help="YAML file(s) applied over configs/default.yaml")
    parser.add_argument("--run_name", type=str, default="default", help="runs go to <runs_dir>/<run_name>/version_N/")
    parser.add_argument("--runs_dir", type=str, default="runs")
    parser.add_argument("--seed_everything", type=int, default=0)
    parser.add_argument(
        "--attn", type=str | None, default=None, choices=[*kernels.BACKENDS, None],
        help="shortcut for --model.attn_backend",
    )
    parser.add_argument("--ckpt_path", type=str | None, default=None, help="checkpoint to resume training from")
    parser.add_argument(
        "--baseline", type=bool, default=False,
        help="after training, fit a logistic regression (no feature interactions) on the same split "
        "and report both validation AUCs in <run folder>/baseline.json",
    )
    parser.add_class_arguments(RankingModelConfig, "model")
    # RankingTask's own arguments (schema and model aside) are the optimizer settings.
    parser.add_class_arguments(RankingTask, "optim", instantiate=False, skip={"schema", "model"})
    parser.add_lightning_class_args(CTRDataModule, "data")
    # Loggers and callbacks are fixed below so every run folder has the same layout.
    parser.add_class_arguments(
        L.Trainer, "trainer", instantiate=False, fail_untyped=False, skip={"logger", "callbacks", "default_root_dir"}
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    config = parser.parse_args(argv)
    if config.attn is not None:
        config.model.attn_backend = config.attn
    L.seed_everything(config.seed_everything, workers=True)
    try:
        objects = parser.instantiate(config)
    except ValueError as error:  # e.g. RankingModelConfig's checks of sizes and backend name
        parser.error(str(error))

    csv_logger = CSVLogger(config.runs_dir, name=config.run_name)
    loggers = [
        csv_logger,
        TensorBoardLogger(config.runs_dir, name=config.run_name, version=csv_logger.version, default_hp_metric=False),
    ]
    callbacks = [
        # Two checkpointers: Lightning 2.6 only refreshes a monitoring checkpointer's
        # last.ckpt when the monitored metric improved, and resuming wants the latest state.
        ModelCheckpoint(
            monitor="val/ne", mode="min", filename="best-step{step}-ne{val/ne:.4f}", auto_insert_metric_name=False
        ),
        ModelCheckpoint(filename="last"),  # overwritten at every validation
        SaveConfigCallback(parser, config),
    ]
    try:
        trainer = L.Trainer(**objects.trainer, logger=loggers, callbacks=callbacks)
    except MisconfigurationException as error:  # e.g. accelerator: gpu on a machine without one
        parser.error(f"trainer settings: {error}")

    if trainer.strategy.root_device.type == "cuda":
        # Lets the matmuls that bf16-mixed keeps in fp32 use TF32 tensor cores (CPU numerics stay exact).
        torch.set_float32_matmul_precision("high")

    # Fail before any data is prepared if the chosen kernel cannot run on this device.
    try:
        kernels.check_backend(config.model.attn_backend, trainer.strategy.root_device)
    except kernels.BackendUnavailableError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None

    datamodule: CTRDataModule = objects.data
    task = RankingTask(datamodule.schema, objects.model, **objects.optim)
    trainer.fit(task, datamodule=datamodule, ckpt_path=config.ckpt_path)
    if config.baseline:
        report_baseline(trainer, datamodule, Path(csv_logger.log_dir))


def report_baseline(trainer: L.Trainer, datamodule: CTRDataModule, run_dir: Path) -> None:
    """The bar the interaction model must clear: an additive logistic regression, same split."""
    baseline_auc = logistic_regression_auc(
        datamodule.schema, datamodule.train_dataloader(), datamodule.val_dataloader(), seed=0
    )
    model_auc = float(trainer.callback_metrics["val/auc"])
    result = {"model_val_auc": model_auc, "logistic_regression_val_auc": baseline_auc}
    (run_dir / "baseline.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"validation AUC: model {model_auc:.4f}, logistic regression {baseline_auc:.4f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        from benchmarks.compare_backends import main as compare_main

        sys.exit(compare_main(sys.argv[2:]))
    main()
