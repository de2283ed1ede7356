"""A logistic-regression baseline: the bar any interaction model has to clear.

Every feature enters additively (a weight per dense value, a weight per
categorical id, the mean of per-id weights over each sequence), so nothing can
model how two features act together.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn
from torchmetrics.functional.classification import binary_auroc

from data.batch import Batch
from data.schema import FeatureSchema


def binary_auc(scores, labels) -> float:
    """ROC AUC (torchmetrics, as the training's validation AUC); tied scores count half."""
    scores = torch.as_tensor(np.asarray(scores, dtype=np.float64)).ravel()
    labels = torch.as_tensor(np.asarray(labels)).ravel()
    if scores.shape != labels.shape:
        raise ValueError(f"binary_auc: {scores.shape[0]} scores but {labels.shape[0]} labels")
    if not bool(((labels == 0) | (labels == 1)).all()):
        raise ValueError(f"binary_auc: labels must be 0 or 1, got {labels.unique()[:10].tolist()}")
    positives = int(labels.sum())
    if positives == 0 or positives == labels.numel():
        raise ValueError(f"binary_auc: need both classes, got {positives} positives and {labels.numel() - positives} negatives")
    return float(binary_auroc(scores, labels.long()))


class LogisticRegression(nn.Module):
    def __init__(self, schema: FeatureSchema):
        super().__init__()
        self.schema = schema
        self.dense = nn.Linear(len(schema.dense), 1)
        # sparse=True keeps an Adagrad step proportional to the ids in the batch, not the table size.
        self.categorical = nn.ModuleList(nn.Embedding(size, 1, sparse=True) for _, size in schema.categorical)
        self.sequence = nn.ModuleList(
            nn.EmbeddingBag(size, 1, mode="mean", sparse=True, include_last_offset=True)
            for _, size, _ in schema.sequence
        )
        for table in [*self.categorical, *self.sequence]:
            nn.init.zeros_(table.weight)

    def forward(self, batch: Batch) -> torch.Tensor:
        logits = self.dense(batch.dense).squeeze(1)
        sparse = batch.sparse.to_dict()
        for (name, _), table in zip(self.schema.categorical, self.categorical):
            logits = logits + table(sparse[name].values()).squeeze(1)
        sequences = batch.sequence.to_dict()
        for (name, _, _), table in zip(self.schema.sequence, self.sequence):
            jagged = sequences[name]
            logits = logits + table(jagged.values(), jagged.offsets()).squeeze(1)
        return logits


def logistic_regression_auc(
    schema: FeatureSchema,
    train: Iterable[Batch],
    val: Iterable[Batch],
    *,
    epochs: int = 2,
    lr: float = 0.05,
    seed: int = 0,
) -> float:
    """Fit on the train batches, return ROC AUC on the validation batches."""
    torch.manual_seed(seed)
    model = LogisticRegression(schema)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=lr)
    loss_fn = nn.BCEWithLogitsLoss()
    model.train()
    # Explicitly skip invariant checks on the sparse gradients (cost per step, and torch warns when left implicit).
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        for _ in range(epochs):
            for batch in train:
                optimizer.zero_grad()
                loss_fn(model(batch), batch.labels).backward()
                optimizer.step()
    model.eval()
    scores, labels = [], []
    with torch.no_grad():
        for batch in val:
            scores.append(model(batch).numpy())
            labels.append(batch.labels.numpy())
    return binary_auc(np.concatenate(scores), np.concatenate(labels))
