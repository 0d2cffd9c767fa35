"""pallas_kernels.conv1d public ops (impl="reference") against the float64 token-by-token oracle.

The oracle (``reference.causal_conv1d_recurrent``) is itself checked against a NumPy
transcription of the formula. Inputs are fresh random numbers; pools are random everywhere
with a NaN pad slot, so a read or a write that must not happen shows up.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import check_impl_refusals, query_start_loc, rel, replace

from pallas_kernels import conv1d
from pallas_kernels.conv1d import reference

C, W = 8, 4
S = 13
# A sequence shorter than the window (1, 2), an empty one in the middle, longer ones, and two
# padded rows (length 0, slot 0); the token axis has a padded tail of 3.
LENGTHS = (1, 2, 0, 7, 13, 0, 0)
N_REAL = 5
T = sum(LENGTHS) + 3


def _params(rng, with_bias=True):
    weight = rng.normal(size=(C, W)).astype(np.float32)
    bias = rng.normal(size=C).astype(np.float32) if with_bias else None
    return weight, bias


def _pool(rng, dtype=np.float32):
    pool = rng.normal(size=(S, C, W - 1)).astype(dtype)
    pool[0] = np.nan
    return pool


def _batch(rng, with_bias=True, lengths=LENGTHS):
    """A packed varlen call: random distinct slots for the real rows, slot 0 for padded rows."""
    n = len(lengths)
    slots = np.zeros(n, np.int32)
    slots[:N_REAL] = rng.permutation(np.arange(1, S))[:N_REAL]
    has_init = rng.uniform(size=n) < 0.5
    has_init[:2] = (True, True)  # the short sequences continue a window
    has_init[3] = False
    has_init[N_REAL:] = True  # padded rows: must still read and write nothing
    x = rng.normal(size=(T, C)).astype(np.float32)
    return (x, *_params(rng, with_bias), _pool(rng), query_start_loc(lengths), slots, has_init)


def _f64(args):
    return tuple(
        np.asarray(a, np.float64)
        if a is not None and np.issubdtype(np.asarray(a).dtype, np.floating)
        else a
        for a in args
    )


_oracle_f64 = jax.jit(reference.causal_conv1d_recurrent, static_argnames="activation")
_gathered_f64 = jax.jit(reference.causal_conv1d_gathered, static_argnames="activation")
_prefill = jax.jit(conv1d.causal_conv1d, static_argnames=("activation", "impl"))
_update = jax.jit(conv1d.causal_conv1d_update, static_argnames=("activation", "impl"))
_verify = jax.jit(conv1d.causal_conv1d_verify, static_argnames=("activation", "impl"))


def _oracle(args, **options):
    with jax.enable_x64(True):
        y, pool = _oracle_f64(*_f64(args), **options)
        return np.asarray(y), np.asarray(pool)


def _numpy_sequence(x, weight, bias, window, activation="silu"):
    """The formula with NumPy loops, one sequence, float64: (y [L, C], new window [C, W-1])."""
    x, weight, window = _f64((x, weight, window))
    ext = np.concatenate([window, x.T], axis=1)  # [C, W-1+L]
    y = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for c in range(C):
            acc = sum(weight[c, w] * ext[c, t + w] for w in range(W))
            acc += 0.0 if bias is None else float(bias[c])
            y[t, c] = acc / (1 + np.exp(-acc)) if activation == "silu" else acc
    return y, ext[:, ext.shape[1] - (W - 1) :]


def _check_pool(new_pool, old_pool, expected_pool, written, tol=1e-6):
    new_pool = np.asarray(new_pool)
    for slot in range(S):
        if slot in written:
            assert rel(new_pool[slot], expected_pool[slot]) <= tol, slot
        else:
            np.testing.assert_array_equal(new_pool[slot], old_pool[slot], err_msg=f"slot {slot}")


def _written_slots(lengths, slots):
    return {int(s) for length, s in zip(lengths, slots, strict=True) if length > 0}


def test_oracle_matches_numpy_formula():
    args = _batch(np.random.default_rng(0))
    x, weight, bias, pool, qsl, slots, has_init = args
    y, new_pool = _oracle(args)
    for n, length in enumerate(LENGTHS):
        a, b = qsl[n], qsl[n + 1]
        window = pool[slots[n]] if has_init[n] else np.zeros((C, W - 1))
        y_ref, window_ref = _numpy_sequence(x[a:b], weight, bias, window)
        np.testing.assert_allclose(y[a:b], y_ref, rtol=1e-12, atol=1e-12)
        if length:
            np.testing.assert_array_equal(new_pool[slots[n]], window_ref)
    assert not np.any(y[qsl[-1] :])


@pytest.mark.parametrize(
    ("with_bias", "activation"), [(True, "silu"), (False, None)], ids=["bias_silu", "plain"]
)
def test_prefill_matches_oracle_and_writes_only_real_slots(with_bias, activation):
    args = _batch(np.random.default_rng(1), with_bias)
    y_ref, pool_ref = _oracle(args, activation=activation)
    y, pool = _prefill(*args, activation=activation, impl="reference")
    qsl, slots = args[4], args[5]
    assert y.dtype == jnp.float32 and pool.dtype == jnp.float32
    assert rel(y[: qsl[-1]], y_ref[: qsl[-1]]) < 1e-6
    np.testing.assert_array_equal(np.asarray(y[qsl[-1] :]), 0)
    _check_pool(pool, args[3], pool_ref, _written_slots(LENGTHS, slots), tol=0)


def test_gathered_equals_token_by_token_in_float64():
    args = _f64(_batch(np.random.default_rng(2)))
    with jax.enable_x64(True):
        y_ref, pool_ref = _oracle_f64(*args)
        y, pool = _gathered_f64(*args)
        assert y.dtype == jnp.float64
        np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(pool, pool_ref)


@pytest.mark.parametrize("cut", [2, 9], ids=["first_piece_shorter_than_window", "long"])
def test_prefill_in_two_pieces_equals_one_piece(cut):
    # The shapes of the other prefill tests, so nothing recompiles: one real sequence of 12
    # tokens in row 0, the other rows padded; the second piece's window mixes both pieces
    # when the first piece is shorter than W-1.
    rng = np.random.default_rng(3)
    length = 12
    x, weight, bias, pool, _, _, _ = _batch(rng)
    slots = np.array([5] + [0] * (len(LENGTHS) - 1), np.int32)
    cont = np.zeros(len(LENGTHS), bool)
    cont[0] = True

    def call(x, pool, n_tokens, has_init):
        qsl = query_start_loc([n_tokens] + [0] * (len(LENGTHS) - 1))
        return _prefill(x, weight, bias, pool, qsl, slots, has_init, impl="reference")

    one_y, one_pool = call(x, pool, length, cont)
    first_y, mid_pool = call(x, pool, cut, cont)
    second_y, two_pool = call(np.roll(x, -cut, axis=0), mid_pool, length - cut, cont)
    pieces = np.concatenate([first_y[:cut], second_y[: length - cut]])
    np.testing.assert_allclose(pieces, one_y[:length], rtol=1e-6, atol=1e-6)
    _check_pool(two_pool, pool, one_pool, {5}, tol=0)


def _rows(rng, n_steps, slots, dtype=np.float32):
    x = rng.normal(size=(len(slots), n_steps, C)).astype(dtype)
    return (x, *_params(rng), _pool(rng, dtype), np.asarray(slots, np.int32))


def test_update_token_by_token_equals_prefill():
    rng = np.random.default_rng(4)
    slots = [6, 1, 10, 0]  # three real rows and a padded one
    n_steps = 5
    x, weight, bias, pool, idx = _rows(rng, n_steps, slots)
    # Prefill of the three real rows' 5 tokens each, continuing their windows.
    lengths = [n_steps] * 3 + [0]
    packed = np.concatenate([x[:3].reshape(-1, C), np.zeros((2, C), np.float32)])
    has_init = np.array([True, True, True, True])
    y_pre, pool_pre = _prefill(
        packed, weight, bias, pool, query_start_loc(lengths), idx, has_init, impl="reference"
    )
    step_pool = pool
    for t in range(n_steps):
        y_t, step_pool = _update(x[:, t : t + 1], weight, bias, step_pool, idx, impl="reference")
        np.testing.assert_allclose(y_t[:3, 0], y_pre[t : 3 * n_steps : n_steps], rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(y_t[3]), 0)
    _check_pool(step_pool, pool, pool_pre, {6, 1, 10}, tol=0)
    # All five tokens in one update call give the same.
    y_all, all_pool = _update(x, weight, bias, pool, idx, impl="reference")
    np.testing.assert_allclose(y_all[:3].reshape(-1, C), y_pre[: 3 * n_steps], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(all_pool), np.asarray(step_pool))


def test_verify_windows_are_windows_after_each_token():
    rng = np.random.default_rng(5)
    slots = [3, 12, 0]
    n_steps = 3
    x, weight, bias, pool, idx = _rows(rng, n_steps, slots)
    y, windows = _verify(x, weight, bias, pool, idx, impl="reference")
    assert windows.shape == (3, n_steps, C, W - 1) and windows.dtype == jnp.float32
    for n, slot in enumerate(slots[:2]):
        y_ref, _ = _numpy_sequence(x[n], weight, bias, pool[slot])
        np.testing.assert_allclose(y[n], y_ref, rtol=1e-5, atol=1e-6)
        ext = np.concatenate([pool[slot], x[n].T], axis=1)
        for t in range(n_steps):
            np.testing.assert_array_equal(np.asarray(windows[n, t]), ext[:, t + 1 : t + W])
    np.testing.assert_array_equal(np.asarray(y[2]), 0)
    np.testing.assert_array_equal(np.asarray(windows[2]), 0)


def test_bfloat16_prefill_keeps_dtypes_and_stores_raw_inputs():
    rng = np.random.default_rng(7)
    x, weight, bias, pool, qsl, slots, has_init = _batch(rng)
    x, pool = x.astype(jnp.bfloat16), pool.astype(jnp.bfloat16)
    y, new_pool = _prefill(x, weight, bias, pool, qsl, slots, has_init)
    assert y.dtype == new_pool.dtype == jnp.bfloat16
    y_ref, _ = _oracle((x, weight, bias, pool, qsl, slots, has_init))
    assert rel(y[: qsl[-1]], y_ref[: qsl[-1]]) < 1e-2
    # Sequence 4 (13 tokens) ends on its own inputs: the window is them, bit for bit.
    np.testing.assert_array_equal(
        np.asarray(new_pool[slots[4]]), np.asarray(x[qsl[5] - (W - 1) : qsl[5]]).T
    )


def test_auto_picks_the_reference_on_cpu():
    args = _batch(np.random.default_rng(8))

    def program(impl):
        return str(jax.make_jaxpr(lambda *a: conv1d.causal_conv1d(*a, impl=impl))(*args))

    assert program("auto") == program("reference")


@pytest.mark.parametrize("impl", ["pallas", "interpret"])
def test_kernel_impls_refuse_calls_the_kernel_cannot_take(impl):
    rng = np.random.default_rng(9)
    rows = _rows(rng, 2, [1, 2])
    calls = {
        "causal_conv1d": lambda: conv1d.causal_conv1d(*_batch(rng), impl=impl),
        "causal_conv1d_update": lambda: conv1d.causal_conv1d_update(*rows, impl=impl),
        "causal_conv1d_verify": lambda: conv1d.causal_conv1d_verify(*rows, impl=impl),
    }
    check_impl_refusals(calls, impl)


@pytest.mark.parametrize(
    ("position", "make", "message"),
    [
        (0, lambda a: a[:, :, None], r"x.shape=.* must be \[T, C\]"),
        (1, lambda a: a[:4], r"weight.shape=\(4, 4\) must be \[C, W\]=\[8, W\] with W >= 2"),
        (1, lambda a: a[:, :1], r"weight.shape=\(8, 1\) must be \[C, W\]=\[8, W\] with W >= 2"),
        (2, lambda a: a[:4], r"bias.shape=\(4,\) must be \[C\]=\(8,\) or bias=None"),
        (3, lambda a: a[:, :, :2], r"conv_pool.shape=.* must be \[S, C, W-1\]=\[S, 8, 3\]"),
        (3, lambda a: a.astype(np.float16), r"conv_pool.dtype=float16 must equal x.dtype"),
        (4, lambda a: a[:-1], r"qsl.shape=\(7,\) must be \[N\+1\]=\(8,\)"),
        (5, lambda a: a.astype(np.int64), r"state_indices.dtype=int64 must be int32"),
        (6, lambda a: a.astype(np.int32), r"has_initial_state.dtype=int32 must be bool"),
    ],
    ids=[
        "x_rank", "weight_channels", "width_one", "bias_channels", "pool_window",
        "pool_dtype", "qsl_length", "slots_dtype", "has_initial_state_dtype",
    ],
)  # fmt: skip
def test_prefill_rejects_bad_shapes_and_dtypes(position, make, message):
    args = _batch(np.random.default_rng(10))
    bad = replace(args, position, make(args[position]))
    with pytest.raises(ValueError, match=rf"causal_conv1d: {message}"):
        conv1d.causal_conv1d(*bad, impl="reference")


def test_rows_and_commit_reject_bad_arguments():
    rng = np.random.default_rng(11)
    rows = _rows(rng, 2, [1, 2])
    with pytest.raises(ValueError, match=r"activation='relu' must be one of \('silu', None\)"):
        conv1d.causal_conv1d_update(*rows, activation="relu")
    with pytest.raises(ValueError, match=r"state_indices.shape=\(3,\) must be \(2,\)"):
        conv1d.causal_conv1d_verify(*replace(rows, 4, np.zeros(3, np.int32)))
    windows = np.ones((2, 2, C, W - 1), np.float32)
    with pytest.raises(ValueError, match=r"windows.dtype=float16 must equal conv_pool.dtype"):
        conv1d.commit_windows(rows[3], windows.astype(np.float16), rows[4], np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"conv_pool.shape=.* must be \[S, C, W-1\]"):
        conv1d.commit_windows(rows[3], windows[:, :, :4], rows[4], np.zeros(2, np.int32))
