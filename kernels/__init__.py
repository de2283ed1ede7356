"""Block attention over jagged sequences: one API, several backends (see dispatch.py)."""

from .blocks import BLOCK_SIZE, block_cu_seqlens, block_table, offsets_from_lengths
from .dispatch import (
    BACKENDS,
    BackendUnavailableError,
    available_backends,
    backend_unavailable_reason,
    block_attention,
    check_backend,
)
from .reference import block_attention_reference
from .rotary import Rotary, apply_rotary, rotary_tables

__all__ = [
    "BACKENDS",
    "BLOCK_SIZE",
    "BackendUnavailableError",
    "Rotary",
    "apply_rotary",
    "available_backends",
    "backend_unavailable_reason",
    "block_attention",
    "block_attention_reference",
    "block_cu_seqlens",
    "block_table",
    "check_backend",
    "offsets_from_lengths",
    "rotary_tables",
]
