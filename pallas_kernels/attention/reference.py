"""Causal attention within packed segments in plain jnp (dense scores), and a float64 oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["segment_causal_attention", "segment_causal_oracle"]


def segment_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_start: jax.Array, *, scale: float
) -> tuple[jax.Array, jax.Array]:
    """Token t attends keys ``segment_start[t] .. t``: (out ``[T, H, D]`` in q's dtype, the
    log-sum-exp of the scaled scores ``[T, H]`` in float32 or wider); scores ``[H, T, T]`` are
    materialised."""
    num_tokens, num_heads, head_dim = q.shape
    groups = num_heads // k.shape[1]
    acc = jnp.promote_types(q.dtype, jnp.float32)
    q_g = q.reshape(num_tokens, k.shape[1], groups, head_dim)
    scores = jnp.einsum("qkgd,lkd->kgql", q_g, k, preferred_element_type=acc) * scale
    key = jnp.arange(num_tokens)
    seen = (key[None, :] <= key[:, None]) & (key[None, :] >= segment_start[:, None])
    scores = jnp.where(seen, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [KVH, G, T]
    probs = jnp.exp(scores - lse[..., None]).astype(v.dtype)
    out = jnp.einsum("kgql,lkd->qkgd", probs, v, preferred_element_type=acc)
    lse = lse.transpose(2, 0, 1).reshape(num_tokens, num_heads)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype), lse


def segment_causal_oracle(q, k, v, segment_start, scale):
    """The same in float64 with NumPy, token by token: (out, log-sum-exp)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    num_tokens, num_heads, _ = q.shape
    groups = num_heads // k.shape[1]
    out = np.zeros(q.shape)
    lse = np.zeros((num_tokens, num_heads))
    for t in range(num_tokens):
        keys = slice(int(segment_start[t]), t + 1)
        for h in range(num_heads):
            s = k[keys, h // groups] @ q[t, h] * scale
            peak = s.max()
            lse[t, h] = peak + np.log(np.exp(s - peak).sum())
            out[t, h] = np.exp(s - lse[t, h]) @ v[keys, h // groups]
    return out, lse
