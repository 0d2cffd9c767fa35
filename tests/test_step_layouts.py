"""No weight is re-laid-out per step: in the lowered step of every served mode, no model
parameter reaches a transpose (directly or through reshapes, converts and slices). The weights
are stored in the layout the step reads, so nothing rewrites them every step."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from hybrid_jax import Engine, EngineConfig
from hybrid_jax.metadata import example_metadata
from hybrid_jax.modes import ForwardMode

_PASS_THROUGH = ("reshape", "convert", "slice", "bitcast_convert", "broadcast_in_dim")


def transposed_args(module_text: str, args: range) -> set[int]:
    """The ``%argN`` (N in ``args``) of the module's public ``main`` that reach a
    ``stablehlo.transpose`` through pass-through ops only."""
    body = module_text.split("func.func public @main", 1)[1].split("\n  func.func ", 1)[0]
    origin = {f"%arg{i}": i for i in args}
    hit = set()
    for line in body.splitlines():
        m = re.match(r"\s*(%[\w#]+)(?::\d+)? = stablehlo\.(\w+) (%[\w#]+)", line)
        if not m:
            continue
        out, op, src = m.groups()
        if src in origin:
            if op == "transpose":
                hit.add(origin[src])
            elif op in _PASS_THROUGH:
                origin[out] = origin[src]
    return hit


def test_the_checker_sees_a_transposed_weight():
    def step(w, x):
        return x @ w.reshape(8, 4).T

    text = jax.jit(step).lower(jnp.zeros((4, 8)), jnp.zeros((2, 4))).as_text()
    assert transposed_args(text, range(1)) == {0}


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(
        max_batch=4, max_tokens=32, batch_buckets=(4,), token_buckets=(32,), cache_dir=None
    )
    return Engine.from_preset("tiny", config, progress=False)


@pytest.mark.parametrize(
    ("mode", "rows", "tokens"), [(ForwardMode.DECODE, 4, 4), (ForwardMode.EXTEND, 4, 32)]
)
def test_no_weight_is_transposed_in_a_step(engine, mode, rows, tokens):
    steps = engine._steps
    meta = example_metadata(mode, rows, tokens, engine.policy)
    x = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    text = steps.lower(mode, engine.state, x, meta).as_text()
    assert transposed_args(text, range(len(steps.params))) == set()
