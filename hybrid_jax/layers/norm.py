"""RMS norms of the Qwen3-Next family: zero-centred RMSNorm and the gated RMSNorm of GDN.

A norm whose output only products read (a layer's input norm before its projections) can hand
them ``NormedRows``: the norm's input and weight, unformed. A product launch then takes the
rows times the weight and scales each row of its sum by the row's inverse RMS
(``layers.linear.project``), so no separate norm runs between the residual add and the
products; any other reader forms the norm's output (``NormedRows.value``).

A norm whose readers are all products can also hand its weight to them
(``ZeroCenteredRMSNorm.fold_into``: ``x / rms(x) * (1 + w) @ W == x / rms(x) @ ((1 + w) W)``).
Its launch then reads the residual stream itself, and the square sums are all that is left of
the norm: a reduction XLA can form in the kernel of the residual add before it (it does after
a decoder layer's mixer), where the weighted rows, an output of the same shape as its input,
kept the add out of it. Where the launch that forms the residual rows sums their squares too
(a MoE block's combine, ``SparseMoE.add_to``), it hands the next norm ``SummedRows`` and the
norm reduces nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.gdn import reference as gdn_reference

__all__ = [
    "FOLD_NORM_WEIGHTS",
    "GatedRMSNorm",
    "NormedRows",
    "SummedRows",
    "ZeroCenteredRMSNorm",
    "formed",
    "rows_of",
    "summed",
]

FOLD_NORM_WEIGHTS = True
"""Whether an engine folds each decoder layer's norm weights into the products that read the
norm (``ZeroCenteredRMSNorm.fold_into``, on its own stacked copy of the layers): the residual
add after each mixer and the next norm's square sums are then one XLA kernel on the H200 (one
kernel fewer per layer a step: ``benchmarks/RESULTS_serve.md``). Read when an engine is
built."""


def _normalize(x: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SummedRows:
    """Rows ``x`` ``[T, dim]`` of the residual stream with each row's float32 sum of squares
    ``square_sums`` ``[T]``, summed by the launch that formed the rows, for the next norm to
    read instead of reducing the rows again."""

    x: jax.Array
    square_sums: jax.Array


def rows_of(x: jax.Array | SummedRows) -> jax.Array:
    """The rows themselves: ``SummedRows``' rows, an array as it is."""
    return x.x if isinstance(x, SummedRows) else x


def _square_sums(x: jax.Array) -> jax.Array:
    """float32 ``[T]``: each row's sum of squares of ``x`` ``[T, dim]``."""
    x32 = x.astype(jnp.float32)
    return jnp.sum(x32 * x32, axis=-1)


def summed(x: jax.Array | SummedRows) -> SummedRows:
    """``x`` with its rows' float32 square sums: ``SummedRows`` as they are, an array's
    summed here (the reduction a norm of it would make)."""
    if isinstance(x, SummedRows):
        return x
    return SummedRows(x, _square_sums(x))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NormedRows:
    """``x / rms(x) * scale`` over ``x`` ``[T, dim]``'s rows, not yet formed: ``scale``
    float32 ``[dim]`` (a zero-centred norm's ``1 + weight``), or None where the norm's
    weight is folded into its readers (``ZeroCenteredRMSNorm.fold_into``); ``sums``, each
    row's sum of squares where the rows came with it (``SummedRows``)."""

    x: jax.Array
    scale: jax.Array | None
    eps: float = dataclasses.field(metadata=dict(static=True))
    sums: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.x.shape

    @property
    def dtype(self) -> jnp.dtype:
        return self.x.dtype

    def value(self) -> jax.Array:
        """The norm's output, in x's dtype (of the square sums where the rows came with
        them)."""
        if self.sums is None:
            normalized = _normalize(self.x, self.eps)
        else:
            normalized = self.x.astype(jnp.float32) * self.inverse_rms()[:, None]
        if self.scale is not None:
            normalized = normalized * self.scale
        return normalized.astype(self.x.dtype)

    def weighted(self) -> jax.Array:
        """``x * scale`` in x's dtype: the rows a product reads before ``inverse_rms``
        (``x`` itself without a scale)."""
        if self.scale is None:
            return self.x
        return (self.x.astype(jnp.float32) * self.scale).astype(self.x.dtype)

    def square_sum(self) -> jax.Array:
        """float32 ``[T]``: each row's sum of squares (``inverse_rms`` is
        ``1 / sqrt(square_sum / dim + eps)``). A launch takes the sum, not the mean: the
        reduction that gives it is then the last op of its kernel."""
        return _square_sums(self.x) if self.sums is None else self.sums

    def inverse_rms(self) -> jax.Array:
        """float32 ``[T]``: what each row of ``weighted() @ w`` is multiplied by."""
        return jax.lax.rsqrt(self.square_sum() / self.x.shape[-1] + self.eps)


@functools.partial(jax.jit, donate_argnums=0)
def _scaled_along_rows(w: jax.Array, scale: jax.Array) -> jax.Array:
    """``w [*lead, *mid, dim, N]`` times ``scale [*lead, dim]`` along ``dim``, in w's dtype
    (w donated: the folded weight takes its memory)."""
    lead, dim = scale.shape[:-1], scale.shape[-1]
    mid = w.ndim - scale.ndim - 1
    along = scale.reshape(*lead, *(1,) * mid, dim, 1)
    return (w.astype(jnp.float32) * along).astype(w.dtype)


def formed(x: jax.Array | NormedRows) -> jax.Array:
    """``x`` as an array: a ``NormedRows`` formed, an array as it is."""
    return x.value() if isinstance(x, NormedRows) else x


class ZeroCenteredRMSNorm(nnx.Module):
    """``x / rms(x) * (1 + weight)`` with ``weight`` initialised to zeros (Qwen3-Next).

    x: ``[..., dim]`` -> same shape and dtype; the norm is computed in float32.
    """

    OFFSET = 1.0
    """What the weight is added to: the norm multiplies by ``OFFSET + weight``."""

    def __init__(self, dim: int, *, eps: float = 1e-6):
        self.weight = nnx.Param(jnp.zeros((dim,), jnp.float32))
        self.eps = eps
        self.folded = False  # whether ``fold_into`` gave the weight to the norm's readers

    def __call__(self, x: jax.Array | SummedRows) -> jax.Array:
        return self.deferred(x).value()

    def scale(self) -> jax.Array | None:
        """float32 ``[dim]``: what the normalised rows are multiplied by, ``1 + weight``;
        None once the weight is folded into the norm's readers."""
        return None if self.folded else self.OFFSET + self.weight[...]

    def deferred(self, x: jax.Array | SummedRows) -> NormedRows:
        """The norm of ``x`` ``[T, dim]``, left for its products to form (``NormedRows``;
        of ``SummedRows``, with their square sums)."""
        if isinstance(x, SummedRows):
            return NormedRows(x.x, self.scale(), self.eps, x.square_sums)
        return NormedRows(x, self.scale(), self.eps)

    def fold_into(self, readers: Sequence[nnx.Param]) -> None:
        """Multiply ``1 + weight`` into the weights of every product that reads this norm
        (each ``[..., dim, N]``, scaled along ``dim``; leading axes such as a stack of layers
        are the weight's too, then experts), in place, and leave the norm without a weight:
        its output times each weight is unchanged up to rounding (the weights' dtype takes
        the product). The caller owns the weights, and names every reader: one left out
        would read the norm unweighted. A folded norm is left as it is."""
        if self.folded:
            return
        scale = self.OFFSET + self.weight[...]
        for param in readers:  # all checked before any is changed
            shape = tuple(param.get_value().shape)
            if len(shape) < scale.ndim + 1 or shape[-2] != scale.shape[-1]:
                raise ValueError(
                    f"fold_into: a reader of shape {shape} is not [..., {scale.shape[-1]}, N] "
                    "(the norm's dim along its second-last axis)"
                )
        for param in readers:
            param.set_value(_scaled_along_rows(param.get_value(), scale))
        self.weight.set_value(jnp.zeros_like(scale))
        self.folded = True


class GatedRMSNorm(nnx.Module):
    """``weight * x / rms(x) * silu(gate)``, normalised per head (GDN's output norm).

    x, gate: ``[..., head_dim]`` -> same shape, x's dtype. The normalised x is cast back to its
    dtype before the weight, as the reference implementation does, so bf16 runs round alike.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        return gdn_reference.gated_output_norm(x, gate, self.weight[...], self.eps)
