"""The GDN layer's DECODE step runs the decode kernel with the gating fused in.

The step must give what the unfused path gives (``gdn_gating`` in XLA, then the decode op on
g, beta: written out here as the layer ran it before), gate nowhere outside the kernels, and
still lower for ``cuda`` with the pools aliased. Head dims are 64: the smallest the decode
kernel takes, so that ``impl="interpret"`` runs the kernels.
"""

from __future__ import annotations

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import primitives_outside_kernels
from flax import nnx

from hybrid_jax.backend import GDNDims, gdn_mix
from hybrid_jax.backend import gdn as gdn_backend
from hybrid_jax.layers import gdn as gdn_layer
from hybrid_jax.layers import linear
from hybrid_jax.layers.gdn import GatedDeltaNet, GDNConfig
from hybrid_jax.layers.norm import SummedRows
from hybrid_jax.metadata import BucketPolicy, RowSpec, build_metadata, example_metadata
from hybrid_jax.modes import ForwardMode
from pallas_kernels import conv1d, gdn

CONFIG = GDNConfig(hidden_size=32, num_key_heads=1, num_value_heads=2, head_k_dim=64, head_v_dim=64)
SLOTS = 7
POLICY = BucketPolicy(batch_buckets=(4,), token_buckets=(8,))
# Three real rows at scattered slots with different prefixes; the bucket adds a padded row.
ROWS = (RowSpec(5, 3, 1), RowSpec(2, 9, 1), RowSpec(6, 1, 1))
# The elementwise ops of the gating; none of them may run outside a kernel in DECODE.
GATING_PRIMITIVES = frozenset({"exp", "log", "log1p", "logistic"})


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint32)


@pytest.fixture(scope="module")
def layer() -> GatedDeltaNet:
    layer = GatedDeltaNet(CONFIG, rngs=nnx.Rngs(0))
    # dt_bias (gate_params' second row) starts at ones: make it random so that a wrong head's
    # bias shows.
    params = layer.gate_params[...]
    layer.gate_params[...] = params.at[1].set(jax.random.normal(jax.random.key(1), params[1].shape))
    return layer


def _inputs(seed):
    """Fresh random tokens and pools (every slot random, so stale reads and stray writes show)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    spec = CONFIG.state_spec()
    meta = build_metadata(ForwardMode.DECODE, ROWS, POLICY, num_slots=SLOTS)
    x = jax.random.normal(keys[0], (meta.num_tokens, CONFIG.hidden_size), jnp.float32)
    conv = jax.random.normal(keys[1], (SLOTS, *spec.conv_shape), jnp.float32)
    ssm = jax.random.normal(keys[2], (SLOTS, *spec.ssm_shape), jnp.float32) * 0.3
    return x, conv, ssm, meta


def _unfused_decode(layer, x, conv_state, ssm_state, meta, *, impl):
    """The DECODE step with the gating in XLA and the decode op on g, beta (the layer before
    the fusion): projections, gating, conv update, delta rule, norm, output projection."""
    d, bs = CONFIG.dims, meta.batch_size
    mixed, z, ba = layer._project(x)
    b, a = jnp.split(ba, 2, axis=-1)
    a_log, dt_bias = layer.gate_params[...]
    g, beta = gdn.gdn_gating(a_log, a, dt_bias, b)
    mixed, conv_state = conv1d.causal_conv1d_update(
        mixed.reshape(bs, 1, -1), layer.conv_weight[...], None, conv_state,
        meta.state_indices, impl=impl,
    )  # fmt: skip
    q, k, v = jnp.split(mixed, [d.key_dim, 2 * d.key_dim], axis=-1)
    out, ssm_state = gdn.fused_recurrent_gated_delta_rule(
        q.reshape(bs, 1, d.num_key_heads, d.head_k_dim),
        k.reshape(bs, 1, d.num_key_heads, d.head_k_dim),
        v.reshape(bs, 1, d.num_value_heads, d.head_v_dim),
        g.reshape(bs, 1, -1), beta.reshape(bs, 1, -1), ssm_state, meta.state_indices,
        impl=impl,
    )  # fmt: skip
    out = layer.norm(out.reshape(bs, d.num_value_heads, d.head_v_dim), z)
    return layer.out_proj(out.reshape(bs, d.value_dim)), conv_state, ssm_state


def _fused_decode(layer, x, conv_state, ssm_state, meta, *, impl):
    out = layer(x, conv_state, ssm_state, meta, impl=impl)
    return out.y, out.conv_state, out.ssm_state


@pytest.mark.parametrize("norm_in_kernel", [False, True], ids=["norm-after", "norm-in-kernel"])
@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_decode_step_equals_the_unfused_path_and_writes_only_its_rows(
    layer, impl, norm_in_kernel, monkeypatch
):
    """With ``NORM_IN_DECODE_KERNEL`` the decode kernel forms the output norm (its items
    whole heads): the same step within float32 rounding."""
    monkeypatch.setattr(gdn_layer, "NORM_IN_DECODE_KERNEL", norm_in_kernel)
    x, conv, ssm, meta = _inputs(0)
    step = lambda fn: jax.jit(functools.partial(fn, layer, impl=impl))  # noqa: E731
    y, conv_out, ssm_out = step(_fused_decode)(x, conv, ssm, meta)
    y_ref, conv_ref, ssm_ref = step(_unfused_decode)(x, conv, ssm, meta)
    # Same conv kernel on both sides: the windows agree bit for bit.
    np.testing.assert_array_equal(_bits(conv_out), _bits(conv_ref))
    if impl == "reference":  # the same XLA ops in the same order
        np.testing.assert_array_equal(_bits(y), _bits(y_ref))
        np.testing.assert_array_equal(_bits(ssm_out), _bits(ssm_ref))
    else:  # the kernel's float32 gating against XLA's: a few ulps
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ssm_out, ssm_ref, rtol=1e-5, atol=1e-6)
    ssm, ssm_out, conv, conv_out = map(np.asarray, (ssm, ssm_out, conv, conv_out))
    named = np.array([row.slot for row in ROWS])
    others = np.setdiff1d(np.arange(SLOTS), named)  # the pad slot 0 among them
    np.testing.assert_array_equal(_bits(ssm_out[others]), _bits(ssm[others]))
    np.testing.assert_array_equal(_bits(conv_out[others]), _bits(conv[others]))
    assert (ssm_out[named] != ssm[named]).any(axis=(1, 2, 3)).all(), "a real slot was not written"


def _mix_args(layer, x, conv, ssm, meta):
    mixed, _, ba = layer._project(x)
    return mixed, layer.conv_weight[...], layer.gate_params[...], ba, conv, ssm


def test_decode_step_gates_only_inside_the_kernel(layer):
    x, conv, ssm, meta = _inputs(1)
    args = _mix_args(layer, x, conv, ssm, meta)

    def fused(mixed, conv_weight, gate_params, ba, conv, ssm):
        return gdn_mix(
            mixed, conv_weight, gate_params, ba, conv, ssm, meta, CONFIG.dims, impl="interpret"
        )

    names, kernels = primitives_outside_kernels(jax.make_jaxpr(fused)(*args).jaxpr)
    assert kernels == 2, "the conv update and the decode kernel"
    assert not names & GATING_PRIMITIVES, f"gating outside the kernel: {names & GATING_PRIMITIVES}"
    # The check sees gating where it is: the unfused path gates in XLA.
    unfused = functools.partial(_unfused_decode, layer, meta=meta, impl="interpret")
    names, kernels = primitives_outside_kernels(jax.make_jaxpr(unfused)(x, conv, ssm).jaxpr)
    assert kernels == 2 and {"exp", "logistic"} <= names


def test_the_output_norm_handed_to_the_mix_runs_inside_the_decode_kernel(layer):
    x, conv, ssm, meta = _inputs(2)
    _, z, _ = layer._project(x)
    norm = gdn.OutputNorm(z.reshape(x.shape[0], -1), layer.norm.weight[...], layer.norm.eps)

    def mix(*args):
        return gdn_mix(*args, meta, CONFIG.dims, output_norm=norm, impl="interpret").out

    norm_ops = {"rsqrt", "logistic"}
    names, kernels = primitives_outside_kernels(
        jax.make_jaxpr(mix)(*_mix_args(layer, x, conv, ssm, meta)).jaxpr
    )
    assert kernels == 2 and not names & norm_ops, f"the norm outside the kernel: {names}"
    # The check sees the norm where it is: formed in XLA it holds both.
    out = jnp.zeros((meta.num_tokens, 2, 64), jnp.float32)
    formed = jax.make_jaxpr(layer.norm)(out, z)
    assert norm_ops <= primitives_outside_kernels(formed.jaxpr)[0]


@pytest.mark.parametrize("bs", [1, 8, 64])
@pytest.mark.parametrize(
    "conv_in_kernel", [False, True, "up-to-8-rows"],
    ids=["conv-launch", "conv-in-kernel", "conv-in-kernel-up-to-8-rows"],
)  # fmt: skip
def test_decode_step_lowers_for_cuda_with_the_pools_aliased(conv_in_kernel, bs, monkeypatch):
    """Qwen3-Next shapes (H=16, HV=32, K=V=128, bf16 activations) at buckets of 1 to 64 rows,
    the conv in its own launch or in the decode kernel (``CONV_IN_DECODE_KERNEL``, at any
    rows, or as it is set, up to ``CONV_IN_DECODE_KERNEL_MAX_ROWS``): both pools updated in
    place."""
    monkeypatch.setattr(gdn_backend, "CONV_IN_DECODE_KERNEL", bool(conv_in_kernel))
    if conv_in_kernel is True:
        monkeypatch.setattr(gdn_backend, "CONV_IN_DECODE_KERNEL_MAX_ROWS", 64)
    else:
        conv_in_kernel = conv_in_kernel and bs <= gdn_backend.CONV_IN_DECODE_KERNEL_MAX_ROWS
    h, hv, kd, slots = 16, 32, 128, 80
    dims = (h, hv, kd, kd)
    meta = example_metadata(ForwardMode.DECODE, bs, bs, BucketPolicy(batch_buckets=(bs,)))
    channels = 2 * h * kd + hv * kd
    f32, bf16 = jnp.float32, jnp.bfloat16
    shapes = (
        jax.ShapeDtypeStruct((bs, channels), bf16),
        jax.ShapeDtypeStruct((channels, 4), bf16),
        jax.ShapeDtypeStruct((2, hv), f32),
        jax.ShapeDtypeStruct((bs, 2 * hv), bf16),
        jax.ShapeDtypeStruct((slots, channels, 3), bf16),
        jax.ShapeDtypeStruct((slots, hv, kd, kd), f32),
    )

    def step(mixed, conv_weight, gate_params, ba, conv, ssm, meta):
        mix = gdn_mix(
            mixed, conv_weight, gate_params, ba, conv, ssm, meta, GDNDims(*dims), impl="pallas"
        )
        return mix.out, mix.conv_state, mix.ssm_state

    traced = jax.jit(step, donate_argnums=(4, 5)).trace(*shapes, meta)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert re.search(rf"tensor<{slots}x{channels}x3xbf16> {{tf.aliasing_output = 1 ", main)
    assert re.search(rf"tensor<{slots}x{hv}x{kd}x{kd}xf32> {{tf.aliasing_output = 2 ", main)
    assert "stablehlo.logistic" not in text, "the gating's sigmoid ran outside the kernel"
    # The decode kernel reads q, k, v and b, a where the conv and the projection put them.
    assert "stablehlo.slice" not in text
    assert ("gdn_decode_ring_conv" in text) == conv_in_kernel
    assert ("conv1d_update" in text) != conv_in_kernel


def test_a_residual_handed_to_the_layer_joins_it_in_the_output_launch(monkeypatch):
    """A bf16 layer whose output projection splits (K = 512 in 4 parts): given the residual,
    with ``ADD_IN_OUTPUT_LAUNCH`` its output is the residual plus its own output, bit for
    bit, from the add launch, with the new rows' square sums (``SummedRows``)."""
    config = GDNConfig(hidden_size=256, num_key_heads=1, num_value_heads=8, head_k_dim=64,
                       head_v_dim=64, dtype="bfloat16")  # fmt: skip
    layer = GatedDeltaNet(config, rngs=nnx.Rngs(2))
    keys = jax.random.split(jax.random.key(3), 4)
    spec = config.state_spec()
    meta = build_metadata(ForwardMode.DECODE, ROWS, POLICY, num_slots=SLOTS)
    x = jax.random.normal(keys[0], (meta.num_tokens, 256), jnp.bfloat16)
    residual = jax.random.normal(keys[1], (meta.num_tokens, 256), jnp.bfloat16)
    conv = jax.random.normal(keys[2], (SLOTS, *spec.conv_shape), jnp.bfloat16)
    ssm = jax.random.normal(keys[3], (SLOTS, *spec.ssm_shape), jnp.float32) * 0.3
    monkeypatch.setattr(linear, "SPLIT_OUTPUT_PROJECTIONS", True)
    monkeypatch.setattr(linear, "ADD_IN_OUTPUT_LAUNCH", True)

    def step(layer, x, residual, conv, ssm, meta):
        kw = {} if residual is None else dict(residual=residual)
        return layer(x, conv, ssm, meta, impl="interpret", **kw).y

    alone = jax.jit(step)(layer, x, None, conv, ssm, meta)
    added = jax.jit(step)(layer, x, residual, conv, ssm, meta)
    assert isinstance(added, SummedRows)
    np.testing.assert_array_equal(
        np.asarray(added.x).view(np.uint16), np.asarray(residual + alone).view(np.uint16)
    )
    rows = np.asarray(added.x, np.float64)
    np.testing.assert_allclose(np.asarray(added.square_sums), (rows * rows).sum(1), rtol=2e-3)


@pytest.mark.parametrize("in_product", [True, False], ids=["in-product", "add-apart"])
def test_an_output_projection_xla_runs_adds_its_residual_as_switched_with_the_same_bits(
    in_product, monkeypatch
):
    """Above ``FEW_ROWS`` XLA runs the output projection: with ``RESIDUAL_IN_PRODUCT`` off
    the product is stored behind a barrier (cuBLAS cannot take the add into its epilogue)
    and the add is XLA's own; the sum is the same bits either way."""
    rows = linear.FEW_ROWS + 16
    layer = nnx.Linear(256, 128, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                       rngs=nnx.Rngs(4))  # fmt: skip
    keys = jax.random.split(jax.random.key(5))
    x = jax.random.normal(keys[0], (rows, 256), jnp.bfloat16)
    residual = jax.random.normal(keys[1], (rows, 128), jnp.bfloat16)
    monkeypatch.setattr(linear, "RESIDUAL_IN_PRODUCT", in_product)

    def added(x, residual):
        return linear.project_output(x, layer, impl="auto", residual=residual)

    chex.assert_trees_all_equal(jax.jit(added)(x, residual), residual + layer(x))
    barriers = "optimization_barrier" in str(jax.make_jaxpr(added)(x, residual))
    assert barriers == (not in_product)


def _conv_case(seed, dtype):
    """A layer of 2 key / 4 value heads of 128 (the conv in the decode kernel takes heads of
    one channel a thread), its decode inputs and pools (every slot random)."""
    config = GDNConfig(hidden_size=64, num_key_heads=2, num_value_heads=4, head_k_dim=128,
                       head_v_dim=128, dtype=dtype)  # fmt: skip
    layer = GatedDeltaNet(config, rngs=nnx.Rngs(seed))
    keys = jax.random.split(jax.random.key(seed), 3)
    spec = config.state_spec()
    meta = build_metadata(ForwardMode.DECODE, ROWS, POLICY, num_slots=SLOTS)
    x = jax.random.normal(keys[0], (meta.num_tokens, config.hidden_size), dtype)
    conv = jax.random.normal(keys[1], (SLOTS, *spec.conv_shape), dtype)
    ssm = jax.random.normal(keys[2], (SLOTS, *spec.ssm_shape), jnp.float32) * 0.3
    return layer, x, conv, ssm, meta


@pytest.mark.parametrize("norm_in_kernel", [False, True], ids=["norm-after", "norm-in-kernel"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_conv_in_the_decode_kernel_gives_the_conv_launch_s_step_bit_for_bit(
    dtype, norm_in_kernel, monkeypatch
):
    """``CONV_IN_DECODE_KERNEL``: the decode kernel convolves its heads' channels itself (a
    key head's q and k for each of its two value heads, their windows written once): the
    same windows, outputs and states as the conv launch before the kernel (bit for bit where
    both take whole heads, with the norm in the kernel; else within float32 rounding), one
    launch fewer, and the pad slot and the slots no row names untouched."""
    monkeypatch.setattr(gdn_layer, "NORM_IN_DECODE_KERNEL", norm_in_kernel)
    layer, x, conv, ssm, meta = _conv_case(4, dtype)
    monkeypatch.setattr(gdn_backend, "CONV_IN_DECODE_KERNEL", False)
    step = jax.jit(functools.partial(_fused_decode, layer, impl="interpret"))
    want = step(x, conv, ssm, meta)
    monkeypatch.setattr(gdn_backend, "CONV_IN_DECODE_KERNEL", True)
    got = jax.jit(functools.partial(_fused_decode, layer, impl="interpret"))(x, conv, ssm, meta)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))  # the windows
    for a, b in ((got[0], want[0]), (got[2], want[2])):
        if norm_in_kernel:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:  # whole-head items sum in another order than the narrower column blocks
            chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-6)
    named = np.array([row.slot for row in ROWS])
    others = np.setdiff1d(np.arange(SLOTS), named)  # the pad slot 0 among them
    np.testing.assert_array_equal(np.asarray(got[1])[others], np.asarray(conv)[others])
    assert (np.asarray(got[1])[named] != np.asarray(conv)[named]).any(axis=(1, 2)).all()
    # One kernel where there were two: the conv runs inside the decode kernel.
    launches = {}
    for on in (False, True):
        monkeypatch.setattr(gdn_backend, "CONV_IN_DECODE_KERNEL", on)
        jaxpr = jax.make_jaxpr(functools.partial(_fused_decode, layer, impl="interpret"))
        launches[on] = primitives_outside_kernels(jaxpr(x, conv, ssm, meta).jaxpr)[1]
    assert launches[True] == launches[False] - 1
