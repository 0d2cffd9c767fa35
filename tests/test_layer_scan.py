"""Repeated layers under ``lax.scan`` (``models.layer_scan``): the runs found, the same step
results as the layer-by-layer model in every mode, a trace whose size does not grow with
depth, and weights moved (not copied) when donated."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import _model_parity as parity
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax import Engine, EngineConfig, SamplingParams
from hybrid_jax.backend.commit import commit_verified
from hybrid_jax.layers import linear as linear_layer
from hybrid_jax.layers import moe as moe_layer
from hybrid_jax.metadata import RowSpec, build_metadata
from hybrid_jax.models import layer_scan
from hybrid_jax.models.layer_scan import (
    LayerRun,
    ScannedRun,
    fold_scanned_norms,
    layer_runs,
    pair_scanned_swiglu,
    scan_layers,
)
from hybrid_jax.models.nemotron_h import NemotronH, NemotronHConfig
from hybrid_jax.models.qwen3_next import (
    Qwen3Next,
    seed_weights,
    tiny_qwen3_next,
    tiny_qwen3_next_config,
)
from hybrid_jax.models.tokenizer import ByteTokenizer
from pallas_kernels import moe as moe_kernels

M = parity.M
FIXTURES = pathlib.Path(__file__).parent / "fixtures"
G, A = "linear_attention", "full_attention"


def qwen3_next(num_repeats: int, seed: int = 0) -> Qwen3Next:
    """The tiny Qwen3-Next with ``num_repeats`` blocks of (GDN, GDN, attention), dense MLPs
    (the Nemotron-H model below scans MoE blocks)."""
    config = dataclasses.replace(
        tiny_qwen3_next_config(), num_hidden_layers=3 * num_repeats,
        layer_types=(G, G, A) * num_repeats, num_experts=0, mlp_only_layers=(),
        num_nextn_predict_layers=0,
    )  # fmt: skip
    return _seeded(lambda: Qwen3Next(config, rngs=nnx.Rngs(0)), seed)


def _seeded(build, seed: int = 0):
    """The model ``build`` makes, its weights drawn by numpy (no device random programs to
    compile), in the built-in model's ranges."""
    model = nnx.eval_shape(build)
    rng = np.random.default_rng(seed)
    seed_weights(model, lambda path: rng)
    return model


def nemotron_h() -> NemotronH:
    """The hybrid Nemotron-H fixture's dimensions in the pattern M E M E M E A M (runs of
    (Mamba2, MoE) three times, then two single blocks)."""
    config = json.loads((FIXTURES / "nemotron_h" / "hybrid" / "config.json").read_text())
    config["layers_block_type"] = [G, "moe"] * 3 + [A, G]
    config["num_hidden_layers"] = len(config["layers_block_type"])
    return _seeded(lambda: NemotronH(NemotronHConfig.from_hf_dict(config), rngs=nnx.Rngs(0)))


# ---------------------------------------------------------------- runs


@pytest.mark.parametrize(
    ("pattern", "runs"),
    [
        ("GGGA" * 12, [(0, 4, 12)]),
        ("GAGA", [(0, 2, 2)]),
        ("GAGM", [(0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1)]),  # nothing repeats
        ("MEMEMEAM", [(0, 2, 3), (6, 1, 1), (7, 1, 1)]),
        # A block may start anywhere: MMMAM repeats from layer 0, then MMM and A are left.
        ("MMMA" + "MMMMA" * 3, [(0, 5, 3), (15, 1, 3), (18, 1, 1)]),
        ("X", [(0, 1, 1)]),
    ],
)
def test_layer_runs_cover_the_layers_with_the_longest_repeated_blocks(pattern, runs):
    assert layer_runs(pattern) == tuple(LayerRun(*run) for run in runs)


@pytest.mark.parametrize("pattern", ["GGGA" * 3 + "GG", "MEMEAMMMEEE", "ABCABCABD", "AAAAB"])
def test_layer_runs_tile_the_layers_in_order(pattern):
    runs = layer_runs(pattern)
    assert runs[0].start == 0 and runs[-1].stop == len(pattern)
    for before, after in zip(runs, runs[1:], strict=False):
        assert before.stop == after.start
    for run in runs:
        block = pattern[run.start : run.start + run.period]
        assert pattern[run.start : run.stop] == block * run.repeats


def test_scan_layers_groups_qwen3_next_in_its_period_and_leaves_singles_alone():
    model = qwen3_next(3)
    scanned = scan_layers(model)
    (run,) = scanned.layers
    assert isinstance(run, ScannedRun) and run.repeats == 3
    assert (run.linear_per_repeat, run.attention_per_repeat) == (2, 1)
    kernel = run.blocks[0].linear_attn.in_proj_qkv.kernel.get_value()
    assert kernel.shape == (3, *model.layers[0].linear_attn.in_proj_qkv.kernel.shape)
    np.testing.assert_array_equal(kernel[2], model.layers[6].linear_attn.in_proj_qkv.kernel)
    # The tiny preset repeats nothing: its layers stay as they are.
    tiny = tiny_qwen3_next()
    assert not any(isinstance(layer, ScannedRun) for layer in scan_layers(tiny).layers)


# ---------------------------------------------------------------- same results


def _check_same_steps(model, scanned_model=None, verify_tol: float = 1e-5):
    """EXTEND of two rows, DECODE, a chain TARGET_VERIFY and its commit: the scanned model's
    (``scanned_model``, by default ``scan_layers(model)``) logits, pool (random states), cache
    (NaN where unwritten) and verify states are the layer-by-layer model's (the verify states
    and commits to ``verify_tol``)."""
    plain = parity.Runner(model)
    scanned = parity.Runner(scan_layers(model) if scanned_model is None else scanned_model)
    rng = np.random.default_rng(1)
    rows = [RowSpec(1, 0, 5, (3, 7)), RowSpec(3, 0, 7, (1, 12))]
    tokens = rng.integers(0, model.config.vocab_size, 12)
    states = [plain.fresh(seed=4), scanned.fresh(seed=4)]
    for mode, step_rows, step_tokens in (
        (M.EXTEND, rows, tokens),
        (M.DECODE, [RowSpec(1, 5, 1, (3, 7)), RowSpec(3, 7, 1, (1, 12))], tokens[:2]),
        (M.TARGET_VERIFY, [RowSpec(1, 6, parity.D, (3, 7, 9))], tokens[:4]),
    ):
        outs = [
            run.step(mode, step_rows, step_tokens, *state)
            for run, state in zip((plain, scanned), states, strict=True)
        ]
        (logits, out), (logits_scanned, out_scanned) = outs
        # float32 round-off only (XLA may order a scanned block's sums differently): a wrong
        # layer's weights or state would differ by O(1).
        chex.assert_trees_all_close(logits_scanned, logits, rtol=1e-4, atol=1e-4)
        chex.assert_trees_all_close(
            (out_scanned.pool, out_scanned.kv), (out.pool, out.kv), rtol=1e-4, atol=1e-4
        )
        states = [(o.pool, o.kv) for _, o in outs]
    # Verify states: one stack per layer unrolled, one per block position scanned; the same
    # states per layer, and the commits agree.
    per_layer = {v.layers[0]: v for v in out.verify}
    for stack in out_scanned.verify:
        for i, layer in enumerate(stack.layers):
            chex.assert_trees_all_close(
                (stack.windows[i], stack.ssm[i]),
                (per_layer[layer].windows[0], per_layer[layer].ssm[0]),
                rtol=verify_tol, atol=verify_tol,
            )  # fmt: skip
    slots, steps = jnp.asarray([1, 0], jnp.int32), jnp.asarray([2, -1], jnp.int32)
    committed = [commit_verified(o.pool, o.verify, slots, steps) for _, o in outs]
    chex.assert_trees_all_close(committed[1], committed[0], rtol=verify_tol, atol=verify_tol)
    assert not np.allclose(np.asarray(committed[0].ssm[:, 1]), np.asarray(out.pool.ssm[:, 1]))


def test_scanned_qwen3_next_steps_equal_the_layer_by_layer_model():
    _check_same_steps(qwen3_next(2))


def test_scanned_dense_mlps_with_paired_gate_up_step_as_the_layer_by_layer_model(monkeypatch):
    """With ``PAIR_DENSE_SWIGLU`` ``pair_scanned_swiglu`` makes each scanned dense MLP's gate
    and up one weight (``MLP.pair_halves``), whose product gives the hidden rows: the same
    steps as the unpaired layers; off, the layers keep their two weights."""
    model = qwen3_next(2)
    scanned = scan_layers(model)
    monkeypatch.setattr(moe_layer, "PAIR_DENSE_SWIGLU", False)
    pair_scanned_swiglu(scanned)  # off: nothing changes
    assert not any(block.mlp.paired for block in scanned.layers[0].blocks)
    monkeypatch.setattr(moe_layer, "PAIR_DENSE_SWIGLU", True)
    pair_scanned_swiglu(scanned)
    for block in scanned.layers[0].blocks:
        assert block.mlp.paired and not hasattr(block.mlp, "up_proj")
    assert not model.layers[0].mlp.paired  # the layer-by-layer model keeps its weights
    _check_same_steps(model, scanned)


@pytest.mark.parametrize(
    "paired",
    [pytest.param(False, marks=pytest.mark.slow), True],  # slow: the default pairs them too
    ids=["folded", "folded-and-paired"],
)
def test_scanned_layers_with_their_norms_folded_step_as_the_layer_by_layer_model(paired):
    """Each scanned layer's norm weights folded into the products that read them (a MoE
    block's experts, router, shared expert and its gate too), and with ``paired`` its MoE
    blocks' gate/up weights then laid out by ``pair_scanned_swiglu``, as an engine does with
    ``HIDDEN_IN_EXPERT_LAUNCH``: the same steps as the unfolded layers, whose norms weight
    their rows, and the model the run was stacked from keeps its own weights."""
    config = dataclasses.replace(
        tiny_qwen3_next_config(), num_hidden_layers=6, layer_types=(G, G, A) * 2,
        mlp_only_layers=(), num_nextn_predict_layers=0, moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    )  # fmt: skip
    model = _seeded(lambda: Qwen3Next(config, rngs=nnx.Rngs(0)))
    norm = model.layers[0].post_attention_layernorm
    weight, experts = norm.weight.get_value(), model.layers[0].mlp.gate_up_proj.get_value()
    assert np.abs(np.asarray(weight)).min() > 0  # a fold that forgot a reader would show
    folded = scan_layers(model)
    fold_scanned_norms(folded)
    block = folded.layers[0].blocks[0]
    assert block.input_layernorm.folded and block.post_attention_layernorm.folded
    assert not np.asarray(block.post_attention_layernorm.weight.get_value()).any()
    assert block.mlp.shared_expert_gate.kernel.get_value().shape[-1] == moe_layer.SHARED_GATE_WIDTH
    if paired:
        pair_scanned_swiglu(folded)
        assert block.mlp.paired and block.mlp.gate_up_proj.get_value().shape[1:] == experts.shape
        unpaired = moe_kernels.unpair_halves(block.mlp.gate_up_proj.get_value())
        assert not np.array_equal(block.mlp.gate_up_proj.get_value(), unpaired)
    # The folded weights round differently: float32 round-off, carried through the states.
    _check_same_steps(model, folded, verify_tol=1e-4)
    assert not norm.folded
    chex.assert_trees_all_equal(
        (norm.weight.get_value(), model.layers[0].mlp.gate_up_proj.get_value()),
        (weight, experts),
    )


def test_scanned_nemotron_h_steps_equal_the_layer_by_layer_model():
    model = nemotron_h()
    assert [type(layer).__name__ for layer in scan_layers(model).layers] == [
        "ScannedRun", "Block", "Block",
    ]  # fmt: skip
    _check_same_steps(model)


# ---------------------------------------------------------------- compile size


def _decode_jaxpr(model) -> tuple[jax.extend.core.ClosedJaxpr, int]:
    """The traced decode step of one row (the function itself, not its one jit equation),
    and its token count."""
    run = parity.Runner(model)
    pool, kv = run.fresh()
    meta = build_metadata(
        M.DECODE, [RowSpec(1, 3, 1, (2,))], parity.POLICY, num_slots=parity.NUM_SLOTS,
        num_pages=parity.NUM_PAGES,
    )  # fmt: skip
    tokens = jnp.zeros(meta.num_tokens, jnp.int32)
    forward = run.forward.__wrapped__
    return jax.make_jaxpr(forward)(run.params, tokens, pool, kv, meta), meta.num_tokens


def _decode_equations(model) -> int:
    return len(_decode_jaxpr(model)[0].eqns)


def test_the_scanned_step_traces_one_block_whatever_the_depth():
    shallow, deep = qwen3_next(2), qwen3_next(3)
    assert _decode_equations(scan_layers(shallow)) == _decode_equations(scan_layers(deep))
    assert _decode_equations(deep) > _decode_equations(shallow)  # unrolled: grows with depth


def test_a_decode_step_unrolled_gives_the_loop_s_results_bit_for_bit(monkeypatch):
    """``DECODE_SCAN_UNROLLED``: a DECODE step's scan runs its three repeats unrolled (no
    loop) and gives the loop's logits, pool and cache bit for bit."""
    model = scan_layers(qwen3_next(3))

    def scan_unroll(jaxpr):
        (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
        return scan.params["unroll"]

    run = parity.Runner(model)
    rows = [RowSpec(1, 5, 1, (3, 7)), RowSpec(3, 7, 1, (1, 12))]
    tokens = np.asarray([5, 9])
    looped = run.step(M.DECODE, rows, tokens, *run.fresh(seed=4))
    assert scan_unroll(_decode_jaxpr(model)[0]) == 1
    monkeypatch.setattr(layer_scan, "DECODE_SCAN_UNROLLED", True)
    assert scan_unroll(_decode_jaxpr(model)[0]) == 3
    unrolled = parity.Runner(model).step(M.DECODE, rows, tokens, *run.fresh(seed=4))
    chex.assert_trees_all_equal(unrolled[0], looped[0])
    chex.assert_trees_all_equal((unrolled[1].pool, unrolled[1].kv), (looped[1].pool, looped[1].kv))


@pytest.mark.parametrize(
    ("name", "norms_in_launch", "carry", "with_sums"),
    [
        ("qwen3-next", True, True, True),
        ("qwen3-next", True, False, False),
        ("qwen3-next", False, True, False),
        ("nemotron-h", True, True, False),
    ],
)
def test_the_scan_carries_the_rows_square_sums_where_the_next_norm_reads_them(
    name, norms_in_launch, carry, with_sums, monkeypatch
):
    """With the norms left to their products' launches (and ``CARRY_SQUARE_SUMS``), a
    Qwen3-Next scan carries each repeat's rows with their float32 square sums
    (``SummedRows``): a repeat's first norm, and the final norm after the scan, read them
    instead of reducing the rows again. Formed norms, or layers whose norm reads no sums
    (Nemotron-H's), carry the rows alone."""
    monkeypatch.setattr(linear_layer, "NORMS_IN_LAUNCH", norms_in_launch)
    monkeypatch.setattr(layer_scan, "CARRY_SQUARE_SUMS", carry)
    model = scan_layers(qwen3_next(2) if name == "qwen3-next" else nemotron_h())
    jaxpr, tokens = _decode_jaxpr(model)
    (at,) = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "scan"]
    # The scan's outputs: its carry, then the stacked per-repeat outputs (a leading axis).
    outs = [v.aval for v in jaxpr.eqns[at].outvars]
    sums = [a for a in outs if a.shape == (tokens,) and a.dtype == jnp.float32]
    assert len(sums) == with_sums, outs
    before, after = (
        [e.primitive.name for e in eqns if e.primitive.name.startswith("reduce")]
        for eqns in (jaxpr.eqns[:at], jaxpr.eqns[at + 1 :])
    )
    # Carried, the rows are summed once before the scan and the final norm reads the sums.
    assert before == ["reduce_sum"] * with_sums
    if name == "qwen3-next":  # its scan ends the layers: the final norm alone comes after
        assert after == ([] if with_sums else ["reduce_sum"])


# ---------------------------------------------------------------- weights


def test_donated_layers_are_moved_into_the_stack():
    model = qwen3_next(2)
    originals = [layer.linear_attn.in_proj_qkv.kernel.get_value() for layer in model.layers[:4:3]]
    want = np.stack([np.asarray(a) for a in originals])
    scanned = scan_layers(model, donate=True)
    assert all(a.is_deleted() for a in originals)
    np.testing.assert_array_equal(
        scanned.layers[0].blocks[0].linear_attn.in_proj_qkv.kernel.get_value(), want
    )
    assert not model.embed_tokens.embedding.get_value().is_deleted()  # only layers move


def test_engine_on_a_scanned_model_serves_the_greedy_tokens_of_the_layer_by_layer_model():
    model = qwen3_next(2)
    prompt = list(b"hybrid")
    want = parity.greedy_tokens(parity.Runner(model), prompt, (1, 2, 3), 4)  # unrolled
    config = EngineConfig(
        max_batch=1, max_tokens=16, max_context=24, page_size=parity.PAGE, cache_dir=None,
        impl="reference", overlap=False,
    )  # fmt: skip
    first = model.layers[0].linear_attn.in_proj_qkv.kernel.get_value()
    engine = Engine(model, ByteTokenizer(), config, progress=False, donate_weights=True)
    assert first.is_deleted() and isinstance(engine.model.layers[0], ScannedRun)
    (result,) = engine.generate([prompt], SamplingParams(max_new_tokens=4))
    assert result.token_ids == want


def test_an_engine_folds_the_layers_it_stacks_and_leaves_a_scanned_model_alone():
    config = EngineConfig(
        max_batch=1, max_tokens=16, max_context=24, page_size=parity.PAGE, cache_dir=None,
        impl="reference", overlap=False,
    )  # fmt: skip
    own = Engine(qwen3_next(2), ByteTokenizer(), config, progress=False, donate_weights=True)
    assert own.model.layers[0].blocks[0].input_layernorm.folded
    scanned = scan_layers(qwen3_next(2))
    Engine(scanned, ByteTokenizer(), config, progress=False)
    block = scanned.layers[0].blocks[0]
    assert not block.input_layernorm.folded and not block.post_attention_layernorm.folded


def test_an_engine_with_hidden_in_expert_launch_pairs_the_moe_blocks_it_stacks(monkeypatch):
    """``HIDDEN_IN_EXPERT_LAUNCH``: an engine lays out its stacked MoE blocks' gate/up
    weights by ``moe.pair_halves`` and serves the greedy tokens of the engine without it."""
    model_config = dataclasses.replace(
        tiny_qwen3_next_config(), num_hidden_layers=6, layer_types=(G, G, A) * 2,
        mlp_only_layers=(), num_nextn_predict_layers=0, moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    )  # fmt: skip
    config = EngineConfig(
        max_batch=1, max_tokens=16, max_context=24, page_size=parity.PAGE, cache_dir=None,
        impl="reference", overlap=False,
    )  # fmt: skip
    prompt, params = list(b"hybrid"), SamplingParams(max_new_tokens=4)

    def serve():
        model = _seeded(lambda: Qwen3Next(model_config, rngs=nnx.Rngs(0)))
        engine = Engine(model, ByteTokenizer(), config, progress=False, donate_weights=True)
        (result,) = engine.generate([prompt], params)
        return engine.model.layers[0].blocks[0].mlp, result.token_ids

    assert moe_layer.HIDDEN_IN_EXPERT_LAUNCH is True  # the default
    paired, got = serve()
    monkeypatch.setattr(moe_layer, "HIDDEN_IN_EXPERT_LAUNCH", False)
    plain, want = serve()
    assert not plain.paired and paired.paired and paired.shared_expert.paired
    assert got == want


def test_the_scan_body_reads_each_layer_s_slots_and_pages_shifted_before_the_loop():
    """The layers' pool slots and page tables are shifted to every layer's rows before the
    scan (its xs), so the loop body holds no index arithmetic: the metadata's own slots and
    table are not among the scan's inputs, and each repeat's shifted ones are."""
    model = scan_layers(qwen3_next(3))
    run = parity.Runner(model)
    pool, kv = run.fresh()
    meta = build_metadata(
        M.DECODE, [RowSpec(1, 3, 1, (2,)), RowSpec(2, 5, 1, (4, 5))], parity.POLICY,
        num_slots=parity.NUM_SLOTS, num_pages=parity.NUM_PAGES,
    )  # fmt: skip
    meta = jax.tree.map(jnp.asarray, meta)
    tokens = jnp.zeros(meta.num_tokens, jnp.int32)
    args = (run.params, tokens, pool, kv, meta)
    closed = jax.make_jaxpr(run.forward.__wrapped__)(*args)
    leaves = jax.tree.leaves(args)

    def var_of(leaf):
        (i,) = [i for i, a in enumerate(leaves) if a is leaf]
        return closed.jaxpr.invars[i]

    scan = next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan")
    assert var_of(meta.state_indices) not in scan.invars
    assert var_of(meta.pages.table) not in scan.invars
    shapes = {tuple(v.aval.shape) for v in scan.invars if v.aval.dtype == jnp.int32}
    bs, max_pages = meta.pages.table.shape
    assert (3, 2, bs) in shapes  # 3 repeats of 2 GDN layers
    assert (3, 1, bs, max_pages) in shapes  # and of 1 attention layer
