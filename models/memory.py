"""What training a model will hold in memory, estimated before the first step.

A config whose tables do not fit should be refused with the numbers and what to change, not end in
swap, the OOM killer or a CUDA out-of-memory error minutes into the run: a Criteo config with
2^20-row tables is 872 M parameters (issue 25 reported a 21 GB peak on a 24 GB machine).

The estimate is for the dense path (every parameter trained by AdamW, train.py's optimizer): per
parameter an fp32 weight, an fp32 gradient (unsharded torchrec tables have dense gradients) and
AdamW's two fp32 moments, 16 bytes, and what the peak adds to them (the optimizer step's
temporaries, checkpoint writing): the default config with 2^20-row tables (168 M parameters) peaked
at 3.86 GB more resident memory than with 1,000-row ones, 23 bytes a parameter (2 CPU cores,
30 steps and a checkpoint: `/usr/bin/time -v python train.py --data.vocab_size=1048576
--trainer.max_steps=30 --trainer.val_check_interval=30 --data.num_val=512`, against
--data.vocab_size=1000). Plus the activations a step keeps for its backward. Under the torchrec
strategy the sharded tables train with fused optimizers (row-wise Adagrad keeps one value a row, and
no gradient is materialized), so that path is not estimated here.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# fp32 weight + fp32 gradient + AdamW's exp_avg and exp_avg_sq (16), and the peak's temporaries: 23 measured.
TRAINING_BYTES_PER_PARAMETER = 24
GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    training_state_bytes: int  # weights, gradients, optimizer state
    activation_bytes: int  # what one step keeps for its backward, rough

    @property
    def total_bytes(self) -> int:
        return self.training_state_bytes + self.activation_bytes


def activation_values_per_token(d_model: int, mlp_ratio: int) -> int:
    """Values one layer saves per token for its backward, about: the two LayerNorms' outputs and the
    residual stream (3 d), q, k, v and the attention output (4 d), the MLP's pre-activation and
    GELU output (2 * mlp_ratio * d), and the autocast copies of the matmul inputs (about 2 d more)."""
    return (9 + 2 * mlp_ratio) * d_model


def estimate_training_memory(model: nn.Module, tokens_per_batch: int, d_model: int, num_layers: int,
                             mlp_ratio: int) -> MemoryEstimate:
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    per_token = activation_values_per_token(d_model, mlp_ratio) * num_layers
    return MemoryEstimate(
        parameters=parameters,
        training_state_bytes=parameters * TRAINING_BYTES_PER_PARAMETER,
        activation_bytes=tokens_per_batch * per_token * 4,  # fp32: the upper bound of both precisions
    )


def available_bytes(device: torch.device, meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Memory a run on `device` can still take: free GPU memory, or the host's MemAvailable (what the
    kernel can hand out without swapping). None where it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def check_fits(estimate: MemoryEstimate, limit_bytes: int, already_held_bytes: int, where: str) -> None:
    """ValueError, with the numbers and what to change, when the estimate exceeds what is left.

    already_held_bytes: what the estimate counts that is allocated already (the weights, when the
    model was built on the same device), so it is not counted twice against `limit_bytes`."""
    needed = estimate.total_bytes - already_held_bytes
    if needed <= limit_bytes:
        return
    raise ValueError(
        f"this model needs about {_size(estimate.total_bytes)} to train ({estimate.parameters:,} parameters x "
        f"{TRAINING_BYTES_PER_PARAMETER} bytes for weights, gradients, AdamW state and the step's temporaries = "
        f"{_size(estimate.training_state_bytes)}, plus about {_size(estimate.activation_bytes)} of activations), "
        f"and {where} has {_size(limit_bytes + already_held_bytes)} for it. {_remedy(estimate)}; "
        f"--memory_limit_gib sets the limit, 0 turns the check off"
    )


def _remedy(estimate: MemoryEstimate) -> str:
    """What shrinks the larger part of the estimate."""
    if estimate.activation_bytes > estimate.training_state_bytes:  # they scale with the tokens of a batch
        return ("Most of it is activations: make data.batch_size smaller (or model.net.d_model, num_layers, "
                "data.max_history_len)")
    return ("Make the tables smaller (data.vocab_size, and data.prepare's --table-size for Criteo), or shard them "
            "with fused row-wise Adagrad (--config configs/sharded.yaml: no AdamW state or dense gradient for the "
            "tables)")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB" if num_bytes >= GIB // 10 else f"{num_bytes / 2**20:.1f} MiB"
