"""Baseline architectures on the block-attention model's data path and trainer (train.py's
`model.arch`): logistic regression, DLRM, DCNv2 and DeepFM.

Every baseline looks its features up in torchrec collections built like RankingModel's (tables named
t_<feature>, an EmbeddingBagCollection over the categorical features and one over the sequence
features, mean-pooled: RecBole's pooling of a token sequence), so models/sharding.py shards them and
the fused sparse optimizer trains them as it does the block-attention model's. What follows the
lookups, the tower, takes plain tensors (dense [B, num_dense], fields [B, F, D]) and compiles like
RankingModel's DenseTower. The towers are torchrec's own modules, composed as its models compose them:

- dlrm: torchrec.models.dlrm's DenseArch, InteractionArch and OverArch, as torchrec's DLRM.forward
  composes them. DLRM itself takes one EmbeddingBagCollection, while the history needs a mean-pooled
  one of its own, so the arches are built here around our two collections.
- dcnv2: the same with torchrec's DLRM_DCN interaction, InteractionDCNArch over a
  torchrec.modules.crossnet.LowRankCrossNet (x_{l+1} = x_0 * (W_l V_l x_l + b_l) + x_l), then the
  OverArch: DCNv2's stacked form. dcn_low_rank_dim 0 makes the cross weights full rank.
- deepfm: the DeepFM paper's sum of a first-order term, the factorization machine's pairwise field
  interactions and a deep MLP (torchrec.modules.deepfm.DeepFM over the fields, torchrec's MLP).
  torchrec.models.deepfm's SimpleDeepFMNN does not fit: its OverArch ends in a sigmoid (the trainer's
  loss takes logits), and torchrec.modules.deepfm.FactorizationMachine sums products of every pair of
  flattened embedding elements, not the paper's inner products of field pairs, which are computed here.
- lr: a weight per dense feature and per id, summed (no interactions).

The dense features (a column of zeros when the dataset has none, as RankingModel feeds them) enter
DLRM, DCNv2 and DeepFM as one more field, embedded by the DenseArch MLP, as in torchrec's models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.models.dlrm import DenseArch, InteractionArch, InteractionDCNArch, OverArch, choose
from torchrec.modules.crossnet import LowRankCrossNet
from torchrec.modules.deepfm import DeepFM
from torchrec.modules.mlp import MLP

from data.batch import Batch
from data.schema import FeatureSchema
from models.ranking import RankingModel

BASELINE_ARCHS = ("lr", "dlrm", "dcnv2", "deepfm")
BLOCK_ATTENTION = "block_attention"  # models/ranking.py's RankingModel, sized by the task's `net` config
ARCHS = (BLOCK_ATTENTION, *BASELINE_ARCHS)
# A first-order weight is the sum of a row this wide: fbgemm's table kernels (sharded tables) need a
# multiple of 4 columns, and a sum of 4 weights per id is still one weight per id.
LINEAR_WIDTH = 4


@dataclass
class BaselineConfig:
    """Sizes of the baselines (model.arch other than block_attention).

    Args:
        embedding_dim: width of every embedding table (RecBole's ml-1m benchmark uses 16).
        dense_arch: hidden layer sizes of the MLP embedding the dense features into one field.
        over_arch: hidden layer sizes of the MLP on the interactions (dlrm, dcnv2) or the fields
            (deepfm's deep part); a last layer of width 1 is added.
        dcn_num_layers: cross layers (dcnv2).
        dcn_low_rank_dim: rank of each cross layer's weight (dcnv2); 0 = full rank.
        compile: torch.compile the tower after the embedding lookups, as RankingModelConfig's.
        compile_mode: torch.compile's mode for it ("default", "reduce-overhead", "max-autotune").
    """

    embedding_dim: int = 16
    dense_arch: list[int] = field(default_factory=lambda: [64])
    over_arch: list[int] = field(default_factory=lambda: [256, 256])
    dcn_num_layers: int = 2
    dcn_low_rank_dim: int = 0
    compile: bool = False
    compile_mode: str = "default"

    def __post_init__(self) -> None:
        sizes = [self.embedding_dim, *self.dense_arch, *self.over_arch, self.dcn_num_layers]
        if min(sizes) < 1 or self.dcn_low_rank_dim < 0 or not self.over_arch:
            raise ValueError(
                f"BaselineConfig: need embedding_dim, dense_arch, over_arch (at least one layer) and "
                f"dcn_num_layers >= 1 and dcn_low_rank_dim >= 0, got {self}"
            )


class FeatureEmbeddings(nn.Module):
    """Every feature's pooled embedding: [B, F, dim], the categorical features then the sequence
    features, in schema order."""

    def __init__(self, schema: FeatureSchema, dim: int, prefix: str):
        super().__init__()
        # Lists, not tuples: they are compared with KeyedJaggedTensor.keys(), a list.
        self.categorical_names = list(schema.categorical_names)
        self.sequence_names = list(schema.sequence_names)
        self.categorical_embeddings = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"{prefix}{name}", embedding_dim=dim, num_embeddings=n,
                                       feature_names=[name]) for name, n in schema.categorical],
            device=torch.device("cpu"),
        ) if schema.categorical else None  # fmt: skip
        self.sequence_embeddings = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"{prefix}{name}", embedding_dim=dim, num_embeddings=n,
                                       feature_names=[name], pooling=PoolingType.MEAN)
                    for name, n, _ in schema.sequence],
            device=torch.device("cpu"),
        ) if schema.sequence else None  # fmt: skip

    def forward(self, batch: Batch) -> torch.Tensor:
        fields = []
        for collection, features, names, kind in (
            (self.categorical_embeddings, batch.sparse, self.categorical_names, "sparse"),
            (self.sequence_embeddings, batch.sequence, self.sequence_names, "sequence"),
        ):
            if collection is not None:
                # RankingModel's key check; by feature name, as a sharded collection groups its output by shard.
                pooled = collection(RankingModel._check_keys(features, names, kind))
                fields += [pooled[name] for name in names]
        return torch.stack(fields, dim=1)


class LinearTower(nn.Module):
    """Logistic regression's logit: a weight per dense feature, plus each field's first-order weight."""

    def __init__(self, num_dense: int):
        super().__init__()
        self.dense = nn.Linear(num_dense, 1)
        self.interaction_macs = 0

    def forward(self, dense: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
        return self.dense(dense).squeeze(1) + linear.sum(dim=(1, 2))


class DLRMTower(nn.Module):
    """torchrec's DLRM (dcn_num_layers=None) or DLRM_DCN after the lookups: DenseArch, the interaction, OverArch."""

    def __init__(self, num_dense: int, num_fields: int, config: BaselineConfig, cross: bool):
        super().__init__()
        d = config.embedding_dim
        self.dense_arch = DenseArch(in_features=num_dense, layer_sizes=[*config.dense_arch, d])
        if cross:
            width = (num_fields + 1) * d
            self.inter_arch = InteractionDCNArch(num_fields, LowRankCrossNet(
                in_features=width, num_layers=config.dcn_num_layers, low_rank=config.dcn_low_rank_dim or width,
            ))  # fmt: skip
            over_in, self.interaction_macs = width, 0  # the cross weights are matrices: counted as such
        else:
            self.inter_arch = InteractionArch(num_fields)
            over_in = d + choose(num_fields, 2) + num_fields
            self.interaction_macs = (num_fields + 1) ** 2 * d  # the pairwise dot products (a batched matmul)
        self.over_arch = OverArch(over_in, [*config.over_arch, 1])

    def forward(self, dense: torch.Tensor, fields: torch.Tensor) -> torch.Tensor:
        interactions = self.inter_arch(dense_features=self.dense_arch(dense), sparse_features=fields)
        return self.over_arch(interactions).squeeze(1)


class DeepFMTower(nn.Module):
    """First order + factorization machine over the fields + deep MLP over the fields, summed."""

    def __init__(self, num_dense: int, num_fields: int, config: BaselineConfig):
        super().__init__()
        d = config.embedding_dim
        self.first_order = LinearTower(num_dense)
        self.dense_arch = DenseArch(in_features=num_dense, layer_sizes=[*config.dense_arch, d])
        self.deep = DeepFM(dense_module=nn.Sequential(
            MLP((num_fields + 1) * d, config.over_arch), nn.Linear(config.over_arch[-1], 1),
        ))  # fmt: skip
        self.interaction_macs = (num_fields + 1) * d

    def forward(self, dense: torch.Tensor, fields: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
        fields = torch.cat([self.dense_arch(dense).unsqueeze(1), fields], dim=1)  # [B, F + 1, D]
        # Sum over field pairs of <v_f, v_g> = ((sum_f v_f)^2 - sum_f v_f^2) / 2, summed over the dimensions.
        pairwise = 0.5 * (fields.sum(dim=1).square() - fields.square().sum(dim=1)).sum(dim=1)
        return self.first_order(dense, linear) + pairwise + self.deep([fields]).squeeze(1)


class BaselineModel(nn.Module):
    """A baseline architecture with RankingModel's interface: forward(batch) -> (logits [B], tokens), loss."""

    def __init__(self, schema: FeatureSchema, arch: str, config: BaselineConfig):
        super().__init__()
        if arch not in BASELINE_ARCHS:
            raise ValueError(f"arch={arch!r} is not one of {BASELINE_ARCHS}")
        if not schema.categorical and not schema.sequence:
            raise ValueError(f"{arch} needs at least one categorical or sequence feature")
        self.schema, self.arch, self.config = schema, arch, config
        num_dense, num_fields = max(len(schema.dense), 1), len(schema.categorical) + len(schema.sequence)
        uses_first_order = arch in ("lr", "deepfm")
        self.linear_embeddings = FeatureEmbeddings(schema, LINEAR_WIDTH, "w_") if uses_first_order else None
        self.embeddings = FeatureEmbeddings(schema, config.embedding_dim, "t_") if arch != "lr" else None
        if arch == "lr":
            self.tower = LinearTower(num_dense)
        elif arch == "deepfm":
            self.tower = DeepFMTower(num_dense, num_fields, config)
        else:
            self.tower = DLRMTower(num_dense, num_fields, config, cross=arch == "dcnv2")
        if config.compile:
            self.tower.compile(mode=config.compile_mode, dynamic=True)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """Logits [B], and 0: a baseline has no tokens."""
        dense = batch.dense if len(self.schema.dense) else batch.labels.new_zeros(batch.batch_size, 1)
        inputs = [dense]
        if self.embeddings is not None:
            inputs.append(self.embeddings(batch))
        if self.linear_embeddings is not None:
            inputs.append(self.linear_embeddings(batch))
        return self.tower(*inputs), 0

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())

    def train_step_flops(self, batch_size: int) -> int:
        """models/flops.py's convention: matrix-multiply FLOPs only, 2 per multiply-add, a training step
        3 x the forward. Every weight matrix of the tower is one multiply-add per element and sample."""
        matrix_macs = sum(p.numel() for p in self.tower.parameters() if p.dim() == 2)
        return 3 * 2 * batch_size * (matrix_macs + self.tower.interaction_macs)
