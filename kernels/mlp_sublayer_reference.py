"""Pure-PyTorch MLP sublayer: exactly the model's unfused path, and the truth for the fused kernels.

    y = x + W2 · GELU(W1 · LayerNorm(x) + b1) + b2

It runs as torch.autocast runs the unfused path: LayerNorm in fp32, the two linears (weights and
biases cast) in `compute_dtype`, GELU (F.gelu's `approximate`: "none", the exact erf form, or "tanh") on
the first linear's rounded output, and the residual added in x's dtype. With compute_dtype = float64 and
fp64 inputs it is the fp64 truth.
"""

import torch
import torch.nn.functional as F


def mlp_sublayer_reference(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    eps: float = 1e-5,
    compute_dtype: torch.dtype | None = None,
    approximate: str = "none",
) -> torch.Tensor:
    """x [T, D]; norm_weight, norm_bias [D]; w1 [H, D], b1 [H], w2 [D, H], b2 [D] (nn.Linear layouts).
    Returns [T, D] in x.dtype."""
    compute_dtype = compute_dtype or x.dtype
    norm_dtype = torch.promote_types(compute_dtype, torch.float32)
    with torch.autocast(x.device.type, enabled=False):  # the dtypes are explicit here
        normed = F.layer_norm(x.to(norm_dtype), x.shape[-1:], norm_weight.to(norm_dtype), norm_bias.to(norm_dtype), eps)
        hidden = F.linear(normed.to(compute_dtype), w1.to(compute_dtype), b1.to(compute_dtype))
        out = F.linear(F.gelu(hidden, approximate=approximate), w2.to(compute_dtype), b2.to(compute_dtype))
        return (x + out.to(x.dtype)).to(x.dtype)
