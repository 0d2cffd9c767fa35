"""Attention ops: causal attention within packed segments, with its log-sum-exp, and decode
attention over a paged KV cache."""

from pallas_kernels.attention.paged_decode import paged_decode_attention
from pallas_kernels.attention.segments import segment_causal_attention, unsupported_reason

__all__ = ["paged_decode_attention", "segment_causal_attention", "unsupported_reason"]
