"""Full attention over the paged KV cache as a Flax NNX module: every model's attention layer.

Weights follow Hugging Face's layouts. Qwen3-Next / Qwen3.5 attention is gated: ``q_proj``
yields, per head, the query (head_dim) followed by its output gate (head_dim), and the
attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``; ``q_norm`` / ``k_norm``
are zero-centred RMSNorms over head_dim; rotary embedding turns only the first
``partial_rotary_factor`` of each head (the two halves of that part rotated together, as in
GPT-NeoX). Nemotron-H's attention has none of these (``AttentionConfig.plain``): no gate, no
q/k norm, no positions (its Mamba2 layers carry them), no biases.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.backend.attention import decode_rows, paged_attention
from hybrid_jax.kv_cache import KVCacheSpec
from hybrid_jax.layers.linear import project, project_output
from hybrid_jax.layers.norm import ZeroCenteredRMSNorm
from hybrid_jax.metadata import ForwardMetadata
from pallas_kernels.attention.rows import apply_rotary

__all__ = ["Attention", "AttentionConfig", "AttentionOutput", "apply_rotary"]


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Shape of one full-attention layer. ``num_heads`` must be a multiple of
    ``num_kv_heads`` (grouped-query attention); the rotary part of a head,
    ``int(head_dim * partial_rotary_factor)``, must be even (0: the layer sees no positions).
    ``gated``: ``q_proj`` also yields each head's output gate; ``qk_norm``: zero-centred RMSNorms
    on q and k. The defaults are Qwen3-Next's; ``plain`` gives Nemotron-H's."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    gated: bool = True
    qk_norm: bool = True
    dtype: str = "float32"

    @classmethod
    def plain(cls, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
              dtype: str = "float32") -> AttentionConfig:  # fmt: skip
        """Grouped-query attention and nothing else: no gate, no q/k norm, no positions."""
        return cls(
            hidden_size, num_heads, num_kv_heads, head_dim, partial_rotary_factor=0.0,
            gated=False, qk_norm=False, dtype=dtype,
        )  # fmt: skip

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}; query heads share key/value heads in equal groups"
            )
        if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} gives a rotary part of "
                f"{self.rotary_dim} of head_dim={self.head_dim}; it must be even and in "
                f"0..head_dim (0: no rotary)"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def kv_spec(self) -> KVCacheSpec:
        """Per-page cache layout of one layer."""
        return KVCacheSpec(self.num_kv_heads, self.head_dim, jnp.dtype(self.dtype))


class AttentionOutput(NamedTuple):
    """y: ``[T, hidden]``; the layer's key and value pages after the step."""

    y: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array


class Attention(nnx.Module):
    """q (and gate), k, v projections -> q/k norms -> partial rotary -> paged causal GQA ->
    ``* sigmoid(gate)`` -> o_proj, each optional step as its config says."""

    def __init__(self, config: AttentionConfig, *, rngs: nnx.Rngs):
        c = config
        dtype = jnp.dtype(c.dtype)
        linear = dict(use_bias=c.attention_bias, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.config = c
        q_width = (2 if c.gated else 1) * c.num_heads * c.head_dim
        self.q_proj = nnx.Linear(c.hidden_size, q_width, **linear)
        self.k_proj = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, **linear)
        self.v_proj = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, **linear)
        self.o_proj = nnx.Linear(c.num_heads * c.head_dim, c.hidden_size, **linear)
        norm = functools.partial(ZeroCenteredRMSNorm, c.head_dim, eps=c.rms_norm_eps)
        self.q_norm = norm() if c.qk_norm else None
        self.k_norm = norm() if c.qk_norm else None

    def input_readers(self) -> list[nnx.Param]:
        """The weights of the products that read the layer's input (all of its readers)."""
        return [layer.kernel for layer in (self.q_proj, self.k_proj, self.v_proj)]

    def __call__(
        self,
        x: jax.Array,
        k_pages: jax.Array,
        v_pages: jax.Array,
        meta: ForwardMetadata,
        *,
        impl: str = "auto",
        residual: jax.Array | None = None,
        counters: jax.Ref | None = None,
    ) -> AttentionOutput:
        """x: ``[T, hidden]`` packed tokens of ``meta``; k_pages, v_pages:
        ``[P, page_size, KVH, head_dim]``. With ``residual`` ``[T, hidden]`` the output is
        ``residual`` plus the layer's, maybe with its square sums (``project_output``)."""
        c = self.config
        t = x.shape[0]  # explicit sizes: t == 0 when IDLE
        q, k, v = project(x, [self.q_proj, self.k_proj, self.v_proj], impl=impl)
        q = q.reshape(t, c.num_heads, (1 + c.gated) * c.head_dim)
        gate = q if c.gated else None  # each head's last head_dim values: paged_attention
        k = k.reshape(t, c.num_kv_heads, c.head_dim)
        v = v.reshape(t, c.num_kv_heads, c.head_dim)
        norms = (self.q_norm, self.k_norm) if c.qk_norm else ()
        rows = None
        # A folded q/k norm stays in jnp: to the kernel no scales means no norm. The kernel
        # adds the norms' offset to their weights itself (no kernel forms ``1 + weight``).
        if not any(norm.folded for norm in norms):
            weights = [norm.weight[...] for norm in norms] or [None, None]
            rows = decode_rows(
                q, k, v, k_pages, v_pages, meta, q_scale=weights[0], k_scale=weights[1],
                eps=c.rms_norm_eps, rotary_dim=c.rotary_dim, theta=c.rope_theta,
                scale_offset=ZeroCenteredRMSNorm.OFFSET, impl=impl,
            )  # fmt: skip
        if rows is None:
            q = q[..., : c.head_dim]
            if c.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if c.rotary_dim:
                q = apply_rotary(q, meta.positions, c.rotary_dim, c.rope_theta)
                k = apply_rotary(k, meta.positions, c.rotary_dim, c.rope_theta)
        else:
            q, k_pages, v_pages = rows
        out, k_pages, v_pages = paged_attention(
            q, k, v, k_pages, v_pages, meta, scale=c.head_dim**-0.5, gate=gate, impl=impl,
            written=rows is not None, counters=counters,
        )  # fmt: skip
        out = out.reshape(t, c.num_heads * c.head_dim)
        out = project_output(out, self.o_proj, impl=impl, residual=residual, counters=counters)
        return AttentionOutput(out, k_pages, v_pages)
