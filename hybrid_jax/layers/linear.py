"""Projections of one input by several linear layers: one kernel launch at decode's few rows.

A layer's input projections (GDN ``qkv | z | b a``, attention q/k/v, a MoE block's router and
shared expert, a dense MLP's gate and up) each read their weight once; at a few rows a launch
per weight costs more than its bytes. ``project`` runs them in one launch
(``pallas_kernels.projections``, every weight read in place) when the step has at most
``FEW_ROWS`` rows and the kernel runs here, and as the layers themselves otherwise (XLA's
products: the CPU, large steps, biases, shapes the kernel does not take). Its input may be a
norm left unformed (``layers.norm.NormedRows``, with ``NORMS_IN_LAUNCH``): the launch then
applies the norm's row scale to its sums, and no norm kernel runs before it.

``project_output`` is the same choice for a block's single output projection (GDN and Mamba2
``out_proj``, attention's ``o_proj``, an MLP's ``down_proj``): with ``SPLIT_OUTPUT_PROJECTIONS``
(on) its weight is read by one program per (column tile, part of K), and the float32 partial
products are summed where the result is used; given the residual they are added to, with
``ADD_IN_OUTPUT_LAUNCH`` the launch sums and adds them itself.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.layers.norm import NormedRows, SummedRows, formed
from pallas_kernels import moe, projections, resolve_impl

__all__ = [
    "ADDS_FOR_SHORT_SUMS",
    "ADD_IN_OUTPUT_LAUNCH",
    "FEW_ROWS",
    "MIN_SPLITS",
    "NORMS_IN_LAUNCH",
    "RESIDUAL_IN_PRODUCT",
    "SPLIT_OUTPUT_PROJECTIONS",
    "project",
    "project_output",
    "short_sum",
    "swiglu",
]

FEW_ROWS = 64
"""Rows up to which ``project`` launches one kernel: the kernel's most, since up to there the
one launch reads the weights at least as fast as cuBLAS's products
(benchmarks/RESULTS_projections.md)."""

SPLIT_OUTPUT_PROJECTIONS = True
"""Whether ``project_output`` splits K at few rows (``projections.projection_partials``): an
output projection has few column tiles (2048 columns: 32 programs for 132 SMs), which the
split multiplies (benchmarks/RESULTS_serve.md: the 35B-like batch-1 step)."""

ADD_IN_OUTPUT_LAUNCH = True
"""Whether an output projection split over parts of K (``SPLIT_OUTPUT_PROJECTIONS``) that a
layer adds to the residual stream sums its partials, adds them to the residual and forms
the new rows' square sums in its own launch (``projections.projection_add``), where XLA
does that in a kernel of its own after the launch (a kernel fewer per layer:
``benchmarks/RESULTS_serve.md``, session 41)."""

MIN_SPLITS = 4
"""The fewest parts of K a split takes: weights whose column tiles fill at most a quarter of
the SMs (the 35B-like ``out_proj``, 32 tiles, gains from 4 parts; the 9B-like MLP's
``down_proj``, 64 tiles in 2 parts, is slower than cuBLAS at 8 rows:
benchmarks/RESULTS_projections.md)."""

NORMS_IN_LAUNCH = True
"""Whether a decoder layer hands its norms to their products unformed (``NormedRows``): the
projections' launch reads the rows times the norm's weight and scales each row of its sums
by the row's inverse RMS, so no norm kernel (and no copy of its weight out of the layers'
stack) runs between the residual add and the launch."""

ADDS_FOR_SHORT_SUMS = True
"""Whether ``short_sum`` writes a sum over a short axis (the partial products' parts of K, a
MoE token's choices and the softmax over them) as a chain of adds: elementwise ops, which
XLA may fuse into whatever reads the sum, where a reduce is a fusion that other reductions
do not take in. On the H200 the steps keep their kernels, and the residual adds that sum the
output projections' parts and the MoE combine run shorter (``benchmarks/RESULTS_serve.md``,
session 28)."""


RESIDUAL_IN_PRODUCT = True
"""Whether a product XLA runs (``project_output`` above ``FEW_ROWS``, or where its kernel
does not run) may take the residual it is added to into cuBLAS's epilogue; without it the
product is stored as it is and the add is a fusion of its own (cuBLAS keeps its tiles, and
the step at 256 rows its time: ``benchmarks/RESULTS_serve.md``, session 50)."""


def short_sum(x: jax.Array, axis: int) -> jax.Array:
    """``x.sum(axis)`` for a short ``axis`` (a few parts); with ``ADDS_FOR_SHORT_SUMS``, the
    parts added one after another."""
    if not ADDS_FOR_SHORT_SUMS:
        return x.sum(axis=axis)
    parts = (jax.lax.index_in_dim(x, i, axis, keepdims=False) for i in range(x.shape[axis]))
    return functools.reduce(operator.add, parts)


def swiglu(product: jax.Array, *, paired: bool) -> jax.Array:
    """``silu(gate) * up`` of a fused ``[..., 2I]`` product whose columns are the gate's then
    the up projection's, or (``paired``) laid out by ``moe.pair_halves``."""
    if paired:
        return moe.paired_swiglu(product)
    gate, up = jnp.split(product, 2, axis=-1)
    return jax.nn.silu(gate) * up


def project(
    x: jax.Array | NormedRows,
    layers: Sequence[nnx.Linear],
    *,
    impl: str,
    paired: Sequence[bool] = (),
) -> tuple[jax.Array, ...]:
    """``tuple(layer(x) for layer in layers)``, in one launch at few rows on the GPU.

    ``x`` may be a norm's ``NormedRows``: the launch then reads the rows times the norm's
    weight and scales each row of its products by the row's inverse RMS, and the norm is
    never formed; elsewhere it is formed first. When the kernel takes only some of the weights
    (a width that is not a multiple of its column tile: the 27B-like GDN's 96-wide ``b | a``),
    those share the launch if there are two or more (one weight alone is as fast in cuBLAS)
    and the rest run as their layers. ``paired`` (one flag per layer): a flagged layer's
    weight holds a SwiGLU's gate and up columns laid out by ``moe.pair_halves``, and its
    entry is the hidden rows ``silu(gate) * up``, formed in the launch's epilogue where the
    launch takes it and in XLA otherwise."""
    flags = tuple(paired) or (False,) * len(layers)

    def in_xla(h: jax.Array, i: int) -> jax.Array:
        y = layers[i](h)
        return swiglu(y, paired=True) if flags[i] else y

    if not (0 < x.shape[0] <= FEW_ROWS and resolve_impl("projections", impl, None) != "reference"):
        h = formed(x)
        return tuple(in_xla(h, i) for i in range(len(layers)))
    weights = [layer.kernel[...] for layer in layers]
    rows = x.weighted() if isinstance(x, NormedRows) else x
    taken = [
        i
        for i, (layer, w) in enumerate(zip(layers, weights, strict=True))
        if not layer.use_bias and projections.unsupported_reason(rows, [w], [flags[i]]) is None
    ]
    if len(taken) < min(len(layers), 2):
        h = formed(x)
        return tuple(in_xla(h, i) for i in range(len(layers)))
    taken_weights = [weights[i] for i in taken]
    taken_flags = [flags[i] for i in taken]
    if isinstance(x, NormedRows):  # the launch forms each row's inverse RMS
        products = projections.projections(
            rows, taken_weights, row_scale=x.square_sum(), rms_eps=x.eps, paired=taken_flags,
            impl=impl,
        )  # fmt: skip
    else:
        products = projections.projections(rows, taken_weights, paired=taken_flags, impl=impl)
    launched = dict(zip(taken, products, strict=True))
    h = formed(x) if len(launched) < len(layers) else None  # for the layers not launched
    return tuple(launched[i] if i in launched else in_xla(h, i) for i in range(len(layers)))


def _splits(x: jax.Array, weights: Sequence[jax.Array]) -> int:
    """The parts of K ``projection_partials`` takes for these weights; 1 (no split) below
    ``MIN_SPLITS``."""
    splits = projections.partial_splits(x.shape[1], [w.shape[1] for w in weights])
    return splits if splits >= MIN_SPLITS else 1


def _split_product(x: jax.Array, w: jax.Array, *, impl: str) -> jax.Array:
    """``x @ w`` in x's dtype, summed from float32 partial products over parts of K from one
    launch (XLA fuses the sum into its use)."""
    (partial,) = projections.projection_partials(x, [w], impl=impl)
    return short_sum(partial, 0).astype(x.dtype)


def project_output(
    x: jax.Array, layer: nnx.Linear, *, impl: str, residual: jax.Array | None = None,
    counters: jax.Ref | None = None,
) -> jax.Array | SummedRows:  # fmt: skip
    """``layer(x)``, or with ``residual`` ``residual + layer(x)``; at few rows on the GPU with
    ``SPLIT_OUTPUT_PROJECTIONS``, float32 partial products over parts of K from one launch,
    summed (XLA fuses the sum into its use). With ``residual`` and ``ADD_IN_OUTPUT_LAUNCH``
    that launch sums them itself, adds them to the residual and gives the new rows with
    their square sums (``projections.projection_add``: ``SummedRows``, which the next norm
    reads), counting its stored partials in ``counters`` (``LayerStates.counters``)."""
    w = layer.kernel[...]
    if not (
        SPLIT_OUTPUT_PROJECTIONS
        and 0 < x.shape[0] <= FEW_ROWS
        and not layer.use_bias
        and projections.unsupported_reason(x, [w]) is None
        and _splits(x, [w]) > 1
        and resolve_impl("projections", impl, None) != "reference"
    ):
        y = layer(x) if RESIDUAL_IN_PRODUCT else jax.lax.optimization_barrier(layer(x))
        return y if residual is None else residual + y
    if residual is None:
        return _split_product(x, w, impl=impl)
    if ADD_IN_OUTPUT_LAUNCH and projections.add_unsupported_reason(x, w, residual) is None:
        out, sums = projections.projection_add(
            x, w, residual, splits=_splits(x, [w]), counters=counters, impl=impl
        )
        return SummedRows(out, sums)
    return residual + _split_product(x, w, impl=impl)
