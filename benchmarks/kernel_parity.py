"""Kernel-level parity: each block-attention backend's out, dq, dk and dv against an fp64 reference.

Used by benchmarks/compare_backends.py before it trains anything. Every backend gets the same
random ragged batch (sequence lengths LENGTHS cover the empty sequence, a single token, a block
edge on either side and several blocks) in the dtype training feeds the kernels. The fp64
reference runs on those same rounded inputs, so the errors measure the kernel, not the rounding
of its inputs.
"""

import torch

from kernels import Rotary, block_attention, offsets_from_lengths

LENGTHS = (0, 1, 63, 64, 65, 200)
TENSORS = ("out", "dq", "dk", "dv")


class UnsupportedConfigError(ValueError):
    """The backend runs on this device but not with these inputs (head_dim, dtype)."""


def kernel_dtype(precision: str) -> torch.dtype:
    """The dtype the attention kernels see under a Lightning `trainer.precision` setting."""
    precision = str(precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    if precision.startswith("64"):
        return torch.float64
    return torch.float32


def _forward_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, offsets: torch.Tensor,
    rotary: Rotary, backend: str,
) -> dict[str, torch.Tensor]:
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = block_attention(q, k, v, offsets, rotary=rotary, backend=backend)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def kernel_errors(
    backends: list[str], device: torch.device, dtype: torch.dtype, heads: int, head_dim: int, rotary: Rotary,
    seed: int = 0,
) -> dict:
    """{"settings": {...}, "backends": {name: {tensor: {"max_abs", "max_rel", "dtype"}} or {"error": str}}}.

    max_rel is max|got - ref| / max|ref| over the whole tensor (an element-wise ratio blows up
    where the reference is near zero). A backend that does not support these inputs raises
    UnsupportedConfigError, since training with it would fail the same way; any other failure is
    recorded as that backend's "error" so the comparison still reports it.
    """
    offsets_cpu = offsets_from_lengths(LENGTHS)
    generator = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    # Rounded to the kernel dtype first; the reference sees exactly these values in fp64.
    q, k, v, grad_out = (torch.randn(total, heads, head_dim, generator=generator).to(dtype) for _ in range(4))
    reference = _forward_backward(
        *(x.double() for x in (q, k, v, grad_out)), offsets_cpu, rotary=rotary, backend="reference"
    )
    results = {}
    for backend in backends:
        try:
            got = _forward_backward(
                *(x.to(device) for x in (q, k, v, grad_out)), offsets_cpu.to(device), rotary=rotary, backend=backend
            )
        except ValueError as error:  # the inputs are valid by construction: the backend rejected them
            raise UnsupportedConfigError(str(error)) from None
        except Exception as error:  # a kernel crash is a finding to report, not a reason to stop
            results[backend] = {"error": f"{type(error).__name__}: {error}"}
            continue
        results[backend] = {}
        for name in TENSORS:
            difference = (got[name].detach().double().cpu() - reference[name]).abs().max().item()
            scale = reference[name].abs().max().item()
            results[backend][name] = {
                "max_abs": difference, "max_rel": difference / scale if scale else difference,
                "dtype": str(got[name].dtype).removeprefix("torch."),  # what the backend returned
            }
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "settings": {
            "lengths": list(LENGTHS), "heads": heads, "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch."),
            "device": str(device), "seed": seed, "rotary": {
                "base": rotary.base, "within_block": rotary.within_block, "rotate_v": rotary.rotate_v,
            },
            "reference": "kernels reference backend in float64 on the same rounded inputs",
        },
        "backends": results,
    }
