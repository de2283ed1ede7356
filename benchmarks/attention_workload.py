"""What the attention benchmark runs on: its shapes (full blocks or jagged), the seeded inputs of one
shape, and the bytes each pass must move at the least (the bandwidth floor its rows are judged by)."""

import math
from dataclasses import dataclass

import torch

from kernels import BLOCK_SIZE, BlockTable, Rotary, block_table, offsets_from_lengths, rotary_tables

PASSES = ("fwd", "bwd", "fwd+bwd")
# T*H*D-element tensors a pass must move at least once: fwd reads q, k, v and writes o; bwd reads
# q, k, v, o, dO and writes dq, dk, dv.
TENSORS_MOVED = {"fwd": 4, "bwd": 8, "fwd+bwd": 12}
# How many times a pass reads the fp32 cos/sin tables when rotary is on.
TABLE_READS = {"fwd": 1, "bwd": 1, "fwd+bwd": 2}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
JAGGED_MIN_FRACTION = 0.4  # jagged lengths are uniform in [0.4 * max_len, max_len], like Meta's benchmark

SHAPES = {
    "full": ("1024x512x4x128", "2048x256x4x64", "512x1024x8x64"),
    "jagged": ("jagged:1152x1024x4x128", "jagged:1152x4096x4x128"),
}
QUICK_SHAPES = {"full": ("1024x512x4x128",), "jagged": ("jagged:1152x1024x4x128",)}
CPU_SHAPES = {"full": ("4x128x2x32",), "jagged": ("jagged:6x256x2x32",)}


# ---------------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """B sequences of S tokens (full blocks), or of random lengths up to S (jagged); H heads of D."""

    batch: int
    seq_len: int
    heads: int
    head_dim: int
    jagged: bool = False

    def __post_init__(self):
        if min(self.batch, self.seq_len, self.heads, self.head_dim) < 1:
            raise ValueError(f"shape {self.label}: every dimension must be positive")
        if not self.jagged and self.seq_len % BLOCK_SIZE:
            raise ValueError(f"full-block shape {self.label}: S = {self.seq_len} must be a multiple of {BLOCK_SIZE}")
        if self.head_dim % 2:
            raise ValueError(f"shape {self.label}: rotary needs an even head_dim, got {self.head_dim}")

    @property
    def label(self) -> str:
        dims = f"{self.batch}x{self.seq_len}x{self.heads}x{self.head_dim}"
        return f"jagged:{dims}" if self.jagged else dims


def parse_shape(label: str) -> Shape:
    """`BxSxHxD` (full blocks) or `jagged:BxMAXLENxHxD`, the inverse of Shape.label."""
    parts = label.removeprefix("jagged:").split("x")
    if len(parts) != 4 or not all(part.isdigit() for part in parts):
        raise ValueError(f"shape {label!r} is not BxSxHxD or jagged:BxMAXLENxHxD (e.g. 1024x512x4x128)")
    return Shape(*map(int, parts), jagged=label.startswith("jagged:"))


def select_shapes(specs: list[str], device_type: str, quick: bool) -> list[Shape]:
    """Each spec is a kind ("full", "jagged"), expanded per device and mode, or an explicit label."""
    table = CPU_SHAPES if device_type == "cpu" else QUICK_SHAPES if quick else SHAPES
    return [parse_shape(label) for spec in specs for label in table.get(spec, (spec,))]


def sequence_lengths(shape: Shape, seed: int) -> torch.Tensor:
    """int64 [B] on CPU: all S for full blocks, seeded uniform in [ceil(0.4 S), S] for jagged."""
    if not shape.jagged:
        return torch.full((shape.batch,), shape.seq_len, dtype=torch.int64)
    low = math.ceil(JAGGED_MIN_FRACTION * shape.seq_len)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, shape.seq_len + 1, (shape.batch,), generator=generator)


# ----------------------------------------------------------------------------------------- bandwidth


def min_bytes(pass_: str, tokens: int, heads: int, head_dim: int, elem_size: int, rotary: bool) -> int:
    """Bytes a pass must move at the least: its T*H*D tensors, plus fp32 cos and sin with rotary."""
    moved = TENSORS_MOVED[pass_] * tokens * heads * head_dim * elem_size
    tables = TABLE_READS[pass_] * 2 * tokens * (head_dim // 2) * 4 if rotary else 0
    return moved + tables


def frac_copy_bw(nbytes: int, ms: float, copy_bw_tbps: float) -> float:
    """The fraction of the measured copy bandwidth that moving `nbytes` in `ms` achieves."""
    return nbytes / (ms * 1e-3) / (copy_bw_tbps * 1e12)


# -------------------------------------------------------------------------------------------- inputs


@dataclass
class Inputs:
    shape: Shape
    offsets: torch.Tensor  # int32 [B+1]
    table: BlockTable  # built once, as a model builds it once per batch for all its layers
    q: torch.Tensor  # [T, H, D] leaves that require grad
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor  # [T, H, D]
    cos: torch.Tensor  # fp32 [T, D/2], precomputed so no row times the table computation
    sin: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.q.shape[0]


def make_inputs(shape: Shape, device: torch.device, seed: int, dtype: torch.dtype = torch.bfloat16) -> Inputs:
    lengths = sequence_lengths(shape, seed)
    offsets = offsets_from_lengths(lengths, device)
    tokens = int(lengths.sum())
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn() -> torch.Tensor:
        return torch.randn(tokens, shape.heads, shape.head_dim, device=device, dtype=dtype, generator=generator)

    q, k, v = (randn().requires_grad_() for _ in range(3))
    cos, sin = rotary_tables(Rotary(), offsets, tokens, shape.head_dim)
    return Inputs(shape, offsets, block_table(offsets, tokens), q, k, v, randn(), cos, sin)
