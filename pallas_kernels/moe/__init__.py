"""Mixture-of-experts ops: the grouped matmul over tokens sorted by expert."""

from pallas_kernels.moe.grouped_matmul import grouped_matmul, unsupported_reason

__all__ = ["grouped_matmul", "unsupported_reason"]
