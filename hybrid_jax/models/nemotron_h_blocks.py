"""Nemotron-H's feed-forward blocks: the ReLU² MLP and the routed MoE (its attention is
``layers.attention.Attention`` with ``AttentionConfig.plain``).

Weights follow Hugging Face's Nemotron-H layout. The MLP is ``down(relu(up(x))**2)``, without a
gate. The MoE scores experts with a sigmoid of a float32 router, adds a correction bias only to
choose them
(group-limited: the best ``topk_group`` of ``n_group`` groups, ranked by the sum of their two
best scores), weighs the chosen ones by their uncorrected scores (renormalised when
``norm_topk_prob``, then times ``routed_scaling_factor``), and adds a shared ReLU² expert.
Expert weights are stacked ``[E, in, out]`` (``up_proj [E, in, I]``, ``down_proj [E, I, in]``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.layers.moe import ExpertDispatch
from pallas_kernels import moe

__all__ = [
    "RoutedMoE",
    "RoutedMoEConfig",
    "relu2",
    "ReLU2MLP",
]


def relu2(x: jax.Array) -> jax.Array:
    """``relu(x) ** 2``, Nemotron-H's MLP activation.

    Written without a ``max``: XLA folds ``max(dot, 0)`` into the product as a cuBLASLt ReLU
    epilogue, and that call reads a scanned layer's weight from a copy of its slice rather
    than in place. ``x * x`` rounds as ``relu(x) ** 2`` does where x > 0, and is zeroed
    elsewhere."""
    return x * x * (x > 0).astype(x.dtype)


class ReLU2MLP(nnx.Module):
    """``down(relu(up(x)) ** 2)``; x: ``[T, hidden]`` -> ``[T, hidden]``. ``impl`` is the
    feed-forward blocks' kernel choice, which a dense MLP (XLA's matmuls) does not use."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, bias: bool, dtype: str, rngs: nnx.Rngs
    ):
        dt = jnp.dtype(dtype)
        linear = dict(use_bias=bias, dtype=dt, param_dtype=dt, rngs=rngs)
        self.up_proj = nnx.Linear(hidden_size, intermediate_size, **linear)
        self.down_proj = nnx.Linear(intermediate_size, hidden_size, **linear)

    def __call__(
        self, x: jax.Array, real: jax.Array | None = None, *, impl: str = "auto"
    ) -> jax.Array:
        """A feed-forward block's call (``layers.moe.MLP``); every token does the same work."""
        return self.down_proj(relu2(self.up_proj(x)))


@dataclasses.dataclass(frozen=True)
class RoutedMoEConfig:
    """Shape and routing of one Nemotron-H MoE block (Hugging Face field meanings).

    ``latent_size``: experts run in this width between two projections (None: hidden size).
    """

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    latent_size: int | None = None
    mlp_bias: bool = False
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts={self.num_experts} does not split into n_group={self.n_group} "
                f"equal groups"
            )
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError(
                f"n_group={self.n_group} leaves fewer than 2 experts per group; groups are "
                f"ranked by their two best experts"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
        allowed = self.num_experts // self.n_group * self.topk_group
        if not 1 <= self.top_k <= allowed:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be in 1..{allowed} (the experts of the "
                f"topk_group={self.topk_group} chosen groups)"
            )

    @property
    def expert_width(self) -> int:
        return self.latent_size or self.hidden_size


class RoutedMoE(nnx.Module):
    """Sigmoid-routed top-k ReLU² experts plus a shared ReLU² expert; x ``[T, hidden]`` -> same."""

    def __init__(self, config: RoutedMoEConfig, *, rngs: nnx.Rngs):
        c = config
        dtype = jnp.dtype(c.dtype)
        e, w, i = c.num_experts, c.expert_width, c.intermediate_size
        self.config = c
        # The router stays float32 whatever the model's dtype, as in the reference.
        self.gate = nnx.Linear(
            c.hidden_size, e, use_bias=False, dtype=jnp.float32, param_dtype=jnp.float32,
            rngs=rngs,
        )  # fmt: skip
        self.e_score_correction_bias = nnx.Param(jnp.zeros((e,), jnp.float32))
        self.up_proj = nnx.Param(jax.random.normal(rngs.params(), (e, w, i), dtype) * w**-0.5)
        self.down_proj = nnx.Param(jax.random.normal(rngs.params(), (e, i, w), dtype) * i**-0.5)
        self.shared_experts = ReLU2MLP(
            c.hidden_size, c.shared_intermediate_size, bias=c.mlp_bias, dtype=c.dtype, rngs=rngs
        )
        if c.latent_size is not None:
            linear = dict(use_bias=c.mlp_bias, dtype=dtype, param_dtype=dtype, rngs=rngs)
            self.fc1_latent_proj = nnx.Linear(c.hidden_size, c.latent_size, **linear)
            self.fc2_latent_proj = nnx.Linear(c.latent_size, c.hidden_size, **linear)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(float32 weights ``[T, top_k]``, int32 experts ``[T, top_k]``) of each token."""
        c = self.config
        scores = jax.nn.sigmoid(self.gate(x.astype(jnp.float32)))
        choice = scores + self.e_score_correction_bias[...]
        if c.n_group > 1:
            grouped = choice.reshape(-1, c.n_group, c.num_experts // c.n_group)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
            _, groups = jax.lax.top_k(group_scores, c.topk_group)
            keep = (
                jnp.zeros_like(group_scores, bool)
                .at[jnp.arange(group_scores.shape[0])[:, None], groups]
                .set(True)
            )
            keep = jnp.repeat(keep, c.num_experts // c.n_group, axis=-1)
            choice = jnp.where(keep, choice, -jnp.inf)
        _, experts = jax.lax.top_k(choice, c.top_k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return weights * c.routed_scaling_factor, experts.astype(jnp.int32)

    def __call__(
        self, x: jax.Array, real: jax.Array | None = None, *, impl: str = "auto"
    ) -> jax.Array:
        """x ``[T, hidden]`` -> the same; ``real`` (bool ``[T]``) marks the tokens of real
        rows, whose experts alone are computed; ``impl`` chooses the experts' grouped matmul."""
        c = self.config
        weights, experts = self.route(x)
        h = self.fc1_latent_proj(x) if c.latent_size is not None else x
        dispatch = ExpertDispatch.sort(experts, c.num_experts, real)
        sizes = dispatch.group_sizes
        hidden = relu2(moe.grouped_matmul(dispatch.rows(h), self.up_proj[...], sizes, impl=impl))
        ys = moe.grouped_matmul(hidden, self.down_proj[...], sizes, impl=impl)
        # Weighted sum in float32 (the router's dtype), cast back once, as the reference does.
        routed = dispatch.combine(ys, weights).astype(x.dtype)
        if c.latent_size is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)
