"""pallas_kernels.mamba2 public ops (impl="reference") against the float64 token-by-token oracle.

The oracle (``reference.ssd_chunk_scan_recurrent``) is itself checked against a plain NumPy
transcription of the contract's formula. Inputs are fresh random numbers; pools are random
with NaN in the pad slot and in the slots of sequences that start fresh, so a read of a slot
that must not be read, or a write that must not happen, shows up.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import check_impl_refusals, query_start_loc, rel, replace

from pallas_kernels import mamba2
from pallas_kernels.mamba2 import reference

H, G, P, N = 4, 2, 8, 16
S = 13
# Lengths around the 64-token chunk (1, 37, 64, 130), an empty sequence in the middle, and two
# padded rows (length 0, slot 0) at the end; the token axis has a padded tail of 7.
LENGTHS = (1, 37, 0, 64, 130, 0, 0)
N_REAL = 5
T = sum(LENGTHS) + 7
_OPTIONS = ("z", "dt_softplus", "dt_min", "dt_max")
# Every option of the contract: gate z, dt limits that bite (the raw dt spans about 0.05..3),
# and a dt without softplus (then the bias keeps it positive).
CASES = {
    "plain": {},
    "gated": {"z": True},
    "dt_limits": {"dt_min": 0.1, "dt_max": 0.6, "z": True},
    "no_softplus": {"dt_softplus": False, "dt_max": 1.5},
}


def _params(rng):
    """A (negative), D, dt_bias float32 ``[H]``; the bias keeps ``dt + bias`` mostly positive."""
    a = -np.exp(rng.uniform(-1.5, 1.0, size=H))
    d = rng.normal(size=H)
    dt_bias = rng.uniform(0.5, 1.5, size=H)
    return tuple(v.astype(np.float32) for v in (a, d, dt_bias))


def _tokens(rng, lead, dtype=np.float32):
    """x, dt, B, C, z with leading dims ``lead`` (fresh random, never zero)."""
    x = rng.normal(size=(*lead, H, P))
    dt = rng.normal(size=(*lead, H))
    b = rng.normal(size=(*lead, G, N)) / np.sqrt(N)
    c = rng.normal(size=(*lead, G, N))
    z = rng.normal(size=(*lead, H, P))
    return tuple(v.astype(dtype) for v in (x, dt, b, c, z))


def _pool(rng):
    """Random everywhere, the pad slot NaN: the pool must never be read there."""
    pool = rng.normal(size=(S, H, P, N)).astype(np.float32)
    pool[0] = np.nan
    return pool


def _batch(rng, lengths=LENGTHS, n_real=N_REAL, t_total=T, dtype=np.float32):
    """A packed varlen call (positional args of ssd_chunk_scan) and z: random distinct slots for
    the real rows, slot 0 for padded rows; fresh sequences' slots are NaN (must not be read)."""
    n = len(lengths)
    slots = np.zeros(n, np.int32)
    slots[:n_real] = rng.permutation(np.arange(1, S))[:n_real]
    has_init = rng.uniform(size=n) < 0.5
    has_init[:2] = (True, False)
    has_init[n_real:] = True  # padded rows: must still read and write nothing
    pool = _pool(rng)
    pool[slots[:n_real][~has_init[:n_real]]] = np.nan
    x, dt, b, c, z = _tokens(rng, (t_total,), dtype)
    a, d, dt_bias = _params(rng)
    return (x, dt, a, b, c, d, dt_bias, pool, query_start_loc(lengths), slots, has_init), z


def _options(case, z):
    options = dict(CASES[case])
    options["z"] = z if options.get("z") else None
    return options


def _f64(x):
    if x is None:
        return None
    if np.issubdtype(np.asarray(x).dtype, np.floating) or np.asarray(x).dtype == jnp.bfloat16:
        return np.asarray(x, np.float64)
    return x


_oracle_f64 = jax.jit(reference.ssd_chunk_scan_recurrent, static_argnames=_OPTIONS[1:])
_chunked_f64 = jax.jit(reference.ssd_chunk_scan_chunked, static_argnames=_OPTIONS[1:])
_scan = jax.jit(mamba2.ssd_chunk_scan, static_argnames=(*_OPTIONS[1:], "impl"))
_decode = jax.jit(mamba2.selective_state_update, static_argnames=(*_OPTIONS[1:], "impl"))
_verify = jax.jit(mamba2.verify_selective_state_update, static_argnames=(*_OPTIONS[1:], "impl"))


def _oracle(args, **options):
    """The token-by-token jnp oracle in float64."""
    options["z"] = _f64(options.get("z"))
    with jax.enable_x64(True):
        y, pool = _oracle_f64(*map(_f64, args), **options)
        return np.asarray(y), np.asarray(pool)


def _numpy_sequence(x, dt, a, b, c, d, dt_bias, z, state, dt_softplus=True, dt_min=0.0,
                    dt_max=np.inf):  # fmt: skip
    """The contract's formula transcribed with NumPy loops, one sequence, float64."""
    x, dt, a, b, c, d, dt_bias = (np.asarray(v, np.float64) for v in (x, dt, a, b, c, d, dt_bias))
    state = np.array(state, np.float64)
    y = np.zeros(x.shape)
    per_group = H // G
    for t in range(x.shape[0]):
        for h in range(H):
            step = dt[t, h] + dt_bias[h]
            if dt_softplus:
                step = np.log1p(np.exp(step))
            step = min(max(step, dt_min), dt_max)
            bt, ct = b[t, h // per_group], c[t, h // per_group]
            state[h] = np.exp(step * a[h]) * state[h] + step * np.outer(x[t, h], bt)
            y[t, h] = state[h] @ ct + d[h] * x[t, h]
            if z is not None:
                zt = np.asarray(z[t, h], np.float64)
                y[t, h] *= zt / (1 + np.exp(-zt))
    return y, state


def _check_pool(new_pool, old_pool, expected_pool, written, tol=2e-5):
    """Written slots match ``expected_pool``; every other slot is bit-identical to before."""
    new_pool = np.asarray(new_pool)
    for slot in range(S):
        if slot in written:
            assert rel(new_pool[slot], expected_pool[slot]) < tol, slot
        else:
            np.testing.assert_array_equal(new_pool[slot], old_pool[slot], err_msg=f"slot {slot}")


def _written_slots(lengths, slots):
    return {int(s) for length, s in zip(lengths, slots, strict=True) if length > 0}


@pytest.mark.parametrize("case", ["gated", "no_softplus"])
def test_oracle_matches_numpy_formula(case):
    args, z = _batch(np.random.default_rng(0))
    x, dt, a, b, c, d, dt_bias, pool, qsl, slots, has_init = args
    options = _options(case, z)
    y, new_pool = _oracle(args, **options)
    formula = {k: v for k, v in options.items() if k != "z"}
    for n, length in enumerate(LENGTHS):
        lo, hi = qsl[n], qsl[n + 1]
        init = pool[slots[n]] if has_init[n] else np.zeros((H, P, N))
        zs = None if options["z"] is None else z[lo:hi]
        y_ref, state = _numpy_sequence(
            x[lo:hi], dt[lo:hi], a, b[lo:hi], c[lo:hi], d, dt_bias, zs, init, **formula
        )
        np.testing.assert_allclose(y[lo:hi], y_ref, rtol=1e-10, atol=1e-12)
        if length:
            np.testing.assert_allclose(new_pool[slots[n]], state, rtol=1e-10, atol=1e-12)
    assert not np.any(y[qsl[-1] :])


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_scan_matches_oracle_and_writes_only_real_slots(case):
    args, z = _batch(np.random.default_rng(1))
    options = _options(case, z)
    y_ref, pool_ref = _oracle(args, **options)
    y, pool = _scan(*args, **options, impl="reference")
    qsl, slots = args[8], args[9]
    assert y.dtype == jnp.float32 and pool.dtype == jnp.float32
    assert rel(y[: qsl[-1]], y_ref[: qsl[-1]]) < 2e-5
    np.testing.assert_array_equal(np.asarray(y[qsl[-1] :]), 0)
    _check_pool(pool, args[7], pool_ref, _written_slots(LENGTHS, slots))


def test_chunked_equals_token_by_token_in_float64():
    args, z = _batch(np.random.default_rng(2))
    args, z = tuple(map(_f64, args)), _f64(z)
    with jax.enable_x64(True):
        y_ref, pool_ref = _oracle_f64(*args, z=z, dt_max=0.8)
        y, pool = _chunked_f64(*args, z=z, dt_max=0.8)
        assert y.dtype == jnp.float64
        np.testing.assert_allclose(y, y_ref, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(pool, pool_ref, rtol=1e-10, atol=1e-12)


def test_bf16_scan_matches_oracle():
    args, z = _batch(np.random.default_rng(3), dtype=jnp.bfloat16)
    y_ref, pool_ref = _oracle(args, z=z)
    y, pool = _scan(*args, z=z, impl="reference")
    qsl = args[8]
    assert y.dtype == jnp.bfloat16 and pool.dtype == jnp.float32
    assert rel(y[: qsl[-1]], y_ref[: qsl[-1]]) < 1e-2
    _check_pool(pool, args[7], pool_ref, _written_slots(LENGTHS, args[9]), tol=1e-5)


def test_prefill_in_two_pieces_equals_one_piece():
    # The shapes of the other prefill tests (T tokens, N rows), so nothing recompiles: one
    # real sequence of 100 tokens in row 0, the other rows padded.
    rng = np.random.default_rng(4)
    length, cut = 100, 70
    (x, dt, a, b, c, d, dt_bias, pool, _, _, _), z = _batch(rng)
    slots = np.array([5] + [0] * (len(LENGTHS) - 1), np.int32)
    fresh = np.zeros(len(LENGTHS), bool)
    cont = fresh.copy()
    cont[0] = True

    def call(tokens, pool, n_tokens, has_init):
        x, dt, b, c, z = tokens
        qsl = query_start_loc([n_tokens] + [0] * (len(LENGTHS) - 1))
        return _scan(x, dt, a, b, c, d, dt_bias, pool, qsl, slots, has_init, z=z, impl="reference")

    tokens = (x, dt, b, c, z)
    one_y, one_pool = call(tokens, pool, length, fresh)
    first_y, mid_pool = call(tokens, pool, cut, fresh)
    rolled = tuple(np.roll(v, -cut, axis=0) for v in tokens)
    second_y, two_pool = call(rolled, mid_pool, length - cut, cont)
    pieces = np.concatenate([first_y[:cut], second_y[: length - cut]])
    assert rel(pieces, one_y[:length]) < 1e-5
    _check_pool(two_pool, pool, one_pool, {5}, tol=1e-5)


def test_empty_batch_outputs_zeros_and_leaves_pool():
    args, z = _batch(np.random.default_rng(5))
    args = (*args[:8], query_start_loc([0] * len(LENGTHS)), *args[9:])
    y, new_pool = _scan(*args, z=z, impl="reference")
    np.testing.assert_array_equal(np.asarray(y), 0)
    np.testing.assert_array_equal(np.asarray(new_pool), args[7])


def _rows(rng, n_steps, slots):
    """A decode/verify call of len(slots) rows with Dt = n_steps, and z."""
    x, dt, b, c, z = _tokens(rng, (len(slots), n_steps))
    a, d, dt_bias = _params(rng)
    return (x, dt, a, b, c, d, dt_bias, _pool(rng), np.asarray(slots, np.int32)), z


@pytest.mark.parametrize("case", ["plain", "dt_limits"])
def test_decode_is_one_step_of_the_recurrence(case):
    slots = [7, 2, 11, 0, 0]  # three real rows, two padded
    args, z = _rows(np.random.default_rng(6), 1, slots)
    x, dt, a, b, c, d, dt_bias, pool, _ = args
    options = _options(case, z)
    y, new_pool = _decode(*args, **options, impl="reference")
    formula = {k: v for k, v in options.items() if k != "z"}
    for n, slot in enumerate(slots[:3]):
        zs = None if options["z"] is None else z[n]
        y_ref, state = _numpy_sequence(
            x[n], dt[n], a, b[n], c[n], d, dt_bias, zs, pool[slot], **formula
        )
        assert rel(y[n], y_ref) < 1e-5
        assert rel(new_pool[slot], state) < 1e-5
    np.testing.assert_array_equal(np.asarray(y[3:]), 0)
    _check_pool(new_pool, pool, np.asarray(new_pool), set(slots[:3]))


def test_decode_of_several_tokens_equals_scan_continuation():
    """Dt tokens of a row through the decode op == the same tokens as an extend of length Dt."""
    n_steps, slots = 3, [9, 0, 4]
    args, z = _rows(np.random.default_rng(7), n_steps, slots)
    x, dt, a, b, c, d, dt_bias, pool, idx = args
    y, new_pool = _decode(*args, z=z, impl="reference")
    flat = (v.reshape(-1, *v.shape[2:]) for v in (x, dt, b, c, z))
    xf, dtf, bf, cf, zf = flat
    qsl = query_start_loc([n_steps if s else 0 for s in slots])
    real = idx != 0
    keep = np.repeat(real, n_steps)
    y_scan, pool_scan = _scan(
        xf[keep], dtf[keep], a, bf[keep], cf[keep], d, dt_bias, pool, qsl, idx,
        np.ones(3, bool), z=zf[keep], impl="reference",
    )  # fmt: skip
    assert rel(np.asarray(y)[real].reshape(-1, H, P), y_scan) < 1e-5
    np.testing.assert_allclose(new_pool, pool_scan, rtol=1e-5, atol=1e-5)


def test_verify_intermediates_are_states_after_each_token_and_pool_untouched():
    slots, n_steps = [4, 9, 0], 3
    args, z = _rows(np.random.default_rng(8), n_steps, slots)
    x, dt, a, b, c, d, dt_bias, pool, _ = args
    before = pool.copy()
    y, inter = _verify(*args, z=z, impl="reference")
    np.testing.assert_array_equal(pool, before)
    assert inter.shape == (3, n_steps, H, P, N) and inter.dtype == jnp.float32
    for n, slot in enumerate(slots[:2]):
        state = pool[slot]
        for t in range(n_steps):
            one = slice(t, t + 1)
            y_ref, state = _numpy_sequence(
                x[n, one], dt[n, one], a, b[n, one], c[n, one], d, dt_bias, z[n, one], state
            )
            assert rel(y[n, t], y_ref[0]) < 1e-5
            assert rel(inter[n, t], state) < 1e-5
    np.testing.assert_array_equal(np.asarray(y[2]), 0)
    np.testing.assert_array_equal(np.asarray(inter[2]), 0)
    # Verify and multi-token decode agree: decode's pool holds verify's last intermediate.
    y_dec, pool_dec = _decode(*args, z=z, impl="reference")
    np.testing.assert_allclose(y_dec, y, rtol=1e-6, atol=1e-6)
    for n, slot in enumerate(slots[:2]):
        np.testing.assert_allclose(pool_dec[slot], inter[n, -1], rtol=1e-6, atol=1e-6)


def test_auto_picks_the_reference_on_cpu():
    args, z = _batch(np.random.default_rng(10))
    rows, _ = _rows(np.random.default_rng(11), 1, [1, 2])

    def program(fn, call_args, impl):
        return str(jax.make_jaxpr(lambda *a: fn(*a, impl=impl))(*call_args))

    assert program(mamba2.ssd_chunk_scan, args, "auto") == program(
        mamba2.ssd_chunk_scan, args, "reference"
    )
    assert program(mamba2.selective_state_update, rows, "auto") == program(
        mamba2.selective_state_update, rows, "reference"
    )


@pytest.mark.parametrize("impl", ["pallas", "interpret"])
def test_kernel_impls_refuse_calls_the_kernel_cannot_take(impl):
    args, _ = _batch(np.random.default_rng(12))
    rows, _ = _rows(np.random.default_rng(13), 2, [1, 2])  # P=8, N=16: outside the kernel
    calls = {
        "ssd_chunk_scan": lambda: mamba2.ssd_chunk_scan(*args, impl=impl),
        "selective_state_update": lambda: mamba2.selective_state_update(*rows, impl=impl),
        "verify_selective_state_update": lambda: mamba2.verify_selective_state_update(
            *rows, impl=impl
        ),
    }
    check_impl_refusals(calls, impl)


@pytest.mark.parametrize(
    ("position", "make", "message"),
    [
        (3, lambda v: np.concatenate([v, v[:, :1]], 1), r"H=x.shape\[1\]=4 .* of G=B.shape\[1\]=3"),
        (4, lambda v: v[:, :, :8], r"C.shape=.* must equal B.shape=.*"),
        (1, lambda v: v[:-1], rf"dt.shape=.* must be \({T}, 4\)"),
        (2, lambda v: v.astype(np.float16), r"A.dtype=float16 must be float32"),
        (5, lambda v: v[:2], r"D.shape=\(2,\) must be \[H\]=\(4,\)"),
        (7, lambda v: v[:, :, :, :8], r"ssm_pool.shape=.* must be \[S, H, P, N\]"),
        (7, lambda v: v.astype(np.float16), r"ssm_pool.dtype=float16 must be float32"),
        (8, lambda v: v[:-1], r"qsl.shape=\(7,\) must be \[N\+1\]=\(8,\)"),
        (8, lambda v: v.astype(np.int64), r"qsl.dtype=int64 must be int32"),
        (10, lambda v: v[:3], r"has_initial_state.shape=\(3,\) must be \(7,\)"),
        (0, lambda v: v[..., None], r"x.shape=.* must have 3 dims"),
        (4, lambda v: v.astype(jnp.bfloat16), r"C.dtype=bfloat16 must equal x.dtype=float32"),
    ],
    ids=[
        "h_not_multiple_of_g", "c_mismatch", "dt_tokens", "a_dtype", "d_length", "pool_dims",
        "pool_dtype", "qsl_length", "qsl_dtype", "has_initial_state_length", "x_rank",
        "c_dtype",
    ],
)  # fmt: skip
def test_scan_rejects_bad_shapes_and_dtypes_at_trace_time(position, make, message):
    args, _ = _batch(np.random.default_rng(14))
    bad = replace(args, position, make(args[position]))
    with pytest.raises(ValueError, match=rf"ssd_chunk_scan: {message}"):
        mamba2.ssd_chunk_scan(*bad, impl="reference")


def test_rows_options_and_commit_reject_bad_inputs():
    rows, z = _rows(np.random.default_rng(15), 2, [1, 2])
    with pytest.raises(ValueError, match=r"state_indices.shape=\(3,\) must be \(2,\)"):
        mamba2.selective_state_update(*replace(rows, 8, np.zeros(3, np.int32)))
    with pytest.raises(ValueError, match=r"dt.shape=\(2, 1, 4\) must be \(2, 2, 4\)"):
        mamba2.verify_selective_state_update(*replace(rows, 1, rows[1][:, :1]))
    with pytest.raises(ValueError, match=r"z.shape=.* must equal x.shape=.*"):
        mamba2.selective_state_update(*rows, z=z[:, :, :2])
    with pytest.raises(ValueError, match=r"dt_min=1.0 must be <= dt_max=0.5"):
        mamba2.selective_state_update(*rows, dt_min=1.0, dt_max=0.5)
    inter = np.ones((2, 2, H, P, N), np.float32)
    with pytest.raises(ValueError, match=r"accepted_steps.dtype=int64 must be int32"):
        mamba2.commit_states(rows[7], inter, rows[8], np.zeros(2, np.int64))
    with pytest.raises(ValueError, match=r"ssm_pool.shape=.* must be \[S, H, P, N\]"):
        mamba2.commit_states(rows[7], inter[:, :, :2], rows[8], np.zeros(2, np.int32))
