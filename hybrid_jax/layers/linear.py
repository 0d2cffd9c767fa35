"""Projections of one input by several linear layers: one kernel launch at decode's few rows.

A layer's input projections (GDN ``qkv | z | b a``, attention q/k/v, a MoE block's router and
shared expert, a dense MLP's gate and up) each read their weight once; at a few rows a launch
per weight costs more than its bytes. ``project`` runs them in one launch
(``pallas_kernels.projections``, every weight read in place) when the step has at most
``FEW_ROWS`` rows and the kernel runs here, and as the layers themselves otherwise (XLA's
products: the CPU, large steps, biases, shapes the kernel does not take).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx

from pallas_kernels import projections, resolve_impl

__all__ = ["FEW_ROWS", "project"]

FEW_ROWS = 64
"""Rows up to which ``project`` launches one kernel: the kernel's most, since up to there the
one launch reads the weights at least as fast as cuBLAS's products
(benchmarks/RESULTS_projections.md)."""


def project(x: jax.Array, layers: Sequence[nnx.Linear], *, impl: str) -> tuple[jax.Array, ...]:
    """``tuple(layer(x) for layer in layers)``, in one launch at few rows on the GPU."""
    weights = [layer.kernel[...] for layer in layers]
    if (
        0 < x.shape[0] <= FEW_ROWS
        and not any(layer.use_bias for layer in layers)
        and projections.unsupported_reason(x, weights) is None
        and resolve_impl("projections", impl, None) != "reference"
    ):
        return projections.projections(x, weights, impl=impl)
    return tuple(layer(x) for layer in layers)
