"""Ads-ranking model whose feature tokens interact through block attention.

Every sample becomes one jagged sequence of d_model tokens, in this order:

    [dense tokens (n_dense_tokens) | one token per categorical feature | one token per history item]

The first two groups have a fixed size per sample (the "fixed" tokens); history
items come from each sequence feature in schema order, so a sample's length is
n_fixed + sum of its history lengths (under history_tokens "mean" each sequence
feature is one more fixed token instead: the mean of its items' embeddings).
All samples are concatenated into a (total_tokens, d_model) tensor described by
int32 `offsets`, which is the layout block_attention consumes: each sequence is
cut into 64-token blocks from its start and a token only attends within its block.
One more sequence follows the samples: the pad tokens (RankingModelConfig.pad_tokens_to; empty without padding).

The model is two parts: RankingModel.embed runs the torchrec embedding lookups
eagerly (sharded or not, models/sharding/), and DenseTower does everything
after them on plain tensors, so it compiles into one graph.
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    KeyedTensor,
    PoolingType,
)

from data.batch import Batch
from data.schema import FeatureSchema
from kernels import (
    ATTENTION_SUBLAYER_BACKENDS,
    MLP_BACKENDS,
    AttentionBackend,
    BlockTable,
    Rotary,
    attention_sublayer,
    block_attention_qkv,
    block_table,
    mlp_sublayer,
    rotary_tables,
)
from kernels.rotary import token_positions
from models.choices import check_choices


@dataclass
class RankingModelConfig:
    """Sizes of the model; head_dim = d_model // num_heads.

    Args:
        d_model: token width.
        num_heads: attention heads per layer.
        num_layers: pre-norm attention + MLP layers; 0 is the ablation without attention (each token goes
            straight to the final norm and the readout), which says what the attention adds.
        mlp_ratio: hidden width of every MLP, as a multiple of d_model.
        embedding_dim: width of the embedding tables, projected up to d_model.
        n_dense_tokens: tokens the dense-feature MLP emits per sample.
        rotary_base: rotary frequency base.
        rotary_within_block: rotary positions restart at every 64-token block.
        rotate_v: rotate v as well as q and k.
        attn_backend: block_attention backend (kernels.BACKENDS).
        fused_attention: run each layer's LayerNorm + QKV projection + block attention + output
            projection + residual as one fused op (kernels.attention_sublayer), on the attention
            backend's kernels where it has them (triton, tlx, reference), else on the fastest that
            runs here; False is the unfused reference path.
        attention_sublayer_plan: how the fused attention sublayer runs (kernels/attention_sublayer_kernels.py):
            "gemms", GEMMs around the block-attention kernel; "blocks", each pass as one kernel per
            64-token block, which the triton backend (both passes Triton's; 2.2x slower than "gemms" on
            the H200, benchmarks/results/attention_sublayer_h200.md) and the tlx backend (TLX kernels,
            compiled for sm_90 but not yet run on a GPU) have.
        fused_mlp: the same for each layer's LayerNorm + MLP + residual (kernels.mlp_sublayer).
        mlp_gelu: the layers' MLP activation, nn.GELU's `approximate`: "none", the exact erf form, or
            "tanh", the tanh form, which the fused MLP kernels compute with the GPU's hardware tanh (their
            epilogues are bound by erf's instructions: benchmarks/results/mlp_gelu_h100.md); fused or
            not, the model computes the same function. The head's and dense MLPs stay exact.
        compile: torch.compile the DenseTower (token building, attention layers, norm, pooling,
            head); the embedding lookups stay eager. The attention kernels are custom ops, opaque to it.
        compile_mode: torch.compile's mode; "reduce-overhead" also replays the tower from CUDA graphs,
            which wants few distinct token counts: set pad_tokens_to.
        pad_tokens_to: round each batch's token count up to a multiple of this (0: no padding), with
            the pad tokens as one extra sequence that no real token attends to and pooling ignores,
            so a compiled tower sees a few shapes instead of one per batch.
        readout: what the logit head reads of a sample's final tokens: "mean", their mean; "fields",
            its fixed tokens (dense, then each categorical feature) side by side plus that mean, as
            AutoInt reads its fields out, so the head sees which feature said what; "fields_dot", those
            plus the dot product of every pair of fixed tokens (DLRM's interaction, over the attention's
            output): a product such as user x item, which an MLP on the concatenation learns poorly, is
            then one input of the head.
        field_projection: how a categorical feature's embedding becomes its token: "shared", one
            embedding_dim -> d_model linear map for every feature (and the history items), so all
            categorical tokens lie in one embedding_dim-wide subspace, apart from their slot vectors;
            "per_field", a linear map of its own per categorical feature (as AutoInt embeds each field
            in its own d-wide space); history items keep the shared map.
        token_init: how a token's constant parts start. "unit_slots": each slot vector N(0, 1)
            (nn.Embedding's default) and the projections' biases nn.Linear's; next to torchrec's initial
            embedding rows (uniform within +-1/sqrt(rows), ~0.01-0.03) the feature's value is then ~0.002%
            of a token's squared size at MovieLens-1M's sizes, and the model first trains as if it saw no
            feature values (a loss plateau for the first tens of steps on MovieLens). "small_slots": slot
            vectors N(0, 0.02) and zero biases: the value's share starts ~2700x larger (4.9% against
            0.0018%, measured at those sizes), and the LayerNorms that read the token scale it up (the
            baselines add no constant to their embeddings).
        history_order: the order of a sample's history items among its tokens. "given", the data's
            order; "reversed", last item first. A sample's first 64-token block holds its fixed tokens
            (the candidate's among them) and its first ~(64 - n_fixed) items, and only that block's
            items meet the candidate in attention; the data gives histories oldest first
            (data/movielens.py), so "reversed" puts the user's latest items there instead of the
            oldest. Rotary positions follow the placement.
        history_tokens: how a sequence feature (a user's history) becomes tokens. "items", one token per
            item, in the sample's blocks after its fixed tokens; "mean", one fixed token per feature,
            the mean of its items' embeddings (torchrec's mean-pooled lookup, as the baselines read a
            history; an empty history gives a zero embedding), so every sample is its fixed tokens
            alone, the history's summary in the candidate's block.
        target_attention_feature: target attention over the history (DIN's idea, Zhou et al. 2018, here as
            scaled dot-product softmax attention with one query a sample), or None for none. A categorical feature's name (the candidate item's, "item" in MovieLens' time split): that
            feature's final token queries all of its sample's history item tokens, every block of them, not
            only its own (one query a sample, so it costs O(items x d_model), not a block's square), and the
            attention-weighted mean of those items' final tokens joins the readout as one more field (in
            "fields"/"fields_dot" beside the fixed tokens, its dot with each of them included; beside the mean
            under "mean"). Block attention lets an item meet the candidate only inside the candidate's
            64-token block; this lets the candidate weigh every item of the history by its relevance to it.
            Needs history_tokens "items"; a sample without history items gets a zero field.
        head_layers: hidden layers of the logit head's MLP, each mlp_ratio * d_model wide (DCNv2's over
            arch on MovieLens-1M, [256, 256], is 2 at d_model 64).
        head_cross_layers: DCNv2's cross layers on the readout before the head's MLP, x_{l+1} = x_0 *
            (W_l x_l + b_l) + x_l with a full-rank W_l: DCNv2's stacked tower over the attention's output,
            so the head forms bounded-degree products of the readout's features explicitly instead of
            learning them in an MLP.
        residual_init: how each layer's residual branches start. "default", nn.Linear's initialization;
            "zero", the last linear of each branch (the attention's output projection, the MLP's down
            projection) starts at zero weight and bias, so every layer starts as the identity and the model
            as its num_layers=0 ablation; the branches then grow from there (as ReZero and the zero-init
            residual of Goyal et al. start them), instead of first adding random mixing to every token.
        residual_fp32: under autocast, keep the token stream between the layers (their residual
            connections) in fp32, as autocast leaves it; False casts it to the autocast dtype (bf16) once
            after the tokens are built, so every LayerNorm, residual add and their backward moves half the
            bytes (Megatron-LM's default, fp32_residual_connection off). LayerNorm computes as autocast
            runs it (in fp32 on CUDA); the final norm takes the stream back in fp32, so the readout and
            the head stay fp32. Without autocast it changes nothing.
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
    attn_backend: AttentionBackend = "auto"
    fused_attention: bool = False
    attention_sublayer_plan: Literal["gemms", "blocks"] = "gemms"
    fused_mlp: bool = False
    mlp_gelu: Literal["none", "tanh"] = "none"
    compile: bool = False
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    pad_tokens_to: int = 0
    readout: Literal["mean", "fields", "fields_dot"] = "mean"
    field_projection: Literal["shared", "per_field"] = "shared"
    token_init: Literal["unit_slots", "small_slots"] = "unit_slots"
    history_order: Literal["given", "reversed"] = "given"
    history_tokens: Literal["items", "mean"] = "items"
    target_attention_feature: str | None = None
    head_layers: int = 1
    head_cross_layers: int = 0
    residual_init: Literal["default", "zero"] = "default"
    residual_fp32: bool = True

    # The fields that choose how the same network is computed (kernels, compilation, padding, the token
    # stream's dtype), not what it is: a run resumed from a checkpoint may change these and no other.
    EXECUTION_FIELDS = ("attn_backend", "fused_attention", "attention_sublayer_plan", "fused_mlp", "compile",
                        "compile_mode", "pad_tokens_to", "residual_fp32")

    def __post_init__(self):
        check_choices(self)
        for name in ("d_model", "num_heads"):  # before the divisibility test below divides by them
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.d_model % self.num_heads != 0:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even: rotary rotates pairs of channels")
        for name in ("mlp_ratio", "embedding_dim", "n_dense_tokens", "head_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("num_layers", "head_cross_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.fused_attention and self.attention_sublayer_plan == "blocks" and self.attn_backend not in ("triton", "tlx"):
            raise ValueError(f"attention_sublayer_plan='blocks' runs the triton or tlx backend's per-block kernels: set "
                             f"attn_backend to 'triton' or 'tlx' (got {self.attn_backend!r})")
        if self.history_tokens == "mean" and self.history_order != "given":
            raise ValueError(f"history_order={self.history_order!r} orders history item tokens; history_tokens='mean' "
                             f"makes none (a mean has no order): leave history_order 'given'")
        if self.target_attention_feature is not None and self.history_tokens != "items":
            raise ValueError(f"target_attention_feature={self.target_attention_feature!r} attends over history item "
                             f"tokens; history_tokens={self.history_tokens!r} makes none: set history_tokens 'items' "
                             f"or target_attention_feature None")
        if self.pad_tokens_to < 0:
            raise ValueError(f"pad_tokens_to={self.pad_tokens_to} must be >= 0 (0: no padding)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def mlp_backend(self) -> str:
        """The fused MLP sublayer's backend: the attention backend's own kernels where it has them."""
        return self.attn_backend if self.attn_backend in MLP_BACKENDS else "auto"

    @property
    def attention_sublayer_backend(self) -> str:
        """The fused attention sublayer's backend, chosen as the MLP's."""
        return self.attn_backend if self.attn_backend in ATTENTION_SUBLAYER_BACKENDS else "auto"


@dataclass
class JaggedTokens:
    values: torch.Tensor  # (total_tokens, d_model), pad tokens included
    offsets: torch.Tensor  # int32 [B+2]: the B samples, then the pad sequence (empty when nothing is padded)
    sample_ids: torch.Tensor  # int64 (total_tokens,): which sequence each token belongs to (B for pad tokens)
    lengths: torch.Tensor  # int64 [B+1]

    @property
    def num_tokens(self) -> int:
        return self.values.shape[0]


@dataclass
class EmbeddedFeatures:
    """A batch after its embedding lookups: plain tensors, the input of DenseTower."""

    dense: torch.Tensor  # float [B, max(len(schema.dense), 1)]
    categorical: torch.Tensor  # [B, n_categorical, embedding_dim]: pooled embeddings in schema order
    # [M, embedding_dim]: every sequence feature's item embeddings, feature after feature and sample
    # after sample within a feature (a KeyedJaggedTensor's order), then M - items zero rows, which
    # become the pad tokens (RankingModelConfig.pad_tokens_to)
    history: torch.Tensor
    history_lengths: torch.Tensor  # int [n_sequence, B]: items of each feature in each sample
    num_tokens: int  # real tokens, without the pad tokens (known on the host, for token and FLOP counts)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """DenseTower's inputs, in its argument order."""
        return self.dense, self.categorical, self.history, self.history_lengths


def mlp(d_in: int, d_hidden: int, d_out: int, hidden_layers: int = 1, gelu: str = "none") -> nn.Sequential:
    widths = [d_in] + [d_hidden] * hidden_layers
    hidden = [module for w_in, w_out in zip(widths, widths[1:])
              for module in (nn.Linear(w_in, w_out), nn.GELU(approximate=gelu))]
    return nn.Sequential(*hidden, nn.Linear(d_hidden, d_out))


class AttentionLayer(nn.Module):
    """Pre-norm transformer layer: block attention then MLP, each with a residual."""

    def __init__(self, config: RankingModelConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.attn_backend = config.attn_backend
        self.attention_sublayer_backend = config.attention_sublayer_backend if config.fused_attention else None
        self.mlp_backend = config.mlp_backend if config.fused_mlp else None
        plan = config.attention_sublayer_plan
        self.attention_sublayer_launch = None if plan == "gemms" else {"fwd": {"plan": plan}, "bwd": {"plan": plan}}
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out_proj = nn.Linear(config.d_model, config.d_model)
        self.mlp_norm = nn.LayerNorm(config.d_model)
        self.mlp = mlp(config.d_model, config.mlp_ratio * config.d_model, config.d_model, gelu=config.mlp_gelu)
        if config.residual_init == "zero":
            for branch_out in (self.out_proj, self.mlp[-1]):
                nn.init.zeros_(branch_out.weight)
                nn.init.zeros_(branch_out.bias)

    def forward(self, x: torch.Tensor, table: BlockTable, rotary: Rotary) -> torch.Tensor:
        # The table and rotary tables are built once per batch (DenseTower.forward).
        if self.attention_sublayer_backend is None:
            num_tokens, d_model = x.shape
            qkv = self.qkv(self.attn_norm(x)).view(num_tokens, 3, self.num_heads, self.head_dim)
            # Packed: the kernels read q, k, v in place and write their gradients as one dqkv, which the
            # projection's backward takes as is (no copy stacking three).
            attn = block_attention_qkv(qkv, table, rotary=rotary, backend=self.attn_backend)
            x = x + self.out_proj(attn.reshape(num_tokens, d_model))
        else:
            # The same parameters (and state dict) as the unfused path, in one op.
            x = attention_sublayer(x, table, self.attn_norm.weight, self.attn_norm.bias, self.qkv.weight, self.qkv.bias,
                                   self.out_proj.weight, self.out_proj.bias, num_heads=self.num_heads, rotary=rotary,
                                   eps=self.attn_norm.eps, backend=self.attention_sublayer_backend,
                                   launch=self.attention_sublayer_launch)
        if self.mlp_backend is None:
            return x + self.mlp(self.mlp_norm(x))
        # The same parameters (and state dict) as the unfused path, in one op.
        up, activation, down = self.mlp
        return mlp_sublayer(x, self.mlp_norm.weight, self.mlp_norm.bias, up.weight, up.bias, down.weight, down.bias,
                            eps=self.mlp_norm.eps, approximate=activation.approximate, backend=self.mlp_backend)


def readout_fields(config: RankingModelConfig, num_fixed_tokens: int) -> int:
    """The fields the readout sets side by side (beside the mean of all tokens): the fixed tokens under "fields"
    and "fields_dot", then the target attention's pooled history where there is one."""
    return (num_fixed_tokens if config.readout != "mean" else 0) + (config.target_attention_feature is not None)


def head_inputs(config: RankingModelConfig, num_fixed_tokens: int) -> int:
    """The logit head's input width under config.readout."""
    fields = readout_fields(config, num_fixed_tokens)
    pairs = fields * (fields - 1) // 2 if config.readout == "fields_dot" else 0
    return config.d_model * (fields + 1) + pairs


class DenseTower(nn.Module):
    """Everything after the embedding lookups: the dense-feature MLP and the embedding projection
    make the tokens, which are laid out as one jagged sequence per sample, then the attention
    layers, final norm, the readout per sample (config.readout) and the logit head. It takes plain tensors of
    shapes that the padding keeps to a few (RankingModelConfig.pad_tokens_to), so torch.compile
    makes one graph of it and CUDA graphs replay it: one launch instead of hundreds of small ops,
    and no matmul of a new shape per batch (whose cuBLAS heuristics cost host time)."""

    def __init__(self, config: RankingModelConfig, num_dense: int, num_categorical: int, num_sequence: int,
                 target_token: int | None = None):
        """target_token: where config.target_attention_feature's token sits among a sample's fixed tokens."""
        super().__init__()
        if (target_token is None) != (config.target_attention_feature is None):
            raise ValueError(f"target_attention_feature={config.target_attention_feature!r} needs the index of its "
                             f"token among the fixed ones (target_token={target_token!r})")
        self.config = config
        self.num_fixed_tokens = config.n_dense_tokens + num_categorical
        self.num_sequence = num_sequence
        self.target_token = target_token
        d = config.d_model
        self.dense_mlp = mlp(max(num_dense, 1), config.mlp_ratio * d, config.n_dense_tokens * d)
        self.embedding_proj = nn.Linear(config.embedding_dim, d)
        if config.field_projection == "per_field":
            # nn.Linear's initialization, one [embedding_dim, d] map per categorical feature.
            bound = config.embedding_dim ** -0.5
            self.field_proj_weight = nn.Parameter(torch.empty(num_categorical, config.embedding_dim, d).uniform_(-bound, bound))
            self.field_proj_bias = nn.Parameter(torch.empty(num_categorical, d).uniform_(-bound, bound))
        # One learned vector per token slot (each dense token, each categorical
        # feature, each sequence feature) so attention can tell the features apart.
        self.slot_embedding = nn.Embedding(self.num_fixed_tokens + num_sequence, d)
        if config.token_init == "small_slots":
            nn.init.normal_(self.slot_embedding.weight, std=0.02)
            nn.init.zeros_(self.embedding_proj.bias)
            if config.field_projection == "per_field":
                nn.init.zeros_(self.field_proj_bias)
        self.rotary = Rotary(base=config.rotary_base, within_block=config.rotary_within_block, rotate_v=config.rotate_v)
        self.layers = nn.ModuleList(AttentionLayer(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(d)
        # The candidate's token -> the query its history items' final tokens are scored against.
        self.target_query = nn.Linear(d, d, bias=False) if target_token is not None else None
        head_in = head_inputs(config, self.num_fixed_tokens)
        self.head_cross = nn.ModuleList(nn.Linear(head_in, head_in) for _ in range(config.head_cross_layers))
        self.head = mlp(head_in, config.mlp_ratio * d, 1, hidden_layers=config.head_layers)

    def build_tokens(self, dense: torch.Tensor, categorical: torch.Tensor, history: torch.Tensor,
                     history_lengths: torch.Tensor) -> JaggedTokens:
        """Sample b's tokens start at offsets[b]: its fixed tokens (dense, then one per categorical)
        first, then each sequence feature's items, so history item i of feature f in sample b goes to
        offsets[b] + n_fixed + (items of b's earlier features) + i, or + (n - 1 - i) in a list of n
        items under history_order "reversed". The zero rows after the items
        become the pad tokens, one extra sequence at the end. Only tensor ops of static shapes, with
        no value read back to the host."""
        batch_size, num_rows, d = dense.shape[0], history.shape[0], self.config.d_model
        n_fixed, device = self.num_fixed_tokens, dense.device
        slot = self.slot_embedding.weight
        dense_tokens = self.dense_mlp(dense).view(batch_size, self.config.n_dense_tokens, d)
        if self.config.field_projection == "per_field":
            categorical_tokens = torch.einsum("bfe,fed->bfd", categorical, self.field_proj_weight) + self.field_proj_bias
        else:
            categorical_tokens = self.embedding_proj(categorical)
        fixed = torch.cat([dense_tokens, categorical_tokens], dim=1) + slot[:n_fixed]

        rows = torch.arange(num_rows, device=device)
        lengths = history_lengths.long()  # [n_sequence, B]
        items = lengths.sum(0)  # [B]; zeros without sequence features
        token_lengths = n_fixed + items
        starts = torch.cumsum(token_lengths, 0) - token_lengths
        if self.num_sequence:
            per_list = lengths.reshape(-1)  # one entry per (feature, sample) list, in the rows' order
            list_end = torch.cumsum(per_list, 0)
            list_of_row = torch.searchsorted(list_end, rows, right=True)  # == per_list.numel() for pad rows
            is_pad = list_of_row >= per_list.numel()
            list_of_row = list_of_row.clamp(max=per_list.numel() - 1)
            items_before = (torch.cumsum(lengths, 0) - lengths).reshape(-1)  # of the sample's earlier features
            index_in_list = rows - (list_end - per_list)[list_of_row]
            if self.config.history_order == "reversed":
                index_in_list = per_list[list_of_row] - 1 - index_in_list
            destination = starts[list_of_row % batch_size] + n_fixed + items_before[list_of_row] + index_in_list
            feature = list_of_row // batch_size
        else:  # every row is a pad row
            is_pad, destination, feature = torch.ones_like(rows, dtype=torch.bool), rows, torch.zeros_like(rows)
        # Pad row r (r >= the real items) goes right after the real tokens: B * n_fixed + r.
        destination = torch.where(is_pad, batch_size * n_fixed + rows, destination)
        # Pad rows take some slot's vector too (the last: a schema without sequences has no history
        # slot). Selected by a one-hot sum, not looked up: a lookup's backward scatters ~all rows onto
        # one to three slot rows, which on a GPU is atomics (a different sum order each run) or, under
        # torch's deterministic mode, a sort-based kernel that adds each slot's rows one by one (95 ms
        # a step on the H200). The sum's backward is a plain reduction over rows, fixed in order, and
        # its forward is exact (one 1.0 * v and zeros).
        history_slots = slot[-max(self.num_sequence, 1):]
        is_feature = F.one_hot(feature, history_slots.shape[0]).to(slot.dtype)
        history_slot = (is_feature[:, :, None] * history_slots).sum(1)
        history_tokens = self.embedding_proj(history) + history_slot

        fixed_destination = (starts[:, None] + torch.arange(n_fixed, device=device)).reshape(-1)
        sources = torch.cat([fixed.reshape(-1, d), history_tokens.to(fixed.dtype)])
        num_tokens = batch_size * n_fixed + num_rows
        values = sources.new_empty(num_tokens, d).index_copy(0, torch.cat([fixed_destination, destination]), sources)
        lengths = torch.cat([token_lengths, (num_rows - items.sum()).view(1)])  # samples, then the pad sequence
        offsets = F.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)  # block_attention takes int32
        sample_ids = torch.repeat_interleave(torch.arange(batch_size + 1, device=device), lengths,
                                             output_size=num_tokens)
        return JaggedTokens(values=values, offsets=offsets, sample_ids=sample_ids, lengths=lengths)

    def forward(self, dense: torch.Tensor, categorical: torch.Tensor, history: torch.Tensor,
                history_lengths: torch.Tensor) -> torch.Tensor:
        """EmbeddedFeatures' tensors -> logits [B]."""
        tokens = self.build_tokens(dense, categorical, history, history_lengths)
        x, offsets, num_tokens = tokens.values, tokens.offsets, tokens.num_tokens
        # Every layer attends within the same blocks and rotates by the same positions: build the
        # block table and cos/sin tables once per batch, not once per layer.
        table = block_table(offsets, num_tokens)
        cos, sin = rotary_tables(self.rotary, offsets, num_tokens, self.config.head_dim)
        rotary = Rotary(rotate_v=self.config.rotate_v, cos=cos, sin=sin)
        lowered = not self.config.residual_fp32 and torch.is_autocast_enabled(x.device.type)
        if lowered:
            x = x.to(torch.get_autocast_dtype(x.device.type))
        for layer in self.layers:
            x = layer(x, table, rotary)
        x = self.final_norm(x.float() if lowered else x)
        # Mean over each sample's tokens (every sample has >= n_fixed >= 1); the pad sequence is dropped.
        summed = x.new_zeros(tokens.lengths.shape[0], x.shape[1]).index_add(0, tokens.sample_ids, x)
        pooled = summed[:-1] / tokens.lengths[:-1].clamp(min=1)[:, None].to(x.dtype)
        if self.config.readout != "mean" or self.target_query is not None:
            # Sample b's fixed tokens are its first n_fixed, from offsets[b].
            starts = tokens.offsets[:-2].long()
            fixed = x[starts[:, None] + torch.arange(self.num_fixed_tokens, device=x.device)]
            fields = [fixed] if self.config.readout != "mean" else []
            if self.target_query is not None:
                fields.append(self.target_attention(x, tokens, fixed[:, self.target_token])[:, None])
            fields = torch.cat(fields, dim=1)
            head_input = [fields.flatten(1), pooled]
            if self.config.readout == "fields_dot":
                # Scaled as attention's scores: after the final norm a token's norm is ~sqrt(d_model).
                dots = torch.bmm(fields, fields.transpose(1, 2)) * fields.shape[-1] ** -0.5
                first, second = torch.triu_indices(fields.shape[1], fields.shape[1], 1, device=x.device)
                head_input.append(dots[:, first, second])
            pooled = torch.cat(head_input, dim=1)
        crossed = pooled
        for cross in self.head_cross:
            crossed = pooled * cross(crossed) + crossed
        return self.head(crossed).squeeze(-1)

    def target_attention(self, x: torch.Tensor, tokens: JaggedTokens, candidate: torch.Tensor) -> torch.Tensor:
        """Each sample's history item tokens (rows of x) weighted by softmax over the sample's items of their
        dot with its candidate's query, summed: [B, d_model]; zeros for a sample without items."""
        batch_size, d = candidate.shape
        query = self.target_query(candidate)
        sample = tokens.sample_ids
        is_item = (token_positions(tokens.offsets, x.shape[0]) >= self.num_fixed_tokens) & (sample < batch_size)
        sample = sample.clamp(max=batch_size - 1)  # the pad tokens' scores are masked out below
        scores = ((x * query[sample]).sum(1) * d ** -0.5).masked_fill(~is_item, float("-inf"))
        # Each sample's top score, subtracted for exp's range; softmax does not depend on it, so no gradient.
        detached = scores.detach()
        top = detached.new_full((batch_size,), float("-inf")).scatter_reduce(0, sample, detached, "amax")
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # no items: every exp is exp(-inf) = 0
        weights = torch.exp(scores - top[sample])
        # A sample with items sums to >= 1 (its top item's exp(0)), so clamping at 1 changes only the empty ones.
        total = weights.new_zeros(batch_size).index_add(0, sample, weights).clamp(min=1.0)
        return x.new_zeros(batch_size, d).index_add(0, sample, weights[:, None] * x) / total[:, None]


def fields_in_order(pooled: KeyedTensor, names: list[str], embedding_dim: int) -> torch.Tensor:
    """A collection's pooled embeddings as [B, len(names), embedding_dim], features in `names`' order."""
    # torchrec's train pipeline fx-traces forward, where a sharded collection's output is a Proxy without keys.
    if not isinstance(pooled, torch.fx.Proxy) and pooled.keys() == names:
        # The unsharded collection's order: its values are that tensor already, and a view costs
        # the eager step no copy, no split and no launch.
        values = pooled.values()
        return values.view(values.shape[0], len(names), embedding_dim)
    # By feature name: a sharded collection (models/sharding/) returns its features grouped by shard.
    return torch.stack([pooled[name] for name in names], dim=1)


class RankingModel(nn.Module):
    def __init__(self, schema: FeatureSchema, config: RankingModelConfig):
        super().__init__()
        self.schema, self.config = schema, config
        # Lists, not tuples: they are compared with KeyedJaggedTensor.keys(), a list.
        self.categorical_names = list(schema.categorical_names)
        self.sequence_names = list(schema.sequence_names)
        e = config.embedding_dim
        # Plain (unsharded, unfused) torchrec modules run on CPU and CUDA alike.
        self.categorical_embeddings = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f"t_{name}", embedding_dim=e, num_embeddings=n, feature_names=[name])
                for name, n in schema.categorical
            ],
            device=torch.device("cpu"),
        )
        self.pooled_history = config.history_tokens == "mean" and bool(self.sequence_names)
        if self.pooled_history:
            self.sequence_embeddings = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(name=f"t_{name}", embedding_dim=e, num_embeddings=n, feature_names=[name],
                                       pooling=PoolingType.MEAN)
                    for name, n, _ in schema.sequence
                ],
                device=torch.device("cpu"),
            )
        else:
            self.sequence_embeddings = EmbeddingCollection(
                tables=[
                    EmbeddingConfig(name=f"t_{name}", embedding_dim=e, num_embeddings=n, feature_names=[name])
                    for name, n, _ in schema.sequence
                ],
                device=torch.device("cpu"),
            )
        # A pooled history is one more categorical-like field to the tower, with a slot vector of its own.
        pooled_fields = len(schema.sequence) if self.pooled_history else 0
        target_token = None
        if config.target_attention_feature is not None:
            if config.target_attention_feature not in self.categorical_names:
                raise ValueError(f"target_attention_feature={config.target_attention_feature!r} is not a categorical "
                                 f"feature of this data; it has {self.categorical_names}")
            if not self.sequence_names:
                raise ValueError(f"target_attention_feature={config.target_attention_feature!r} attends over history "
                                 f"items, and this data has no sequence feature (e.g. max_history_len=0): set it None")
            target_token = config.n_dense_tokens + self.categorical_names.index(config.target_attention_feature)
        self.tower = DenseTower(config, len(schema.dense), len(schema.categorical) + pooled_fields,
                                len(schema.sequence) - pooled_fields, target_token)
        if config.compile:
            # In place, so the state dict keeps its keys; the first batch compiles, later shapes reuse
            # the graph (dynamic shapes) or, under CUDA graphs, one recording per padded size.
            self.tower.compile(mode=config.compile_mode, dynamic=True)

    def embed(self, batch: Batch) -> EmbeddedFeatures:
        """The embedding lookups (eager: torchrec's modules, sharded or not) and the padding."""
        batch_size, e = batch.labels.shape[0], self.config.embedding_dim
        dense = batch.dense if len(self.schema.dense) else batch.labels.new_zeros(batch_size, 1)
        fields = []
        if self.categorical_names:
            pooled = self.categorical_embeddings(self._check_keys(batch.sparse, self.categorical_names, "sparse"))
            fields.append(fields_in_order(pooled, self.categorical_names, e))
        if self.pooled_history:
            pooled = self.sequence_embeddings(self._check_keys(batch.sequence, self.sequence_names, "sequence"))
            fields.append(fields_in_order(pooled, self.sequence_names, e))
        if not fields:
            categorical = dense.new_zeros(batch_size, 0, e)
        else:
            categorical = fields[0] if len(fields) == 1 else torch.cat(fields, dim=1)
        if self.sequence_names and not self.pooled_history:
            jagged = self.sequence_embeddings(self._check_keys(batch.sequence, self.sequence_names, "sequence"))
            item_rows = [jagged[name].values() for name in self.sequence_names]
            # The batch's own lengths, feature-major like its keys (checked above): the lookups' are the
            # same numbers, split per feature, and stacking them back would cost the eager step a copy.
            history_lengths = batch.sequence.lengths().view(len(self.sequence_names), batch_size)
        else:
            item_rows, history_lengths = [], torch.zeros(0, batch_size, dtype=torch.int32, device=dense.device)
        num_tokens = batch_size * self.tower.num_fixed_tokens + sum(rows.shape[0] for rows in item_rows)
        pad = -num_tokens % self.config.pad_tokens_to if self.config.pad_tokens_to else 0
        history = torch.cat([*item_rows, dense.new_zeros(pad, e, dtype=item_rows[0].dtype if item_rows else None)])
        return EmbeddedFeatures(dense=dense, categorical=categorical, history=history,
                                history_lengths=history_lengths, num_tokens=num_tokens)

    def build_tokens(self, batch: Batch) -> JaggedTokens:
        """The jagged tokens DenseTower attends over (for inspection and tests; forward builds them inside the tower)."""
        return self.tower.build_tokens(*self.embed(batch).tensors())

    @staticmethod
    def _check_keys(features: KeyedJaggedTensor, names: list[str], kind: str) -> KeyedJaggedTensor:
        # EBC/EC match features to tables by position. Reordering a KJT needs an fbgemm op
        # that the CPU build of fbgemm lacks on CUDA, so the batch must already be in schema order.
        # torchrec's TrainPipelineSparseDist fx-traces forward to find the features each sharded
        # collection reads from the batch; a traced KJT has no keys to compare.
        if not isinstance(features, torch.fx.Proxy) and features.keys() != names:
            raise ValueError(f"batch.{kind} has keys {features.keys()}; the schema expects {names}, in that order")
        return features

    def forward(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """Returns logits [B] and the batch's real token count (without pad tokens)."""
        features = self.embed(batch)
        logits = self.tower(*features.tensors())
        return logits, features.num_tokens

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
