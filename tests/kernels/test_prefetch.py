"""Weights prefetched into L2 by a decode kernel's spare programs (``pallas_kernels._prefetch``).

The boxes must cover every element of an array; a kernel given arrays to prefetch must give
the same bits as without them (the interpreter runs the prefetches as no-ops, so what is
checked there is that the spare programs touch no output and no pool), lower for ``cuda``
with the prefetch instructions in it, and refuse arrays TMA cannot box.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import bits, packed_decode_specs

from pallas_kernels import _prefetch, conv1d, gdn, projections
from pallas_kernels.attention import paged_decode as pd

PREFETCH_OP = "cp.async.bulk.prefetch"  # the PTX a prefetch lowers to


@pytest.fixture
def few_sms(monkeypatch):
    """9 SMs and at least 2 prefetching programs: a launch adds a few programs, each issuing
    several boxes, so the interpreter stays quick and every box's turn is exercised."""
    monkeypatch.setattr(_prefetch, "NUM_SMS", 9)
    monkeypatch.setattr(_prefetch, "MIN_PROGRAMS", 2)


def _weights(seed):
    """Two arrays of 6 and 1 boxes: ragged rows and columns, and one smaller than a box."""
    rng = np.random.default_rng(seed)
    return (
        jnp.asarray(rng.standard_normal((300, 520)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((64, 48)), jnp.float32),
    )


@pytest.mark.parametrize("shape", [(4096, 2048), (300, 520), (64, 48), (256, 8), (1, 1000)])
def test_the_boxes_cover_every_element(shape):
    covered = np.zeros(shape, bool)
    rows, cols = min(shape[0], _prefetch.BOX), min(shape[1], _prefetch.BOX)
    for index in range(_prefetch.boxes(shape)):
        r, c = (int(v) for v in _prefetch.box_origin(index, shape))
        assert 0 <= r <= shape[0] - rows and 0 <= c <= shape[1] - cols, (index, r, c)
        covered[r : r + rows, c : c + cols] = True
    assert covered.all()
    assert _prefetch.boxes(shape) == -(-shape[0] // rows) * -(-shape[1] // cols)


def test_a_launch_adds_the_sms_it_leaves_free_and_no_more_programs_than_boxes():
    weight = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)  # 16 x 8 boxes
    assert _prefetch.prefetch_programs((), 4) == 0
    assert _prefetch.prefetch_programs((weight,), 32) == _prefetch.NUM_SMS - 32
    assert _prefetch.prefetch_programs((weight,), 264) == _prefetch.MIN_PROGRAMS
    small = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    assert _prefetch.prefetch_programs((small,), 1) == 1
    # A 2-D grid appends whole rows: 100 programs in rows of 32 are 4 rows.
    assert _prefetch.spare_rows((weight,), 32, 32) == 4
    assert _prefetch.spare_rows((weight,), 32) == _prefetch.NUM_SMS - 32
    assert _prefetch.spare_rows((), 32, 32) == 0


@pytest.mark.parametrize(
    "shape, dtype",
    [((4096,), jnp.bfloat16), ((2, 64, 64), jnp.bfloat16), ((64, 4), jnp.bfloat16),
     ((0, 64), jnp.float32)],
    ids=["1-d", "3-d", "8-byte-rows", "empty"],
)  # fmt: skip
def test_an_array_tma_cannot_box_is_refused_by_name(shape, dtype):
    array = jax.ShapeDtypeStruct(shape, dtype)
    message = f"op: prefetch[1] {jnp.dtype(dtype)}{list(shape)} must be a non-empty [R, C]"
    with pytest.raises(ValueError, match=re.escape(message)):
        _prefetch.check_prefetch("op", [jax.ShapeDtypeStruct((64, 64), jnp.bfloat16), array])


# ------------------------------------------------------------------------ GDN decode kernel

SLOTS, HV, KD = 7, 2, 64


def _gdn_case(seed):
    """The packed decode op's inputs: 3 rows (the second padded) at random slots of a pool
    whose other slots hold NaN; and a random output norm."""
    rng = np.random.default_rng(seed)
    n = 3
    idx = np.array([4, 0, 2], np.int32)
    pool = rng.standard_normal((SLOTS, HV, KD, KD)).astype(np.float32) * 0.3
    pool[[0, 1, 3, 5, 6]] = np.nan
    args = dict(
        qkv=jnp.asarray(rng.standard_normal((n, 1, 2 * KD + HV * KD)), jnp.bfloat16),
        ba=jnp.asarray(rng.standard_normal((n, 1, 2 * HV)) * 2, jnp.bfloat16),
        gate_params=gdn.stack_gate_params(
            jnp.asarray(rng.standard_normal(HV), jnp.float32),
            jnp.asarray(rng.standard_normal(HV), jnp.float32),
        ),
        ssm_pool=jnp.asarray(pool),
        state_indices=jnp.asarray(idx),
    )
    z = jnp.asarray(rng.standard_normal((n, 1, HV * KD)), jnp.bfloat16)
    norm = gdn.OutputNorm(z, jnp.asarray(rng.uniform(0.5, 1.5, KD), jnp.float32), 1e-3)
    return args, norm


@pytest.mark.parametrize("normed", [False, True], ids=["plain", "output-norm"])
def test_gdn_decode_with_prefetch_gives_the_bits_it_gives_without(few_sms, normed):
    args, norm = _gdn_case(1)
    norm = norm if normed else None
    op = jax.jit(functools.partial(gdn.packed_gating_recurrent_gated_delta_rule, impl="interpret"))
    want = op(**args, output_norm=norm)
    got = op(**args, output_norm=norm, prefetch=_weights(2))
    assert np.isfinite(np.asarray(got[0], np.float32)).all()
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(bits(g), bits(w))


def test_gdn_decode_refuses_prefetch_outside_the_pipelined_grid():
    args, _ = _gdn_case(3)
    with pytest.raises(ValueError, match=r"prefetch runs in the pipelined grid"):
        gdn.decode_mgpu.packed_gating_recurrent_gated_delta_rule(
            **args, prefetch=_weights(4), variant="cols", interpret=True
        )


def test_gdn_decode_names_an_array_it_cannot_prefetch_on_every_impl():
    args, _ = _gdn_case(5)
    bad = (jnp.zeros((8, 4), jnp.bfloat16),)
    for impl in ("reference", "interpret"):
        with pytest.raises(ValueError, match=re.escape("prefetch[0] bfloat16[8, 4]")):
            gdn.packed_gating_recurrent_gated_delta_rule(**args, prefetch=bad, impl=impl)


def test_gdn_decode_with_prefetch_lowers_for_cuda_at_the_35b_shapes():
    """Qwen3.5-35B's GDN heads at a bucket of 8 rows, the output norm in the kernel, the
    output projection's ``[4096, 2048]`` weight prefetched."""
    args, norm = packed_decode_specs(8)
    spec = jax.ShapeDtypeStruct
    fn = functools.partial(gdn.packed_gating_recurrent_gated_delta_rule, impl="pallas")

    def lowered(*prefetch):
        traced = jax.jit(fn).trace(**args, output_norm=norm, prefetch=prefetch)
        return traced.lower(lowering_platforms=("cuda",)).as_text()

    assert PREFETCH_OP in lowered(spec((4096, 2048), jnp.bfloat16))
    assert PREFETCH_OP not in lowered()


# --------------------------------------------------------------------- paged decode kernel


def _attention_case(seed):
    """3 rows of 37, 0 and 150 positions over 16-position pages (every other entry NaN)."""
    rng = np.random.default_rng(seed)
    lens, page_size, max_pages, kv_heads, head_dim = [37, 0, 150], 16, 10, 1, 64
    num_pages = len(lens) * max_pages + 1
    shape = (num_pages, page_size, kv_heads, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    table = np.zeros((len(lens), max_pages), np.int32)
    pages = iter(rng.permutation(np.arange(1, num_pages)))
    for b, length in enumerate(lens):
        for p in range(-(-length // page_size)):
            table[b, p] = page = next(pages)
            used = min(page_size, length - p * page_size)
            k[page, :used] = rng.standard_normal((used, kv_heads, head_dim))
            v[page, :used] = rng.standard_normal((used, kv_heads, head_dim))
    bf16 = jnp.bfloat16
    return dict(
        q=jnp.asarray(rng.standard_normal((len(lens), 4, head_dim)), bf16),
        k_pages=jnp.asarray(k, bf16), v_pages=jnp.asarray(v, bf16),
        page_table=jnp.asarray(table), context_lens=jnp.asarray(np.asarray(lens, np.int32)),
    )  # fmt: skip


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_with_prefetch_gives_the_bits_it_gives_without(few_sms, num_splits):
    args = _attention_case(6)
    op = jax.jit(
        functools.partial(
            pd.paged_decode_attention, scale=0.125, num_splits=num_splits, impl="interpret"
        )
    )
    want = op(**args)
    got = op(**args, prefetch=_weights(7))
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_array_equal(bits(got), bits(want))


def test_paged_decode_names_an_array_it_cannot_prefetch():
    args = _attention_case(8)
    with pytest.raises(ValueError, match=re.escape("prefetch[0] bfloat16[4096]")):
        pd.paged_decode_attention(
            **args, scale=0.125, prefetch=(jnp.zeros(4096, jnp.bfloat16),), impl="reference"
        )


def test_paged_decode_with_prefetch_lowers_for_cuda_at_the_35b_shapes():
    """Qwen3.5-35B's attention (16 query / 2 KV heads of 256) at a bucket of 8 rows, its
    ``o_proj`` weight ``[4096, 2048]`` prefetched."""
    spec = jax.ShapeDtypeStruct
    pages = spec((4096, 16, 2, 256), jnp.bfloat16)
    args = (spec((8, 1, 16, 256), jnp.bfloat16), pages, pages, spec((8, 512), jnp.int32),
            spec((8,), jnp.int32))  # fmt: skip
    call = functools.partial(pd._kernel, scale=0.0625, num_splits=1, causal=True, interpret=False)

    def lowered(*prefetch):
        traced = jax.jit(call).trace(*args, None, prefetch)
        return traced.lower(lowering_platforms=("cuda",)).as_text()

    assert PREFETCH_OP in lowered(spec((4096, 2048), jnp.bfloat16))
    assert PREFETCH_OP not in lowered()


# ------------------------------------------------------------------ the projections' launch


@pytest.mark.parametrize("paired", [False, True], ids=["plain", "paired-swiglu"])
def test_projections_with_prefetch_give_the_bits_they_give_without(few_sms, paired):
    """A router and a shared gate/up in one launch (the shared down weight prefetched by
    the programs after theirs): the products' bits do not change."""
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((256, n)) / 16, jnp.bfloat16) for n in (64, 128)]
    flags = (False, paired)
    op = jax.jit(functools.partial(projections.projections, paired=flags, impl="interpret"))
    want = op(x, ws)
    got = op(x, ws, prefetch=_weights(11))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(bits(g), bits(w))


def test_projections_with_prefetch_lower_for_cuda_at_the_35b_router_shapes():
    spec = jax.ShapeDtypeStruct
    x = spec((8, 2048), jnp.bfloat16)
    ws = [spec((2048, n), jnp.bfloat16) for n in (256, 1024, 64)]
    fn = functools.partial(projections.projections, paired=(False, True, False), impl="pallas")

    def lowered(*prefetch):
        traced = jax.jit(fn).trace(x, ws, prefetch=prefetch)
        return traced.lower(lowering_platforms=("cuda",)).as_text()

    assert PREFETCH_OP in lowered(spec((512, 2048), jnp.bfloat16))
    assert PREFETCH_OP not in lowered()
    rows, w = jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((256, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=re.escape("projections: prefetch[0] bfloat16[512]")):
        projections.projections(rows, [w], prefetch=(jnp.zeros(512, jnp.bfloat16),))


# --------------------------------------------------------------------- the conv update


def _conv_case(seed):
    """4 rows (the third padded) of 256 channels, width 4, and a delta-rule pool."""
    rng = np.random.default_rng(seed)
    slots, channels = 6, 256
    return dict(
        x=jnp.asarray(rng.standard_normal((4, 1, channels)), jnp.bfloat16),
        weight=jnp.asarray(rng.standard_normal((channels, 4)), jnp.bfloat16),
        bias=None,
        conv_pool=jnp.asarray(rng.standard_normal((slots, channels, 3)), jnp.bfloat16),
        state_indices=jnp.asarray([3, 1, 0, 5], jnp.int32),
    ), jnp.asarray(rng.standard_normal((slots, HV, KD, KD)), jnp.float32)


def test_conv_update_prefetching_the_states_gives_the_bits_it_gives_without():
    args, states = _conv_case(12)
    op = jax.jit(functools.partial(conv1d.causal_conv1d_update, impl="interpret"))
    want = op(**args)
    got = op(**args, prefetch_slots=(states,))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(bits(g), bits(w))


@pytest.mark.parametrize(
    "shape, dtype, message",
    [((7, 2, 64, 64), jnp.float32, "its slots are not the pool's 6"),
     ((6,), jnp.float32, "it has no axis after the slots"),
     ((6, 4, 2), jnp.float32, "must be a non-empty [R, C] array whose rows")],
    ids=["slots", "rank", "narrow-rows"],
)  # fmt: skip
def test_conv_update_names_an_array_whose_slots_it_cannot_prefetch(shape, dtype, message):
    args, _ = _conv_case(13)
    bad = jnp.zeros(shape, dtype)
    want = f"causal_conv1d_update: prefetch_slots[0] {jnp.dtype(dtype)}{list(shape)}: "
    for impl in ("reference", "interpret"):
        with pytest.raises(ValueError, match=re.escape(want) + ".*" + re.escape(message)):
            conv1d.causal_conv1d_update(**args, prefetch_slots=(bad,), impl=impl)


def test_conv_update_prefetching_the_states_lowers_for_cuda_at_the_35b_shapes():
    spec = jax.ShapeDtypeStruct
    channels, slots = 8192, 64
    args = dict(
        x=spec((8, 1, channels), jnp.bfloat16), weight=spec((channels, 4), jnp.bfloat16),
        bias=None, conv_pool=spec((slots, channels, 3), jnp.bfloat16),
        state_indices=spec((8,), jnp.int32),
    )  # fmt: skip
    fn = functools.partial(conv1d.causal_conv1d_update, impl="pallas")

    def lowered(*prefetch):
        traced = jax.jit(fn).trace(**args, prefetch_slots=prefetch)
        return traced.lower(lowering_platforms=("cuda",)).as_text()

    assert PREFETCH_OP in lowered(spec((slots, 32, 128, 128), jnp.float32))
    assert PREFETCH_OP not in lowered()
