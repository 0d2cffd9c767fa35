"""The Mosaic GPU SSD chunk-scan kernel of Mamba2 against the float64 oracle.

It runs under the Mosaic GPU CPU interpreter (values; fresh output buffers start as NaN, so an
unwritten row shows) and through the Pallas -> Mosaic GPU lowering for ``cuda`` (layouts and TMA
shapes, which the interpreter does not check); tests/kernels/test_mamba2_gpu.py runs it on an
H200. The kernel multiplies with bf16 operands, so it is held to bf16-level error (1e-2
relative).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import bits, rel

from pallas_kernels import mamba2
from pallas_kernels.mamba2 import reference as mamba2_reference
from pallas_kernels.mamba2 import ssd_mgpu

H, G, P, N = 4, 2, 64, 64
S = 11
# A 1-token sequence, one longer than a chunk that starts off the 8-row tiling (at 1), an empty
# one, one of exactly a chunk, one ending inside a chunk, then a padded row; the token axis
# has a padded tail of 5 (T = 158 is not a multiple of 8 either).
LENGTHS = (1, 70, 0, 64, 13, 0)
T = sum(LENGTHS) + 5


def _case(seed, dtype, gate):
    """Random distinct slots in a larger pool, has_initial_state mixed; the pool is NaN in the
    pad slot, in every slot no row names and in the slots of fresh sequences."""
    rng = np.random.default_rng(seed)
    n = len(LENGTHS)
    slots = rng.permutation(np.arange(1, S))[:n].astype(np.int32)
    slots[-1] = 0
    has_init = np.array([True, True, False, False, True, True])
    pool = rng.standard_normal((S, H, P, N)).astype(np.float32)
    pool[np.setdiff1d(np.arange(S), slots[has_init & (slots > 0)])] = np.nan
    args = dict(
        x=jnp.asarray(rng.standard_normal((T, H, P)), dtype),
        dt=jnp.asarray(rng.standard_normal((T, H)), jnp.float32),
        A=jnp.asarray(-np.exp(rng.uniform(-1.5, 1.0, H)), jnp.float32),
        B=jnp.asarray(rng.standard_normal((T, G, N)) / np.sqrt(N), dtype),
        C=jnp.asarray(rng.standard_normal((T, G, N)), dtype),
        D=jnp.asarray(rng.standard_normal(H), jnp.float32),
        dt_bias=jnp.asarray(rng.uniform(-1.0, 0.5, H), jnp.float32),
        ssm_pool=jnp.asarray(pool),
        qsl=jnp.asarray(np.concatenate([[0], np.cumsum(LENGTHS)]), jnp.int32),
        state_indices=jnp.asarray(slots),
        has_initial_state=jnp.asarray(has_init),
    )
    if gate:
        args["z"] = jnp.asarray(rng.standard_normal((T, H, P)), dtype)
    return args


def _oracle(args, **options):
    with jax.enable_x64(True):
        wide = {
            k: jnp.asarray(np.asarray(v, np.float64))
            if jnp.issubdtype(v.dtype, jnp.floating)
            else v
            for k, v in args.items()
        }
        return jax.tree.map(
            np.asarray, mamba2_reference.ssd_chunk_scan_recurrent(**wide, **options)
        )


@pytest.mark.parametrize(
    "dtype, gate, options",
    [(jnp.bfloat16, False, {}), (jnp.float32, True, {"dt_min": 0.05, "dt_max": 0.7})],
    ids=["bf16", "f32-gated-dt_limits"],
)
def test_kernel_matches_oracle_and_writes_only_nonempty_slots(dtype, gate, options):
    args = _case(0, dtype, gate)
    y, pool = jax.jit(functools.partial(ssd_mgpu.ssd_chunk_scan, interpret=True, **options))(**args)
    y_ref, pool_ref = _oracle(args, **options)
    end = int(args["qsl"][-1])
    assert y.dtype == dtype and np.isfinite(np.asarray(y, np.float32)).all()
    assert rel(y[:end], y_ref[:end]) < 1e-2
    assert not np.asarray(y, np.float32)[end:].any(), "padding tokens must give zeros"
    slots = np.asarray(args["state_indices"])
    written = np.array([s for s, length in zip(slots, LENGTHS, strict=True) if length])
    assert rel(pool[written], pool_ref[written]) < 1e-2
    others = np.setdiff1d(np.arange(S), written)  # the empty sequence's slot and slot 0 too
    np.testing.assert_array_equal(bits(pool[others]), bits(args["ssm_pool"][others]))


def _short(args, lengths, t_total):
    """The first ``t_total`` tokens of ``args`` as a call of ``len(lengths)`` rows."""
    short = {k: v[:t_total] for k, v in args.items() if k in ("x", "dt", "B", "C", "z")}
    n = len(lengths)
    short.update(
        {k: args[k] for k in ("A", "D", "dt_bias", "ssm_pool")},
        qsl=jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32),
        state_indices=args["state_indices"][:n],
        has_initial_state=args["has_initial_state"][:n],
    )
    return short


def test_public_op_runs_the_kernel_on_a_call_shorter_than_a_chunk():
    args = _short(_case(1, jnp.bfloat16, gate=True), (13, 0), 20)
    z = args.pop("z")
    names = ("x", "dt", "A", "B", "C", "D", "dt_bias", "ssm_pool", "qsl", "state_indices")
    positional = [args[name] for name in (*names, "has_initial_state")]
    y, pool = mamba2.ssd_chunk_scan(*positional, z=z, impl="interpret")
    y_ref, pool_ref = _oracle({**args, "z": z})
    assert rel(y[:13], y_ref[:13]) < 1e-2
    assert not np.asarray(y, np.float32)[13:].any()
    slot = int(args["state_indices"][0])
    assert rel(pool[slot], pool_ref[slot]) < 1e-2
    others = np.setdiff1d(np.arange(S), [slot])
    np.testing.assert_array_equal(bits(pool[others]), bits(args["ssm_pool"][others]))


def test_all_empty_batch_outputs_zeros_and_leaves_pool():
    args = _short(_case(2, jnp.bfloat16, gate=False), (0, 0), 20)
    y, pool = jax.jit(functools.partial(ssd_mgpu.ssd_chunk_scan, interpret=True))(**args)
    np.testing.assert_array_equal(np.asarray(y, np.float32), 0)
    np.testing.assert_array_equal(bits(pool), bits(args["ssm_pool"]))


def test_packing_invariant_calls_give_a_sequence_the_same_bits_wherever_it_sits():
    """The 70-token row of the case (slot and state of its own) alone, after 13 tokens and
    after 3 with its last chunk at the end of the axis: outputs and final state bit for bit,
    each call near the oracle."""
    base = _case(4, jnp.bfloat16, gate=True)
    token_names = ("x", "dt", "B", "C", "z")
    target = {name: base[name][1:71] for name in token_names}  # LENGTHS[1] starts at 1
    run = jax.jit(functools.partial(ssd_mgpu.ssd_chunk_scan, interpret=True,
                                    packing_invariant=True))  # fmt: skip
    seen = []
    for lens, at, tokens in (([70], 0, 80), ([13, 70, 5], 1, 96), ([3, 0, 70], 2, 73)):
        start = sum(lens[:at])
        args = {
            name: base[name][-tokens:].at[start : start + 70].set(target[name])
            for name in token_names
        }
        own = int(base["state_indices"][1])  # a slot with a finite state (has_init)
        slots = np.array([s for s in range(1, S) if s != own][: len(lens)], np.int32)
        slots[at] = own
        args.update(
            {name: base[name] for name in ("A", "D", "dt_bias", "ssm_pool")},
            qsl=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),
            state_indices=jnp.asarray(slots),
            has_initial_state=jnp.asarray(np.arange(len(lens)) == at),
        )
        y, pool = run(**args)
        y_ref, pool_ref = _oracle(args)
        y = np.asarray(y, np.float32)
        assert np.isfinite(y[: sum(lens)]).all() and not y[sum(lens) :].any()
        assert rel(y[: sum(lens)], y_ref[: sum(lens)]) < 1e-2
        written = slots[np.asarray(lens) > 0]
        assert rel(pool[written], pool_ref[written]) < 1e-2
        kept = np.setdiff1d(np.arange(S), written)
        np.testing.assert_array_equal(bits(pool[kept]), bits(base["ssm_pool"][kept]))
        seen.append((y[start : start + 70], np.asarray(pool[slots[at]])))
    for y, state in seen[1:]:
        np.testing.assert_array_equal(bits(y), bits(seen[0][0]))
        np.testing.assert_array_equal(bits(state), bits(seen[0][1]))


def _production(t_total, n_seq, *, h=128, g=8, p=64, nd=128, dtype=jnp.bfloat16, gate=False):
    """Nemotron-H 8B-like shapes."""
    f32 = jnp.float32
    args = dict(
        x=jax.ShapeDtypeStruct((t_total, h, p), dtype),
        dt=jax.ShapeDtypeStruct((t_total, h), dtype),
        A=jax.ShapeDtypeStruct((h,), f32),
        B=jax.ShapeDtypeStruct((t_total, g, nd), dtype),
        C=jax.ShapeDtypeStruct((t_total, g, nd), dtype),
        D=jax.ShapeDtypeStruct((h,), f32),
        dt_bias=jax.ShapeDtypeStruct((h,), f32),
        ssm_pool=jax.ShapeDtypeStruct((32, h, p, nd), f32),
        qsl=jax.ShapeDtypeStruct((n_seq + 1,), jnp.int32),
        state_indices=jax.ShapeDtypeStruct((n_seq,), jnp.int32),
        has_initial_state=jax.ShapeDtypeStruct((n_seq,), jnp.bool_),
    )
    if gate:
        args["z"] = jax.ShapeDtypeStruct((t_total, h, p), dtype)
    return args


@pytest.mark.parametrize(
    "t_total, n_seq, shape",
    [
        (8192, 1, {}),
        (300, 4, {"p": 128, "nd": 64, "dtype": jnp.float32, "gate": True}),
        (40, 3, {"h": 64, "g": 1}),
    ],
    ids=["1x8192", "varlen-P128-N64-f32-gated", "shorter-than-a-chunk"],
)
def test_kernel_lowers_for_cuda_with_the_pool_aliased(t_total, n_seq, shape):
    args = _production(t_total, n_seq, **shape)
    traced = jax.jit(ssd_mgpu.ssd_chunk_scan, donate_argnames=("ssm_pool",)).trace(**args)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    pool_type = "x".join(map(str, args["ssm_pool"].shape))
    assert re.search(rf"tensor<{pool_type}xf32> {{tf.aliasing_output = 1 ", main)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize(
    "change, words",
    [(dict(p=96), "head dims"), (dict(nd=256), "state sizes"), (dict(g=3), "multiple of G")],
    ids=["P96", "N256", "G3"],
)
def test_unsupported_reason_names_the_rule(change, words):
    args = _production(64, 2, **change)
    assert words in ssd_mgpu.unsupported_reason(**args)
    assert ssd_mgpu.unsupported_reason(**_production(8192, 4, gate=True)) is None
