"""Pure-PyTorch attention sublayer: exactly the model's unfused path, and the truth for the fused ops.

    y = x + Wo · blockattn(rotary(split(Wqkv · LayerNorm(x) + bqkv))) + bo

It runs as torch.autocast runs the unfused path: LayerNorm in fp32, the two linears (weights and
biases cast) in `compute_dtype`, block attention by kernels.block_attention_reference (in fp32 with
`upcast`, the reference backend's way; in `compute_dtype` without it, the same-precision yardstick),
and the residual added in x's dtype. With compute_dtype = float64 and fp64 inputs it is the fp64 truth.
"""

import torch
import torch.nn.functional as F

from .block_attention_reference import block_attention_reference
from .blocks import BlockTable


def attention_sublayer_reference(
    x: torch.Tensor,
    offsets: torch.Tensor | BlockTable,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    w_qkv: torch.Tensor,
    b_qkv: torch.Tensor,
    w_out: torch.Tensor,
    b_out: torch.Tensor,
    num_heads: int,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rotate_v: bool = False,
    eps: float = 1e-5,
    compute_dtype: torch.dtype | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """x [T, D]; norm_weight, norm_bias [D]; w_qkv [3D, D], b_qkv [3D], w_out [D, D], b_out [D]
    (nn.Linear layouts; q, k, v are the projection's three D-wide thirds, each split into num_heads
    heads); cos, sin: the fp32 rotary tables [T, D / num_heads / 2] or None. Returns [T, D] in x.dtype."""
    compute_dtype = compute_dtype or x.dtype
    norm_dtype = torch.promote_types(compute_dtype, torch.float32)
    tokens, d_model = x.shape
    with torch.autocast(x.device.type, enabled=False):  # the dtypes are explicit here
        normed = F.layer_norm(x.to(norm_dtype), x.shape[-1:], norm_weight.to(norm_dtype), norm_bias.to(norm_dtype), eps)
        qkv = F.linear(normed.to(compute_dtype), w_qkv.to(compute_dtype), b_qkv.to(compute_dtype))
        q, k, v = qkv.view(tokens, 3, num_heads, d_model // num_heads).unbind(1)
        if tokens:
            attn = block_attention_reference(q, k, v, offsets, cos, sin, rotate_v, upcast=upcast)
        else:
            attn = (q + k + v) * 0  # keeps the autograd graph of an empty batch, as block_attention does
        out = F.linear(attn.reshape(tokens, d_model), w_out.to(compute_dtype), b_out.to(compute_dtype))
        return (x + out.to(x.dtype)).to(x.dtype)
