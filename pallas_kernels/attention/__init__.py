"""Attention ops: causal attention within packed segments, with its log-sum-exp."""

from pallas_kernels.attention.segments import segment_causal_attention, unsupported_reason

__all__ = ["segment_causal_attention", "unsupported_reason"]
