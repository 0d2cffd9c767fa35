"""The Mosaic GPU chunked prefill of Gated DeltaNet (chunk_mgpu) against the float64 oracle.

The kernels run under the Mosaic GPU CPU interpreter (values; fresh buffers start as NaN, so
an unwritten output shows) and through the lowering for ``cuda`` at the production head dims
(layouts, swizzles and TMA shapes, which the interpreter does not check).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import bits, rel

from pallas_kernels import _mgpu_chunks
from pallas_kernels.gdn import chunk_mgpu
from pallas_kernels.gdn import reference as gdn_reference


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
    args = dict(
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
    return args


def _oracle(args):
    """The token-by-token reference on float64 copies of the inputs."""
    with jax.enable_x64(True):
        wide = {
            name: jnp.asarray(np.asarray(x, np.float64)) if x.dtype.kind == "f" else x
            for name, x in args.items()
        }
        return jax.tree.map(np.asarray, gdn_reference.chunk_gated_delta_rule_recurrent(**wide))


@pytest.mark.parametrize(
    "block_v, stages",
    [(64, 0), (32, 0), (64, 2), (32, 3)],
    ids=["bv64", "bv32-kmajor", "bv64-warp-specialised", "bv32-warp-specialised-3-stages"],
)
def test_varlen_prefill_matches_oracle_and_writes_only_its_slots(block_v, stages):
    # Starts at 0, 100 and 137 (unaligned: leading masked rows), an empty sequence, lengths
    # not multiples of 64, 13 padding tokens, T=300 not a multiple of 8 (the last chunk is
    # shifted back), GVA (2 value heads per key head).
    lens = [100, 0, 37, 150]
    args = _case(0, lens, 300, h=1, hv=2, kd=64, vd=64, slots=9)
    config = chunk_mgpu.Config(block_v=block_v, state_stages=stages)
    o, pool = jax.jit(
        lambda a: chunk_mgpu.chunk_gated_delta_rule(**a, interpret=True, config=config)
    )(args)
    o_ref, pool_ref = _oracle(args)
    o = np.asarray(o, np.float32)
    end = int(np.asarray(args["qsl"])[-1])
    assert np.isfinite(o).all(), "an output was never written (NaN) or a NaN slot was read"
    assert not o[end:].any(), "padding tokens must give zeros"
    assert rel(o[:end], o_ref[:end]) < 1e-2
    idx = np.asarray(args["state_indices"])
    written = idx[np.asarray(lens) > 0]
    assert rel(pool[written], pool_ref[written]) < 1e-2
    kept = np.setdiff1d(np.arange(pool.shape[0]), written)  # incl. the empty sequence's slot
    np.testing.assert_array_equal(bits(pool[kept]), bits(args["ssm_pool"][kept]))


# Qwen3.5's value/key head ratios 1, 3 and 4 (2 is the case above).
@pytest.mark.parametrize(("h", "hv"), [(2, 2), (1, 3), (1, 4)], ids=["ratio1", "ratio3", "ratio4"])
def test_varlen_prefill_takes_every_value_key_head_ratio(h, hv):
    lens = [40, 20]  # one chunk holds both: the cheapest interpreter run with a state carried
    args = _case(3, lens, 64, h=h, hv=hv, kd=64, vd=64, slots=5)
    o, pool = jax.jit(lambda a: chunk_mgpu.chunk_gated_delta_rule(**a, interpret=True))(args)
    o_ref, pool_ref = _oracle(args)
    end = int(np.asarray(args["qsl"])[-1])
    assert rel(np.asarray(o, np.float32)[:end], o_ref[:end]) < 1e-2
    idx = np.asarray(args["state_indices"])
    assert rel(pool[idx], pool_ref[idx]) < 1e-2


def test_chunk_table_covers_every_token_once_from_aligned_starts():
    lens = [100, 0, 37, 150, 1, 64, 7]
    tokens = 376  # 17 padding tokens
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    n_chunks = tokens // 64 + 1 + 2 * (len(lens) + 1)
    table, first = map(np.asarray, _mgpu_chunks.chunk_table(qsl, tokens, n_chunks))
    seen = np.zeros(tokens, int)
    owner = np.full(tokens, -1)
    for seg in range(len(lens) + 1):
        for c in range(first[seg], first[seg + 1]):
            start, lo, hi = table[:, c]
            assert start % chunk_mgpu.ALIGN == 0 and 0 <= start <= tokens - chunk_mgpu.CHUNK
            assert 0 <= lo < hi <= chunk_mgpu.CHUNK
            seen[start + lo : start + hi] += 1
            owner[start + lo : start + hi] = seg
    np.testing.assert_array_equal(seen, 1)
    bounds = np.concatenate([np.asarray(qsl), [tokens]])
    np.testing.assert_array_equal(owner, np.repeat(np.arange(len(lens) + 1), np.diff(bounds)))
    assert first[-1] <= n_chunks


def test_sequence_layout_starts_every_sequence_aligned_and_maps_tokens_both_ways():
    lens = [13, 0, 70, 5, 1]
    tokens = 96  # 7 padding tokens
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    layout = _mgpu_chunks.sequence_layout(qsl, tokens)
    starts, ends = np.asarray(layout.qsl), np.asarray(layout.ends)
    assert (starts % chunk_mgpu.ALIGN == 0).all()
    np.testing.assert_array_equal(ends - starts[:-1], lens)
    assert ends.max() + chunk_mgpu.CHUNK <= layout.num_tokens  # no chunk is shifted back
    x = jnp.arange(1, tokens + 1, dtype=jnp.int32)
    spread = np.asarray(layout.spread(x))
    for n, length in enumerate(lens):
        np.testing.assert_array_equal(spread[starts[n] : ends[n]], x[qsl[n] : qsl[n] + length])
    assert np.count_nonzero(spread) == sum(lens)  # gaps and padding hold zeros
    back = np.asarray(layout.gather(layout.spread(x)))
    np.testing.assert_array_equal(back[: sum(lens)], x[: sum(lens)])
    assert not back[sum(lens) :].any()  # the call's padding tokens give zeros


def _placed(target, lens, at, tokens, seed):
    """A call of ``lens`` packed in ``tokens`` rows whose sequence ``at`` is ``target`` (a
    dict of its token arrays, its slot 1 continuing a state) and the rest fresh random tokens
    in slots 2.."""
    rng = np.random.default_rng(seed)
    h, kd = target["q"].shape[1:]
    hv, vd = target["v"].shape[1:]
    filler = _case(seed, [tokens], tokens, h=h, hv=hv, kd=kd, vd=vd, slots=2)
    start = int(np.sum(lens[:at]))
    args = {
        name: filler[name].at[start : start + lens[at]].set(target[name])
        for name in ("q", "k", "v", "g", "beta")
    }
    slots = np.arange(2, len(lens) + 2, dtype=np.int32)
    slots[at] = 1
    init = rng.random(len(lens)) < 0.5
    init[at] = True
    args.update(
        ssm_pool=target["ssm_pool"],
        qsl=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),
        state_indices=jnp.asarray(slots),
        has_initial_state=jnp.asarray(init),
    )
    return args


def test_packing_invariant_calls_give_a_sequence_the_same_bits_wherever_it_sits():
    """A 70-token sequence (two chunks) alone, after 13 tokens (its chunks would start 5 rows
    early), and after 3 tokens with its last chunk at the end of the axis (which the packed
    layout shifts back): outputs and final state bit for bit, each call near the oracle."""
    rng = np.random.default_rng(11)
    one = _case(11, [70], 70, h=1, hv=2, kd=64, vd=64, slots=8)
    pool = jnp.asarray(rng.standard_normal((8, 2, 64, 64)).astype(np.float32) * 0.3)
    target = {**{name: one[name] for name in ("q", "k", "v", "g", "beta")}, "ssm_pool": pool}
    run = jax.jit(
        lambda a: chunk_mgpu.chunk_gated_delta_rule(**a, interpret=True, packing_invariant=True)
    )
    seen = []
    for lens, at, tokens in (([70], 0, 80), ([13, 70, 5], 1, 96), ([3, 0, 70], 2, 73)):
        args = _placed(target, lens, at, tokens, seed=len(seen))
        o, out_pool = run(args)
        o_ref, pool_ref = _oracle(args)
        end, start = sum(lens), sum(lens[:at])
        o = np.asarray(o, np.float32)
        assert np.isfinite(o).all() and not o[end:].any()
        assert rel(o[:end], o_ref[:end]) < 1e-2
        written = np.asarray(args["state_indices"])[np.asarray(lens) > 0]
        assert rel(out_pool[written], pool_ref[written]) < 1e-2
        kept = np.setdiff1d(np.arange(8), written)
        np.testing.assert_array_equal(bits(out_pool[kept]), bits(pool[kept]))
        seen.append((o[start : start + 70], np.asarray(out_pool[1])))
    for o, state in seen[1:]:
        np.testing.assert_array_equal(bits(o), bits(seen[0][0]))
        np.testing.assert_array_equal(bits(state), bits(seen[0][1]))


@pytest.mark.parametrize("block_v, d", [(64, 128), (32, 128), (32, 64)])
def test_kernels_lower_for_cuda_at_qwen3_next_shapes(block_v, d):
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
    config = chunk_mgpu.Config(block_v=block_v)
    fn = jax.jit(lambda *a: chunk_mgpu.chunk_gated_delta_rule(*a, config=config), donate_argnums=5)
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "gdn_chunk_intra" in text and "gdn_chunk_state" in text


def _shapes(t=128, h=2, hv=4, kd=128, vd=128, dtype=jnp.bfloat16):
    return [
        jnp.zeros((t, h, kd), dtype),
        jnp.zeros((t, h, kd), dtype),
        jnp.zeros((t, hv, vd), dtype),
        jnp.zeros((t, hv), jnp.float32),
        jnp.zeros((t, hv), jnp.float32),
        jnp.zeros((3, hv, kd, vd), jnp.float32),
        jnp.zeros((3,), jnp.int32),
        jnp.zeros((2,), jnp.int32),
        jnp.zeros((2,), bool),
    ]


def test_unsupported_reason_accepts_the_contract_and_names_what_it_refuses():
    assert chunk_mgpu.unsupported_reason(*_shapes()) is None
    assert chunk_mgpu.unsupported_reason(*_shapes(kd=64, vd=64, dtype=jnp.float32)) is None
    assert "K=96" in chunk_mgpu.unsupported_reason(*_shapes(kd=96))
    assert "use_qk_l2norm" in chunk_mgpu.unsupported_reason(*_shapes(), use_qk_l2norm=False)
    assert "HV=3" in chunk_mgpu.unsupported_reason(*_shapes(hv=3))
    with pytest.raises(ValueError, match="K=96"):
        chunk_mgpu.chunk_gated_delta_rule(*_shapes(kd=96))


def test_block_v_is_narrow_only_while_wide_blocks_leave_multiprocessors_idle():
    def pick(n_seqs):
        return chunk_mgpu._resolve(chunk_mgpu.Config(), n_seqs, 32, 128).block_v

    assert pick(1) == 32  # one long sequence: 64 blocks of 64 columns, 132 SMs
    assert pick(4) == 64 and pick(64) == 64
    assert chunk_mgpu._resolve(chunk_mgpu.Config(block_v=64), 1, 32, 128).block_v == 64


def test_state_pass_is_warp_specialised_on_the_gpu_and_single_in_the_interpreter():
    def stages(n_seqs, interpret=None, **fixed):
        config = chunk_mgpu.Config(**fixed)
        return chunk_mgpu._resolve(config, n_seqs, 32, 128, interpret=interpret).state_stages

    assert stages(1) == 3 and stages(4) == 2  # 3 stages fit at 32 columns only
    assert stages(1, interpret=True) == 0  # its warpgroups would need NPROC > 2
    assert stages(1, interpret=True, state_stages=2) == 2
    assert stages(4, state_stages=0) == 0


@pytest.mark.parametrize(
    "lens, tokens", [([30], 40), ([0, 0], 16)], ids=["shorter-than-a-chunk", "all-empty"]
)
def test_tiny_and_empty_calls_write_only_what_they_must(lens, tokens):
    args = _case(3, lens, tokens, h=1, hv=2, kd=64, vd=64, slots=5)
    o, pool = chunk_mgpu.chunk_gated_delta_rule(**args, interpret=True)
    o_ref, pool_ref = _oracle(args)
    o = np.asarray(o, np.float32)
    end = sum(lens)
    assert o.shape == (tokens, 2, 64) and np.isfinite(o).all()
    assert not o[end:].any(), "padding tokens must give zeros"
    idx = np.asarray(args["state_indices"])
    written = idx[np.asarray(lens) > 0]
    if end:
        assert rel(o[:end], o_ref[:end]) < 1e-2
        assert rel(pool[written], pool_ref[written]) < 1e-2
    kept = np.setdiff1d(np.arange(pool.shape[0]), written)
    np.testing.assert_array_equal(bits(pool[kept]), bits(args["ssm_pool"][kept]))
