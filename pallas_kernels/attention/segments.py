"""segment_causal_attention: causal attention within the segments of a packed token axis.

Token t attends the keys ``segment_start[t] .. t`` (its own segment up to itself), grouped-query
(query head h reads key head ``h // (H // KVH)``), and the op returns the log-sum-exp of each
token's scaled scores beside the output, so that a caller can merge it with attention over
other keys (a cached prefix) exactly. On an sm_90 GPU it runs tokamax's Mosaic GPU flash
attention (warp-specialised wgmma, TMA loads; per-token key ranges skip the key blocks of other
segments); the reference materialises the scores in jnp. tokamax is an optional dependency (the
``cuda`` extra): without it ``auto`` takes the reference and ``pallas`` says how to install it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import resolve_impl
from pallas_kernels.attention import reference

__all__ = ["segment_causal_attention", "unsupported_reason"]

_OP = "segment_causal_attention"
_DTYPES = (jnp.bfloat16, jnp.float16)


@functools.cache
def _tokamax_flash():
    try:
        from tokamax._src.ops.attention import base, pallas_mosaic_gpu
    except ImportError:
        return None
    return base.Mask, pallas_mosaic_gpu.PallasMosaicGpuFlashAttention()


def unsupported_reason(q: jax.Array, k: jax.Array) -> str | None:
    """Why the Mosaic GPU kernel cannot take this call, or None when it can."""
    if _tokamax_flash() is None:
        return "tokamax is not installed (pip install 'hybrid-jax[cuda]')"
    if q.dtype != k.dtype or q.dtype not in _DTYPES:
        return f"q and k must share a 16-bit float dtype (got {q.dtype} and {k.dtype})"
    if q.shape[-1] % 64 or q.shape[-1] > 256:
        return f"head_dim={q.shape[-1]} must be a multiple of 64 up to 256"
    return None


def _check(q: jax.Array, k: jax.Array, v: jax.Array, segment_start: jax.Array) -> None:
    if q.ndim != 3 or k.shape != v.shape or k.ndim != 3 or k.shape[::2] != q.shape[::2]:
        raise ValueError(
            f"{_OP}: q must be [T, H, D] and k, v [T, KVH, D] with one T and D; got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"{_OP}: H={q.shape[1]} query heads must be a multiple of KVH={k.shape[1]}"
        )
    if segment_start.shape != q.shape[:1] or not jnp.issubdtype(segment_start.dtype, jnp.integer):
        raise ValueError(
            f"{_OP}: segment_start must be int [T={q.shape[0]}]; got {segment_start.dtype} "
            f"{segment_start.shape}"
        )


def segment_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_start: jax.Array,
    *,
    scale: float,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of each token over its segment's earlier keys and itself.

    Args:
      q: ``[T, H, D]``; k, v: ``[T, KVH, D]`` (the same packed tokens).
      segment_start: int32 ``[T]``, the first token of t's segment (``<= t``; a padding
        token may be its own segment, ``segment_start[t] = t``).
      scale: the scores' scale.
      impl: ``"auto" | "pallas" | "reference"`` (the kernel is tokamax's; there is no
        interpreter run of it).

    Returns:
      ``(out [T, H, D]`` in q's dtype, ``lse [T, H]``: ``log sum exp`` of t's scaled scores
      over the keys it sees, float32, or float64 for float64 inputs).
    """
    _check(q, k, v, segment_start)
    reason = unsupported_reason(q, k) if impl != "reference" else None
    if impl == "interpret":
        reason = reason or "tokamax's kernel has no interpreter run here"
    if resolve_impl(_OP, impl, reason) == "reference":
        return reference.segment_causal_attention(q, k, v, segment_start, scale=scale)
    mask_type, flash = _tokamax_flash()
    mask = mask_type(k_start=segment_start.astype(jnp.int32)[None, None, :], is_causal=True)
    out, (peak, total) = flash(
        q[None], k[None], v[None], mask=mask, logits_scale=scale, return_residuals=True
    )
    # Residuals: the running maximum of the scaled scores (natural log units) and the sum of
    # exp(score - maximum), per [batch, head, token].
    lse = (peak[0] + jnp.log(total[0])).T
    return out[0], lse.astype(jnp.float32)
