"""The warp-specialised chunked GDN prefill (chunk_fused_mgpu) against the float64 oracle.

Runs under the Mosaic GPU CPU interpreter (every warpgroup a CPU thread, barriers real, fresh
buffers NaN so an unwritten output shows) and through the lowering for ``cuda`` at the
production head dims (layouts, swizzles, TMA shapes, warpgroup count).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gdn import chunk_fused_mgpu
from pallas_kernels.gdn import reference as gdn_reference


def _rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint32)


def _case(seed, lens, tokens, *, h, hv, kd, vd, slots):
    """Packed sequences ``lens`` in ``tokens`` rows (the rest is padding), distinct random
    slots, has_initial_state alternating. The pool is NaN wherever the kernel must not read:
    slots no sequence names and slots of sequences that start from zeros."""
    rng = np.random.default_rng(seed)
    n = len(lens)
    idx = rng.permutation(np.arange(1, slots))[:n].astype(np.int32)
    init = np.arange(n) % 2 == 0
    pool = rng.standard_normal((slots, hv, kd, vd)).astype(np.float32) * 0.3
    pool[np.setdiff1d(np.arange(slots), idx[init])] = np.nan
    return dict(
        q=jnp.asarray(rng.standard_normal((tokens, h, kd)), jnp.bfloat16),
        k=jnp.asarray(rng.standard_normal((tokens, h, kd)), jnp.bfloat16),
        v=jnp.asarray(rng.standard_normal((tokens, hv, vd)), jnp.bfloat16),
        g=jnp.asarray(-np.log1p(np.exp(rng.standard_normal((tokens, hv)) - 1)), jnp.float32),
        beta=jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((tokens, hv)))), jnp.float32),
        ssm_pool=jnp.asarray(pool),
        qsl=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),
        state_indices=jnp.asarray(idx),
        has_initial_state=jnp.asarray(init),
    )


def _oracle(args):
    """The token-by-token reference on float64 copies of the inputs."""
    with jax.enable_x64(True):
        wide = {
            name: jnp.asarray(np.asarray(x, np.float64)) if x.dtype.kind == "f" else x
            for name, x in args.items()
        }
        return jax.tree.map(np.asarray, gdn_reference.chunk_gated_delta_rule_recurrent(**wide))


def _check(args, lens, o, pool):
    o_ref, pool_ref = _oracle(args)
    o = np.asarray(o, np.float32)
    end = sum(lens)
    assert np.isfinite(o).all(), "an output was never written (NaN) or a NaN slot was read"
    assert not o[end:].any(), "padding tokens must give zeros"
    idx = np.asarray(args["state_indices"])
    written = idx[np.asarray(lens) > 0]
    if end:
        assert _rel(o[:end], o_ref[:end]) < 1e-2
        assert _rel(pool[written], pool_ref[written]) < 1e-2
    kept = np.setdiff1d(np.arange(pool.shape[0]), written)  # incl. empty sequences' slots
    np.testing.assert_array_equal(_bits(pool[kept]), _bits(args["ssm_pool"][kept]))


@pytest.mark.parametrize(
    "block_v, producers, slots, lens, tokens",
    [
        (64, 1, 2, [100, 0, 37, 150], 300),
        (32, 2, 2, [37, 150], 200),
        (32, 1, 3, [0, 250, 0], 260),
    ],
    ids=["bv64-1producer", "bv32-2producers", "bv32-3slots"],
)
def test_varlen_prefill_matches_oracle_and_writes_only_its_slots(
    block_v, producers, slots, lens, tokens
):
    # Unaligned starts (leading masked rows), empty sequences, sequences of 3 and 4 chunks
    # (every SMEM slot reused; with 2 producers each producer reuses its own), padding tokens,
    # T not a multiple of 8 (the last chunk is shifted back), GVA (2 value heads per key head).
    args = _case(0, lens, tokens, h=1, hv=2, kd=64, vd=64, slots=9)
    config = chunk_fused_mgpu.Config(block_v=block_v, producers=producers, slots=slots)
    o, pool = jax.jit(
        lambda a: chunk_fused_mgpu.chunk_gated_delta_rule(**a, interpret=True, config=config)
    )(args)
    _check(args, lens, o, pool)


@pytest.mark.parametrize(
    "lens, tokens", [([30], 40), ([0, 0], 16)], ids=["shorter-than-a-chunk", "all-empty"]
)
def test_tiny_and_empty_calls_write_only_what_they_must(lens, tokens):
    args = _case(3, lens, tokens, h=1, hv=2, kd=64, vd=64, slots=5)
    o, pool = chunk_fused_mgpu.chunk_gated_delta_rule(**args, interpret=True)
    assert o.shape == (tokens, 2, 64)
    _check(args, lens, o, pool)


@pytest.mark.parametrize(
    "block_v, producers, slots, d",
    [(64, 1, 2, 128), (64, 2, 2, 128), (32, 2, 2, 128), (32, 1, 3, 128), (32, 1, 2, 64)],
)
def test_kernel_lowers_for_cuda_at_qwen3_next_shapes(block_v, producers, slots, d):
    shape = jax.ShapeDtypeStruct
    tokens, n, h, hv = 4096, 3, 16, 32
    args = (
        shape((tokens, h, d), jnp.bfloat16),
        shape((tokens, h, d), jnp.bfloat16),
        shape((tokens, hv, d), jnp.bfloat16),
        shape((tokens, hv), jnp.float32),
        shape((tokens, hv), jnp.float32),
        shape((8, hv, d, d), jnp.float32),
        shape((n + 1,), jnp.int32),
        shape((n,), jnp.int32),
        shape((n,), jnp.bool_),
    )
    config = chunk_fused_mgpu.Config(block_v=block_v, producers=producers, slots=slots)
    fn = jax.jit(
        lambda *a: chunk_fused_mgpu.chunk_gated_delta_rule(*a, config=config), donate_argnums=5
    )
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "gdn_chunk_fused" in text


def test_unsupported_reason_names_the_config_and_the_contract():
    args = [
        jnp.zeros((128, 2, 128), jnp.bfloat16),
        jnp.zeros((128, 2, 128), jnp.bfloat16),
        jnp.zeros((128, 4, 128), jnp.bfloat16),
        jnp.zeros((128, 4), jnp.float32),
        jnp.zeros((128, 4), jnp.float32),
        jnp.zeros((3, 4, 128, 128), jnp.float32),
        jnp.zeros((3,), jnp.int32),
        jnp.zeros((2,), jnp.int32),
        jnp.zeros((2,), bool),
    ]
    assert chunk_fused_mgpu.unsupported_reason(*args) is None
    bad = chunk_fused_mgpu.Config(producers=3)
    assert "producers=3" in chunk_fused_mgpu.unsupported_reason(*args, config=bad)
    assert "use_qk_l2norm" in chunk_fused_mgpu.unsupported_reason(*args, use_qk_l2norm=False)
    three_slots = chunk_fused_mgpu.Config(block_v=64, slots=3)
    assert "slots=3" in chunk_fused_mgpu.unsupported_reason(*args, config=three_slots)
    with pytest.raises(ValueError, match="producers=3"):
        chunk_fused_mgpu.chunk_gated_delta_rule(*args, config=bad)
