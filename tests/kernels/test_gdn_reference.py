"""pallas_kernels.gdn public ops (impl="reference") against the float64 token-by-token oracle.

The oracle (``reference.chunk_gated_delta_rule_recurrent``) is itself checked against a plain
NumPy transcription of the formula. Inputs are fresh random numbers; pools are random
everywhere with a NaN pad slot, so a read of a slot that must not be read, or a write that must
not happen, shows up.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import check_impl_refusals, query_start_loc, rel, replace

from pallas_kernels import gdn
from pallas_kernels.gdn import reference

H, HV, K, V = 2, 4, 16, 16
S = 13
# Lengths around the 64-token chunk (1, 37, 64, 130), an empty sequence in the middle, and two
# padded rows (length 0, slot 0) at the end; the token axis has a padded tail of 7.
LENGTHS = (1, 37, 0, 64, 130, 0, 0)
N_REAL = 5
T = sum(LENGTHS) + 7


def _tokens(rng, shape_lead, l2norm=True):
    """q, k, v, g, beta float32 with leading dims ``shape_lead`` (fresh random, never zero)."""
    q = rng.normal(size=(*shape_lead, H, K))
    k = rng.normal(size=(*shape_lead, H, K))
    if not l2norm:  # keep |k| near 1 so that the unnormalized recurrence stays bounded
        q, k = q / np.sqrt(K), k / np.sqrt(K)
    v = rng.normal(size=(*shape_lead, HV, V))
    g = -rng.uniform(0.01, 0.7, size=(*shape_lead, HV))
    beta = rng.uniform(0.05, 0.95, size=(*shape_lead, HV))
    return tuple(x.astype(np.float32) for x in (q, k, v, g, beta))


def _pool(rng):
    """Random everywhere, the pad slot NaN: the pool must never be read there."""
    pool = rng.normal(size=(S, HV, K, V)).astype(np.float32)
    pool[0] = np.nan
    return pool


def _batch(rng, lengths=LENGTHS, n_real=N_REAL, t_total=T, l2norm=True):
    """A packed varlen call: random distinct slots for the real rows, slot 0 for padded rows."""
    n = len(lengths)
    slots = np.zeros(n, np.int32)
    slots[:n_real] = rng.permutation(np.arange(1, S))[:n_real]
    has_init = rng.uniform(size=n) < 0.5
    has_init[:2] = (True, False)
    has_init[n_real:] = True  # padded rows: must still read and write nothing
    return (
        *_tokens(rng, (t_total,), l2norm),
        _pool(rng),
        query_start_loc(lengths),
        slots,
        has_init,
    )


def _f64(args):
    return tuple(
        np.asarray(a, np.float64) if np.issubdtype(np.asarray(a).dtype, np.floating) else a
        for a in args
    )


_options = ("scale", "use_qk_l2norm")
_oracle_f64 = jax.jit(reference.chunk_gated_delta_rule_recurrent, static_argnames=_options)
_chunked_f64 = jax.jit(reference.chunk_gated_delta_rule_chunked, static_argnames=_options)


def _oracle(args, **options):
    """The token-by-token jnp oracle in float64."""
    with jax.enable_x64(True):
        o, pool = _oracle_f64(*_f64(args), **options)
        return np.asarray(o), np.asarray(pool)


def _numpy_sequence(q, k, v, g, beta, state, scale, l2norm=True):
    """docs/DESIGN.md's formula transcribed with NumPy loops, one sequence, float64."""
    q, k, v, g, beta = _f64((q, k, v, g, beta))
    state = np.array(state, np.float64)
    o = np.zeros(v.shape)
    group = HV // H
    for t in range(q.shape[0]):
        for h in range(HV):
            qt, kt = q[t, h // group], k[t, h // group]
            if l2norm:
                qt, kt = qt / np.sqrt(qt @ qt + 1e-6), kt / np.sqrt(kt @ kt + 1e-6)
            s = np.exp(g[t, h]) * state[h]
            u = beta[t, h] * (v[t, h] - s.T @ kt)
            state[h] = s + np.outer(kt, u)
            o[t, h] = state[h].T @ (scale * qt)
    return o, state


_chunk = jax.jit(gdn.chunk_gated_delta_rule, static_argnames=("scale", "use_qk_l2norm", "impl"))
_decode = jax.jit(
    gdn.fused_recurrent_gated_delta_rule, static_argnames=("scale", "use_qk_l2norm", "impl")
)
_verify = jax.jit(gdn.verify_gated_delta_rule, static_argnames=("scale", "use_qk_l2norm", "impl"))


def _check_pool(new_pool, old_pool, expected_pool, written):
    """Written slots match ``expected_pool``; every other slot is bit-identical to before."""
    new_pool = np.asarray(new_pool)
    for slot in range(S):
        if slot in written:
            assert rel(new_pool[slot], expected_pool[slot]) < 2e-5, slot
        else:
            np.testing.assert_array_equal(new_pool[slot], old_pool[slot], err_msg=f"slot {slot}")


def _written_slots(lengths, slots):
    return {int(s) for length, s in zip(lengths, slots, strict=True) if length > 0}


def test_oracle_matches_numpy_formula():
    rng = np.random.default_rng(0)
    args = _batch(rng)
    q, k, v, g, beta, pool, qsl, slots, has_init = args
    o, new_pool = _oracle(args)
    for n, length in enumerate(LENGTHS):
        a, b = qsl[n], qsl[n + 1]
        init = pool[slots[n]] if has_init[n] else np.zeros((HV, K, V))
        o_ref, state = _numpy_sequence(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], init, K**-0.5)
        np.testing.assert_allclose(o[a:b], o_ref, rtol=1e-10, atol=1e-12)
        if length:
            np.testing.assert_allclose(new_pool[slots[n]], state, rtol=1e-10, atol=1e-12)
    assert not np.any(o[qsl[-1] :])


@pytest.mark.parametrize(
    "options", [{}, {"scale": 0.3, "use_qk_l2norm": False}], ids=["l2norm", "raw_qk"]
)
def test_chunked_prefill_matches_oracle_and_writes_only_real_slots(options):
    rng = np.random.default_rng(1)
    args = _batch(rng, l2norm=options.get("use_qk_l2norm", True))
    o_ref, pool_ref = _oracle(args, **options)
    o, pool = _chunk(*args, **options, impl="reference")
    qsl, slots = args[6], args[7]
    assert o.dtype == jnp.float32 and pool.dtype == jnp.float32
    assert rel(o[: qsl[-1]], o_ref[: qsl[-1]]) < 2e-5
    np.testing.assert_array_equal(np.asarray(o[qsl[-1] :]), 0)
    _check_pool(pool, args[5], pool_ref, _written_slots(LENGTHS, slots))


def test_chunked_equals_token_by_token_in_float64():
    args = _f64(_batch(np.random.default_rng(2)))
    with jax.enable_x64(True):
        o_ref, pool_ref = _oracle_f64(*args)
        o, pool = _chunked_f64(*args)
        assert o.dtype == jnp.float64
        np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(pool, pool_ref, rtol=1e-10, atol=1e-12)


def test_prefill_in_two_pieces_equals_one_piece():
    # The shapes of the other prefill tests (T tokens, N rows), so nothing recompiles: one
    # real sequence of 100 tokens in row 0, the other rows padded.
    rng = np.random.default_rng(3)
    length, cut = 100, 70
    q, k, v, g, beta, pool, _, _, _ = _batch(rng)
    tokens = (q, k, v, g, beta)
    slots = np.array([5] + [0] * (len(LENGTHS) - 1), np.int32)
    fresh = np.zeros(len(LENGTHS), bool)
    cont = fresh.copy()
    cont[0] = True

    def call(xs, pool, n_tokens, has_init):
        qsl = query_start_loc([n_tokens] + [0] * (len(LENGTHS) - 1))
        return _chunk(*xs, pool, qsl, slots, has_init, impl="reference")

    one_o, one_pool = call(tokens, pool, length, fresh)
    first_o, mid_pool = call(tokens, pool, cut, fresh)
    second_o, two_pool = call(
        tuple(np.roll(x, -cut, axis=0) for x in tokens), mid_pool, length - cut, cont
    )
    pieces = np.concatenate([first_o[:cut], second_o[: length - cut]])
    assert rel(pieces, one_o[:length]) < 1e-5
    assert rel(two_pool[5], one_pool[5]) < 1e-5
    _check_pool(two_pool, pool, one_pool, {5})


def test_empty_batch_outputs_zeros_and_leaves_pool():
    rng = np.random.default_rng(4)
    *tokens, pool, _, slots, has_init = _batch(rng)
    qsl = query_start_loc([0] * len(LENGTHS))
    o, new_pool = _chunk(*tokens, pool, qsl, slots, has_init, impl="reference")
    np.testing.assert_array_equal(np.asarray(o), 0)
    np.testing.assert_array_equal(np.asarray(new_pool), pool)


def _rows(rng, n_steps, slots):
    """A decode/verify call of len(slots) rows with D = n_steps."""
    return (*_tokens(rng, (len(slots), n_steps)), _pool(rng), np.asarray(slots, np.int32))


def test_decode_is_one_step_of_the_recurrence():
    rng = np.random.default_rng(5)
    slots = [7, 2, 11, 0, 0]  # three real rows, two padded
    q, k, v, g, beta, pool, idx = args = _rows(rng, 1, slots)
    o, new_pool = _decode(*args, impl="reference")
    for n, slot in enumerate(slots[:3]):
        o_ref, state = _numpy_sequence(q[n], k[n], v[n], g[n], beta[n], pool[slot], K**-0.5)
        assert rel(o[n], o_ref) < 1e-5
        assert rel(new_pool[slot], state) < 1e-5
    np.testing.assert_array_equal(np.asarray(o[3:]), 0)
    _check_pool(new_pool, pool, np.asarray(new_pool), set(slots[:3]))


def test_verify_intermediates_are_states_after_each_token():
    rng = np.random.default_rng(6)
    slots = [4, 9, 0]
    n_steps = 3
    q, k, v, g, beta, pool, idx = args = _rows(rng, n_steps, slots)
    o, inter = _verify(*args, impl="reference")
    assert inter.shape == (3, n_steps, HV, K, V) and inter.dtype == jnp.float32
    for n, slot in enumerate(slots[:2]):
        state = pool[slot]
        for t in range(n_steps):
            o_ref, state = _numpy_sequence(
                q[n, t : t + 1], k[n, t : t + 1], v[n, t : t + 1],
                g[n, t : t + 1], beta[n, t : t + 1], state, K**-0.5,
            )  # fmt: skip
            assert rel(o[n, t], o_ref[0]) < 1e-5
            assert rel(inter[n, t], state) < 1e-5
    np.testing.assert_array_equal(np.asarray(o[2]), 0)
    np.testing.assert_array_equal(np.asarray(inter[2]), 0)
    # Verify and multi-token decode agree: decode's pool holds verify's last intermediate.
    o_dec, pool_dec = _decode(*args, impl="reference")
    np.testing.assert_allclose(o_dec, o, rtol=1e-6, atol=1e-6)
    for n, slot in enumerate(slots[:2]):
        np.testing.assert_allclose(pool_dec[slot], inter[n, -1], rtol=1e-6, atol=1e-6)


def test_gating_matches_formula_in_float64():
    rng = np.random.default_rng(8)
    a_log = rng.normal(size=HV).astype(np.float32)
    a = (3 * rng.normal(size=(T, HV))).astype(np.float32)
    dt_bias = rng.normal(size=HV).astype(np.float32)
    b = (3 * rng.normal(size=(T, HV))).astype(np.float32)
    g, beta = jax.jit(gdn.gdn_gating)(a_log, a, dt_bias, b)
    assert g.dtype == beta.dtype == jnp.float32 and g.shape == beta.shape == (T, HV)
    x = a.astype(np.float64) + dt_bias
    g_ref = -np.exp(a_log.astype(np.float64)) * np.logaddexp(0.0, x)
    beta_ref = 1 / (1 + np.exp(-b.astype(np.float64)))
    np.testing.assert_allclose(g, g_ref, rtol=1e-6)
    np.testing.assert_allclose(beta, beta_ref, rtol=1e-6)
    assert np.all(np.asarray(g) <= 0)


def test_auto_picks_the_reference_on_cpu():
    args = _batch(np.random.default_rng(9))

    def program(impl):
        return str(jax.make_jaxpr(lambda *a: gdn.chunk_gated_delta_rule(*a, impl=impl))(*args))

    assert program("auto") == program("reference")


@pytest.mark.parametrize("impl", ["pallas", "interpret"])
def test_kernel_impls_refuse_calls_the_kernel_cannot_take(impl):
    rng = np.random.default_rng(10)
    rows = _rows(rng, 2, [1, 2])
    calls = {
        "chunk_gated_delta_rule": lambda: gdn.chunk_gated_delta_rule(*_batch(rng), impl=impl),
        "fused_recurrent_gated_delta_rule": lambda: gdn.fused_recurrent_gated_delta_rule(
            *rows, impl=impl
        ),
        "verify_gated_delta_rule": lambda: gdn.verify_gated_delta_rule(*rows, impl=impl),
    }
    check_impl_refusals(calls, impl)


@pytest.mark.parametrize(
    ("position", "make", "message"),
    [
        (2, lambda a: a[:, :3], r"HV=v.shape\[1\]=3 must be a multiple of H=q.shape\[1\]=2"),
        (1, lambda a: a[:, :, :8], r"q.shape=.* and k.shape=.* must be equal"),
        (3, lambda a: a[:-1], rf"g.shape=.* must be \({T}, 4\)"),
        (4, lambda a: a.astype(np.float16), r"beta.dtype=float16 must be float32"),
        (5, lambda a: a[:, :, :, :8], r"ssm_pool.shape=.* must be \[S, HV, K, V\]"),
        (5, lambda a: a.astype(np.float16), r"ssm_pool.dtype=float16 must be float32"),
        (6, lambda a: a[:-1], r"qsl.shape=\(7,\) must be \[N\+1\]=\(8,\)"),
        (6, lambda a: a.astype(np.int64), r"qsl.dtype=int64 must be int32"),
        (8, lambda a: a[:3], r"has_initial_state.shape=\(3,\) must be \(7,\)"),
        (0, lambda a: a[..., None], r"q.shape=.* must have 3 dims"),
    ],
    ids=[
        "hv_not_multiple_of_h", "k_mismatch", "g_tokens", "beta_dtype", "pool_dims",
        "pool_dtype", "qsl_length", "qsl_dtype", "has_initial_state_length", "q_rank",
    ],
)  # fmt: skip
def test_chunk_rejects_bad_shapes_and_dtypes_at_trace_time(position, make, message):
    args = _batch(np.random.default_rng(11))
    bad = replace(args, position, make(args[position]))
    with pytest.raises(ValueError, match=rf"chunk_gated_delta_rule: {message}"):
        gdn.chunk_gated_delta_rule(*bad, impl="reference")


def test_rows_and_commit_reject_bad_shapes():
    rng = np.random.default_rng(12)
    rows = _rows(rng, 2, [1, 2])
    with pytest.raises(ValueError, match=r"state_indices.shape=\(3,\) must be \(2,\)"):
        gdn.fused_recurrent_gated_delta_rule(*replace(rows, 6, np.zeros(3, np.int32)))
    with pytest.raises(ValueError, match=r"g.shape=\(2, 1, 4\) must be \(2, 2, 4\)"):
        gdn.verify_gated_delta_rule(*replace(rows, 3, rows[3][:, :1]))
    inter = np.ones((2, 2, HV, K, V), np.float32)
    with pytest.raises(ValueError, match=r"accepted_steps.dtype=int64 must be int32"):
        gdn.commit_states(rows[5], inter, rows[6], np.zeros(2, np.int64))
    with pytest.raises(ValueError, match=r"ssm_pool.shape=.* must be \[S, HV, K, V\]"):
        gdn.commit_states(rows[5], inter[:, :, :2], rows[6], np.zeros(2, np.int32))
