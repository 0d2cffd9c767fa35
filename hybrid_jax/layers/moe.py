"""Qwen3-Next's feed-forward blocks: the dense SwiGLU MLP and the sparse MoE with a shared expert.

The MoE routes each token to its ``top_k`` experts by softmax probability (renormalised over
the chosen ones when ``norm_topk_prob``), runs the chosen experts as grouped matmuls over the
tokens sorted by expert (``jax.lax.ragged_dot``: each expert multiplies only its own tokens),
and adds a shared expert scaled by ``sigmoid(shared_expert_gate(x))``. A step of a few tokens
on the GPU runs its experts by id instead (``moe.expert_matmul``: no sort, gather or groups).

Expert weights are stacked in ``[E, in, out]`` order, the layout the grouped matmul reads:
``gate_up_proj`` ``[E, hidden, 2I]`` (the gate's I columns, then the up projection's: one
product for both), ``down_proj`` ``[E, I, hidden]``; the loader transposes Hugging Face's
per-expert ``[out, in]`` matrices (or its fused ``gate_up_proj``) into them. An engine may
lay out its own stacked copy's gate/up columns by ``moe.pair_halves`` (``pair_halves``,
``HIDDEN_IN_EXPERT_LAUNCH``), for launches that form the SwiGLU in their epilogue.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.layers import linear as linear_layer
from hybrid_jax.layers.linear import project, project_output, short_sum, swiglu
from hybrid_jax.layers.norm import NormedRows, SummedRows, formed
from pallas_kernels import moe, projections, resolve_impl
from pallas_kernels.moe import softmax_of_exps, top_k_exps, top_k_softmax

__all__ = [
    "BY_ID_MAX_PAIRS",
    "COMBINE_IN_LAUNCH",
    "EXPERTS_IN_ONE_LAUNCH",
    "HIDDEN_IN_EXPERT_LAUNCH",
    "MLP",
    "PAIR_DENSE_SWIGLU",
    "RANKED_TOP_K_TOKENS",
    "RANKING_IN_ROUTER_LAUNCH",
    "SHARED_DOWN_WITH_EXPERTS",
    "SHARED_GATE_WIDTH",
    "SHARED_HIDDEN_WITH_EXPERTS",
    "SOFTMAX_IN_RANKING",
    "SPLIT_ROUTER_LAUNCH",
    "ExpertDispatch",
    "MoEConfig",
    "SparseMoE",
    "top_k",
    "top_k_softmax",
]

BY_ID_MAX_PAIRS = 64
"""Routed (token, choice) pairs up to which a step runs its experts by id: each pair reads its
own expert, which costs about what the grouped matmul reads while few pairs share an expert
(decode buckets up to 8 tokens at top 8), and the step skips the sort-based dispatch."""

RANKED_TOP_K_TOKENS = 64
"""Tokens up to which ``top_k`` ranks instead of sorting."""

SHARED_DOWN_WITH_EXPERTS = True
"""Whether a block whose experts run by id takes the shared expert's down product in the
experts' down launch (``moe.expert_matmul(dense=)``: one launch fewer per block) instead of a
product of its own: the 35B-like batch-1 step's launches ~130 us shorter on the H200
(``benchmarks/RESULTS_serve.md``, session 33)."""


SHARED_HIDDEN_WITH_EXPERTS = True
"""Whether a block whose experts run by id forms the shared expert's SiLU product and its
experts' in one array (the shared rows after the routed pairs' ones, where both widths
agree), which each down launch reads its rows of in place: one XLA fusion for both products
instead of one each (one kernel fewer per MoE block on the H200:
``benchmarks/RESULTS_serve.md``)."""


HIDDEN_IN_EXPERT_LAUNCH = True
"""Whether an engine lays out its stacked MoE blocks' gate/up weights by ``moe.pair_halves``
(``SparseMoE.pair_halves``: each 64-column tile 32 gate and the same 32 up columns), so that
a block whose experts run by id forms its SwiGLU hidden rows in the launches' epilogues: the
routed pairs' in the experts' launch (``moe.expert_hidden``) and the shared
expert's in the router's (``project(paired=)``), instead of gate/up products and an XLA
fusion for both SiLU products. Other steps split the paired products in XLA. On the H200 the
35B-like batch-1 step drops a kernel per MoE block and ~80 us
(``benchmarks/RESULTS_serve.md``, session 31)."""

PAIR_DENSE_SWIGLU = True
"""Whether an engine lays out its stacked dense MLPs' gate and up weights as one weight by
``moe.pair_halves`` (``MLP.pair_halves``): at few rows the projections' launch then forms the
SwiGLU hidden rows in its epilogue (no XLA fusion after it), and above them cuBLAS runs one
product twice as wide instead of two. Read when the engine stacks its layers. A kernel fewer
per dense layer (``benchmarks/RESULTS_serve.md``, session 48)."""

COMBINE_IN_LAUNCH = True
"""Whether a block whose hidden rows come from the experts' launches
(``HIDDEN_IN_EXPERT_LAUNCH``) adds its output to the residual stream in one launch that also
sums each new row's squares for the next norm (``SparseMoE.add_to``, ``moe.combine_pairs``),
where XLA forms the combine and the next norm's square sums as two kernels (a kernel fewer
per MoE block but a scan repeat's last: ``benchmarks/RESULTS_serve.md``, session 35)."""

EXPERTS_IN_ONE_LAUNCH = True
"""Whether a block whose hidden rows come from the experts' launches
(``HIDDEN_IN_EXPERT_LAUNCH``) runs its experts' hidden rows and their down products (with
the shared expert's) as one launch (``moe.expert_mlp``): the down programs' weights stream in
while the hidden programs read theirs, and each pair's down programs start once its hidden
tiles are stored, instead of a launch that starts after the hidden launch ends. The launches
of a forward count in one buffer (``add_to``'s ``counters``), so none zero-fills its own (a
kernel fewer per MoE block: ``benchmarks/RESULTS_serve.md``, session 41)."""

SHARED_GATE_WIDTH = max(projections.COLUMN_TILE, projections.COMBINED_WIDTH)
"""The columns a widened shared expert gate has (``SparseMoE.widen_shared_gate``): a width the
router's launch takes, whole-K or combined by rows (``SPLIT_ROUTER_LAUNCH``)."""

SPLIT_ROUTER_LAUNCH = True
"""Whether a block whose hidden rows come from the experts' launches splits its router's
launch over parts of K (``projections(splits=)``, ``projections.partial_splits``'s count): a
program per (column tile, part) instead of a few programs that each stream a whole K (the
35B-like router, shared gate/up and gate are 22 column tiles), and one more program a token
that sums its partials, forms the norm's scale and the shared expert's SwiGLU (and with
``RANKING_IN_ROUTER_LAUNCH`` ranks the logits from its registers). With the ranking, ~2 us
and 2 kernels fewer a MoE block of a batch-1 step (``benchmarks/RESULTS_serve.md``)."""

RANKING_IN_ROUTER_LAUNCH = True
"""Whether a block that ranks its tokens' experts with the softmax in the ranking
(``SOFTMAX_IN_RANKING``) and adds its output in one launch (``COMBINE_IN_LAUNCH``) ranks them
in the router's launch (``projections.ranked_projections``: one more program a token, which
waits for the router's tiles), instead of the two XLA reductions between the router's launch
and the experts' (measured with ``SPLIT_ROUTER_LAUNCH``: ``benchmarks/RESULTS_serve.md``)."""

SOFTMAX_IN_RANKING = True
"""Whether a block that ranks its tokens' experts (``RANKED_TOP_K_TOKENS``, with
``norm_topk_prob``) forms the chosen experts' softmax inside the ranking's reductions
(``top_k_softmax``: the row's max beside each entry's rank, the exponentials' picks beside the
chosen ids) instead of after them, where it is a kernel of its own on the GPU (one kernel
fewer per MoE block: ``benchmarks/RESULTS_serve.md``)."""


def top_k(x: jax.Array, k: int, valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` along the last axis of ``x`` ``[T, n]`` (equal values: the lower
    index first), with int32 indices; rows where ``valid`` (bool ``[T]``) is False get index
    ``n`` (out of range: no expert) for each choice.

    Up to ``RANKED_TOP_K_TOKENS`` rows it ranks (``moe.ranked_top_k``: an ``[T, n, n]``
    comparison that XLA fuses into a reduction, where ``lax.top_k`` on the GPU is a sort of its
    own per call). More rows sort (the comparison grows as ``n ** 2``).
    """
    n = x.shape[-1]
    if x.shape[0] > RANKED_TOP_K_TOKENS:
        values, indices = jax.lax.top_k(x, k)
        indices = indices.astype(jnp.int32)
        return values, indices if valid is None else jnp.where(valid[:, None], indices, n)
    return moe.ranked_top_k(x, k, valid)


def _softmax_of_ordered(x: jax.Array) -> jax.Array:
    """The softmax of each row of ``x`` ``[T, k]``, whose values come largest first (as
    ``top_k`` gives them); with ``ADDS_FOR_SHORT_SUMS`` its max is the first value and its
    sum ``short_sum``'s, so it holds no reduce."""
    if not linear_layer.ADDS_FOR_SHORT_SUMS:
        return jax.nn.softmax(x, axis=-1)
    exps = jnp.exp(x - x[:, :1])
    return exps / short_sum(exps, 1)[:, None]


class MLP(nnx.Module):
    """``down(silu(gate(x)) * up(x))``; x: ``[T, hidden]`` -> ``[T, hidden]``.

    A feed-forward block takes ``(x, real)``: ``real`` (bool ``[T]``, or int32 flags, 0 at
    padding: ``LayerStates.real_flags``) marks the tokens of real rows, which lets a MoE skip
    the padding, and ``impl`` chooses its kernels; a dense MLP does the same work for every
    token and uses ``impl`` for its gate and up projections (``project``: one launch at few
    rows)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype: str, rngs: nnx.Rngs):
        dt = jnp.dtype(dtype)
        linear = dict(use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs)
        self.gate_proj = nnx.Linear(hidden_size, intermediate_size, **linear)
        self.up_proj = nnx.Linear(hidden_size, intermediate_size, **linear)
        self.down_proj = nnx.Linear(intermediate_size, hidden_size, **linear)
        self.paired = False  # whether ``pair_halves`` made gate and up one weight

    def __call__(
        self, x: jax.Array, real: jax.Array | None = None, *, impl: str = "auto"
    ) -> jax.Array:
        del real
        if self.paired:  # the launch's epilogue forms the hidden rows where it takes them
            (hidden,) = project(x, self.inputs(), impl=impl, paired=(True,))
        else:
            hidden = self.hidden(project(x, self.inputs(), impl=impl))
        return self.down(hidden, impl=impl)

    def inputs(self) -> list[nnx.Linear]:
        """The products of the block's input: the gate and up projections, or the one
        weight of both after ``pair_halves``."""
        return [self.gate_up_proj] if self.paired else [self.gate_proj, self.up_proj]

    def input_readers(self) -> list[nnx.Param]:
        """The weights of the products that read the block's input (all of its readers)."""
        return [layer.kernel for layer in self.inputs()]

    def pair_halves(self) -> None:
        """Make the gate and up projections one weight ``gate_up_proj`` ``[hidden, 2I]`` laid
        out by ``moe.pair_halves`` (each 64-column tile the gate and up columns of 32 hidden
        units), in place: the layout a launch forming ``silu(gate) * up`` in its epilogue
        reads (a MoE block's shared expert in the router's launch, ``project(paired=)``).
        The block's outputs are unchanged; for a copy the caller owns (an engine's stacked
        layers)."""
        if self.paired:
            return
        both = jnp.concatenate([self.gate_proj.kernel[...], self.up_proj.kernel[...]], -1)
        self.gate_up_proj = self.gate_proj  # the same Linear, twice as wide
        self.gate_up_proj.kernel.set_value(moe.pair_halves(both))
        self.gate_up_proj.out_features = both.shape[-1]
        del self.gate_proj, self.up_proj
        self.paired = True

    def down(self, hidden: jax.Array, *, impl: str) -> jax.Array:
        """The down projection of ``hidden`` (``project_output``)."""
        return project_output(hidden, self.down_proj, impl=impl)

    def hidden(self, products: Sequence[jax.Array]) -> jax.Array:
        """The input of the down projection, ``silu(gate) * up``, of the products of
        ``inputs()`` (the gate's and the up projection's, or their one paired product)."""
        if self.paired:
            (both,) = products
            return swiglu(both, paired=True)
        gate, up = products
        return jax.nn.silu(gate) * up


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertDispatch:
    """Where each routed (token, choice) pair goes in the expert-sorted row order.

    ``token`` ``[T * top_k]``: the token of each sorted row; ``position`` ``[T * top_k]``: the
    sorted row of each token-major (token, choice) pair; ``group_sizes`` ``[E]``: rows per
    expert, the grouped matmul's groups.
    """

    token: jax.Array
    position: jax.Array
    group_sizes: jax.Array

    @classmethod
    def sort(
        cls, experts: jax.Array, num_experts: int, real: jax.Array | None = None
    ) -> ExpertDispatch:
        """The dispatch of int32 ``experts`` ``[T, top_k]`` over ``num_experts`` experts.

        ``real`` (bool ``[T]``, optional) marks the tokens of real rows: a padding token's
        pairs sort after every group, so the grouped matmul neither computes them nor reads
        an expert for them (its output rows past the groups are zeros). Without it a padding
        row of a decode bucket would read up to ``top_k`` experts of its own.
        """
        if real is not None:
            experts = jnp.where(real[:, None], experts, num_experts)
        flat = experts.reshape(-1)  # token-major
        order = jnp.argsort(flat, stable=True)
        # No scatters: on the GPU each one is a copy of its zeroed buffer plus a scatter
        # kernel, per MoE block per step. The inverse permutation is a second sort, and the
        # group sizes a comparison and a sum (the padding key, num_experts, matches no group).
        return cls(
            token=order // experts.shape[1],
            position=jnp.argsort(order),
            group_sizes=jnp.sum(
                flat[:, None] == jnp.arange(num_experts, dtype=flat.dtype), axis=0, dtype=jnp.int32
            ),
        )

    def rows(self, x: jax.Array) -> jax.Array:
        """x ``[T, d]`` -> the experts' input rows ``[T * top_k, d]``, sorted by expert."""
        return x[self.token]

    def combine(self, ys: jax.Array, weights: jax.Array) -> jax.Array:
        """Sorted expert outputs ``[T * top_k, d]`` -> float32 ``[T, d]``, each token's rows
        weighted by its ``weights`` ``[T, top_k]``.

        A gather back into token-major order and a sum over the choices: a scatter-add into
        the token rows would serialise on the repeated token indices.
        """
        tokens, top_k = weights.shape
        per_token = ys[self.position].reshape(tokens, top_k, ys.shape[-1])
        # A product and a sum over the choices, which XLA fuses with the gather into one
        # reduction (a dot would materialise the gathered rows first).
        scaled = per_token.astype(jnp.float32) * weights.astype(jnp.float32)[..., None]
        return short_sum(scaled, 1)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shape of one sparse MoE block: ``num_experts`` experts of width ``intermediate_size``,
    ``top_k`` per token, and a shared expert of width ``shared_intermediate_size``."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    norm_topk_prob: bool = True
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be in 1..num_experts={self.num_experts}"
            )


def _expert_weights(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype) -> nnx.Param:
    # LeCun-normal over each expert's input dimension, like nnx.Linear's default.
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * shape[1] ** -0.5)


def _launch_rows(x: jax.Array | NormedRows, layers) -> tuple[jax.Array, list, dict]:
    """(the rows a launch reads, the layers' weights, the norm's arguments: each row's
    square sum and eps where ``x`` is a norm's rows, which the launch scales by)."""
    rows = x.weighted() if isinstance(x, NormedRows) else x
    norm = dict(row_scale=x.square_sum(), rms_eps=x.eps) if isinstance(x, NormedRows) else {}
    return rows, [layer.kernel[...] for layer in layers], norm


class SparseMoE(nnx.Module):
    """Top-k routed experts plus a sigmoid-gated shared expert; x ``[T, hidden]`` -> same;
    ``impl`` chooses the experts' grouped matmul (``moe.grouped_matmul``)."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
        c = config
        dtype = jnp.dtype(c.dtype)
        self.config = c
        self.gate = nnx.Linear(
            c.hidden_size, c.num_experts, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        gate = _expert_weights(rngs, (c.num_experts, c.hidden_size, c.intermediate_size), dtype)
        up = _expert_weights(rngs, (c.num_experts, c.hidden_size, c.intermediate_size), dtype)
        self.gate_up_proj = nnx.Param(jnp.concatenate([gate[...], up[...]], axis=-1))
        self.down_proj = _expert_weights(
            rngs, (c.num_experts, c.intermediate_size, c.hidden_size), dtype
        )
        self.shared_expert = MLP(
            c.hidden_size, c.shared_intermediate_size, dtype=c.dtype, rngs=rngs
        )
        self.shared_expert_gate = nnx.Linear(
            c.hidden_size, 1, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.paired = False  # whether ``pair_halves`` laid out the gate/up weights

    def route(
        self, logits: jax.Array, real: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """(weights ``[T, top_k]`` in the logits' dtype, experts int32 ``[T, top_k]``) of each
        token, from its router logits ``[T, E]``; a token that ``real`` (bool ``[T]``) marks
        as padding gets expert ``E`` (none) for every choice."""
        weights, experts, exps = self._route(logits, real)
        if exps:
            weights = softmax_of_exps(weights)
        return weights.astype(logits.dtype), experts

    def _route(
        self, logits: jax.Array, real: jax.Array | None
    ) -> tuple[jax.Array, jax.Array, bool]:
        """``route``'s (float32 weights, experts), and whether the weights are still the
        chosen experts' softmax exponentials, to be divided by their sum (``SOFTMAX_IN_RANKING``:
        the ranking gives them, and whoever reads the weights divides)."""
        k = self.config.top_k
        wide = logits.astype(jnp.float32)
        ranked = logits.shape[0] <= RANKED_TOP_K_TOKENS
        if self.config.norm_topk_prob and SOFTMAX_IN_RANKING and ranked:
            return (*top_k_exps(wide, k, real), True)
        if self.config.norm_topk_prob:
            # The softmax renormalised over the chosen experts is the softmax of their logits
            # (the softmax keeps the logits' order): no softmax over every expert.
            chosen, experts = top_k(wide, k, real)
            return _softmax_of_ordered(chosen), experts, False
        return (*top_k(jax.nn.softmax(wide, axis=-1), k, real), False)

    def __call__(
        self, x: jax.Array, real: jax.Array | None = None, *, impl: str = "auto"
    ) -> jax.Array:
        """x ``[T, hidden]`` -> the same; ``real`` (bool ``[T]``) marks the tokens of real
        rows, whose experts alone are computed (padding tokens get the shared expert only)."""
        shared_mlp = self.shared_expert
        hidden_in_launch = self._hidden_in_launch(x, impl)
        logits, shared_products, gate_logits = self._router_launch(x, hidden_in_launch, impl)
        shared_scale = jax.nn.sigmoid(gate_logits[:, :1])
        if hidden_in_launch:
            (shared_hidden,) = shared_products
            weights, experts = self.route(logits, real)
            ys, shared = self._experts_launches(x, experts, shared_hidden, impl)
            routed = self._weighted_choices(ys, weights, experts)
            return routed.astype(x.dtype) + shared_scale * shared
        shared_hidden = shared_mlp.hidden(shared_products)
        if self._runs_by_id(x, impl):
            routed, shared = self._experts_by_id(x, logits, real, shared_hidden, impl)
            return routed.astype(x.dtype) + shared_scale * shared
        weights, experts = self.route(logits, real)
        x = formed(x)
        shared = shared_scale * shared_mlp.down(shared_hidden, impl=impl)
        # ``route`` gave padding tokens the out-of-range expert: they sort after the groups.
        dispatch = ExpertDispatch.sort(experts, self.config.num_experts)
        xs = dispatch.rows(x)

        def experts_matmul(rows: jax.Array, w: nnx.Param) -> jax.Array:
            return moe.grouped_matmul(rows, w[...], dispatch.group_sizes, impl=impl)

        hidden = swiglu(experts_matmul(xs, self.gate_up_proj), paired=self.paired)
        routed = dispatch.combine(experts_matmul(hidden, self.down_proj), weights)
        return routed.astype(x.dtype) + shared

    def add_to(
        self, residual: jax.Array, x: jax.Array | NormedRows, real: jax.Array | None = None,
        *, impl: str = "auto", counters: jax.Ref | None = None,
    ) -> jax.Array | SummedRows:  # fmt: skip
        """``residual + self(x, real)``. Where the hidden rows come from the experts'
        launches and ``COMBINE_IN_LAUNCH``, one ``moe.combine_pairs`` launch forms the sum
        from the down launch's tiles and gives each new row's sum of squares with it
        (``SummedRows``, which the next norm reads instead of reducing the rows again).
        ``counters``: int32 zeros for the experts' one launch to count in
        (``moe.expert_mlp``'s), shared by the forward's blocks (``LayerStates.counters``)."""
        if not (COMBINE_IN_LAUNCH and self._hidden_in_launch(x, impl)):
            return residual + self(x, real, impl=impl)
        ranked = self._ranked_router_launch(x, real, impl, counters)
        if ranked is not None:
            shared_hidden, gate_logits, weights, experts = ranked
            exps = True
        else:
            logits, (shared_hidden,), gate_logits = self._router_launch(
                x, True, impl, counters=counters
            )
            weights, experts, exps = self._route(logits, real)
            if not exps:  # as ``route`` gives them (the combine divides exponentials itself)
                weights = weights.astype(logits.dtype)
        tiles, shared = self._experts_launches(
            x, experts, shared_hidden, impl, tiles=True, counters=counters
        )
        # The down launch's pairs are the (token, choice) pairs in order: the same tiles
        # read as each token's choices.
        pairs = moe.PairTiles(tiles.tiles, experts, tiles.num_experts, tiles.per_line)
        out, sums = moe.combine_pairs(
            pairs, weights, shared, gate_logits, residual, normalize=exps, impl=impl
        )
        return SummedRows(out, sums)

    def _router_launch(self, x: jax.Array | NormedRows, hidden_in_launch: bool, impl: str,
                       counters: jax.Ref | None = None):  # fmt: skip
        """(the router's logits ``[T, E]``; the shared expert's input products, its hidden
        rows alone with ``hidden_in_launch``; its gate logits ``[T, G]``, the logit in column
        0) from the launch of the products that read the block's input, over parts of K
        where ``_router_splits`` splits it (counting in ``counters``)."""
        inputs, paired, gate_in_launch = self._router_inputs(hidden_in_launch)
        rows, weights, norm = _launch_rows(x, inputs)
        splits = self._router_splits(rows, inputs, weights, paired, impl) if hidden_in_launch else 1
        if splits > 1:
            logits, *shared_products = projections.projections(
                rows, weights, paired=paired, splits=splits, counters=counters, impl=impl,
                **norm,
            )  # fmt: skip
        else:
            logits, *shared_products = project(x, inputs, impl=impl, paired=paired)
        if gate_in_launch:
            *shared_products, gate_logits = shared_products
        else:
            gate_logits = self._shared_gate_logit(x)
        return logits, shared_products, gate_logits

    def _router_inputs(self, hidden_in_launch: bool):
        """(the router's launch's layers: the router, the shared expert's input products and,
        widened, its gate; whether each is paired; whether the gate is among them)."""
        shared_inputs = self._shared_inputs()
        inputs = [self.gate, *shared_inputs]
        # With the hidden rows formed in the launches, the router's forms the shared
        # expert's (its one paired weight) and the experts' launch the routed pairs'.
        paired = [False, *[hidden_in_launch] * len(shared_inputs)]
        gate_in_launch = self._shared_gate_in_launch()
        if gate_in_launch:
            inputs.append(self.shared_expert_gate)
            paired.append(False)
        return inputs, paired, gate_in_launch

    def _ranked_router_launch(self, x: jax.Array | NormedRows, real, impl: str, counters):
        """(the shared expert's hidden rows; its gate logits ``[T, G]``, the logit in column
        0; the chosen experts' softmax exponentials, float32 ``[T, top_k]``; the experts,
        int32, out of range for padding tokens) from one router launch that ranks the
        logits itself (``RANKING_IN_ROUTER_LAUNCH``), or None where it does not: the
        ranking as ``_route`` ranks with ``SOFTMAX_IN_RANKING``, from the logits the launch
        stores."""
        c = self.config
        ranks = x.shape[0] <= RANKED_TOP_K_TOKENS and c.norm_topk_prob and SOFTMAX_IN_RANKING
        if not (RANKING_IN_ROUTER_LAUNCH and ranks):
            return None
        inputs, paired, gate_in_launch = self._router_inputs(True)
        rows, weights, norm = _launch_rows(x, inputs)
        reason = projections.ranked_unsupported_reason(rows, weights, c.top_k, paired)
        if any(layer.use_bias for layer in inputs) or reason is not None:
            return None
        if resolve_impl("projections", impl, reason) == "reference":
            return None  # the blocks' XLA products and ranking
        products, exps, experts = projections.ranked_projections(
            rows, weights, top_k=c.top_k, valid=real, paired=paired,
            splits=self._router_splits(rows, inputs, weights, paired, impl), counters=counters,
            impl=impl, **norm,
        )  # fmt: skip
        shared_hidden = products[1]
        gate_logits = products[-1] if gate_in_launch else self._shared_gate_logit(x)
        return shared_hidden, gate_logits, exps, experts

    @staticmethod
    def _router_splits(rows: jax.Array, layers, weights, paired, impl: str) -> int:
        """The parts of K the router's launch (``layers``, their ``weights``) takes:
        ``projections.partial_splits``' count with ``SPLIT_ROUTER_LAUNCH`` where the launch
        combines those (on the GPU: no biases, widths its row programs take), else 1."""
        if not SPLIT_ROUTER_LAUNCH or not 0 < rows.shape[0] <= linear_layer.FEW_ROWS:
            return 1
        splits = projections.partial_splits(rows.shape[1], [w.shape[1] for w in weights])
        reason = projections.combined_unsupported_reason(rows, weights, splits, paired)
        if splits == 1 or reason is not None or any(layer.use_bias for layer in layers):
            return 1
        return splits if resolve_impl("projections", impl, reason) != "reference" else 1

    def _shared_gate_logit(self, x: jax.Array | NormedRows) -> jax.Array:
        """``shared_expert_gate(x)`` ``[T, 1]``; of ``NormedRows``, the product of the
        weighted rows times each row's inverse RMS (the norm is not formed for it)."""
        if not isinstance(x, NormedRows):
            return self.shared_expert_gate(x)[:, :1]
        logit = self.shared_expert_gate(x.weighted())[:, :1].astype(jnp.float32)
        return (logit * x.inverse_rms()[:, None]).astype(x.dtype)

    def _shared_gate_in_launch(self) -> bool:
        """Whether the shared expert's gate is widened to a column tile
        (``widen_shared_gate``): its logit is then column 0 of a product in the router's
        launch."""
        return self.shared_expert_gate.kernel.shape[-1] > 1

    def input_readers(self) -> list[nnx.Param]:
        """The weights of the products that read the block's input (all of its readers)."""
        shared = [layer.kernel for layer in (*self._shared_inputs(), self.shared_expert_gate)]
        return [self.gate.kernel, *shared, self.gate_up_proj]

    def widen_shared_gate(self) -> None:
        """Give the shared expert's gate ``[hidden, 1]`` zero columns up to a width the
        projections' launch takes, which then forms its logit beside the router's (the other
        columns are never read). For a block whose input norm is folded into its readers
        (``ZeroCenteredRMSNorm.fold_into``): the launch's rows are then the input itself,
        and the gate alone would be a product of its own over them."""
        kernel = self.shared_expert_gate.kernel
        width = kernel.shape[-1]
        if width % SHARED_GATE_WIDTH:
            pad = SHARED_GATE_WIDTH - width % SHARED_GATE_WIDTH
            widths = [(0, 0)] * (len(kernel.shape) - 1) + [(0, pad)]
            kernel.set_value(jnp.pad(kernel.get_value(), widths))

    def _runs_by_id(self, x: jax.Array | NormedRows, impl: str) -> bool:
        """Whether this call's experts run by id: few pairs, and the kernel runs here (never
        the reference, which would gather every pair's whole expert)."""
        if not 0 < x.shape[0] * self.config.top_k <= BY_ID_MAX_PAIRS:
            return False
        hidden = jax.ShapeDtypeStruct((x.shape[0], self.config.intermediate_size), x.dtype)
        tokens = jax.ShapeDtypeStruct(x.shape, x.dtype)
        for rows, w in ((tokens, self.gate_up_proj[...]), (hidden, self.down_proj[...])):
            if moe.expert_matmul_unsupported_reason(rows, w) is not None:
                return False
        return resolve_impl("expert_matmul", impl, None) != "reference"

    def _shared_inputs(self) -> list[nnx.Linear]:
        """The shared expert's products of the block's input (``MLP.inputs``)."""
        return self.shared_expert.inputs()

    def pair_halves(self) -> None:
        """Lay out the experts' and the shared expert's gate/up weights by ``moe.pair_halves``
        (each 64-column tile the gate and up columns of 32 hidden units), in place: the
        layout ``moe.expert_hidden`` reads, one tile per program, to form the
        hidden rows in its epilogue; widths that are not whole tiles of ``moe.PAIRED_UNITS``
        stay as they are. The block's outputs are unchanged; for a copy the caller owns (an
        engine's stacked layers)."""
        widths = (self.config.intermediate_size, self.config.shared_intermediate_size)
        if self.paired or any(width % moe.PAIRED_UNITS for width in widths):
            return  # the layout holds whole tiles of hidden units
        self.gate_up_proj.set_value(moe.pair_halves(self.gate_up_proj.get_value()))
        self.shared_expert.pair_halves()
        self.paired = True

    def _hidden_in_launch(self, x: jax.Array | NormedRows, impl: str) -> bool:
        """Whether this call's routed hidden rows come from ``moe.expert_hidden`` and its
        shared expert's from the router's launch (``HIDDEN_IN_EXPERT_LAUNCH``, weights laid
        out by ``pair_halves``, experts by id, shapes the kernel takes)."""
        if not (HIDDEN_IN_EXPERT_LAUNCH and self.paired and self._runs_by_id(x, impl)):
            return False
        rows = jax.ShapeDtypeStruct(x.shape, x.dtype)
        reason = moe.expert_hidden_unsupported_reason(rows, self.gate_up_proj[...])
        return reason is None

    def _hidden_by_id(self, x, experts, impl: str) -> moe.PairTiles:
        """The routed pairs' hidden rows as the ``moe.expert_hidden`` launch over the paired
        weights stored them (``moe.PairTiles``, which the down launch reads in place); of
        ``NormedRows``, the weighted rows with each row's inverse RMS formed in the launch."""
        w, kw = self.gate_up_proj[...], dict(tiles=True, impl=impl)
        if isinstance(x, NormedRows):
            return moe.expert_hidden(
                x.weighted(), w, experts, row_scale=x.square_sum(), rms_eps=x.eps, **kw
            )
        return moe.expert_hidden(x, w, experts, **kw)

    def _gate_up_by_id(self, x, logits, real, impl: str):
        """(each token's experts' gate/up products ``[T, top_k, 2I]``, of ``NormedRows``
        times each token's inverse RMS; the weights ``[T, top_k]`` in the logits' dtype; the
        int32 experts ``[T, top_k]``, out of range for padding tokens, from ``route``)."""
        rows = x.weighted() if isinstance(x, NormedRows) else x
        weights, experts = self.route(logits, real)
        gate_up = moe.expert_matmul(rows, self.gate_up_proj[...], experts, impl=impl)
        if isinstance(x, NormedRows):
            gate_up = gate_up.astype(jnp.float32) * x.inverse_rms()[:, None, None]
        return gate_up, weights, experts

    def _experts_by_id(self, x, logits, real, shared_hidden, impl: str):
        """(float32 ``[T, hidden]``: each token's experts read by id (padding tokens' ids are
        out of range: they read none and give zeros), weighted and summed; the shared
        expert's down product of ``shared_hidden``) from the experts' gate/up launch
        (``_gate_up_by_id``), the SiLU products in XLA and ``_down_by_id``."""
        gate_up, weights, experts = self._gate_up_by_id(x, logits, real, impl)
        tokens, top_k = experts.shape
        hidden = swiglu(gate_up, paired=self.paired).astype(x.dtype).reshape(tokens * top_k, -1)
        if SHARED_HIDDEN_WITH_EXPERTS and shared_hidden.shape[1] == hidden.shape[1]:
            # The barrier keeps the slices from being folded back into the two products
            # (which would leave the concatenation a copy of its own).
            both = jax.lax.optimization_barrier(jnp.concatenate([hidden, shared_hidden]))
            hidden, shared_hidden = both[: tokens * top_k], both[tokens * top_k :]
        return self._down_by_id(hidden, shared_hidden, weights, experts, impl)

    def _down_by_id(self, hidden, shared_hidden, weights, experts, impl: str):
        """(float32 ``[T, hidden]``: the pairs' down products of ``hidden`` ``[T * top_k,
        I]`` (or an earlier launch's ``moe.PairTiles`` of those pairs) read by id, weighted
        and summed over each token's choices; the shared expert's
        down product of ``shared_hidden``, in the experts' down launch with
        ``SHARED_DOWN_WITH_EXPERTS`` where the kernel takes it)."""
        ys, shared = self._down_launch(hidden, shared_hidden, experts, impl)
        return self._weighted_choices(ys, weights, experts), shared

    @staticmethod
    def _weighted_choices(ys, weights, experts) -> jax.Array:
        """float32 ``[T, hidden]``: the pairs' down products ``ys`` (``[T * top_k, 1, N]``)
        weighted and summed over each token's choices."""
        tokens, top_k = experts.shape
        ys = ys.reshape(tokens, top_k, -1).astype(jnp.float32)
        return short_sum(ys * weights.astype(jnp.float32)[..., None], 1)

    def _experts_launches(
        self, x, experts, shared_hidden, impl: str, *, tiles: bool = False, counters=None
    ):
        """(the pairs' down products, as ``_down_launch`` gives them; the shared expert's
        down product of ``shared_hidden``) from the routed hidden rows formed in the experts'
        launch: with ``EXPERTS_IN_ONE_LAUNCH`` and the shared down in it, one
        ``moe.expert_mlp`` launch; otherwise ``_hidden_by_id``'s launch and the down launch
        after it."""
        dense = (shared_hidden, self.shared_expert.down_proj.kernel[...])
        up, down = self.gate_up_proj[...], self.down_proj[...]
        rows = x.weighted() if isinstance(x, NormedRows) else x
        if not (
            EXPERTS_IN_ONE_LAUNCH
            and SHARED_DOWN_WITH_EXPERTS
            and moe.expert_mlp_unsupported_reason(rows, up, down, dense) is None
        ):
            hidden = self._hidden_by_id(x, experts, impl)
            return self._down_launch(hidden, shared_hidden, experts, impl, tiles=tiles)
        kw = dict(dense=dense, tiles=tiles, counters=counters, impl=impl)
        if isinstance(x, NormedRows):
            kw.update(row_scale=x.square_sum(), rms_eps=x.eps)
        return moe.expert_mlp(rows, up, down, experts, **kw)

    def _down_launch(self, hidden, shared_hidden, experts, impl: str, *, tiles: bool = False):
        """(the pairs' down products of ``hidden`` read by id, as rows ``[T * top_k, 1, N]``
        or, with ``tiles``, as the launch stored them; the shared expert's down product of
        ``shared_hidden``, in the same launch with ``SHARED_DOWN_WITH_EXPERTS`` where the
        kernel takes it)."""
        down, ids = self.down_proj[...], experts.reshape(-1, 1)
        dense = (shared_hidden, self.shared_expert.down_proj.kernel[...])
        if (
            SHARED_DOWN_WITH_EXPERTS
            and moe.expert_matmul_unsupported_reason(hidden, down, dense) is None
        ):
            return moe.expert_matmul(hidden, down, ids, dense=dense, tiles=tiles, impl=impl)
        ys = moe.expert_matmul(hidden, down, ids, tiles=tiles, impl=impl)
        return ys, self.shared_expert.down(shared_hidden, impl=impl)
