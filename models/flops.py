"""What one training step of RankingModel must compute and move: the numerator of MFU and the two
terms of the step's speed of light.

FLOPs follow the convention MFU is quoted in (PaLM, nanoGPT, torchtitan): matrix multiplies only,
2 FLOPs per multiply-add, backward = 2 x forward, so a training step is 3 x the forward. Norms,
activations, softmax, biases and embedding gathers are left out. Attention counts Q K^T and P V
over each 64-token block's real tokens: 4 * d_model * len^2 per block and layer.

Minimum bytes are a lower bound no implementation can beat, assuming maximal fusion: every dense
parameter read forward and backward, its gradient written, and AdamW reading parameter, gradient
and both moments and writing parameter and moments (fp32); each layer reading its input and writing
its output forward, and reading input and output gradient and writing the input gradient backward;
the embedding rows gathered forward and scattered backward.
"""

import numpy as np
import torch

from data.schema import FeatureSchema
from kernels import BLOCK_SIZE
from models.ranking import RankingModelConfig, head_inputs, readout_fields

# Dense (no sparsity) bf16/fp16 tensor-core peaks from the vendors' datasheets, SXM parts: the
# denominator of MFU. Lightning's table lists the H200's 2:4-sparse figure (2e15), twice this.
PEAK_DENSE_16BIT_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}
# AdamW per fp32 parameter: read it forward and backward (8 B), write its gradient (4 B), then read
# parameter, gradient, exp_avg, exp_avg_sq (16 B) and write parameter, exp_avg, exp_avg_sq (12 B).
ADAMW_BYTES_PER_PARAM = 40


def fixed_token_count(config: RankingModelConfig, schema: FeatureSchema) -> int:
    """Tokens every sample has: the dense tokens, one per categorical feature, and under history_tokens
    "mean" one per sequence feature."""
    pooled_history = len(schema.sequence) if config.history_tokens == "mean" else 0
    return config.n_dense_tokens + len(schema.categorical) + pooled_history


def item_token_counts(config: RankingModelConfig, history_lengths: np.ndarray) -> np.ndarray:
    """Each sample's history item tokens: its history length, or none where the history is pooled."""
    lengths = np.asarray(history_lengths, dtype=np.int64)
    return lengths if config.history_tokens == "items" else np.zeros_like(lengths)


def sample_token_counts(config: RankingModelConfig, schema: FeatureSchema, history_lengths: np.ndarray) -> np.ndarray:
    """Tokens of each sample: the fixed ones plus its history's item tokens."""
    return fixed_token_count(config, schema) + item_token_counts(config, history_lengths)


def block_length_square_sum(token_counts: np.ndarray) -> int:
    """Sum over every 64-token block of its length squared (the last block of a sample may be partial)."""
    full, last = np.divmod(np.asarray(token_counts, dtype=np.int64), BLOCK_SIZE)
    return int((full * BLOCK_SIZE**2 + last**2).sum())


def forward_flops(config: RankingModelConfig, schema: FeatureSchema, history_lengths: np.ndarray) -> int:
    """Matrix-multiply FLOPs of one forward pass over a batch with these per-sample history lengths."""
    d, e, hidden = config.d_model, config.embedding_dim, config.mlp_ratio * config.d_model
    batch_size = len(history_lengths)
    tokens = sample_token_counts(config, schema, history_lengths)
    num_tokens, item_tokens = int(tokens.sum()), int(item_token_counts(config, history_lengths).sum())
    dense_in = max(len(schema.dense), 1)
    dense_mlp = 2 * batch_size * (dense_in * hidden + hidden * config.n_dense_tokens * d)
    # Every token but the dense ones is an embedding projected to d_model.
    embedding_proj = 2 * (batch_size * (fixed_token_count(config, schema) - config.n_dense_tokens) + item_tokens) * e * d
    # Per layer: qkv (d -> 3d), out projection (d -> d), MLP (d -> hidden -> d).
    projections = 2 * num_tokens * d * (3 * d + d + 2 * hidden)
    attention = 4 * d * block_length_square_sum(tokens)
    n_fixed = fixed_token_count(config, schema)
    head_in = head_inputs(config, n_fixed)
    head = 2 * batch_size * (config.head_cross_layers * head_in**2 + head_in * hidden
                             + (config.head_layers - 1) * hidden**2 + hidden)
    target_query = 2 * batch_size * d * d if config.target_attention_feature is not None else 0
    return (dense_mlp + embedding_proj + config.num_layers * (projections + attention) + head + target_query
            + readout_dot_flops(config, batch_size, n_fixed) + target_attention_flops(config, item_tokens))


def readout_dot_flops(config: RankingModelConfig, batch_size: int, num_fixed_tokens: int) -> int:
    """The "fields_dot" readout's dot products (a batched [n, d] x [d, n] product per sample over its n readout
    fields, the whole square)."""
    fields = readout_fields(config, num_fixed_tokens)
    return 2 * batch_size * fields**2 * config.d_model if config.readout == "fields_dot" else 0


def target_attention_flops(config: RankingModelConfig, item_tokens: int) -> int:
    """Target attention's per-item products (elementwise, not matmuls): each item's score against its candidate's
    query, and its weighted share of the pooled field (the query's projection is a matmul of the forward)."""
    return 4 * item_tokens * config.d_model if config.target_attention_feature is not None else 0


def train_step_flops(config: RankingModelConfig, schema: FeatureSchema, history_lengths: np.ndarray) -> int:
    """Forward plus backward: twice the forward (gradients of inputs and of weights), less the one
    input gradient nothing needs, that of the dense features entering the dense MLP."""
    hidden = config.mlp_ratio * config.d_model
    unused_input_grad = 2 * len(history_lengths) * max(len(schema.dense), 1) * hidden
    return 3 * forward_flops(config, schema, history_lengths) - unused_input_grad


def train_step_min_bytes(
    config: RankingModelConfig, schema: FeatureSchema, history_lengths: np.ndarray, num_params: int,
    activation_bytes: int = 2,
) -> int:
    """The fewest bytes a training step moves through device memory (see the module docstring)."""
    tokens = int(sample_token_counts(config, schema, history_lengths).sum())
    history_items = int(np.sum(history_lengths))
    gathered_rows = len(history_lengths) * len(schema.categorical) + history_items
    per_layer = 5 * tokens * config.d_model * activation_bytes
    embeddings = 2 * gathered_rows * config.embedding_dim * 4
    built_tokens = tokens * config.d_model * activation_bytes
    return ADAMW_BYTES_PER_PARAM * num_params + config.num_layers * per_layer + embeddings + built_tokens


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense 16-bit peak (datasheet) when training runs in bf16/fp16, else None:
    MFU is quoted against the tensor-core peak, which fp32 training does not use."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for chip, peak in PEAK_DENSE_16BIT_FLOPS.items() if chip in name), None)
