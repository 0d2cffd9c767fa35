"""attention_rows: the Mosaic GPU kernel in the interpreter and the jnp reference against a
float64 oracle written row by row in numpy, on fresh random inputs (pages poisoned with NaN
wherever nothing is written, so a stray write or a lost page shows); the kernel also lowers
for the GPU at the Qwen3-Next attention shape."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention_rows import EPS, check
from _attention_rows import case as make_case

from pallas_kernels.attention import rows as ar

SHAPES = [
    # (rows, heads, kv_heads, head_dim, rotary_dim, gated, normed): Qwen3-Next's attention,
    # the same half turned (pieces of 64), a GQA ratio of 4 at head_dim 128 with half
    # turned, and Nemotron-H's plain rows.
    (4, 16, 2, 256, 64, True, True),
    (2, 16, 2, 256, 128, True, True),
    (3, 8, 2, 128, 64, False, True),
    (3, 8, 8, 128, 0, False, False),
]


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rows_match_the_float64_oracle(impl, shape):
    rows, heads, kv_heads, head_dim, rotary_dim, gated, normed = shape
    case = make_case(rows + head_dim, rows=rows, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                 gated=gated, normed=normed)  # fmt: skip
    theta = 10000.0
    got = ar.attention_rows(**case, eps=EPS, rotary_dim=rotary_dim, theta=theta, impl=impl)
    check(got, case, rotary_dim=rotary_dim, theta=theta, tol=8e-3)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_a_zero_centred_norm_s_weight_with_its_offset_matches_the_oracle(impl):
    """``scale_offset=1`` with the weights ``w`` is the call with the scales ``1 + w``."""
    case = make_case(11, rows=3, heads=16, kv_heads=2, head_dim=256)
    weights = {name: case[name] - 1.0 for name in ("q_scale", "k_scale")}
    got = ar.attention_rows(**{**case, **weights}, eps=EPS, rotary_dim=64, theta=1e4,
                            scale_offset=1.0, impl=impl)  # fmt: skip
    check(got, case, rotary_dim=64, theta=1e4, tol=8e-3)


def test_kernel_and_reference_agree_to_a_rounding_at_long_positions():
    """Positions far into a 128k context (angles of ~1e5 radians): the kernel's cos and sin
    follow the reference's float32 angles."""
    case = make_case(7, rows=2, heads=16, kv_heads=2, head_dim=256, max_pages=8192)
    case["positions"] = jnp.asarray([131000, 98765], jnp.int32)
    options = dict(eps=EPS, rotary_dim=64, theta=10_000_000.0)
    got = ar.attention_rows(**case, **options, impl="interpret")
    want = ar.attention_rows(**case, **options, impl="reference")
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=3e-2, rtol=2e-2)  # fmt: skip


def test_kernel_writes_the_pages_in_place_under_jit():
    case = make_case(3, rows=4, heads=16, kv_heads=2, head_dim=256)
    call = functools.partial(ar.attention_rows, eps=EPS, rotary_dim=64, theta=1e4, impl="interpret")
    fn = jax.jit(call, donate_argnames=("k_pages", "v_pages"))
    text = fn.lower(**case).as_text()
    assert "tf.aliasing_output" in text or "jax.buffer_donor" in text
    check(fn(**make_case(3, rows=4, heads=16, kv_heads=2, head_dim=256)), case, rotary_dim=64,
           theta=1e4, tol=8e-3)  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "scale_offset", "rotary_dim"), [(8, 0.0, 64), (64, 1.0, 64), (8, 1.0, 128)]
)
def test_kernel_lowers_for_the_gpu_at_the_qwen_shape(rows, scale_offset, rotary_dim):
    spec = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    pages = spec((10 * 650, 16, 2, 256), bf16)
    args = dict(
        q=spec((rows, 16, 512), bf16), k=spec((rows, 2, 256), bf16), v=spec((rows, 2, 256), bf16),
        k_pages=pages, v_pages=pages, page_table=spec((rows, 64), jnp.int32),
        positions=spec((rows,), jnp.int32), q_scale=spec((256,), jnp.float32),
        k_scale=spec((256,), jnp.float32),
    )  # fmt: skip
    assert ar.unsupported_reason(args["q"], args["k"], pages, rotary_dim) is None
    call = functools.partial(ar.attention_rows, eps=EPS, rotary_dim=rotary_dim, theta=1e7,
                             scale_offset=scale_offset, impl="pallas")  # fmt: skip
    with jax.default_device(jax.devices("cpu")[0]):
        text = jax.jit(call).trace(**args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# (heads, kv_heads, head_dim, rotary_dim): the models' shapes and a tensor-parallel GPU's
# share of them (1 KV head of 2 on two GPUs), with and without rotary.
LOWERING_GRID = [
    (16, 2, 256, 64), (8, 1, 256, 64), (4, 1, 256, 64), (16, 4, 256, 64), (8, 1, 128, 64),
    (16, 2, 256, 128), (8, 2, 256, 128), (2, 2, 256, 128), (16, 8, 256, 128), (1, 1, 256, 0),
    (32, 8, 128, 0), (8, 1, 64, 0),
]  # fmt: skip


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "rotary_dim"), LOWERING_GRID, ids=str)
def test_every_shape_the_kernel_takes_lowers_for_the_gpu(heads, kv_heads, head_dim, rotary_dim):
    """What ``unsupported_reason`` accepts lowers: ``auto`` on a GPU runs the kernel on it
    (a shape Mosaic GPU's layout inference cannot place fails at compile time)."""
    spec = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    pages = spec((40, 16, kv_heads, head_dim), bf16)
    kv = spec((8, kv_heads, head_dim), bf16)
    q = spec((8, heads, 2 * head_dim), bf16)
    assert ar.unsupported_reason(q, kv, pages, rotary_dim) is None
    call = functools.partial(ar.attention_rows, eps=EPS, rotary_dim=rotary_dim, theta=1e7,
                             scale_offset=1.0, impl="pallas")  # fmt: skip
    scale = spec((head_dim,), jnp.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        traced = jax.jit(call).trace(
            q, kv, kv, pages, pages, spec((8, 8), jnp.int32), spec((8,), jnp.int32),
            q_scale=scale, k_scale=scale,
        )  # fmt: skip
        assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_unsupported_calls_and_bad_arguments_say_why():
    case = make_case(1, rows=2, heads=16, kv_heads=2, head_dim=256)
    q, k, pages = case["q"], case["k"], case["k_pages"]
    assert "rotary_dim=48" in ar.unsupported_reason(q, k, pages, 48)
    # Shapes whose kernel Mosaic GPU cannot lay out: pieces of 16, and pieces of 64 over an
    # odd number of KV heads (one of two on each of two GPUs).
    assert "half (16) is under 32" in ar.unsupported_reason(q[:, :, :128], k[..., :128], pages, 32)
    one = k[:, :1]
    assert "even KVH, not 1" in ar.unsupported_reason(q[:, :8], one, pages[:, :, :1], 128)
    assert "16-bit float" in ar.unsupported_reason(q.astype(jnp.float32), k, pages, 64)
    options = dict(eps=EPS, rotary_dim=64, theta=1e4)
    with pytest.raises(NotImplementedError, match="rotary_dim=48"):
        ar.attention_rows(**case, eps=EPS, rotary_dim=48, theta=1e4, impl="pallas")
    bad = dict(case, positions=case["positions"].astype(jnp.float32))
    with pytest.raises(ValueError, match="positions must be int32"):
        ar.attention_rows(**bad, **options)
    bad = dict(case, k_scale=None)
    with pytest.raises(ValueError, match="come together"):
        ar.attention_rows(**bad, **options)
    bad = dict(case, q=case["q"][:, :15])
    with pytest.raises(ValueError, match="multiple of KVH=2"):
        ar.attention_rows(**bad, **options)
