"""Standalone Pallas kernels for hybrid linear attention (no import of hybrid_jax)."""

from pallas_kernels import attention, conv1d, gdn, mamba2, moe, projections
from pallas_kernels._common import IMPLS, on_hopper_gpu, resolve_impl
from pallas_kernels.commit import commit_states

__all__ = [
    "IMPLS",
    "attention",
    "commit_states",
    "conv1d",
    "gdn",
    "mamba2",
    "moe",
    "on_hopper_gpu",
    "projections",
    "resolve_impl",
]
