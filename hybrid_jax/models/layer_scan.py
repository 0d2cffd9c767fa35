"""Runs of repeated layers under ``jax.lax.scan``: a model whose compile time does not grow
with its depth.

A decoder's layers repeat: Qwen3-Next's are three GDN blocks and one attention block, twelve
times over; Nemotron-H's patterns repeat in runs. ``layer_runs`` finds, from each layer's
structure (its module graph, parameter shapes and dtypes), the runs of a block of ``period``
layers repeated ``repeats`` times; ``scan_layers`` returns the model with every run of two or
more repeats replaced by one ``ScannedRun``, whose weights are stacked on a leading axis, so
the forward traces and compiles the block once and ``lax.scan`` runs it ``repeats`` times over
the stacked weights, with the whole pool and cache as its carry (``decoder.LayerStates.scan``).
The layers' arithmetic is unchanged: a scanned model computes what the layer-by-layer one does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.layers import linear as linear_layer
from hybrid_jax.layers.norm import rows_of, summed
from hybrid_jax.modes import ForwardMode, LayerKind

__all__ = [
    "CARRY_SQUARE_SUMS",
    "DECODE_SCAN_UNROLLED",
    "LayerRun",
    "ScannedRun",
    "fold_scanned_norms",
    "layer_runs",
    "layer_signature",
    "pair_scanned_swiglu",
    "scan_layers",
]


CARRY_SQUARE_SUMS = True
"""Whether a scan whose layers' norms read square sums (``reads_square_sums``, with the norms
left to their products' launches) carries the rows with their sums (``ScannedRun``). Read
while tracing a step."""

DECODE_SCAN_UNROLLED = False
"""Whether a DECODE step runs a scanned run's repeats unrolled (``lax.scan(unroll=True)``):
no loop, so no loop counter and no per-repeat slices of the scan's inputs, each a kernel of
its own each repeat; every repeat's block is in the executable, its kernels lowered once
(``benchmarks/RESULTS_serve.md``, session 42). Read while tracing a step."""


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """Layers ``start .. start + period * repeats - 1``: a block of ``period`` layers,
    ``repeats`` times."""

    start: int
    period: int
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats


def layer_runs(signatures: Sequence[Hashable], *, min_repeats: int = 2) -> tuple[LayerRun, ...]:
    """The layers cut into runs, left to right: at each layer, the block (of the periods that
    repeat at least ``min_repeats`` times there) that covers the most layers, the shortest
    period on a tie; a layer that starts no such block is a run of one.

    >>> layer_runs("GGGAGGGAGGGA")
    (LayerRun(start=0, period=4, repeats=3),)
    >>> layer_runs("MMAMMAX")
    (LayerRun(start=0, period=3, repeats=2), LayerRun(start=6, period=1, repeats=1))
    """
    sig, runs, i = list(signatures), [], 0
    while i < len(sig):
        best = LayerRun(i, 1, 1)
        for period in range(1, (len(sig) - i) // min_repeats + 1):
            repeats = 1
            while sig[i + repeats * period : i + (repeats + 1) * period] == sig[i : i + period]:
                repeats += 1
            covered = period * repeats
            if repeats >= min_repeats and covered > best.period * best.repeats:
                best = LayerRun(i, period, repeats)
        runs.append(best)
        i = best.stop
    return tuple(runs)


def layer_signature(layer: nnx.Module) -> Hashable:
    """What must match for two layers to share a compiled block: the module graph (its
    classes and static attributes) and every parameter's shape and dtype."""
    graphdef, state = nnx.split(layer)
    leaves = tuple((a.shape, a.dtype) for a in jax.tree.leaves(state))
    return graphdef, leaves


def _stack(layers: Sequence[nnx.Module], donate: bool) -> nnx.Module:
    """One module of the layers' structure whose arrays are theirs stacked on axis 0."""
    graphdef, first = nnx.split(layers[0])
    states = [first, *(nnx.split(layer)[1] for layer in layers[1:])]

    def stack(*arrays: jax.Array) -> jax.Array:
        out = jnp.stack(arrays)
        if donate:
            for a in arrays:
                a.delete()
        return out

    return nnx.merge(graphdef, jax.tree.map(stack, *states))


class ScannedRun(nnx.Module):
    """``repeats`` repeats of a block of ``period`` layers, their weights stacked; called
    like a layer (``run(x, states, meta, impl=impl) -> x``)."""

    def __init__(self, layers: Sequence[nnx.Module], kinds: Sequence[LayerKind | None], *,
                 period: int, donate: bool = False):  # fmt: skip
        """``layers``: the run's layers in order (``period * repeats`` of them); ``kinds``:
        the kind of state each keeps (None: none, ``HybridCausalLM.block_kinds``);
        ``donate``: delete each layer's arrays once stacked."""
        if len(layers) % period or len(kinds) != len(layers):
            raise ValueError(
                f"{len(layers)} layers and {len(kinds)} kinds do not make whole repeats of a "
                f"period of {period}"
            )
        self.repeats = len(layers) // period
        block = kinds[:period]
        self.attention_per_repeat = sum(kind is LayerKind.FULL_ATTENTION for kind in block)
        self.linear_per_repeat = sum(kind is not None for kind in block) - self.attention_per_repeat
        self.blocks = nnx.List([_stack(layers[j::period], donate) for j in range(period)])

    def __call__(self, x: Any, states: Any, meta: Any, *, impl: str) -> Any:
        """x ``[T, hidden]`` through every repeat; ``states``: the forward's ``LayerStates``.
        Where the block's layers read square sums (``reads_square_sums``) and the norms are
        left to their products' launches, the scan carries the rows with their sums
        (``SummedRows``; the block's last launch may give them, or XLA sums the rows in the
        kernel of the last residual add), so no repeat's first norm reduces its rows again."""
        graphdefs, weights = zip(*(nnx.split(block) for block in self.blocks), strict=True)
        with_sums = (
            CARRY_SQUARE_SUMS
            and linear_layer.NORMS_IN_LAUNCH
            and getattr(self.blocks[0], "reads_square_sums", False)
        )
        carried = summed if with_sums else rows_of

        def block(x: Any, w: tuple) -> Any:
            for graphdef, wj in zip(graphdefs, w, strict=True):
                x = nnx.merge(graphdef, wj)(x, states, meta, impl=impl)
            return carried(x)

        x = carried(x)
        return states.scan(
            block, x, tuple(weights), meta, repeats=self.repeats,
            linear_per_repeat=self.linear_per_repeat,
            attention_per_repeat=self.attention_per_repeat,
            unroll=DECODE_SCAN_UNROLLED and meta.mode is ForwardMode.DECODE,
        )  # fmt: skip


def scan_layers[Model: nnx.Module](model: Model, *, donate: bool = False) -> Model:
    """``model`` with every run of repeated layers (``layer_runs``) as one ``ScannedRun``.

    The result shares every other module and array with ``model`` (``layers`` is its own).
    Stacking copies the repeated layers' weights; with ``donate`` each original array is
    deleted once stacked, so peak memory grows by one stacked parameter, not the model, and
    ``model``'s layers must not be used afterwards. The result is for running (the engine's
    steps); checkpoints and per-layer access stay on ``model``. A scanned model is returned
    as it is.
    """
    if any(isinstance(layer, ScannedRun) for layer in model.layers):
        return model  # scanned already
    scanned = nnx.merge(*nnx.split(model))
    layers, kinds = list(model.layers), model.block_kinds
    runs = layer_runs([layer_signature(layer) for layer in layers])
    blocks = []
    for run in runs:
        if run.repeats == 1:
            blocks.extend(layers[run.start : run.stop])
        else:
            span = slice(run.start, run.stop)
            blocks.append(ScannedRun(layers[span], kinds[span], period=run.period, donate=donate))
    scanned.layers = nnx.List(blocks)
    return scanned


def fold_scanned_norms(model: nnx.Module) -> None:
    """Fold the norm weights of every scanned run's layers into their products, in place
    (each layer's ``fold_norm_weights``, where its kind has one): the stacked weights are a
    scanned model's own copy, never the checkpoint's. Layers outside the runs (shared with
    the model ``scan_layers`` was given) are left as they are."""
    _call_scanned_blocks(model, "fold_norm_weights")


def pair_scanned_swiglu(model: nnx.Module) -> None:
    """Lay out the SwiGLU gate/up weights of every scanned run's layers for a launch that
    forms the hidden rows in its epilogue, in place (each layer's ``pair_swiglu_halves``,
    where its kind has one, as its switch says); like ``fold_scanned_norms``, on a scanned
    model's own copy."""
    _call_scanned_blocks(model, "pair_swiglu_halves")


def _call_scanned_blocks(model: nnx.Module, method: str) -> None:
    for layer in model.layers:
        if isinstance(layer, ScannedRun):
            for block in layer.blocks:
                call = getattr(block, method, None)
                if call is not None:
                    call()
