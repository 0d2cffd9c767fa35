"""The hybrid linear-attention backend: one module per mixer kind (``gdn``, ``mamba2``,
``attention``), what the linear kinds share (``linear``), and the commits after a verify."""

from hybrid_jax.backend.attention import paged_attention
from hybrid_jax.backend.commit import commit_tree_verified, commit_verified
from hybrid_jax.backend.gdn import GDNDims, gdn_mix
from hybrid_jax.backend.linear import LinearMixResult, VerifyStack, VerifyStates
from hybrid_jax.backend.mamba2 import Mamba2Dims, mamba2_mix

__all__ = [
    "GDNDims",
    "LinearMixResult",
    "Mamba2Dims",
    "VerifyStack",
    "VerifyStates",
    "commit_tree_verified",
    "commit_verified",
    "gdn_mix",
    "mamba2_mix",
    "paged_attention",
]
