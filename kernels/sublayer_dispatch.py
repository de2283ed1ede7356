"""Which backend of a fused sublayer op runs an input: what the attention-sublayer and MLP-sublayer
dispatchers share.

A sublayer's backends are `reference` (its unfused PyTorch path, runs anywhere) and kernel backends
named as block attention's, whose machine requirements they share (dispatch.check_backend).
"""

from dataclasses import dataclass
from typing import Callable

import torch

from .dispatch import backend_unavailable_reason, check_backend


@dataclass(frozen=True)
class SublayerBackend:
    name: str
    # Why it cannot take x [T, D] with the op's shape argument (the MLP's hidden width, the attention's
    # heads) and compute dtype, or None if it can.
    unsupported_reason: Callable[[torch.Tensor, int, torch.dtype], str | None]
    # The op's inputs, weights already in the compute dtype -> y (each dispatcher lists them).
    run: Callable[..., torch.Tensor]
    # The kernel backend's forward/backward custom ops (tests opcheck them); None for the reference.
    ops: Callable[..., torch.Tensor] | None = None


class SublayerBackends:
    """The backends of sublayer op `op`: `reference`, and `kernels` (fastest first on a GPU), loaded
    on first use by `load(name)` so that importing `kernels` needs no Triton."""

    def __init__(self, op: str, reference, kernels: tuple[str, ...], load: Callable[[str], object]):
        self.op, self.reference, self._load = op, reference, load
        self.names = ("auto", "reference", *kernels)
        self.auto_order = (*kernels, "reference")
        self.loaded: dict[str, object] = {}

    def _check_name(self, name: str, allowed: tuple[str, ...]) -> None:
        if name not in allowed:
            raise ValueError(f"unknown {self.op} backend {name!r}; choose one of {', '.join(allowed)}")

    def get(self, name: str):
        self._check_name(name, self.names[1:])
        if name == "reference":
            return self.reference
        if name not in self.loaded:
            self.loaded[name] = self._load(name)
        return self.loaded[name]

    def check(self, name: str, device: torch.device | str) -> None:
        """Raises BackendUnavailableError (saying why and how to get it) if `name` can't run on
        `device`, and imports the backends it may use, so that no import happens inside a compiled region."""
        device = torch.device(device)
        self._check_name(name, self.names)
        if name == "auto":
            for candidate in self.auto_order if device.type != "cpu" else ():
                if candidate == "reference" or backend_unavailable_reason(candidate, device) is None:
                    self.get(candidate)
            return
        if name != "reference":
            check_backend(name, device)
        self.get(name)

    def resolve(self, name: str, x: torch.Tensor, *shape, compute_dtype: torch.dtype):
        """The backend that runs x [T, D] (with the op's `shape` arguments) in compute_dtype: `name`,
        or a ValueError saying why it can't; for `auto` the fastest that can (the reference on a CPU)."""
        self._check_name(name, self.names)
        if name != "auto":
            if name != "reference":
                check_backend(name, x.device)
            backend = self.get(name)
            reason = backend.unsupported_reason(x, *shape, compute_dtype)
            if reason is not None:
                raise ValueError(f"{self.op} backend {name!r} does not support {reason}")
            return backend
        if x.device.type == "cpu":
            return self.reference
        for candidate in self.auto_order:
            if candidate != "reference" and backend_unavailable_reason(candidate, x.device) is not None:
                continue
            backend = self.get(candidate)
            if backend.unsupported_reason(x, *shape, compute_dtype) is None:
                return backend
        return self.reference


# F.gelu's `approximate`: "none", the exact erf form, or "tanh", which the kernels compute with the GPU's
# hardware tanh (kernels/sublayer_triton.py's _tanh).
GELU_APPROXIMATIONS = ("none", "tanh")


def check_gelu_approximate(approximate: str) -> None:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"GELU approximate {approximate!r}: choose one of {GELU_APPROXIMATIONS} (F.gelu's)")


def check_sublayer_inputs(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be (total_tokens, d_model), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")


def check_sublayer_parameters(x: torch.Tensor, parameters: dict[str, torch.Tensor], shapes: dict[str, tuple],
                              given: str) -> None:
    """Each parameter has its shape in `shapes` (what `given`, e.g. "x [T, 64]", needs), x's device
    and a floating-point dtype."""
    for name, tensor in parameters.items():
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; {given} need {shapes[name]}")
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device} and x on {x.device}; all must share a device")
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")


def sublayer_compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmuls' dtype: autocast's where it is on for x's device (as nn.Linear's would be), else the weights'."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight.dtype
