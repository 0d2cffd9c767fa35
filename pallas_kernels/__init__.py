"""Standalone Pallas kernels for hybrid linear attention (no import of hybrid_jax)."""

from pallas_kernels import conv1d, gdn, mamba2, moe
from pallas_kernels._common import IMPLS, on_hopper_gpu

__all__ = ["IMPLS", "conv1d", "gdn", "mamba2", "moe", "on_hopper_gpu"]
