"""The warp-specialised state pass (gdn/_chunk_state.py) against chunk_mgpu's and the oracle.

Both state passes read the same intra-kernel outputs (chunk_mgpu's own ``_intra``), so the
new one must give ``chunk_mgpu._state``'s bits, outputs and pool alike; the float64
token-by-token oracle checks both. Kernels run under the Mosaic GPU CPU interpreter (each
warpgroup a thread, barriers real, fresh buffers NaN so an unwritten output shows; it needs
``NPROC`` from tests/conftest.py) and through the lowering for ``cuda`` at the production
dims (layouts, swizzles, TMA shapes and the SMEM budget, which the interpreter does not see).
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import bits, rel
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax.experimental.mosaic.gpu import core as mosaic_gpu_core

from pallas_kernels._common import on_hopper_gpu
from pallas_kernels._mgpu_chunks import ALIGN, BF16, CHUNK, F32, chunk_table
from pallas_kernels.gdn import _chunk_state, chunk_mgpu
from pallas_kernels.gdn import reference as gdn_reference
from pallas_kernels.gdn._chunk_intra import VEC_ROWS

# Starts at 0, 100 and 137 (unaligned: leading masked rows), an empty sequence, partial
# chunks, a sequence of 5 chunks (every stage and hand-off slot reused), 13 padding tokens,
# T=420 not a multiple of 8 (the last chunk is shifted back), GVA (2 value heads per key head).
VARLEN = ((100, 0, 37, 270), 420)
SMALL = (2, 4, 64, 64)  # H, HV, K, V
QWEN3_NEXT = (16, 32, 128, 128)


def _interpret(gpu: bool):
    return None if gpu else plgpu.InterpretGPUParams()


@functools.cache
def _case(lens: tuple[int, ...], tokens: int, dims=SMALL, gpu=False, seed=0):
    """The op's arguments (distinct random slots, has_initial_state alternating, the pool NaN
    wherever nothing may read it: slots nobody names and slots of sequences starting from
    zeros) and the state pass's inputs, prepared as ``chunk_mgpu`` prepares them; ``gpu``:
    the intra kernel runs compiled instead of interpreted."""
    h, hv, kd, vd = dims
    rng = np.random.default_rng(seed)
    n = len(lens)
    idx = rng.permutation(np.arange(1, 9))[:n].astype(np.int32)
    init = np.arange(n) % 2 == 0
    pool = rng.standard_normal((9, hv, kd, vd)).astype(np.float32) * 0.3
    pool[np.setdiff1d(np.arange(9), idx[init])] = np.nan
    args = dict(
        q=jnp.asarray(rng.standard_normal((tokens, h, kd)), BF16),
        k=jnp.asarray(rng.standard_normal((tokens, h, kd)), BF16),
        v=jnp.asarray(rng.standard_normal((tokens, hv, vd)), BF16),
        g=jnp.asarray(-np.log1p(np.exp(rng.standard_normal((tokens, hv)) - 1)), F32),
        beta=jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((tokens, hv)))), F32),
        ssm_pool=jnp.asarray(pool),
        qsl=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),
        state_indices=jnp.asarray(idx),
        has_initial_state=jnp.asarray(init),
    )
    padded = max(CHUNK, -(-tokens // ALIGN) * ALIGN)
    pad = padded - tokens

    def prepare(x):
        return jnp.pad(x, [(0, pad), (0, 0), (0, 0)])

    q, k, v = prepare(args["q"]), prepare(args["k"]), prepare(args["v"])
    g_t = jnp.pad(args["g"].T, [(0, 0), (0, pad)])
    beta_t = jnp.pad(args["beta"].T, [(0, 0), (0, pad)])
    table, first = chunk_table(args["qsl"], padded, -(-padded // CHUNK) + 2 * (n + 1))
    intra = jax.jit(
        functools.partial(chunk_mgpu._intra, n_seqs=n, scale=kd**-0.5, interpret=_interpret(gpu))
    )
    m, p, vecs = intra(q, k, g_t, beta_t, table, first)
    inputs = (q, k, v, m, p, vecs, table, first, jnp.asarray(idx), jnp.asarray(init, jnp.int32))
    return args, inputs


def _run(state_fn, lens, tokens, dims=SMALL, gpu=False, **kw):
    """``state_fn`` on the case's inputs with the pool as a mutable ref: ``(o, pool)``."""
    args, inputs = _case(lens, tokens, dims, gpu)

    def call(pool, *inputs):
        ref = jax.new_ref(pool)
        o = state_fn(*inputs, ref, n_seqs=len(lens), **kw)
        return o[:tokens], jax.freeze(ref)

    return jax.tree.map(np.asarray, jax.jit(call)(args["ssm_pool"], *inputs))


@functools.cache
def _baseline(lens, tokens, block_v, dims=SMALL, gpu=False):
    config = chunk_mgpu.Config(block_v=block_v)
    return _run(chunk_mgpu._state, lens, tokens, dims, gpu, cfg=config, interpret=_interpret(gpu))


@functools.cache
def _oracle(lens, tokens, dims=SMALL, gpu=False):
    """The token-by-token reference on float64 copies of the op's arguments."""
    args, _ = _case(lens, tokens, dims, gpu)
    with jax.enable_x64(True):
        wide = {
            name: jnp.asarray(np.asarray(x, np.float64)) if x.dtype.kind == "f" else x
            for name, x in args.items()
        }
        return jax.tree.map(np.asarray, gdn_reference.chunk_gated_delta_rule_recurrent(**wide))


def _check(lens, tokens, block_v, o, pool, dims=SMALL, gpu=False):
    """Bits of chunk_mgpu's state pass (on the GPU: its values, the compiler may contract
    the float32 operations differently); the oracle's values; padding zero; slots nobody
    writes (incl. an empty sequence's) bit-identical to the input pool."""
    o_old, pool_old = _baseline(lens, tokens, block_v, dims, gpu)
    args, _ = _case(lens, tokens, dims, gpu)
    idx = np.asarray(args["state_indices"])
    written = idx[np.asarray(lens) > 0]
    if gpu:
        assert rel(o, o_old) < 1e-3
        assert rel(pool[written], pool_old[written]) < 1e-3
    else:
        np.testing.assert_array_equal(bits(o), bits(o_old))
        np.testing.assert_array_equal(bits(pool), bits(pool_old))
    o_ref, pool_ref = _oracle(lens, tokens, dims, gpu)
    o = np.asarray(o, np.float32)
    end = sum(lens)
    assert np.isfinite(o).all(), "an output was never written (NaN) or a NaN slot was read"
    assert not o[end:].any(), "padding tokens must give zeros"
    if end:
        assert rel(o[:end], o_ref[:end]) < 1e-2
        assert rel(pool[written], pool_ref[written]) < 1e-2
    kept = np.setdiff1d(np.arange(pool.shape[0]), written)
    np.testing.assert_array_equal(bits(pool[kept]), bits(args["ssm_pool"][kept]))


@pytest.mark.parametrize(
    "block_v, stages",
    [(64, 2), (64, 3), pytest.param(32, 2, marks=pytest.mark.slow), (32, 3)],
    ids=lambda x: str(x),
)
def test_varlen_state_pass_gives_chunk_mgpu_bits_and_writes_only_its_slots(block_v, stages):
    lens, tokens = VARLEN
    o, pool = _run(
        _chunk_state.state_pass, lens, tokens, block_v=block_v, stages=stages, interpret=True
    )
    _check(lens, tokens, block_v, o, pool)


@pytest.mark.parametrize(
    "lens, tokens, block_v, stages",
    [((30,), 40, 32, 3), ((0, 0), 16, 64, 2)],
    ids=["shorter-than-a-chunk", "all-empty"],
)
def test_tiny_and_empty_calls_write_only_what_they_must(lens, tokens, block_v, stages):
    o, pool = _run(
        _chunk_state.state_pass, lens, tokens, block_v=block_v, stages=stages, interpret=True
    )
    assert o.shape == (tokens, SMALL[1], SMALL[3])
    _check(lens, tokens, block_v, o, pool)


def test_warpgroups_hand_over_tiles_without_a_data_race():
    # The interpreter's happens-before race detector sees every SMEM access of the three
    # warpgroups and the TMA engine. It can fail: without the `retired` wait (tried by hand)
    # it reports a race while the values stay right, and it found the missing proxy fence
    # before the output warpgroup hands a stage back.
    lens, tokens = (37, 150), 200
    params = plgpu.InterpretGPUParams(detect_races=True)
    o, pool = _run(_chunk_state.state_pass, lens, tokens, block_v=32, stages=2, interpret=params)
    assert not gpu_callbacks.get_races().races_found
    _check(lens, tokens, 32, o, pool)


def test_the_interpreter_refuses_a_cpu_pool_too_small_for_its_warpgroups(monkeypatch):
    # With 2 threads in XLA's CPU pool the warpgroups would wait on each other forever: the
    # call must stop with the fix instead (the rest of the suite runs with NPROC=16).
    monkeypatch.setenv("NPROC", "2")
    with pytest.raises(ValueError, match="has 2 here.*NPROC=16"):
        _run(_chunk_state.state_pass, *VARLEN, block_v=32, stages=2, interpret=True)


def _lower(block_v, stages, d=128):
    """The state pass jitted with the pool donated, lowered for cuda at Qwen3-Next TP1 dims."""
    shape = jax.ShapeDtypeStruct
    tokens, n, h, hv = 4096, 3, 16, 32
    nc = tokens // CHUNK + 2 * (n + 1)
    args = (
        shape((tokens, h, d), BF16),
        shape((tokens, h, d), BF16),
        shape((tokens, hv, d), BF16),
        shape((nc, hv, CHUNK, CHUNK), BF16),
        shape((nc, hv, CHUNK, CHUNK), BF16),
        shape((nc, hv, VEC_ROWS, CHUNK), F32),
        shape((3, nc), jnp.int32),
        shape((n + 2,), jnp.int32),
        shape((n,), jnp.int32),
        shape((n,), jnp.int32),
        shape((8, hv, d, d), F32),
    )

    def call(*a):
        ref = jax.new_ref(a[-1])
        o = _chunk_state.state_pass(*a[:-1], ref, n_seqs=n, block_v=block_v, stages=stages)
        return o, jax.freeze(ref)

    return jax.jit(call, donate_argnums=10).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("block_v, stages", [(32, 2), (32, 3), (64, 2)], ids=lambda x: str(x))
def test_lowers_for_cuda_at_qwen3_next_shapes_within_the_counted_smem(block_v, stages):
    # Mosaic GPU refuses at lowering a kernel over its SMEM bound: with the bound set to
    # smem_bytes the kernel lowers, one byte under it does not, so the count is Mosaic's own.
    need = _chunk_state.smem_bytes(128, block_v, stages)
    assert need <= _chunk_state.SMEM_LIMIT
    with mosaic_gpu_core.artificial_shared_memory_limit(need):
        assert "gdn_chunk_state_ws" in _lower(block_v, stages).as_text()
    with mosaic_gpu_core.artificial_shared_memory_limit(need - 1):
        with pytest.raises(ValueError, match="exceeds available shared memory"):
            _lower(block_v, stages)


def test_configs_over_the_smem_budget_or_outside_the_kernel_are_refused():
    reason = _chunk_state.unsupported_reason
    allowed = {
        (bv, st)
        for bv in (32, 64)
        for st in (2, 3)
        if reason(128, 128, block_v=bv, stages=st) is None
    }
    assert allowed == {(32, 2), (32, 3), (64, 2)}
    assert "stages=3" in reason(128, 128, block_v=64, stages=3)
    assert reason(64, 64, block_v=64, stages=3) is None  # K=64 tiles are half the size
    assert "block_v=48" in reason(128, 128, block_v=48, stages=2)
    assert "stages=4" in reason(128, 128, block_v=32, stages=4)
    with pytest.raises(ValueError, match="SMEM"):
        _lower(64, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper_gpu(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("block_v, stages", [(32, 2), (32, 3), (64, 2)], ids=lambda x: str(x))
def test_on_the_gpu_state_pass_matches_chunk_mgpu_at_qwen3_next_dims(block_v, stages):
    # Every varlen path at the production dims, compiled: unaligned starts, partial chunks,
    # an empty sequence, sequences of 16 and 48 chunks, 13 padding tokens.
    lens, tokens = (1000, 0, 37, 3000, 77, 1), 4128
    o, pool = _run(
        _chunk_state.state_pass, lens, tokens, QWEN3_NEXT, True, block_v=block_v, stages=stages
    )
    _check(lens, tokens, block_v, o, pool, QWEN3_NEXT, True)
