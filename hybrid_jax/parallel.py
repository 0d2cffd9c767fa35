"""Tensor parallelism across the GPUs of one host: each GPU holds a slice of every block.

Megatron's split, built from JAX's own machinery. A ``jax.sharding.Mesh`` with one axis
(``AXIS``, ``"tp"``) spans the GPUs; ``shard_model`` places every weight with a
``NamedSharding``: a block's heads (GDN key heads with their value heads, Mamba2 heads with
their groups, attention KV heads with their query heads) or its intermediate width (dense MLPs,
each expert of an MoE) are cut across the GPUs, embeddings and the LM head by vocabulary, and
everything else (norms, routers, the hidden states between blocks) is replicated. The slot
pool and the KV cache are cut the same way (``shard_pool``, ``shard_kv_cache``), so a slot's
state lives on the GPU that computes it.

Inside a step traced under the mesh (``jax.set_mesh``), ``run_block`` runs a block under
``jax.shard_map``: each GPU merges its slices of the weights into the block a model with
``1/tp`` of the heads (or of the width) would have, runs it, kernels and all, on its slices of
the pools and caches, and one ``psum`` adds the partial outputs of the block's last (row-cut)
projection: one all-reduce per block. Outside a mesh, ``run_block`` is just the call. A weight
that packs several parts along its cut axis (GDN's ``[Q | K | V]`` channels, MoE's
``[gate | up]`` columns) is stored in the order that gives each GPU its slice of every part
(``Cut.parts``): ``shard_model``'s model is for the engine's steps, like
``layer_scan.scan_layers``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hybrid_jax.backend import VerifyStates
from hybrid_jax.backend.linear import LinearLayerOutput
from hybrid_jax.kv_cache import KVCache
from hybrid_jax.layers.attention import Attention, AttentionOutput
from hybrid_jax.layers.gdn import GatedDeltaNet
from hybrid_jax.layers.mamba2 import Mamba2Mixer
from hybrid_jax.layers.moe import MLP, SparseMoE
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.models.nemotron_h_blocks import ReLU2MLP, RoutedMoE
from hybrid_jax.modes import ForwardMode
from hybrid_jax.state_pool import StatePool

__all__ = [
    "AXIS",
    "Cut",
    "Placement",
    "check_divisible",
    "is_placed",
    "make_mesh",
    "on_mesh",
    "replicate",
    "replicated",
    "run_block",
    "shard_kv_cache",
    "shard_model",
    "shard_pool",
    "spec_of",
    "tp_size",
]

AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class Cut:
    """How one weight of a block is cut across the GPUs: along ``dim`` (counted from the end,
    so a scanned run's stacked weights cut alike), into equal slices; ``parts``: the sizes of
    the parts the axis packs (each GPU takes its slice of every part; empty: one part);
    ``once``: a replicated bias of a row-cut projection, added on one GPU only (the partial
    outputs are summed)."""

    dim: int | None
    parts: tuple[int, ...] = ()
    once: bool = False


ONCE = Cut(None, once=True)


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """A block under tensor parallelism: ``counts`` the sizes the GPUs share (heads, groups,
    widths: each must divide by tp), ``local(block, tp)`` builds the block one GPU holds
    (abstract), ``cuts`` says how each weight (by its path in the block) is cut, ``kind``
    which arguments and outputs the block takes (``"linear"``, ``"attention"`` or
    ``"feed_forward"``)."""

    counts: Callable[[nnx.Module], Mapping[str, int]]
    local: Callable[[nnx.Module, int], nnx.Module]
    cuts: Callable[[nnx.Module], Mapping[str, Cut]]
    kind: str


def _gdn_cuts(m: GatedDeltaNet) -> dict[str, Cut]:
    d = m.config.dims
    qkv = (d.key_dim, d.key_dim, d.value_dim)
    return {
        "in_proj_qkv.kernel": Cut(-1, qkv), "in_proj_z.kernel": Cut(-1),
        "in_proj_ba.kernel": Cut(-1, (d.num_value_heads,) * 2), "conv_weight": Cut(-2, qkv),
        "gate_params": Cut(-1), "out_proj.kernel": Cut(-2),
    }  # fmt: skip


def _mamba2_cuts(m: Mamba2Mixer) -> dict[str, Cut]:
    c = m.config
    bc = c.n_groups * c.state_size
    xbc = (c.inner_dim, bc, bc)
    cuts = {
        "in_proj.kernel": Cut(-1, (c.inner_dim, *xbc, c.num_heads)), "conv_weight": Cut(-2, xbc),
        "dt_bias": Cut(-1), "A_log": Cut(-1), "D": Cut(-1), "norm.weight": Cut(-1),
        "out_proj.kernel": Cut(-2),
    }  # fmt: skip
    if c.use_conv_bias:
        cuts["conv_bias"] = Cut(-1, xbc)
    if c.use_bias:
        cuts |= {"in_proj.bias": Cut(-1, (c.inner_dim, *xbc, c.num_heads)), "out_proj.bias": ONCE}
    return cuts


def _attention_cuts(m: Attention) -> dict[str, Cut]:
    cuts = {f"{p}.kernel": Cut(-1) for p in ("q_proj", "k_proj", "v_proj")}
    cuts["o_proj.kernel"] = Cut(-2)
    if m.config.attention_bias:
        cuts |= {f"{p}.bias": Cut(-1) for p in ("q_proj", "k_proj", "v_proj")}
        cuts["o_proj.bias"] = ONCE
    return cuts


def _mlp_cuts(prefix: str = "") -> dict[str, Cut]:
    return {
        f"{prefix}gate_proj.kernel": Cut(-1), f"{prefix}up_proj.kernel": Cut(-1),
        f"{prefix}down_proj.kernel": Cut(-2),
    }  # fmt: skip


def _relu2_cuts(m: ReLU2MLP, prefix: str = "") -> dict[str, Cut]:
    cuts = {f"{prefix}up_proj.kernel": Cut(-1), f"{prefix}down_proj.kernel": Cut(-2)}
    if m.up_proj.use_bias:
        cuts |= {f"{prefix}up_proj.bias": Cut(-1), f"{prefix}down_proj.bias": ONCE}
    return cuts


def _sparse_moe_cuts(m: SparseMoE) -> dict[str, Cut]:
    inter = m.config.intermediate_size
    return {
        "gate_up_proj": Cut(-1, (inter, inter)), "down_proj": Cut(-2),
        **_mlp_cuts("shared_expert."),
    }  # fmt: skip


def _routed_moe_cuts(m: RoutedMoE) -> dict[str, Cut]:
    cuts = {
        "up_proj": Cut(-1), "down_proj": Cut(-2),
        **_relu2_cuts(m.shared_experts, "shared_experts."),
    }  # fmt: skip
    if m.config.latent_size is not None and m.fc2_latent_proj.use_bias:
        cuts["fc2_latent_proj.bias"] = ONCE
    return cuts


def _mlp_local(m: MLP, tp: int) -> nnx.Module:
    hidden, inter = m.gate_proj.kernel.shape
    dtype = jnp.dtype(m.gate_proj.kernel.dtype).name
    return nnx.eval_shape(lambda: MLP(hidden, inter // tp, dtype=dtype, rngs=nnx.Rngs(0)))


def _relu2_local(m: ReLU2MLP, tp: int) -> nnx.Module:
    hidden, inter = m.up_proj.kernel.shape
    dtype = jnp.dtype(m.up_proj.kernel.dtype).name
    return nnx.eval_shape(
        lambda: ReLU2MLP(hidden, inter // tp, bias=m.up_proj.use_bias, dtype=dtype,
                         rngs=nnx.Rngs(0))
    )  # fmt: skip


def _config_local(cls: type, *fields: str):
    """``counts`` and ``local`` of a block of ``cls`` built from its config: the named config
    fields are the shared sizes, divided by tp in the block one GPU holds."""

    def counts(m: nnx.Module) -> dict[str, int]:
        return {f: getattr(m.config, f) for f in fields}

    def local(m: nnx.Module, tp: int) -> nnx.Module:
        config = dataclasses.replace(m.config, **{f: getattr(m.config, f) // tp for f in fields})
        return nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))

    return counts, local


def _width(m: MLP | ReLU2MLP) -> dict[str, int]:
    return {"intermediate_size": m.down_proj.kernel.shape[0]}


PLANS: dict[type, BlockPlan] = {
    GatedDeltaNet: BlockPlan(
        *_config_local(GatedDeltaNet, "num_key_heads", "num_value_heads"), _gdn_cuts, "linear"
    ),
    Mamba2Mixer: BlockPlan(
        *_config_local(Mamba2Mixer, "num_heads", "n_groups"), _mamba2_cuts, "linear"
    ),
    Attention: BlockPlan(
        *_config_local(Attention, "num_heads", "num_kv_heads"), _attention_cuts, "attention"
    ),
    MLP: BlockPlan(_width, _mlp_local, lambda m: _mlp_cuts(), "feed_forward"),
    SparseMoE: BlockPlan(
        *_config_local(SparseMoE, "intermediate_size", "shared_intermediate_size"),
        _sparse_moe_cuts,
        "feed_forward",
    ),  # fmt: skip
    ReLU2MLP: BlockPlan(_width, _relu2_local, _relu2_cuts, "feed_forward"),
    RoutedMoE: BlockPlan(
        *_config_local(RoutedMoE, "intermediate_size", "shared_intermediate_size"),
        _routed_moe_cuts,
        "feed_forward",
    ),  # fmt: skip
}
"""The blocks that run cut across the GPUs; every other module runs replicated."""


def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh over the first ``tp`` devices; raises ``ValueError`` naming the count
    when fewer are visible."""
    devices = list(jax.devices() if devices is None else devices)
    if tp > len(devices):
        raise ValueError(
            f"tensor_parallel={tp} needs {tp} devices but JAX sees {len(devices)} "
            f"({devices[0].platform}); use at most {len(devices)}"
        )
    return Mesh(np.array(devices[:tp]), (AXIS,))


def on_mesh(mesh: Mesh | None) -> contextlib.AbstractContextManager:
    """The context to trace and compile under: ``jax.set_mesh(mesh)``, or nothing without one
    (arguments given without a sharding are then replicated over the mesh)."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def spec_of(x: Any) -> jax.ShapeDtypeStruct:
    """``x``'s shape, dtype and sharding (an array's, or a ShapeDtypeStruct's own), to compile
    for arguments laid out as ``x`` is."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def tp_size() -> int:
    """The GPUs of the tensor-parallel axis of the mesh being traced under (1: none)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[AXIS]


def _named(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _spec(cut: Cut | None, ndim: int) -> P:
    if cut is None or cut.dim is None:
        return P()
    axes: list[Any] = [None] * ndim
    axes[cut.dim] = AXIS
    return P(*axes)


def _layout(size: int, parts: tuple[int, ...], tp: int) -> np.ndarray:
    """Indices that reorder an axis packing ``parts`` so that slice g of ``tp`` equal slices
    holds slice g of every part, in part order."""
    if sum(parts) != size:
        raise ValueError(f"parts {parts} do not add up to the axis of {size}")
    starts = np.cumsum((0, *parts[:-1]))
    return np.concatenate([
        start + g * (n // tp) + np.arange(n // tp)
        for g in range(tp) for start, n in zip(starts, parts, strict=True)
    ])  # fmt: skip


def check_divisible(model: nnx.Module, tp: int) -> None:
    """Raises ``ValueError`` naming the first block and size that ``tp`` GPUs cannot share
    equally (each GPU takes whole heads and groups, and an equal share of every width)."""
    for path, node in nnx.iter_graph(model):
        plan = PLANS.get(type(node))
        if plan is None:
            continue
        for name, size in plan.counts(node).items():
            if size % tp:
                raise ValueError(
                    f"tensor_parallel={tp} does not divide {_named(path)}'s {name}={size}; "
                    f"each GPU takes whole heads and groups and an equal share of each width"
                )


class Placement:
    """Where each weight of a model goes on ``mesh``: each block of ``PLANS`` cut (packed axes
    reordered for the cut, see the module docstring), the embeddings and the LM head by
    vocabulary, the rest replicated. ``place(path, value)`` puts one weight there (a host
    array is reordered on the host and each device receives only its slice)."""

    def __init__(self, model: nnx.Module, mesh: Mesh):
        self.mesh, self.tp = mesh, mesh.shape[AXIS]
        check_divisible(model, self.tp)
        self.cuts: dict[tuple, Cut] = {}
        for path, node in nnx.iter_graph(model):
            plan = PLANS.get(type(node))
            if plan is not None:
                cuts = plan.cuts(node).items()
                self.cuts |= {(*path, *name.split(".")): cut for name, cut in cuts}

    def place(self, path: tuple, value: Any) -> jax.Array:
        cut = self.cuts.get(tuple(path))
        xp = np if isinstance(value, np.ndarray) else jnp
        if cut is not None and cut.parts:
            value = xp.take(value, _layout(value.shape[cut.dim], cut.parts, self.tp), axis=cut.dim)
        spec = _vocab_spec(path, value.ndim) if cut is None else _spec(cut, value.ndim)
        return jax.device_put(value, NamedSharding(self.mesh, spec))


def shard_model(model: nnx.Module, mesh: Mesh, *, donate: bool = False) -> nnx.Module:
    """A copy of ``model`` whose weights are placed on ``mesh`` (``Placement``); run its
    forward under ``jax.set_mesh(mesh)``. A model already placed there (a loader's ``mesh=``)
    is returned as it is. With ``donate`` each of ``model``'s arrays is deleted once placed
    (memory for one model, not two; ``model`` must not be used afterwards)."""
    if is_placed(model, mesh):
        return model
    placement = Placement(model, mesh)
    graphdef, state = nnx.split(model)
    placed = []
    for path, variable in nnx.to_flat_state(state):
        value = variable.get_value()
        placed.append((path, variable.replace(placement.place(path, value))))
        if donate and value is not placed[-1][1].get_value():
            value.delete()
    return nnx.merge(graphdef, nnx.from_flat_state(placed))


def is_placed(model: nnx.Module, mesh: Mesh) -> bool:
    """Whether ``model``'s weights are on ``mesh`` already (placed by ``Placement``)."""
    leaves = jax.tree.leaves(nnx.state(model))
    return bool(leaves) and all(
        isinstance(a, jax.Array) and getattr(a.sharding, "mesh", None) == mesh for a in leaves
    )


def _vocab_spec(path: tuple, ndim: int) -> P:
    """Embeddings ``[V, H]`` and LM heads ``[H, V]`` by vocabulary; the rest replicated."""
    if path[-1] == "embedding" and ndim == 2:
        return P(AXIS, None)
    if path[-2:] == ("lm_head", "kernel"):
        return P(None, AXIS)
    return P()


def shard_pool(pool: StatePool, mesh: Mesh) -> StatePool:
    """The pool on ``mesh``: conv windows ``[L, S, C, W-1]`` by channel, states
    ``[L, S, heads, ...]`` by head."""
    sharded = NamedSharding(mesh, P(None, None, AXIS))
    return dataclasses.replace(
        pool, conv=jax.device_put(pool.conv, sharded), ssm=jax.device_put(pool.ssm, sharded)
    )


def shard_kv_cache(kv: KVCache, mesh: Mesh) -> KVCache:
    """The cache on ``mesh``: pages ``[L, P, page_size, KVH, hd]`` by KV head."""
    sharded = NamedSharding(mesh, P(None, None, None, AXIS))
    return dataclasses.replace(kv, k=jax.device_put(kv.k, sharded), v=jax.device_put(kv.v, sharded))


def replicate(x: jax.Array, mesh: Mesh) -> jax.Array:
    """``x`` placed whole on every device of ``mesh``."""
    return jax.device_put(x, NamedSharding(mesh, P()))


def replicated(x: jax.Array) -> jax.Array:
    """``x`` whole on every GPU of the mesh being traced under (unchanged outside one)."""
    if tp_size() == 1:
        return x
    return jax.lax.with_sharding_constraint(x, P())


def _arg_specs(kind: str) -> tuple[P, ...]:
    if kind == "linear":  # h, conv [L*S, C, W-1], ssm [L*S, heads, ...], meta
        return (P(), P(None, AXIS), P(None, AXIS), P())
    if kind == "attention":  # h, k and v pages [L*P, page_size, KVH, hd], meta
        return (P(), P(None, None, AXIS), P(None, None, AXIS), P())
    return (P(), P())  # h, the real-token mask


def _out_specs(kind: str, args: tuple) -> Any:
    if kind == "linear":
        meta: ForwardMetadata = args[-1]
        verify = ()
        if meta.mode is ForwardMode.TARGET_VERIFY:  # [bs, D, C, W-1] and [bs, D, heads, ...]
            verify = VerifyStates(P(None, None, AXIS), P(None, None, AXIS))
        return LinearLayerOutput(P(), P(None, AXIS), P(None, AXIS), verify)
    if kind == "attention":
        return AttentionOutput(P(), P(None, None, AXIS), P(None, None, AXIS))
    return P()


def _reduce(kind: str, out: Any) -> Any:
    """The block's output with its partial sums added across the GPUs."""
    if kind == "feed_forward":
        return jax.lax.psum(out, AXIS)
    return out._replace(y=jax.lax.psum(out.y, AXIS))


def run_block(block: nnx.Module, *args: Any, **kwargs: Any) -> Any:
    """``block(*args, **kwargs)``; traced under a mesh with a tensor-parallel axis, a block of
    ``PLANS`` runs its slice on each GPU and its partial output is all-reduced (see the
    module docstring). ``args``: a linear mixer's ``(h, conv, ssm, meta)``, an attention
    layer's ``(h, k_pages, v_pages, meta)``, a feed-forward block's ``(h, real)``."""
    tp = tp_size()
    plan = PLANS.get(type(block))
    if tp == 1 or plan is None:
        return block(*args, **kwargs)
    local_graphdef = nnx.graphdef(plan.local(block, tp))
    state = nnx.state(block)
    cuts = {tuple(name.split(".")): cut for name, cut in plan.cuts(block).items()}
    flat = nnx.to_flat_state(state)
    leaves = [v.get_value() for _, v in flat]
    specs = [_spec(cuts.get(path), leaf.ndim) for (path, _), leaf in zip(flat, leaves, strict=True)]
    once = [bool(cuts.get(path) and cuts[path].once) for path, _ in flat]

    def local(weights: list[jax.Array], *args: Any) -> Any:
        first = jax.lax.axis_index(AXIS) == 0
        weights = [jnp.where(first, w, 0) if o else w for w, o in zip(weights, once, strict=True)]
        module = nnx.merge(local_graphdef, _with_values(flat, weights))
        return _reduce(plan.kind, module(*args, **kwargs))

    mapped = jax.shard_map(
        local, in_specs=(specs, *_arg_specs(plan.kind)),
        out_specs=_out_specs(plan.kind, args), check_vma=False,
    )  # fmt: skip
    return mapped(leaves, *args)


def _with_values(flat, values):
    """The flat state ``flat`` with its leaves replaced by ``values``."""
    return nnx.from_flat_state(
        [
            (path, variable.replace(value))
            for (path, variable), value in zip(flat, values, strict=True)
        ]
    )
