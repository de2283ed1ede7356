"""Block attention over jagged sequences, and the fused attention and MLP sublayers: one API each,
several backends (see dispatch.py, attention_sublayer_dispatch.py and mlp_dispatch.py)."""

from .attention_sublayer_dispatch import (
    ATTENTION_SUBLAYER_BACKENDS,
    attention_sublayer,
    check_attention_sublayer_backend,
)
from .attention_sublayer_reference import attention_sublayer_reference
from .block_attention_reference import block_attention_reference
from .blocks import BLOCK_SIZE, BlockTable, block_cu_seqlens, block_table, offsets_from_lengths
from .dispatch import (
    AUTO_ORDER,
    BACKENDS,
    AttentionBackend,
    BackendUnavailableError,
    available_backends,
    backend_unavailable_reason,
    block_attention,
    block_attention_qkv,
    check_backend,
    get_backend,
    validate_offsets,
)
from .mlp_dispatch import MLP_BACKENDS, check_mlp_backend, mlp_sublayer
from .mlp_sublayer_reference import mlp_sublayer_reference
from .rotary import Rotary, apply_rotary, rotary_tables

__all__ = [
    "ATTENTION_SUBLAYER_BACKENDS",
    "AUTO_ORDER",
    "AttentionBackend",
    "BACKENDS",
    "MLP_BACKENDS",
    "BLOCK_SIZE",
    "BackendUnavailableError",
    "BlockTable",
    "Rotary",
    "apply_rotary",
    "attention_sublayer",
    "attention_sublayer_reference",
    "available_backends",
    "backend_unavailable_reason",
    "block_attention",
    "block_attention_qkv",
    "block_attention_reference",
    "block_cu_seqlens",
    "block_table",
    "check_attention_sublayer_backend",
    "check_backend",
    "check_mlp_backend",
    "get_backend",
    "mlp_sublayer",
    "mlp_sublayer_reference",
    "offsets_from_lengths",
    "rotary_tables",
    "validate_offsets",
]
