"""Attention ops: causal attention within packed segments, with its log-sum-exp, and
attention over a paged KV cache: a row's last tokens (decode, verify chains) and a ragged
step's tokens over their cached prefixes."""

from pallas_kernels.attention.paged_decode import (
    paged_decode_attention,
    paged_prefix_attention,
    prefix_tiles,
    tokens_per_tile,
)
from pallas_kernels.attention.segments import segment_causal_attention, unsupported_reason

__all__ = [
    "paged_decode_attention",
    "paged_prefix_attention",
    "prefix_tiles",
    "segment_causal_attention",
    "tokens_per_tile",
    "unsupported_reason",
]
