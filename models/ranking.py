"""Ads-ranking model whose feature tokens interact through block attention.

Every sample becomes one jagged sequence of d_model tokens, in this order:

    [dense tokens (n_dense_tokens) | one token per categorical feature | one token per history item]

The first two groups have a fixed size per sample (the "fixed" tokens); history
items come from each sequence feature in schema order, so a sample's length is
n_fixed + sum of its history lengths. All samples are concatenated into a
(total_tokens, d_model) tensor described by int32 `offsets` [B+1], which is the
layout block_attention consumes: each sequence is cut into 64-token blocks from
its start and a token only attends within its block.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)

from data.batch import Batch
from data.schema import FeatureSchema
from kernels import BACKENDS, BlockTable, Rotary, block_attention, block_table, rotary_tables


@dataclass
class RankingModelConfig:
    """Sizes of the model; head_dim = d_model // num_heads.

    Args:
        d_model: token width.
        num_heads: attention heads per layer.
        num_layers: pre-norm attention + MLP layers.
        mlp_ratio: hidden width of every MLP, as a multiple of d_model.
        embedding_dim: width of the embedding tables, projected up to d_model.
        n_dense_tokens: tokens the dense-feature MLP emits per sample.
        rotary_base: rotary frequency base.
        rotary_within_block: rotary positions restart at every 64-token block.
        rotate_v: rotate v as well as q and k.
        attn_backend: block_attention backend: auto, reference, fa2, triton or tlx.
        compile: torch.compile the token-interaction stack (attention layers, norm, pooling, head);
            the embedding lookups stay eager. The attention kernels are custom ops, opaque to it.
        compile_mode: torch.compile's mode; "reduce-overhead" also replays the stack from CUDA graphs,
            which wants few distinct token counts: set pad_tokens_to.
        pad_tokens_to: round each batch's token count up to a multiple of this (0: no padding), with
            the pad tokens as one extra sequence that no real token attends to and pooling ignores,
            so a compiled stack sees a few shapes instead of one per batch.
    """

    d_model: int = 64
    num_heads: int = 2
    num_layers: int = 2
    mlp_ratio: int = 4
    embedding_dim: int = 32
    n_dense_tokens: int = 2
    rotary_base: float = 10000.0
    rotary_within_block: bool = False
    rotate_v: bool = False
    attn_backend: str = "auto"
    compile: bool = False
    compile_mode: str = "default"
    pad_tokens_to: int = 0

    def __post_init__(self):
        if self.attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend={self.attn_backend!r} is not one of {', '.join(BACKENDS)}")
        if self.d_model % self.num_heads != 0:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even: rotary rotates pairs of channels")
        for name in ("num_layers", "mlp_ratio", "embedding_dim", "n_dense_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.pad_tokens_to < 0:
            raise ValueError(f"pad_tokens_to={self.pad_tokens_to} must be >= 0 (0: no padding)")
        modes = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
        if self.compile_mode not in modes:
            raise ValueError(f"compile_mode={self.compile_mode!r} is not one of {modes}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@dataclass
class JaggedTokens:
    values: torch.Tensor  # (total_tokens, d_model)
    offsets: torch.Tensor  # int32 [B+1]
    sample_ids: torch.Tensor  # int64 (total_tokens,): which sample each token belongs to
    lengths: torch.Tensor  # int64 [B]

    @property
    def num_tokens(self) -> int:
        return self.values.shape[0]


def mlp(d_in: int, d_hidden: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_out))


class AttentionLayer(nn.Module):
    """Pre-norm transformer layer: block attention then MLP, each with a residual."""

    def __init__(self, config: RankingModelConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.attn_backend = config.attn_backend
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out_proj = nn.Linear(config.d_model, config.d_model)
        self.mlp_norm = nn.LayerNorm(config.d_model)
        self.mlp = mlp(config.d_model, config.mlp_ratio * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor, table: BlockTable, rotary: Rotary) -> torch.Tensor:
        num_tokens, d_model = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(num_tokens, 3, self.num_heads, self.head_dim)
        # Views of one projection: the kernels read them in place (shared strides), no copies.
        q, k, v = qkv.unbind(dim=1)
        # The table and rotary tables are built once per batch (TokenInteraction.forward).
        attn = block_attention(q, k, v, table, rotary=rotary, backend=self.attn_backend)
        x = x + self.out_proj(attn.reshape(num_tokens, d_model))
        return x + self.mlp(self.mlp_norm(x))


class TokenInteraction(nn.Module):
    """The dense, token-parallel part of the model: attention layers over the jagged tokens, final
    norm, mean pooling per sample and the logit head. It takes plain tensors, so torch.compile
    sees one graph whatever the batch (RankingModelConfig.compile)."""

    def __init__(self, config: RankingModelConfig):
        super().__init__()
        self.config = config
        self.rotary = Rotary(base=config.rotary_base, within_block=config.rotary_within_block, rotate_v=config.rotate_v)
        self.layers = nn.ModuleList(AttentionLayer(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.d_model)
        self.head = mlp(config.d_model, config.mlp_ratio * config.d_model, 1)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, sample_ids: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor:
        """values (T, d_model), int32 offsets [B+1], sample_ids int64 (T,), lengths int64 [B] -> logits [B]."""
        # Every layer attends within the same blocks and rotates by the same positions: build the
        # block table and cos/sin tables once per batch, not once per layer.
        table = block_table(offsets, values.shape[0])
        cos, sin = rotary_tables(self.rotary, offsets, values.shape[0], self.config.head_dim)
        rotary = Rotary(rotate_v=self.config.rotate_v, cos=cos, sin=sin)
        x = values
        for layer in self.layers:
            x = layer(x, table, rotary)
        x = self.final_norm(x)
        # Mean over each sample's tokens; every sample has >= n_fixed >= 1 tokens (a pad sequence,
        # which may be empty, is divided by at least 1 and dropped by the caller).
        summed = x.new_zeros(lengths.shape[0], x.shape[1]).index_add(0, sample_ids, x)
        pooled = summed / lengths.clamp(min=1)[:, None].to(x.dtype)
        return self.head(pooled).squeeze(-1)


class RankingModel(nn.Module):
    def __init__(self, schema: FeatureSchema, config: RankingModelConfig):
        super().__init__()
        self.schema, self.config = schema, config
        # Lists, not tuples: they are compared with KeyedJaggedTensor.keys(), a list.
        self.categorical_names = list(schema.categorical_names)
        self.sequence_names = list(schema.sequence_names)
        self.num_fixed_tokens = config.n_dense_tokens + len(schema.categorical)
        d, e = config.d_model, config.embedding_dim

        self.dense_mlp = mlp(max(len(schema.dense), 1), config.mlp_ratio * d, config.n_dense_tokens * d)
        # Plain (unsharded, unfused) torchrec modules run on CPU and CUDA alike.
        self.categorical_embeddings = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f"t_{name}", embedding_dim=e, num_embeddings=n, feature_names=[name])
                for name, n in schema.categorical
            ],
            device=torch.device("cpu"),
        )
        self.sequence_embeddings = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name=f"t_{name}", embedding_dim=e, num_embeddings=n, feature_names=[name])
                for name, n, _ in schema.sequence
            ],
            device=torch.device("cpu"),
        )
        self.embedding_proj = nn.Linear(e, d)
        # One learned vector per token slot (each dense token, each categorical
        # feature, each sequence feature) so attention can tell the features apart.
        self.slot_embedding = nn.Embedding(self.num_fixed_tokens + len(schema.sequence), d)
        self.interaction = TokenInteraction(config)
        if config.compile:
            # In place, so the state dict keeps its keys; the first batch compiles, later token
            # counts reuse the graph (dynamic shapes) or, under CUDA graphs, one recording per size.
            self.interaction.compile(mode=config.compile_mode, dynamic=True)

    def build_tokens(self, batch: Batch) -> JaggedTokens:
        """Embed every feature and lay the tokens out as one jagged sequence per sample."""
        batch_size, d = batch.labels.shape[0], self.config.d_model
        device = batch.labels.device
        dense_input = batch.dense if len(self.schema.dense) else batch.labels.new_zeros(batch_size, 1)
        dense_tokens = self.dense_mlp(dense_input).view(batch_size, self.config.n_dense_tokens, d)
        fixed_tokens = [dense_tokens]
        if self.categorical_names:
            pooled = self.categorical_embeddings(self._check_keys(batch.sparse, self.categorical_names, "sparse"))
            # By feature name: a sharded collection (models/sharding.py) returns its features grouped
            # by shard, not in table order.
            categorical = torch.stack([pooled[name] for name in self.categorical_names], dim=1)
            fixed_tokens.append(self.embedding_proj(categorical))
        fixed = torch.cat(fixed_tokens, dim=1)
        fixed = fixed + self.slot_embedding.weight[: self.num_fixed_tokens]

        # Sample b's tokens start at offsets[b]; its fixed tokens come first, then
        # each sequence feature's items, so a history item's destination is
        # offsets[b] + n_fixed + (items of earlier features in b) + (index in its list).
        history_lengths, history_values = [], []
        if self.sequence_names:
            jagged = self.sequence_embeddings(self._check_keys(batch.sequence, self.sequence_names, "sequence"))
            for slot, name in enumerate(self.sequence_names, start=self.num_fixed_tokens):
                history_lengths.append(jagged[name].lengths().long())
                history_values.append(self.embedding_proj(jagged[name].values()) + self.slot_embedding.weight[slot])
        fixed_lengths = torch.full((batch_size,), self.num_fixed_tokens, dtype=torch.long, device=device)
        lengths = sum(history_lengths, fixed_lengths)
        offsets = F.pad(torch.cumsum(lengths, 0), (1, 0))
        starts = offsets[:-1]
        num_tokens = batch_size * self.num_fixed_tokens + sum(v.shape[0] for v in history_values)

        fixed_dest = (starts[:, None] + torch.arange(self.num_fixed_tokens, device=device)).reshape(-1)
        destinations, sources = [fixed_dest], [fixed.reshape(-1, d)]
        items_before = torch.full_like(lengths, self.num_fixed_tokens)
        for feature_lengths, values in zip(history_lengths, history_values):
            owner = torch.repeat_interleave(
                torch.arange(batch_size, device=device), feature_lengths, output_size=values.shape[0]
            )
            feature_starts = torch.cumsum(feature_lengths, 0) - feature_lengths
            index_in_list = torch.arange(values.shape[0], device=device) - feature_starts[owner]
            destinations.append(starts[owner] + items_before[owner] + index_in_list)
            sources.append(values)
            items_before = items_before + feature_lengths
        source = torch.cat(sources).to(fixed.dtype)
        values = source.new_empty(num_tokens, d).index_copy(0, torch.cat(destinations), source)

        sample_ids = torch.repeat_interleave(torch.arange(batch_size, device=device), lengths, output_size=num_tokens)
        # block_attention takes int32 offsets; the index arithmetic above stays int64.
        return JaggedTokens(values=values, offsets=offsets.to(torch.int32), sample_ids=sample_ids, lengths=lengths)

    @staticmethod
    def _check_keys(features: KeyedJaggedTensor, names: list[str], kind: str) -> KeyedJaggedTensor:
        # EBC/EC match features to tables by position. Reordering a KJT needs an fbgemm op
        # that the CPU build of fbgemm lacks on CUDA, so the batch must already be in schema order.
        if features.keys() != names:
            raise ValueError(f"batch.{kind} has keys {features.keys()}; the schema expects {names}, in that order")
        return features

    def forward(self, batch: Batch) -> tuple[torch.Tensor, JaggedTokens]:
        """Returns logits [B] and the jagged tokens (for token counts)."""
        tokens = self.build_tokens(batch)
        values, offsets, sample_ids, lengths = tokens.values, tokens.offsets, tokens.sample_ids, tokens.lengths
        pad = -tokens.num_tokens % self.config.pad_tokens_to if self.config.pad_tokens_to else 0
        if self.config.pad_tokens_to:
            # The pad tokens form one extra sequence at the end (even when pad is 0, so the sample
            # count, and with it every shape, stays the same from batch to batch).
            values = torch.cat([values, values.new_zeros(pad, values.shape[1])])
            offsets = torch.cat([offsets, offsets[-1:] + pad])
            lengths = torch.cat([lengths, lengths.new_full((1,), pad)])
            sample_ids = torch.cat([sample_ids, sample_ids.new_full((pad,), lengths.shape[0] - 1)])
        logits = self.interaction(values, offsets, sample_ids, lengths)
        return logits[: tokens.lengths.shape[0]], tokens

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
