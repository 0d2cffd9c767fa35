"""State pools (shapes, reset of exactly the given slots) and the host-side slot allocator."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax import state_pool
from hybrid_jax.state_pool import (
    LinearStateSpec,
    PoolExhaustedError,
    SlotAllocator,
    SlotError,
    StatePool,
    allocate_slots,
    bytes_per_slot,
    init_state_pool,
    reset_slots,
)

S = 9  # real slots 1..8
GDN = LinearStateSpec.gdn(num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=4)
OTHER = LinearStateSpec(conv_channels=6, conv_width=3, ssm_shape=(2, 3, 5), conv_dtype=jnp.float32)
SPECS = (GDN, GDN)


def random_pool(seed=0):
    """A pool whose every element is nonzero, so a zeroed slot is visible."""
    rng = np.random.default_rng(seed)
    pool = init_state_pool(SPECS, S)
    return jax.tree.map(lambda a: jnp.asarray(rng.uniform(0.5, 1.5, a.shape), a.dtype), pool)


def snapshot(pool):
    """Each layer's conv and ssm pool, ``[S, ...]`` each."""
    return [np.asarray(a) for a in (*pool.conv, *pool.ssm)]


def state(allocator):
    return allocator.used_slots, allocator.num_free, allocator.num_used


# ---------------------------------------------------------------- specs and pools


def test_gdn_spec_convolves_q_k_v_and_keeps_hv_k_v_state():
    spec = LinearStateSpec.gdn(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)
    assert spec.conv_channels == 2 * 16 * 128 + 32 * 128
    assert spec.conv_shape == (8192, 3)
    assert spec.ssm_shape == (32, 128, 128)
    assert (spec.conv_dtype, spec.ssm_dtype) == (jnp.bfloat16, np.float32)


def test_bytes_per_slot_sums_conv_and_ssm_of_every_layer():
    assert GDN.slot_bytes == (2 * 4 + 2 * 4) * 3 * 2 + 2 * 4 * 4 * 4
    assert OTHER.slot_bytes == 6 * 2 * 4 + 2 * 3 * 5 * 4
    assert bytes_per_slot((GDN, OTHER)) == GDN.slot_bytes + OTHER.slot_bytes


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"conv_channels": 0}, "conv_channels=0 must be a positive int"),
        ({"conv_width": 1}, "conv_width=1 must be an int >= 2"),
        ({"ssm_shape": ()}, r"ssm_shape=\(\) must be a non-empty tuple"),
        ({"ssm_shape": (2, 0)}, r"ssm_shape=\(2, 0\)"),
    ],
)
def test_spec_rejects_degenerate_shapes(kwargs, message):
    args = {"conv_channels": 4, "conv_width": 4, "ssm_shape": (2, 2)} | kwargs
    with pytest.raises(ValueError, match=message):
        LinearStateSpec(**args)


def test_init_pool_stacks_the_layers_in_one_array_each_zeroed():
    pool = init_state_pool(SPECS, S)
    assert (pool.num_slots, pool.num_layers) == (S, 2)
    assert (pool.conv.shape, pool.conv.dtype) == ((2, S, 16, 3), jnp.bfloat16)
    assert (pool.ssm.shape, pool.ssm.dtype) == ((2, S, 2, 4, 4), jnp.float32)
    assert not np.asarray(pool.conv).any() and not np.asarray(pool.ssm).any()


def test_init_pool_without_linear_layers_has_empty_arrays():
    pool = init_state_pool((), S)
    assert pool.num_layers == 0 and pool.conv.shape[:2] == (0, S)


def test_init_pool_rejects_layers_of_different_layouts():
    with pytest.raises(ValueError, match="linear layer 1 has layout .* layer 0 has .* same layout"):
        init_state_pool((GDN, OTHER), S)


def test_pool_is_a_pytree_with_static_slot_count():
    pool = init_state_pool(SPECS, S)
    assert len(jax.tree.leaves(pool)) == 2  # conv and ssm, every layer stacked
    other = init_state_pool(SPECS, S + 1)
    assert jax.tree.structure(pool) != jax.tree.structure(other)
    assert isinstance(jax.jit(lambda p: p)(pool), StatePool)


@pytest.mark.parametrize("num_slots", [0, 1, 2.0])
def test_pool_needs_a_real_slot(num_slots):
    with pytest.raises(SlotError, match=f"num_slots={num_slots!r} leaves no real slot"):
        init_state_pool(SPECS, num_slots)


# ---------------------------------------------------------------- reset_slots


def test_reset_zeroes_exactly_the_given_slots_in_every_layer():
    pool = random_pool()
    before = snapshot(pool)
    after = snapshot(reset_slots(pool, [2, 5, 7]))
    for old, new in zip(before, after, strict=True):
        assert not new[[2, 5, 7]].any()
        keep = [s for s in range(S) if s not in (2, 5, 7)]
        np.testing.assert_array_equal(new[keep], old[keep])  # bit-identical


def test_reset_donates_the_pool():
    pool = random_pool()
    reset_slots(pool, [1])
    assert pool.conv.is_deleted() and pool.ssm.is_deleted()


def test_reset_of_no_slots_returns_the_pool_unchanged():
    pool = random_pool()
    assert reset_slots(pool, []) is pool


def test_reset_pads_slot_lists_to_powers_of_two_by_repeating_a_given_slot():
    assert state_pool._pad_to_power_of_two([4]).tolist() == [4]
    assert state_pool._pad_to_power_of_two([4, 5, 6]).tolist() == [4, 5, 6, 4]
    assert state_pool._pad_to_power_of_two([1, 2, 3, 4, 5]).tolist() == [1, 2, 3, 4, 5, 1, 1, 1]


def test_reset_compiles_once_per_power_of_two():
    state_pool._zero_slots.clear_cache()
    pool = random_pool()
    for n in range(1, S):
        pool = reset_slots(pool, range(1, n + 1))
    assert state_pool._zero_slots._cache_size() == 4  # 1, 2, 4, 8 slots


@pytest.mark.parametrize("slot", [S, -1, 2.0])
def test_reset_rejects_slots_outside_the_pool_before_touching_it(slot):
    pool = random_pool()
    before = snapshot(pool)
    with pytest.raises(
        SlotError, match=rf"slots\[1\]={slot!r} is outside the pool \(slots 0\.\.8\)"
    ):
        reset_slots(pool, [1, slot])
    assert not pool.conv.is_deleted() and not pool.ssm.is_deleted()
    for old, new in zip(before, snapshot(pool), strict=True):
        np.testing.assert_array_equal(new, old)


# ---------------------------------------------------------------- SlotAllocator


def test_allocator_hands_out_lowest_free_slots_first():
    allocator = SlotAllocator(S)
    assert allocator.allocate(3) == [1, 2, 3]
    assert allocator.allocate(1) == [4]
    allocator.free([2, 4])
    assert allocator.allocate(3) == [2, 4, 5]
    assert allocator.used_slots == (1, 2, 3, 4, 5)


def test_allocator_counts():
    allocator = SlotAllocator(S)
    assert (allocator.capacity, allocator.num_free, allocator.num_used) == (8, 8, 0)
    allocator.allocate(5)
    assert (allocator.num_free, allocator.num_used) == (3, 5)
    assert allocator.allocate(0) == []


def test_allocator_never_hands_out_the_pad_slot():
    allocator = SlotAllocator(S)
    assert 0 not in allocator.allocate(S - 1)
    assert allocator.num_free == 0


def test_exhaustion_names_slots_used_asked_cost_and_fix():
    allocator = SlotAllocator(S, bytes_per_slot=3 * 2**20 // 2)
    allocator.allocate(6)
    with pytest.raises(PoolExhaustedError) as info:
        allocator.allocate(3)
    err = info.value
    assert (err.requested, err.capacity, err.used) == (3, 8, 6)
    assert str(err) == (
        "cannot allocate 3 slots: the pool has 8 real slots (plus the pad slot 0), 6 in use, "
        "2 free; one slot holds 1.5 MiB of state; free finished requests or build the pool with "
        "more slots"
    )


def test_exhaustion_without_a_slot_cost_leaves_it_out():
    with pytest.raises(PoolExhaustedError, match="9 slots") as info:
        SlotAllocator(S).allocate(9)
    assert "MiB" not in str(info.value)


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        ([1, 4], r"slots\[1\]=4 is not allocated \(freed twice, or never allocated\)"),
        ([0], r"slots\[0\]=0 is the pad slot"),
        ([1, S], rf"slots\[1\]={S} is outside the pool \(slots 1\.\.8\)"),
        ([-3], r"slots\[0\]=-3 is outside the pool"),
        ([2, 1, 2], r"slots\[2\]=2 appears twice in one free\(\) call"),
        ([1.0], r"slots\[0\]=1\.0 is not an int slot"),
    ],
    ids=["double_free", "pad_slot", "past_the_end", "negative", "duplicate", "float"],
)
def test_bad_free_raises_and_changes_nothing(slots, message):
    allocator = SlotAllocator(S)
    allocator.allocate(3)
    before = state(allocator)
    with pytest.raises(SlotError, match=message):
        allocator.free(slots)
    assert state(allocator) == before
    assert allocator.allocate(1) == [4]


def test_double_free_across_calls_raises():
    allocator = SlotAllocator(S)
    allocator.allocate(2)
    allocator.free([2])
    with pytest.raises(SlotError, match=r"slots\[0\]=2 is not allocated"):
        allocator.free([2])


def test_rejected_allocate_changes_nothing():
    allocator = SlotAllocator(S)
    allocator.allocate(6)
    allocator.free([3])
    before = state(allocator)
    with pytest.raises(PoolExhaustedError):
        allocator.allocate(4)
    with pytest.raises(SlotError, match=r"allocate\(n=-1\): n must be an int >= 0"):
        allocator.allocate(-1)
    assert state(allocator) == before
    assert allocator.allocate(3) == [3, 7, 8]


# ---------------------------------------------------------------- allocate_slots


def test_allocate_slots_zeroes_a_reused_dirty_slot():
    allocator = SlotAllocator(S)
    pool = random_pool()  # every slot dirty, as if finished requests had used them
    slots, pool = allocate_slots(allocator, pool, 2)
    assert slots == [1, 2]
    before = snapshot(pool)
    allocator.free([1])
    slots, pool = allocate_slots(allocator, pool, 2)
    assert slots == [1, 3]
    for old, new in zip(before, snapshot(pool), strict=True):
        assert not new[[1, 2, 3]].any()
        np.testing.assert_array_equal(new[[0, 4, 5, 6, 7, 8]], old[[0, 4, 5, 6, 7, 8]])


def test_allocate_slots_rolls_back_when_zeroing_fails(monkeypatch):
    allocator = SlotAllocator(S)
    allocator.allocate(2)
    before = state(allocator)

    def broken(pool, slots):
        raise RuntimeError("device lost")

    monkeypatch.setattr(state_pool, "reset_slots", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        allocate_slots(allocator, random_pool(), 3)
    assert state(allocator) == before


def test_allocate_slots_rejects_a_pool_of_another_size():
    allocator = SlotAllocator(S + 1)
    with pytest.raises(SlotError, match="allocator manages 10 slots but the pool has 9"):
        allocate_slots(allocator, random_pool(), 1)
    assert allocator.num_used == 0
