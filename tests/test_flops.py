"""models/flops.py: the FLOP count MFU divides by, against PyTorch's own FLOP counter."""

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from data.batch import Batch
from models import RankingModel, RankingModelConfig
from kernels.blocks import max_num_blocks
from models.flops import (block_length_square_sum, forward_flops, readout_dot_flops, target_attention_flops, train_step_flops,
                          train_step_min_bytes)
from tests.test_model import SCHEMA, make_batch

CONFIG = RankingModelConfig(d_model=32, num_heads=2, num_layers=2, mlp_ratio=2, embedding_dim=8, n_dense_tokens=2)
FIXED_TOKENS = CONFIG.n_dense_tokens + len(SCHEMA.categorical)


def counted(model: RankingModel, batch: Batch) -> dict:
    """FlopCounterMode's forward+backward FLOPs of one step, by op: matmuls of 2-D inputs (the
    projections and MLPs) are mm/addmm, the reference attention's per-tile einsums are bmm."""
    with FlopCounterMode(display=False) as counter:
        logits, _ = model(batch)
        model.loss(logits, batch.labels).backward()
    return {str(op).split(".")[1]: flops for op, flops in counter.get_flop_counts()["Global"].items()}


def test_block_length_square_sum_counts_partial_blocks():
    assert block_length_square_sum(np.array([0, 1, 64, 65, 200])) == 1 + 4096 + 4096 + 1 + 3 * 4096 + 8 * 8


# fields: a wider head input; fields_dot: a bmm; history_tokens "mean": each history one fixed token, no item
# tokens; head (hidden layers, cross layers): a deeper head and DCNv2 cross layers on the readout; layers 0: the
# ablation without attention; target: target attention's query map, one more readout field and its per-item products
@pytest.mark.parametrize("readout, history_tokens, head, layers, target", [
    ("mean", "items", (1, 0), 2, None), ("fields", "items", (1, 0), 2, None), ("fields_dot", "items", (1, 0), 2, None),
    ("mean", "mean", (1, 0), 2, None), ("fields_dot", "mean", (1, 0), 2, None), ("mean", "items", (3, 0), 2, None),
    ("fields_dot", "items", (2, 2), 2, None), ("fields_dot", "items", (1, 2), 0, None),
    ("mean", "items", (1, 0), 2, "ad"), ("fields_dot", "items", (1, 2), 2, "user")])
def test_matmul_flops_equal_pytorchs_count(readout, history_tokens, head, layers, target):
    config = RankingModelConfig(**{**CONFIG.__dict__, "readout": readout, "history_tokens": history_tokens,
                                   "head_layers": head[0], "head_cross_layers": head[1], "num_layers": layers,
                                   "target_attention_feature": target})
    model = RankingModel(SCHEMA, config)
    batch = make_batch(clicks_lengths=[0, 70, 3, 100], views_lengths=[2, 0, 5, 8])
    history = np.array([2, 70, 8, 108])
    counts = counted(model, batch)
    fixed = FIXED_TOKENS + (len(SCHEMA.sequence) if history_tokens == "mean" else 0)
    tokens = fixed + (history if history_tokens == "items" else np.zeros_like(history))
    attention = 4 * config.d_model * block_length_square_sum(tokens)
    dots = readout_dot_flops(config, len(history), fixed)
    assert (dots > 0) == (readout == "fields_dot")
    per_item = target_attention_flops(config, int(history.sum()))
    assert per_item == (4 * config.d_model * history.sum() if target else 0)
    # Everything but attention, the readout's dots and target attention's per-item products (elementwise ops
    # here) is exactly the counter's mm + addmm, forward and backward.
    assert train_step_flops(config, SCHEMA, history) - 3 * (config.num_layers * attention + dots + per_item) == (
        counts["mm"] + counts["addmm"])


def test_attention_flops_equal_pytorchs_count_when_every_block_is_full():
    """The reference pads each block to 64 and its table to a shape-derived row count
    (kernels.blocks.max_num_blocks). One sample of two whole blocks, plus the model's (empty) pad
    sequence, leaves no padded block and one padded table row: the bmm count is the formula's
    attention plus that row's."""
    model = RankingModel(SCHEMA, CONFIG)
    batch = make_batch(clicks_lengths=[128 - FIXED_TOKENS - 8], views_lengths=[8])
    history = np.array([128 - FIXED_TOKENS])
    attention = 4 * CONFIG.d_model * block_length_square_sum(FIXED_TOKENS + history)
    assert attention == 4 * CONFIG.d_model * 2 * 64**2
    assert max_num_blocks(128, 2) == 3
    assert 3 * CONFIG.num_layers * attention * 3 // 2 == counted(model, batch)["bmm"]


def test_backward_is_twice_the_forward_but_the_dense_inputs_gradient_and_min_bytes_grow_with_tokens():
    history = np.array([10, 200])
    dense_inputs_grad = 2 * 2 * len(SCHEMA.dense) * CONFIG.mlp_ratio * CONFIG.d_model
    assert train_step_flops(CONFIG, SCHEMA, history) == 3 * forward_flops(CONFIG, SCHEMA, history) - dense_inputs_grad
    params = 10_000
    assert train_step_min_bytes(CONFIG, SCHEMA, history * 2, params) > train_step_min_bytes(CONFIG, SCHEMA, history, params)
    assert train_step_min_bytes(CONFIG, SCHEMA, np.array([0]), params) >= 40 * params


@pytest.mark.parametrize("name, peak", [("NVIDIA H200", 989.4e12), ("NVIDIA H100 80GB HBM3", 989.4e12),
                                        ("NVIDIA GeForce RTX 4090", None)])
def test_peak_is_the_dense_16_bit_datasheet_figure(monkeypatch, name, peak):
    from models import flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert flops.peak_flops(torch.device("cuda"), torch.bfloat16) == peak
    assert flops.peak_flops(torch.device("cuda"), torch.float32) is None
    assert flops.peak_flops(torch.device("cpu"), torch.bfloat16) is None
