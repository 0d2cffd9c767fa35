"""projections: the Mosaic GPU kernel in the interpreter and the XLA reference against a float64
oracle, the ``cuda`` lowering, the errors, and ``layers.linear.project``'s choice of path."""

from __future__ import annotations

import importlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.layers.gdn import GatedDeltaNet, GDNConfig
from hybrid_jax.layers.linear import FEW_ROWS, project
from pallas_kernels import projections

# The module, not the function of the same name that it exports.
proj_module = importlib.import_module("pallas_kernels.projections")


def _case(seed, rows, k, widths):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16) for n in widths]
    return x, ws


@pytest.mark.parametrize(
    ("rows", "k", "widths"),
    [(5, 256, (128, 64, 192)), (8, 128, (64,)), (13, 384, (64, 256))],
)
@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_every_product_matches_the_float64_oracle(rows, k, widths, impl, product_variant):
    x, ws = _case(rows + k, rows, k, widths)
    got = projections.projections(x, ws, impl=impl)
    assert len(got) == len(ws)
    for out, w in zip(got, ws, strict=True):
        chex.assert_shape(out, (rows, w.shape[1]))
        assert out.dtype == jnp.bfloat16
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        err = np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
        assert err < 1e-2


def test_the_kernel_lowers_for_cuda(product_variant):
    x = jnp.zeros((8, 2048), jnp.bfloat16)
    ws = tuple(jnp.zeros((2048, n), jnp.bfloat16) for n in (8192, 4096, 64))

    def call(x, ws):
        return proj_module._kernel(x, ws, interpret=False)

    text = jax.jit(call).trace(x, ws).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_unsupported_reason_names_rows_dtype_and_alignment():
    x = jnp.zeros((8, 256), jnp.bfloat16)
    w = jnp.zeros((256, 64), jnp.bfloat16)
    assert projections.unsupported_reason(x, [w]) is None
    assert "at most 64" in projections.unsupported_reason(jnp.zeros((65, 256), jnp.bfloat16), [w])
    assert "16-bit float" in projections.unsupported_reason(x, [w.astype(jnp.float32)])
    assert "multiple of 128" in projections.unsupported_reason(x[:, :64], [w[:64]])
    assert "got [1]" in projections.unsupported_reason(x, [w, jnp.zeros((256, 1), jnp.bfloat16)])


def test_misshapen_calls_raise_naming_the_shapes():
    with pytest.raises(ValueError, match=r"each weight \[K, N\] with x's K"):
        projections.projections(jnp.zeros((8, 128)), [jnp.zeros((64, 64))])
    with pytest.raises(ValueError, match="projections: x must be"):
        projections.projections(jnp.zeros((8, 128)), [])


def _linears(k, widths, *, bias=False):
    rngs = nnx.Rngs(0)
    kw = dict(use_bias=bias, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
    return [nnx.Linear(k, n, **kw) for n in widths]


def test_project_runs_one_kernel_at_few_rows_and_the_layers_otherwise():
    layers = _linears(128, (64, 128))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 128)), jnp.bfloat16)
    got = project(x, layers, impl="interpret")
    for out, layer in zip(got, layers, strict=True):
        chex.assert_trees_all_close(out, layer(x), rtol=2e-2, atol=2e-2)

    def runs_kernel(rows, layers, impl):
        a = jax.ShapeDtypeStruct((rows, 128), jnp.bfloat16)
        text = jax.jit(lambda a: project(a, layers, impl=impl)).lower(a).as_text()
        return "@_kernel(" in text  # the kernel's jitted function (interpreted here)

    assert runs_kernel(3, layers, "interpret")
    assert not runs_kernel(FEW_ROWS + 1, layers, "interpret")
    assert not runs_kernel(3, layers, "reference")
    assert not runs_kernel(3, _linears(128, (64,), bias=True), "interpret")
    assert not runs_kernel(3, _linears(128, (64, 1)), "interpret")


def test_a_gdn_layer_s_projections_in_one_launch_split_as_its_own_do():
    # qkv 640, z 512 and b|a 64 columns: every width a multiple of 64, so the kernel runs.
    config = GDNConfig(hidden_size=128, num_key_heads=4, num_value_heads=32, head_k_dim=16,
                       head_v_dim=16, dtype="bfloat16")  # fmt: skip
    layer = GatedDeltaNet(config, rngs=nnx.Rngs(2))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((5, 128)), jnp.bfloat16)
    weights = [p.kernel[...] for p in (layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_ba)]
    assert projections.unsupported_reason(x, weights) is None  # the kernel takes this layer
    one_launch = layer._project(x, impl="interpret")
    per_layer = layer._project(x, impl="reference")
    for got, want in zip(one_launch, per_layer, strict=True):
        chex.assert_equal_shape([got, want])
        chex.assert_trees_all_close(got, want, rtol=2e-2, atol=2e-2)
