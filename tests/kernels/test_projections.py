"""projections: the Mosaic GPU kernels (every weight of an input in one launch; one weight's
partial products over parts of K) in the interpreter and the XLA references against a float64
oracle, the ``cuda`` lowering, the errors, and ``layers.linear``'s choice of path."""

from __future__ import annotations

import importlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import rel
from flax import nnx

from hybrid_jax.layers import linear
from hybrid_jax.layers.gdn import GatedDeltaNet, GDNConfig
from hybrid_jax.layers.linear import FEW_ROWS, project, project_output
from hybrid_jax.layers.moe import MLP
from hybrid_jax.layers.norm import SummedRows
from pallas_kernels import moe, projections
from pallas_kernels._skinny import ProductVariant, current_variant, programs_per_sm, scratch

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


@pytest.mark.parametrize(("rows", "k", "widths"), [(5, 256, (128, 64)), (16, 384, (192,))])
@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("rms_eps", [None, 0.25])
def test_row_scaled_products_match_the_float64_oracle(
    rows, k, widths, impl, rms_eps, product_variant
):
    x, ws = _case(rows * k, rows, k, widths)
    scale = jnp.asarray(np.random.default_rng(rows).uniform(0.1, 3.0, rows), jnp.float32)
    got = projections.projections(x, ws, row_scale=scale, rms_eps=rms_eps, impl=impl)
    scale64 = np.asarray(scale, np.float64)
    if rms_eps is not None:  # scale holds sums of squares over K
        scale64 = 1 / np.sqrt(scale64 / k + rms_eps)
    for out, w in zip(got, ws, strict=True):
        chex.assert_shape(out, (rows, w.shape[1]))
        want = (np.asarray(x, np.float64) @ np.asarray(w, np.float64)) * scale64[:, None]
        err = np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
        assert err < 1e-2


def _swiglu64(x, w_paired, scale64=None):
    """The float64 SwiGLU of a weight laid out by ``pair_halves``: silu(x @ gate) * (x @ up)."""
    gate, up = np.split(np.asarray(moe.unpair_halves(w_paired), np.float64), 2, axis=-1)
    x64 = np.asarray(x, np.float64)
    g, u = x64 @ gate, x64 @ up
    if scale64 is not None:
        g, u = g * scale64[:, None], u * scale64[:, None]
    return g / (1 + np.exp(-g)) * u


@pytest.mark.parametrize(("rows", "k"), [(5, 256), (8, 128), (13, 384)])
@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("rms_eps", [None, 0.25], ids=["plain", "normed"])
def test_a_paired_weight_gives_its_swiglu_beside_the_other_products(rows, k, impl, rms_eps):
    """``paired``: a weight laid out by ``pair_halves`` gives ``silu(gate) * up`` (formed in
    the launch's epilogue), the others their products, in one call; with ``rms_eps`` each
    row's inverse RMS scales both halves first."""
    x, (router, gate_up, gate) = _case(rows * 7 + k, rows, k, (128, 256, 64))
    paired_w = moe.pair_halves(gate_up)
    rng = np.random.default_rng(rows)
    scale = None if rms_eps is None else jnp.asarray(rng.uniform(1, 30, rows), jnp.float32)
    got = projections.projections(
        x, [router, paired_w, gate], row_scale=scale, rms_eps=rms_eps,
        paired=(False, True, False), impl=impl,
    )  # fmt: skip
    scale64 = None if scale is None else 1 / np.sqrt(np.asarray(scale, np.float64) / k + rms_eps)
    chex.assert_shape(got, ((rows, 128), (rows, 128), (rows, 64)))
    x64 = np.asarray(x, np.float64)
    wants = [x64 @ np.asarray(w, np.float64) for w in (router, gate)]
    if scale64 is not None:
        wants = [want * scale64[:, None] for want in wants]
    wants.insert(1, _swiglu64(x, paired_w, scale64))
    for out, want in zip(got, wants, strict=True):
        err = np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
        assert err < 1e-2


def test_a_paired_weight_needs_swapped_products_and_whole_tiles(monkeypatch):
    from pallas_kernels import _skinny

    x, (w,) = _case(1, 8, 128, (192,))
    with pytest.raises(
        ValueError, match=r"paired weight's N must be whole tiles of 64; got \[96\]"
    ):
        projections.projections(x, [w[:, :96]], paired=(True,))
    with pytest.raises(ValueError, match="paired has 2 flags for 1 weights"):
        projections.projections(x, [w], paired=(True, False))
    monkeypatch.setattr(_skinny, "SWAP_OPERANDS", False)
    reason = projections.unsupported_reason(x, [w], paired=(True,))
    assert "swapped products" in reason
    assert projections.unsupported_reason(x, [w]) is None


def test_a_row_scale_of_another_length_is_refused():
    x, ws = _case(0, 8, 128, (64,))
    with pytest.raises(ValueError, match=r"row_scale \(5,\) must be \[R\] = \[8\]"):
        projections.projections(x, ws, row_scale=jnp.ones((5,), jnp.float32))
    with pytest.raises(ValueError, match="rms_eps=0.1 scales rows by their row_scale; none"):
        projections.projections(x, ws, rms_eps=0.1)


@pytest.mark.parametrize(
    ("widths", "splits", "partial", "scaled"),
    [((8192, 4096, 64), 1, False, None), ((256, 512, 512), 4, True, None),
     ((8192, 4096, 64), 1, False, "scale"), ((8192, 4096, 64), 1, False, "rms"),
     ((256, 1024, 64), 1, False, "rms-paired")],
)  # fmt: skip
def test_the_kernel_lowers_for_cuda(widths, splits, partial, scaled, product_variant):
    """The last case: the 35B-like router, its shared expert paired and the shared gate."""
    x = jnp.zeros((8, 2048), jnp.bfloat16)
    ws = tuple(jnp.zeros((2048, n), jnp.bfloat16) for n in widths)
    scale = jnp.ones((8,), jnp.float32) if scaled else None
    paired = (False, True, False) if scaled == "rms-paired" else ()
    if paired and not current_variant().swap:
        pytest.skip("a SwiGLU over a tile's halves takes swapped products")

    def call(x, ws, scale):
        return proj_module._kernel(
            x, ws, scale, splits=splits, partial=partial, variant=current_variant(),
            interpret=False, rms_eps=1e-6 if scaled and "rms" in scaled else None, paired=paired,
        )  # fmt: skip

    text = jax.jit(call).trace(x, ws, scale).lower(lowering_platforms=("cuda",)).as_text()
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
    assert not runs_kernel(3, _linears(128, (64, 1)), "interpret")  # one weight: cuBLAS's
    # Weights the kernel takes share the launch; a width it does not take runs as its layer.
    mixed = _linears(128, (64, 96, 128))
    assert runs_kernel(3, mixed, "interpret")
    for out, layer in zip(project(x, mixed, impl="interpret"), mixed, strict=True):
        chex.assert_trees_all_close(out, layer(x), rtol=2e-2, atol=2e-2)


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


@pytest.mark.parametrize(
    ("rows", "k", "widths", "splits"),
    [(5, 768, (128,), 3), (8, 512, (64,), 4), (16, 512, (64, 128), 2), (3, 256, (64,), 1)],
)
@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_partial_products_sum_to_the_float64_oracle(rows, k, widths, splits, impl, product_variant):
    x, ws = _case(rows * sum(widths) + splits, rows, k, widths)
    got = projections.projection_partials(x, ws, splits=splits, impl=impl)
    assert len(got) == len(ws)
    x64 = np.asarray(x, np.float64)
    part = k // splits
    for out, w in zip(got, ws, strict=True):
        chex.assert_shape(out, (splits, rows, w.shape[1]))
        assert out.dtype == jnp.float32
        w64 = np.asarray(w, np.float64)
        for s in range(splits):  # each part is its own slice of K
            want = x64[:, s * part : (s + 1) * part] @ w64[s * part : (s + 1) * part]
            np.testing.assert_allclose(np.asarray(out[s], np.float64), want, rtol=1e-5, atol=1e-5)


def test_splits_fill_the_sms_with_whole_blocks_of_k():
    assert projections.partial_splits(4096, (2048,)) == 4  # 35B-like out_proj: 32 tiles -> 128
    assert projections.partial_splits(512, (2048,)) == 4  # shared expert's down: 1 block each
    assert projections.partial_splits(2048, (256, 512, 512)) == 4  # router, shared gate, up
    assert projections.partial_splits(4096, (4096,)) == 2  # 64 tiles -> 128
    assert projections.partial_splits(2048, (8192,)) == 1  # 128 tiles fill the SMs already
    assert projections.partial_splits(384, (2048,)) == 1  # 3 blocks of K: no even split
    with pytest.raises(ValueError, match="splits=3 must be >= 1 and divide K=256"):
        projections.projection_partials(jnp.zeros((8, 256)), [jnp.zeros((256, 64))], splits=3)


def test_project_output_sums_split_partials_when_switched_on(monkeypatch):
    (layer,) = _linears(512, (128,))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 512)), jnp.bfloat16)
    calls = _count_partials(monkeypatch)
    want = layer(x)
    monkeypatch.setattr(linear, "SPLIT_OUTPUT_PROJECTIONS", False)
    chex.assert_trees_all_equal(project_output(x, layer, impl="interpret"), want)
    assert calls == []  # switched off: the layer's own product
    monkeypatch.setattr(linear, "SPLIT_OUTPUT_PROJECTIONS", True)
    got = project_output(x, layer, impl="interpret")
    assert calls == [[(512, 128)]]
    assert got.dtype == want.dtype
    chex.assert_trees_all_close(got, want, rtol=2e-2, atol=2e-2)
    for rows, impl in ((FEW_ROWS + 1, "interpret"), (3, "reference")):
        rows_x = jnp.ones((rows, 512), jnp.bfloat16)
        chex.assert_trees_all_equal(project_output(rows_x, layer, impl=impl), layer(rows_x))
    assert calls == [[(512, 128)]]


def test_an_mlp_s_down_projection_splits_when_switched_on(monkeypatch):
    mlp = MLP(128, 512, dtype="bfloat16", rngs=nnx.Rngs(3))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((6, 128)), jnp.bfloat16)
    want = mlp(x, impl="reference")
    monkeypatch.setattr(linear, "SPLIT_OUTPUT_PROJECTIONS", True)
    calls = _count_partials(monkeypatch)
    chex.assert_trees_all_close(mlp(x, impl="interpret"), want, rtol=3e-2, atol=3e-2)
    assert calls == [[(512, 128)]]  # down: 2 column tiles x 4 parts of K
    # Fewer parts than linear.MIN_SPLITS: the layer's own product.
    narrow = MLP(128, 256, dtype="bfloat16", rngs=nnx.Rngs(3))  # down: 2 parts of K
    hidden = jnp.ones((6, 256), jnp.bfloat16)
    chex.assert_trees_all_equal(narrow.down(hidden, impl="interpret"), narrow.down_proj(hidden))
    assert len(calls) == 1


def _count_partials(monkeypatch) -> list:
    """The weights' shapes of each ``projection_partials`` call from now on."""
    calls, partials = [], projections.projection_partials

    def counted(x, weights, **kwargs):
        calls.append([w.shape for w in weights])
        return partials(x, weights, **kwargs)

    monkeypatch.setattr(projections, "projection_partials", counted)
    return calls


def test_swapped_operands_fit_three_programs_on_an_sm_at_eight_rows():
    plain, swapped = ProductVariant(), ProductVariant(swap=True)
    assert programs_per_sm(scratch(16, jnp.bfloat16, plain, 8)) == 1
    assert programs_per_sm(scratch(16, jnp.bfloat16, swapped, 8)) == 3
    assert programs_per_sm(scratch(16, jnp.bfloat16, swapped, 64)) == 1
    # A float32 output tile keeps the plain product and its 64-row buffers.
    assert programs_per_sm(scratch(16, jnp.bfloat16, swapped, 8, jnp.float32)) == 1


def test_a_switch_changed_between_calls_reaches_the_next_trace(monkeypatch):
    from pallas_kernels import _skinny

    x = jax.ShapeDtypeStruct((8, 256), jnp.bfloat16)
    ws = (jax.ShapeDtypeStruct((256, 64), jnp.bfloat16),)

    def lowered():
        call = jax.jit(lambda x, ws: projections.projections(x, ws, impl="interpret"))
        return call.lower(x, ws).as_text()

    monkeypatch.setattr(_skinny, "SWAP_OPERANDS", False)
    plain = lowered()
    monkeypatch.setattr(_skinny, "SWAP_OPERANDS", True)
    assert lowered() != plain  # no trace of the plain launch is reused
    monkeypatch.setattr(_skinny, "SWAP_OPERANDS", False)
    assert lowered() == plain


def test_a_launch_of_one_program_an_sm_fills_its_shared_memory_with_the_ring():
    from pallas_kernels._common import NUM_SMS, SMEM_BYTES
    from pallas_kernels._mgpu_chunks import scratch_smem_bytes
    from pallas_kernels._skinny import filling_ring

    filled = ProductVariant(swap=True, fill_sm=True)
    # The 35B-like router and shared gate/up: 20 column tiles, K = 2048 (16 blocks), 8 rows.
    ring = filling_ring(filled, 20, 16, jnp.bfloat16, 8, row_scale=True)
    assert ring._replace(stages=filled.stages) == filled
    deeper = ring._replace(stages=ring.stages + 1)
    assert scratch_smem_bytes(scratch(16, jnp.bfloat16, ring, 8, row_scale=True)) <= SMEM_BYTES
    assert scratch_smem_bytes(scratch(16, jnp.bfloat16, deeper, 8, row_scale=True)) > SMEM_BYTES
    assert ring.stages == 12
    # Float32 partials keep 64-row buffers: fewer stages fit.
    assert filling_ring(filled, 128, 8, jnp.bfloat16, 8, jnp.float32).stages == 6
    assert filling_ring(filled, 20, 6, jnp.bfloat16, 8).stages == 6  # no more than the blocks
    assert filling_ring(filled, 20, 2, jnp.bfloat16, 8) == filled  # never fewer than asked
    assert filling_ring(filled, NUM_SMS + 1, 16, jnp.bfloat16, 8) == filled
    unfilled = ProductVariant(swap=True)
    assert filling_ring(unfilled, 20, 16, jnp.bfloat16, 8) == unfilled


@pytest.mark.parametrize("partial", [False, True], ids=["products", "partials"])
def test_filled_rings_that_wrap_match_the_float64_oracle(partial, monkeypatch):
    """``RING_FILLS_SM``: 20 blocks of K through a 12-stage ring (6 for float32 partials),
    every stage refilled at least once."""
    from pallas_kernels import _skinny

    monkeypatch.setattr(_skinny, "RING_FILLS_SM", True)
    x, ws = _case(7, 8, 20 * 128, (64, 128))
    x64, ws64 = np.asarray(x, np.float64), [np.asarray(w, np.float64) for w in ws]
    if partial:
        got = [p.sum(0) for p in projections.projection_partials(x, ws, splits=1, impl="interpret")]
    else:
        scale = jnp.asarray(
            np.random.default_rng(3).uniform(1.0, 400.0, 8) * x.shape[1], jnp.float32
        )
        got = projections.projections(x, ws, row_scale=scale, rms_eps=1e-6, impl="interpret")
        x64 = x64 / np.sqrt(np.asarray(scale, np.float64) / x.shape[1] + 1e-6)[:, None]
    for out, w in zip(got, ws64, strict=True):
        want = x64 @ w
        err = np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
        assert err < 1e-2
    # The ring's depth changes when blocks arrive, not the order they are summed in.
    monkeypatch.setattr(_skinny, "RING_FILLS_SM", False)
    if partial:
        unfilled = [
            p.sum(0) for p in projections.projection_partials(x, ws, splits=1, impl="interpret")
        ]
    else:
        unfilled = projections.projections(x, ws, row_scale=scale, rms_eps=1e-6, impl="interpret")
    chex.assert_trees_all_equal(tuple(got), tuple(unfilled))


def test_filled_rings_lower_for_cuda_at_the_35b_router_shapes(monkeypatch):
    from pallas_kernels import _skinny

    x = jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16)
    ws = tuple(jax.ShapeDtypeStruct((2048, n), jnp.bfloat16) for n in (256, 512, 512))
    scale = jax.ShapeDtypeStruct((8,), jnp.float32)

    def lowered():
        call = jax.jit(
            lambda x, ws, s: projections.projections(
                x, ws, row_scale=s, rms_eps=1e-6, impl="pallas"
            )
        )
        return call.trace(x, ws, scale).lower(lowering_platforms=("cuda",)).as_text()

    monkeypatch.setattr(_skinny, "RING_FILLS_SM", True)
    filled = lowered()
    assert "mosaic_gpu" in filled
    monkeypatch.setattr(_skinny, "RING_FILLS_SM", False)
    assert lowered() != filled


@pytest.mark.parametrize(("rows", "k", "n", "splits"), [(5, 1024, 512, 4), (8, 512, 256, 2)])
@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_the_residual_plus_the_split_product_matches_the_float64_oracle(rows, k, n, splits, impl):
    """``projection_add``: the residual plus the product, and the new rows' square sums."""
    (x, (w,)), rng = _case(20 + rows, rows, k, (n,)), np.random.default_rng(rows)
    residual = jnp.asarray(rng.standard_normal((rows, n)), jnp.bfloat16)
    out, sums = projections.projection_add(x, w, residual, splits=splits, impl=impl)
    chex.assert_shape((out, sums), ((rows, n), (rows,)))
    assert out.dtype == jnp.bfloat16 and sums.dtype == jnp.float32
    want = np.asarray(residual, np.float64) + np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    got = np.asarray(out, np.float64)
    np.testing.assert_allclose(got, want, atol=3e-2)
    # The interpreter may keep the bf16 sum's excess precision (XLA on the CPU does).
    np.testing.assert_allclose(np.asarray(sums), (got * got).sum(1), rtol=2e-3)


def test_the_add_launch_sums_the_partials_as_the_reference_does():
    """The interpreter's rows equal the XLA reference's bit for bit: the partials summed in
    split order, then added to the residual in the rows' dtype."""
    (x, (w,)), rng = _case(30, 6, 1024, (256,)), np.random.default_rng(31)
    residual = jnp.asarray(rng.standard_normal((6, 256)), jnp.bfloat16)
    got, _ = projections.projection_add(x, w, residual, splits=4, impl="interpret")
    want, _ = projections.projection_add(x, w, residual, splits=4, impl="reference")
    chex.assert_trees_all_equal(got, want)


def test_the_add_launch_lowers_for_cuda_at_the_35b_output_shapes_counting_in_place():
    """One Mosaic GPU launch, its counter a ``Ref`` updated in place: a scan's repeats count
    in the one buffer it carries."""
    s = jax.ShapeDtypeStruct

    def call(xs, w, residual):
        counters = jax.new_ref(jnp.zeros((8,), jnp.int32))

        def body(r, x):
            out, sums = projections.projection_add(x, w, r, counters=counters, impl="pallas")
            return out, sums

        return jax.lax.scan(body, residual, xs)

    args = (s((3, 8, 4096), jnp.bfloat16), s((4096, 2048), jnp.bfloat16),
            s((8, 2048), jnp.bfloat16))  # fmt: skip
    text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    (loop,) = [line for line in text.splitlines() if "stablehlo.while" in line]
    assert "tensor<8xi32>" in loop
    assert "output_operand_aliases" in text


def test_add_calls_refuse_what_they_cannot_take():
    x, (w,) = _case(32, 4, 512, (256,))
    with pytest.raises(ValueError, match=r"the residual must be \[R, N\] = \(4, 256\)"):
        projections.projection_add(x, w, jnp.zeros((4, 128), jnp.bfloat16))
    with pytest.raises(TypeError, match="counters must be a jax.Ref"):
        projections.projection_add(x, w, x[:, :256], counters=jnp.zeros(1, jnp.int32))
    assert "residual's dtype float32" in projections.add_unsupported_reason(
        x, w, jnp.zeros((4, 256), jnp.float32)
    )
    assert "multiple of 256" in projections.add_unsupported_reason(x, w[:, :128], x[:, :128])


def test_project_output_adds_in_its_launch_when_switched_on(monkeypatch):
    """With a residual and ``ADD_IN_OUTPUT_LAUNCH``, ``project_output`` gives ``SummedRows``
    from the add launch; switched off, the residual plus the split product."""
    (layer,) = _linears(1024, (256,))
    rng = np.random.default_rng(33)
    x = jnp.asarray(rng.standard_normal((3, 1024)), jnp.bfloat16)
    residual = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    want = residual + layer(x)
    monkeypatch.setattr(linear, "SPLIT_OUTPUT_PROJECTIONS", True)
    monkeypatch.setattr(linear, "ADD_IN_OUTPUT_LAUNCH", False)
    apart = project_output(x, layer, impl="interpret", residual=residual)
    assert isinstance(apart, jax.Array)
    monkeypatch.setattr(linear, "ADD_IN_OUTPUT_LAUNCH", True)
    got = project_output(x, layer, impl="interpret", residual=residual)
    assert isinstance(got, SummedRows)
    chex.assert_trees_all_equal(got.x, apart)
    chex.assert_trees_all_close(got.x, want, rtol=3e-2, atol=3e-2)
    got32 = np.asarray(got.x, np.float32)
    np.testing.assert_allclose(np.asarray(got.square_sums), (got32 * got32).sum(1), rtol=2e-3)
    # Where the product is the layer's own, so is the sum.
    chex.assert_trees_all_equal(project_output(x, layer, impl="reference", residual=residual), want)


def _ranking64(logits, top_k, valid):
    """The float64 oracle of a ranking: each row's ``top_k`` entries of largest logit, equal
    logits by the lower index (a stable sort), their ``exp(logit - max)``; index N in rows
    that ``valid`` marks False."""
    logits = np.asarray(logits, np.float64)
    order = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    picked = np.take_along_axis(logits, order, axis=1)
    exps = np.exp(picked - logits.max(axis=1, keepdims=True))
    return exps, np.where(np.asarray(valid)[:, None], order, logits.shape[1])


@pytest.mark.parametrize(
    ("rows", "widths", "top_k", "normed"),
    [(8, (256, 256, 64), 8, True), (3, (128,), 10, False), (5, (64, 128), 64, False)],
    ids=["router-paired-gate", "one-weight", "every-entry"],
)
@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_the_ranked_launch_ranks_the_router_logits_it_stores(rows, widths, top_k, normed, impl):
    """``ranked_projections``: the products as ``projections`` gives them (the first case's
    second weight paired, rows scaled by their inverse RMS), and each row of the first
    ranked as the float64 oracle ranks the stored logits, a third of whose columns repeat
    others (equal logits tie, the lower index first) and some of which are zero; the last
    row is padding, with no expert."""
    k = 128
    x, ws = _case(rows * 31 + top_k, rows, k, widths)
    router = np.asarray(ws[0], np.float32)
    router[:, 2::3] = router[:, 1::3][:, : router[:, 2::3].shape[1]]
    router[:, 5::16] = 0
    ws[0] = jnp.asarray(router, jnp.bfloat16)
    paired = (False, True, False) if normed else ()
    if normed:
        ws[1] = moe.pair_halves(ws[1])
    rng = np.random.default_rng(rows)
    scale = jnp.asarray(rng.uniform(1, 30, rows), jnp.float32) if normed else None
    valid = jnp.arange(rows) < rows - 1
    kw = dict(row_scale=scale, rms_eps=0.25 if normed else None, paired=paired)
    products, exps, ids = projections.ranked_projections(
        x, ws, top_k=top_k, valid=valid, impl=impl, **kw
    )
    chex.assert_trees_all_equal(products, projections.projections(x, ws, impl=impl, **kw))
    chex.assert_shape((exps, ids), (rows, top_k))
    assert exps.dtype == jnp.float32 and ids.dtype == jnp.int32
    want_exps, want_ids = _ranking64(products[0], top_k, valid)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(exps), want_exps, rtol=1e-6)
    logits = np.asarray(products[0], np.float32)
    assert any(len(set(row)) < len(row) for row in logits[:, :top_k])  # ties were ranked


def test_the_ranked_launch_reads_int32_validity_flags_as_their_bools():
    """``valid`` as int32 flags (``LayerStates.real_flags``: 0 at padding) ranks as the
    same bools do: padding rows get no expert, the others theirs."""
    x, ws = _case(5, 8, 128, (256, 128))
    flags = jnp.asarray([1, 1, 0, 1, 0, 1, 1, 0], jnp.int32)
    got = projections.ranked_projections(x, ws, top_k=8, valid=flags, impl="interpret")
    want = projections.ranked_projections(x, ws, top_k=8, valid=flags != 0, impl="interpret")
    chex.assert_trees_all_equal(got, want)
    ids = np.asarray(got[2])
    assert (ids[np.asarray(flags) == 0] == 256).all() and (ids[np.asarray(flags) != 0] < 256).all()


@pytest.mark.parametrize(
    ("rows", "experts", "top_k"), [(8, 256, 8), (1, 256, 8), (8, 512, 10), (8, 64, 8)]
)
def test_the_ranked_launch_lowers_for_cuda_at_the_routers_shapes(rows, experts, top_k):
    """The 35B-like router (256 experts top 8) with its paired shared gate/up and widened
    gate, Qwen3-Next's (512 top 10) and a test model's (64 top 8), rows normed in launch and
    counting in a shared buffer."""
    spec = jax.ShapeDtypeStruct
    x = spec((rows, 2048), jnp.bfloat16)
    ws = tuple(spec((2048, n), jnp.bfloat16) for n in (experts, 1024, 64))

    def call(x, ws, scale, valid):
        counters = jax.new_ref(jnp.zeros((4,), jnp.int32))
        return projections.ranked_projections(
            x, ws, top_k=top_k, valid=valid, row_scale=scale, rms_eps=1e-6,
            paired=(False, True, False), counters=counters, impl="pallas",
        )  # fmt: skip

    traced = jax.jit(call).trace(x, ws, spec((rows,), jnp.float32), spec((rows,), bool))
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "projections_ranked" in text


def test_ranked_calls_refuse_what_the_ranking_cannot_take():
    x = jnp.zeros((8, 128), jnp.bfloat16)
    router, other = jnp.zeros((128, 256), jnp.bfloat16), jnp.zeros((128, 128), jnp.bfloat16)
    reason = projections.ranked_unsupported_reason
    assert reason(x, [router, other], 8) is None
    assert "multiple of 64" in reason(x, [jnp.zeros((128, 192 + 32), jnp.bfloat16)], 8)
    assert "k=65 must be in 1..64" in reason(x, [router], 65)
    assert "cannot be paired" in reason(x, [router, other], 8, (True, False))
    assert "16-bit float" in reason(x.astype(jnp.float32), [router.astype(jnp.float32)], 8)
    with pytest.raises(ValueError, match=r"valid bool\[7\] must be bool or int32 \[R\] = \[8\]"):
        projections.ranked_projections(x, [router], top_k=8, valid=jnp.ones(7, bool))
    with pytest.raises(ValueError, match=r"valid float32\[8\] must be bool or int32"):
        projections.ranked_projections(x, [router], top_k=8, valid=jnp.ones(8, jnp.float32))
    with pytest.raises(ValueError, match=r"top_k=257 must be in 1..256"):
        projections.ranked_projections(x, [router], top_k=257)
    with pytest.raises(ValueError, match="counters must be int32"):
        projections.ranked_projections(
            x, [router], top_k=8, counters=jax.new_ref(jnp.zeros((2,), jnp.float32))
        )


@pytest.mark.parametrize(
    ("rows", "splits", "widths", "paired", "top_k"),
    [
        (8, 4, (256, 1024, 128), (False, True, False), 8),  # the 35B-like router's launch
        (3, 2, (128, 256), (), None),  # no flags: none paired
        (1, 4, (512,), (False,), 10),
    ],
    ids=["router-paired-ranked", "two-weights", "one-row-ranked"],
)
@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_a_launch_over_parts_of_k_combines_them_by_row(rows, splits, widths, paired, top_k,
                                                       impl):  # fmt: skip
    """``projections(splits=)``: each product is ``combined_reference``'s bit for bit (the
    partials summed in split order, then the rows' inverse RMS; a paired weight's SwiGLU
    within float32 rounding) and within the float64 oracle's bf16 rounding; with ``top_k``
    the rows are ranked as the oracle ranks the stored logits (one of them padding)."""
    k = 512
    x, ws = _case(rows * 7 + splits, rows, k, widths)
    flags = paired or (False,) * len(ws)
    ws = [moe.pair_halves(w) if p else w for w, p in zip(ws, flags, strict=True)]
    rng = np.random.default_rng(rows)
    scale = jnp.asarray(rng.uniform(1, 30, rows), jnp.float32)
    kw = dict(row_scale=scale, rms_eps=0.25, paired=paired, splits=splits, impl=impl)
    if top_k is None:
        got = projections.projections(x, ws, **kw)
    else:
        valid = jnp.arange(rows) < max(1, rows - 1)
        got, exps, ids = projections.ranked_projections(x, ws, top_k=top_k, valid=valid, **kw)
        want_exps, want_ids = _ranking64(got[0], top_k, valid)
        np.testing.assert_array_equal(np.asarray(ids), want_ids)
        np.testing.assert_allclose(np.asarray(exps), want_exps, rtol=1e-6)
    want = projections.combined_reference(x, ws, splits, scale, 0.25, paired)
    for out, expected, p in zip(got, want, flags, strict=True):
        if p:  # the SwiGLU's exponential: its own formula, within float32 rounding
            chex.assert_trees_all_close(out, expected, rtol=1e-2, atol=1e-5)
        else:
            chex.assert_trees_all_equal(out, expected)
    inverse_rms = 1 / np.sqrt(np.asarray(scale, np.float64) / k + 0.25)
    for out, w, p in zip(got, ws, flags, strict=True):
        y = (np.asarray(x, np.float64) @ np.asarray(w, np.float64)) * inverse_rms[:, None]
        if p:
            gate, up = np.split(np.asarray(moe.unpair_halves(jnp.asarray(y)), np.float64), 2, -1)
            y = gate / (1 + np.exp(-gate)) * up
        assert rel(out, y) < 1e-2


def test_a_launch_over_parts_of_k_refuses_what_its_rows_cannot_take():
    x = jnp.zeros((8, 512), jnp.bfloat16)
    router, gate = jnp.zeros((512, 256), jnp.bfloat16), jnp.zeros((512, 64), jnp.bfloat16)
    reason = projections.combined_unsupported_reason
    assert reason(x, [router], 4) is None
    assert "width 64 must be a multiple of 128" in reason(x, [router, gate], 4)
    assert reason(x, [jnp.zeros((512, 256), jnp.bfloat16)], 4, (True,)) is None
    assert "hidden width 64" in reason(x, [jnp.zeros((512, 128), jnp.bfloat16)], 4, (True,))
    assert "splits x 128" in reason(x, [router], 8)
    with pytest.raises(NotImplementedError, match="width 64 must be a multiple of 128"):
        projections.projections(x, [router, gate], splits=4, impl="pallas")
    with pytest.raises(ValueError, match=r"splits=3 must be >= 1 and divide K=512"):
        projections.projections(x, [router], splits=3)
