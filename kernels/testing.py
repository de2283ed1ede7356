"""The one definition of a correct block-attention backend: `parity`.

Every test, GPU check, benchmark and sweep judges a backend with it. On a random ragged batch, the
backend's out, dq, dk and dv are compared with the fp64 reference on the same (rounded) inputs:

- error: max |kernel - fp64| <= ERROR_RATIO x max |PyTorch in the input dtype - fp64| + ABS_FLOOR,
  the flash-attention rule (the same-precision PyTorch reference is kernels.block_attention_reference with
  upcast=False: the error any plain implementation in that dtype makes);
- gradient SNR: 10 log10(|truth|^2 / |kernel - truth|^2) >= MIN_GRAD_SNR_DB for dq, dk, dv, a
  scale-free check (Meta's block-attention test) that catches a small wrong region the max hides.
  Where PyTorch in the same dtype cannot reach that floor itself, the floor is PyTorch's own SNR
  less SNR_MARGIN_DB (the kernel's noise power at most twice PyTorch's): a fused sublayer in bf16
  rounds its output and the intermediates between its matmuls to 8 bits, as PyTorch does: on the
  H200, PyTorch's bf16 attention-sublayer gradients have 35-40 dB at d_model 256, the Triton and TLX
  kernels' 38-43 dB (benchmarks/results/parity_h200.log, run 5);
- determinism: a second run gives bitwise-identical out, dq, dk, dv;
- every value finite.
The batch covers the empty sequence, a single token, both sides of a block edge and several
blocks (EDGE_LENGTHS), and grad_out is strided, so the backward must honour its strides.
`attention_sublayer_parity` and `mlp_parity` apply the same rule to a fused sublayer's output and the
gradients of x and of every parameter.
"""

import math
from dataclasses import dataclass, field

import torch

from .attention_sublayer_dispatch import attention_sublayer
from .attention_sublayer_reference import attention_sublayer_reference
from .dispatch import block_attention
from .mlp_dispatch import mlp_sublayer
from .mlp_sublayer_reference import mlp_sublayer_reference
from .block_attention_reference import block_attention_reference
from .rotary import Rotary, rotary_tables

ERROR_RATIO = 2.0
MIN_GRAD_SNR_DB = 45.0
SNR_MARGIN_DB = 10 * math.log10(2)
# Below these, errors are rounding noise of the comparison itself, not of either implementation.
ABS_FLOOR = {torch.float64: 0.0, torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-5}
EDGE_LENGTHS = (0, 1, 63, 64, 65, 200)
OUTPUTS = ("out", "dq", "dk", "dv")


@dataclass
class ParityResult:
    backend: str
    case: dict
    outputs: dict = field(default_factory=dict)  # name -> the numbers and checks below
    failures: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        cells = []
        for name, o in self.outputs.items():
            cells.append(f"{name} {o['max_err']:.2e}/{o['torch_max_err']:.2e} {o['snr_db']:5.1f}"
                         f"/{o['torch_snr_db']:.1f}dB")
        status = "PASS" if self.ok else "FAIL " + "; ".join(self.failures)
        return f"{self.backend} {self.case['label']}: " + " | ".join(cells) + f"  {status}"


def snr_db(result: torch.Tensor, truth: torch.Tensor) -> float:
    noise = (result.double() - truth).pow(2).sum().item()
    signal = truth.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def _out_and_grads(attend, leaves, grad_out):
    leaves = [x.detach().requires_grad_() for x in leaves]
    out = attend(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


def parity(
    backend: str,
    *,
    lengths=EDGE_LENGTHS,
    heads: int = 4,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    rotary: Rotary | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    launch: dict | None = None,
) -> ParityResult:
    """Judges `backend` (through kernels.block_attention) on one random ragged batch; see the module doc."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    tokens = int(offsets[-1])
    # Rounded to dtype once: the fp64 truth sees exactly the values the kernel sees.
    q, k, v = (torch.randn(tokens, heads, head_dim, generator=generator).to(dtype).to(device) for _ in range(3))
    grad_out = torch.randn(tokens, heads, 2 * head_dim, generator=generator).to(dtype).to(device)[..., :head_dim]
    offsets = offsets.to(device)
    rotary_label = "none" if rotary is None else "qkv" if rotary.rotate_v else "qk"
    label = f"D{head_dim} H{heads} {str(dtype).removeprefix('torch.')} rotary={rotary_label} lengths={list(lengths)}"
    result = ParityResult(backend, dict(label=label, lengths=list(lengths), heads=heads, head_dim=head_dim,
                                        dtype=str(dtype), rotary=rotary_label, device=str(device), seed=seed))
    cos = sin = None
    if rotary is not None:
        cos, sin = rotary_tables(rotary, offsets, tokens, head_dim)
    rotate_v = rotary is not None and rotary.rotate_v

    def kernel(*x):
        return block_attention(*x, offsets, rotary=rotary, backend=backend, launch=launch)

    def reference(*x, upcast=True):
        return block_attention_reference(*x, offsets, cos, sin, rotate_v, upcast=upcast)

    runs = [_out_and_grads(kernel, (q, k, v), grad_out) for _ in range(2)]
    same_precision = _out_and_grads(lambda *x: reference(*x, upcast=False), (q, k, v), grad_out)
    truth = _out_and_grads(reference, [x.double() for x in (q, k, v)], grad_out.double())
    _judge(result, OUTPUTS, runs, same_precision, truth, dtype)
    return result


def _judge(result: ParityResult, names, runs, same_precision, truth, dtype: torch.dtype) -> None:
    """Applies the rule of the module doc to each named output (the first is the forward's, the rest
    gradients), recording the numbers and checks in `result`."""
    for index, (name, got, again, plain, exact) in enumerate(zip(names, *runs, same_precision, truth)):
        err = (got.double() - exact).abs().max().item() if got.numel() else 0.0
        torch_err = (plain.double() - exact).abs().max().item() if got.numel() else 0.0
        bound = ERROR_RATIO * torch_err + ABS_FLOOR[dtype]
        snr, torch_snr = snr_db(got, exact), snr_db(plain, exact)
        snr_floor = min(MIN_GRAD_SNR_DB, torch_snr - SNR_MARGIN_DB)
        checks = {
            "finite": bool(torch.isfinite(got).all()),
            "dtype": got.dtype == plain.dtype and got.shape == exact.shape,
            "error_ratio": err <= bound,
            "snr": index == 0 or snr >= snr_floor,
            "deterministic": torch.equal(got, again),
        }
        result.outputs[name] = dict(max_err=err, torch_max_err=torch_err, bound=bound, snr_db=snr,
                                    torch_snr_db=torch_snr, snr_floor_db=snr_floor,
                                    rounding_floor=(exact.to(got.dtype).double() - exact).abs().max().item()
                                    if got.numel() else 0.0, **checks)
        for check, passed in checks.items():
            if not passed:
                detail = {"error_ratio": f" ({err:.3g} > {bound:.3g})",
                          "snr": f" ({snr:.1f} < {snr_floor:.1f} dB)"}.get(check, "")
                result.failures.append(f"{name} {check}{detail}")


MLP_OUTPUTS = ("y", "dx", "dnorm_weight", "dnorm_bias", "dw1", "db1", "dw2", "db2")


def _sublayer_inputs(tokens: int, d_model: int, first_width: int, second_width: int, first_scale: float,
                     x_dtype: torch.dtype, compute_dtype: torch.dtype, device: torch.device, seed: int):
    """A sublayer's leaves, x [T, D], LayerNorm's weight and bias [D], the first linear's weight
    [first_width, D] and bias, the second's [D, second_width] and bias, and a strided grad_y [T, D]
    (the backward must honour its strides): nn.Linear-like scales (the first's `first_scale`), a
    LayerNorm affine away from its (1, 0) start, x with a per-token offset and scale so the
    normalization has work to do. Rounded once: the truth sees what the kernel sees."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0, shift=0.0, dtype=compute_dtype):
        return (torch.randn(*shape, generator=generator) * scale + shift).to(dtype).to(device)

    leaves = [
        draw(tokens, d_model, dtype=x_dtype) * draw(tokens, 1, scale=0.5, shift=1.0, dtype=x_dtype)
        + draw(tokens, 1, dtype=x_dtype),
        draw(d_model, scale=0.1, shift=1.0, dtype=x_dtype), draw(d_model, scale=0.1, dtype=x_dtype),
        draw(first_width, d_model, scale=first_scale), draw(first_width, scale=0.1),
        draw(d_model, second_width, scale=second_width ** -0.5), draw(d_model, scale=0.1),
    ]
    return leaves, draw(tokens, 2 * d_model, dtype=x_dtype)[:, :d_model]


def mlp_parity(
    backend: str,
    *,
    tokens: int = 200,
    d_model: int = 64,
    hidden: int = 256,
    x_dtype: torch.dtype = torch.bfloat16,
    compute_dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    launch: dict | None = None,
    approximate: str = "none",
) -> ParityResult:
    """Judges an mlp_sublayer backend by the module doc's rule on one random batch of `tokens` rows:
    y and the gradients of x and of every parameter, against the fp64 reference on the same (rounded)
    inputs. x (and LayerNorm's affine) are in x_dtype, the linears' weights in compute_dtype (x_dtype
    if None), as under autocast; the error floor is the compute dtype's. `approximate` is GELU's (F.gelu's),
    the same in the kernel and both references."""
    device = torch.device(device)
    compute_dtype = compute_dtype or x_dtype
    leaves, grad_y = _sublayer_inputs(tokens, d_model, hidden, hidden, d_model ** -0.5, x_dtype, compute_dtype, device,
                                      seed)
    label = (f"T{tokens} D{d_model} H{hidden} x={str(x_dtype).removeprefix('torch.')} "
             f"compute={str(compute_dtype).removeprefix('torch.')}" + (f" gelu={approximate}" if approximate != "none"
                                                                       else ""))
    result = ParityResult(backend, dict(label=label, tokens=tokens, d_model=d_model, hidden=hidden,
                                        x_dtype=str(x_dtype), compute_dtype=str(compute_dtype), device=str(device),
                                        seed=seed, approximate=approximate))

    def kernel(*x):
        return mlp_sublayer(*x, approximate=approximate, backend=backend, launch=launch)

    def reference(dtype):
        return lambda *x: mlp_sublayer_reference(*x, compute_dtype=dtype, approximate=approximate)

    runs = [_out_and_grads(kernel, leaves, grad_y) for _ in range(2)]
    same_precision = _out_and_grads(reference(compute_dtype), leaves, grad_y)
    truth = _out_and_grads(reference(torch.float64), [x.double() for x in leaves], grad_y.double())
    _judge(result, MLP_OUTPUTS, runs, same_precision, truth, compute_dtype)
    return result


ATTENTION_SUBLAYER_OUTPUTS = ("y", "dx", "dnorm_weight", "dnorm_bias", "dw_qkv", "db_qkv", "dw_out", "db_out")


def attention_sublayer_parity(
    backend: str,
    *,
    lengths=EDGE_LENGTHS,
    num_heads: int = 2,
    head_dim: int = 32,
    x_dtype: torch.dtype = torch.bfloat16,
    compute_dtype: torch.dtype | None = None,
    rotary: Rotary | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    launch: dict | None = None,
) -> ParityResult:
    """Judges an attention_sublayer backend by the module doc's rule on one random ragged batch (the
    sequence lengths of block attention's parity): y and the gradients of x and of every parameter,
    against the fp64 reference on the same (rounded) inputs. x (and LayerNorm's affine) are in
    x_dtype, the linears' weights in compute_dtype (x_dtype if None), as under autocast; the error
    floor is the compute dtype's."""
    device = torch.device(device)
    compute_dtype = compute_dtype or x_dtype
    d_model = num_heads * head_dim
    offsets = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    tokens = int(offsets[-1])
    offsets = offsets.to(device)
    # The q, k, v projection scaled up, so the softmax is not nearly uniform.
    leaves, grad_y = _sublayer_inputs(tokens, d_model, 3 * d_model, d_model, 2 * d_model ** -0.5, x_dtype,
                                      compute_dtype, device, seed)
    rotary_label = "none" if rotary is None else "qkv" if rotary.rotate_v else "qk"
    label = (f"H{num_heads}x{head_dim} x={str(x_dtype).removeprefix('torch.')} "
             f"compute={str(compute_dtype).removeprefix('torch.')} rotary={rotary_label} lengths={list(lengths)}")
    result = ParityResult(backend, dict(label=label, lengths=list(lengths), num_heads=num_heads, head_dim=head_dim,
                                        x_dtype=str(x_dtype), compute_dtype=str(compute_dtype), rotary=rotary_label,
                                        device=str(device), seed=seed))
    cos = sin = None
    if rotary is not None:
        cos, sin = rotary_tables(rotary, offsets, tokens, head_dim)
    rotate_v = rotary is not None and rotary.rotate_v

    def kernel(*x):
        return attention_sublayer(x[0], offsets, *x[1:], num_heads=num_heads, rotary=rotary, backend=backend,
                                  launch=launch)

    def reference(*x, compute_dtype, upcast):
        return attention_sublayer_reference(x[0], offsets, *x[1:], num_heads, cos, sin, rotate_v,
                                            compute_dtype=compute_dtype, upcast=upcast)

    runs = [_out_and_grads(kernel, leaves, grad_y) for _ in range(2)]
    same_precision = _out_and_grads(lambda *x: reference(*x, compute_dtype=compute_dtype, upcast=False), leaves,
                                    grad_y)
    truth = _out_and_grads(lambda *x: reference(*x, compute_dtype=torch.float64, upcast=True),
                           [x.double() for x in leaves], grad_y.double())
    _judge(result, ATTENTION_SUBLAYER_OUTPUTS, runs, same_precision, truth, compute_dtype)
    return result
