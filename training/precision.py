"""What a Lightning `trainer.precision` setting means for the tensors the model computes with."""

import torch


def kernel_dtype(precision: str) -> torch.dtype:
    """The dtype the attention kernels and matmuls see under a Lightning `trainer.precision` setting
    (autocast's for the mixed settings)."""
    precision = str(precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    if precision.startswith("64"):
        return torch.float64
    return torch.float32
