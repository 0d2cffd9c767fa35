"""Per-request recurrent state: conv-window and ssm-state pools, and the host-side slot allocator.

Every linear-attention layer (GDN, later Mamba2) keeps, per request, the last W-1 inputs of
its causal conv1d and its recurrent ssm state. They live in pools indexed by layer and slot,
one array for all layers: ``conv`` is ``[L, S, C, W-1]`` (activations' dtype, oldest input
first on the last axis) and ``ssm`` is ``[L, S, *ssm_shape]`` (float32), so a forward that scans
over its layers carries one array and each layer's kernel reads the flat ``[L*S, ...]`` view
at rows ``l*S + slot`` (``ForwardMetadata.at_linear_layer``). Slot 0 of every layer is its pad
slot, never handed out; a padded row reads index 0 of the flat pool in every layer, which
every op skips (its outputs are zeros and it writes nothing). Which request owns
which slot is host-side bookkeeping (``SlotAllocator``) and never enters jitted code.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from hybrid_jax.index_allocator import IndexAllocator, is_int

__all__ = [
    "LinearStateSpec",
    "PoolExhaustedError",
    "SlotAllocator",
    "SlotError",
    "StatePool",
    "allocate_slots",
    "bytes_per_slot",
    "common_spec",
    "init_state_pool",
    "reset_slots",
]


class SlotError(ValueError):
    """A slot that is not allocated, not in the pool, the pad slot, or repeated in one call."""


class PoolExhaustedError(RuntimeError):
    """More slots were asked for than are free.

    Attributes: ``requested``, ``capacity`` (real slots, pad slot excluded), ``used``,
    ``bytes_per_slot``.
    """

    def __init__(self, requested: int, capacity: int, used: int, bytes_per_slot: int) -> None:
        self.requested, self.capacity, self.used = requested, capacity, used
        self.bytes_per_slot = bytes_per_slot
        cost = (
            f"; one slot holds {bytes_per_slot / 2**20:.3g} MiB of state" if bytes_per_slot else ""
        )
        super().__init__(
            f"cannot allocate {requested} slots: the pool has {capacity} real slots (plus the "
            f"pad slot 0), {used} in use, {capacity - used} free{cost}; free finished requests "
            f"or build the pool with more slots"
        )


def _check_num_slots(num_slots: object) -> None:
    if not is_int(num_slots) or num_slots < 2:
        raise SlotError(
            f"num_slots={num_slots!r} leaves no real slot (slot 0 is the pad slot); "
            f"build the pool with at least 2 slots"
        )


@dataclasses.dataclass(frozen=True)
class LinearStateSpec:
    """The per-request state of one linear-attention layer.

    conv window ``[conv_channels, conv_width - 1]`` in ``conv_dtype`` (the activations');
    ssm state ``ssm_shape`` in ``ssm_dtype``: ``(HV, K, V)`` for GDN, ``(H, P, N)`` for Mamba2.
    """

    conv_channels: int
    conv_width: int
    ssm_shape: tuple[int, ...]
    conv_dtype: np.dtype = np.dtype(jnp.bfloat16)
    ssm_dtype: np.dtype = np.dtype(np.float32)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ssm_shape", tuple(self.ssm_shape))
        object.__setattr__(self, "conv_dtype", np.dtype(self.conv_dtype))
        object.__setattr__(self, "ssm_dtype", np.dtype(self.ssm_dtype))
        if not is_int(self.conv_channels) or self.conv_channels < 1:
            raise ValueError(f"conv_channels={self.conv_channels!r} must be a positive int")
        if not is_int(self.conv_width) or self.conv_width < 2:
            raise ValueError(
                f"conv_width={self.conv_width!r} must be an int >= 2: the pool keeps the last "
                f"conv_width - 1 inputs"
            )
        if not self.ssm_shape or not all(is_int(d) and d >= 1 for d in self.ssm_shape):
            raise ValueError(f"ssm_shape={self.ssm_shape!r} must be a non-empty tuple of ints >= 1")

    @classmethod
    def gdn(
        cls,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_width: int = 4,
        conv_dtype: DTypeLike = jnp.bfloat16,
    ) -> LinearStateSpec:
        """A Gated DeltaNet layer: the conv runs over q, k and v concatenated (H*K + H*K + HV*V
        channels); the ssm state is ``(HV, K, V)``."""
        channels = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
        return cls(channels, conv_width, (num_v_heads, head_k_dim, head_v_dim), conv_dtype)

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_channels, self.conv_width - 1)

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot of this layer holds (conv window plus ssm state)."""
        conv = math.prod(self.conv_shape) * self.conv_dtype.itemsize
        return conv + math.prod(self.ssm_shape) * self.ssm_dtype.itemsize


def bytes_per_slot(specs: Iterable[LinearStateSpec]) -> int:
    """Bytes one request's slot holds across all linear layers."""
    return sum(spec.slot_bytes for spec in specs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StatePool:
    """The state of every linear layer for ``num_slots`` slots (slot 0 is the pad slot).

    conv: ``[L, S, C, W - 1]`` activations' dtype; ssm: ``[L, S, *ssm_shape]`` float32;
    ``conv[l]`` and ``ssm[l]`` are layer l's pools.
    """

    conv: jax.Array
    ssm: jax.Array
    num_slots: int = dataclasses.field(metadata={"static": True})

    @property
    def num_layers(self) -> int:
        return self.ssm.shape[0]


def common_spec[Spec](specs: Sequence[Spec], what: str) -> Spec | None:
    """The one layout all of ``specs`` share (None for no layers); a ValueError naming the
    first layer that differs otherwise: a pool or cache stacks its layers in one array."""
    for i, spec in enumerate(specs):
        if spec != specs[0]:
            raise ValueError(
                f"{what} layer {i} has layout {spec}, layer 0 has {specs[0]}: the layers are "
                f"stacked in one array, so every one needs the same layout"
            )
    return specs[0] if specs else None


def init_state_pool(specs: Sequence[LinearStateSpec], num_slots: int) -> StatePool:
    """A zeroed pool with ``num_slots`` slots for the linear layers described by ``specs``
    (all of one layout)."""
    _check_num_slots(num_slots)
    spec = common_spec(specs, "linear")
    if spec is None:  # no linear layers: empty arrays keep the pool's structure
        spec = LinearStateSpec(1, 2, (1,))
    layers = len(specs)
    return StatePool(
        conv=jnp.zeros((layers, num_slots, *spec.conv_shape), spec.conv_dtype),
        ssm=jnp.zeros((layers, num_slots, *spec.ssm_shape), spec.ssm_dtype),
        num_slots=num_slots,
    )


@functools.partial(jax.jit, donate_argnums=0)
def _zero_slots(pool: StatePool, slots: jax.Array) -> StatePool:
    return StatePool(
        conv=pool.conv.at[:, slots].set(0), ssm=pool.ssm.at[:, slots].set(0),
        num_slots=pool.num_slots,
    )  # fmt: skip


def _pad_to_power_of_two(slots: list[int]) -> np.ndarray:
    # Padding to a power of two compiles a handful of lengths, not one per count. The padding
    # repeats slots[0] (zeroed twice, same result) rather than the pad slot 0, so that a reset
    # touches exactly the slots it was given.
    padded = np.full(1 << (len(slots) - 1).bit_length(), slots[0], np.int32)
    padded[: len(slots)] = slots
    return padded


def reset_slots(pool: StatePool, slots: Iterable[int]) -> StatePool:
    """Zeroes ``slots`` in every layer's conv and ssm pool; every other slot is untouched.

    ``pool`` is donated: its arrays are updated in place and must not be used afterwards.
    Slots outside ``0..S-1`` raise ``SlotError`` before anything changes.
    """
    slots = list(slots)
    for i, slot in enumerate(slots):
        if not is_int(slot) or not 0 <= slot < pool.num_slots:
            raise SlotError(
                f"slots[{i}]={slot!r} is outside the pool (slots 0..{pool.num_slots - 1})"
            )
    if not slots:
        return pool
    return _zero_slots(pool, jnp.asarray(_pad_to_power_of_two(slots)))


class SlotAllocator(IndexAllocator):
    """Host-side owner of slots ``1..num_slots-1``: hands out the lowest free slots first.

    Every call validates its whole request before changing anything, so a rejected call
    leaves the allocator as it was. ``bytes_per_slot`` only makes exhaustion errors say what
    a slot costs.
    """

    noun, container, error = "slot", "pool", SlotError

    def __init__(self, num_slots: int, bytes_per_slot: int = 0) -> None:
        _check_num_slots(num_slots)
        super().__init__(num_slots)
        self.num_slots = num_slots
        self.bytes_per_slot = bytes_per_slot

    @property
    def used_slots(self) -> tuple[int, ...]:
        return tuple(sorted(self._used))

    def _exhausted(self, requested: int) -> PoolExhaustedError:
        return PoolExhaustedError(requested, self.capacity, self.num_used, self.bytes_per_slot)

    def __repr__(self) -> str:
        return (
            f"SlotAllocator(capacity={self.capacity}, used={self.num_used}, free={self.num_free})"
        )


def allocate_slots(
    allocator: SlotAllocator, pool: StatePool, n: int
) -> tuple[list[int], StatePool]:
    """Allocates ``n`` slots and zeroes them in every layer (a reused slot holds a finished
    request's state). If zeroing fails the allocation is rolled back. ``pool`` is donated."""
    if allocator.num_slots != pool.num_slots:
        raise SlotError(
            f"the allocator manages {allocator.num_slots} slots but the pool has "
            f"{pool.num_slots}; build both from the same num_slots"
        )
    slots = allocator.allocate(n)
    try:
        pool = reset_slots(pool, slots)
    except BaseException:
        allocator.free(slots)
        raise
    return slots, pool
