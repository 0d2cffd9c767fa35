"""Qwen3-Next's multi-token-prediction head and the MTP draft source of the engine.

The head is checked against a float64 numpy oracle written from its definition over the
checkpoint's own tensors (``mtp.*`` in Hugging Face layout, written with our safetensors
writer), so the definition and the loader's name and layout mapping are pinned together.
The engine tests serve with MTP drafts and compare against serving without speculation.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _engine_helpers import (
    GREEDY,
    PROMPTS,
    FromScratch,
    OracleDrafter,
    agreeing_model,
    assert_same_states,
    check_agreeing_drafts_are_accepted,
    generate_tokens,
    run_bench,
    run_joining_and_leaving,
    seeded_runs,
    speculative_fixtures,
    states_by_position,
)
from flax import nnx

from hybrid_jax import Engine, EngineConfig
from hybrid_jax.engine.speculative import SpeculativeConfig, SpeculativeConfigError
from hybrid_jax.kv_cache import init_kv_cache
from hybrid_jax.metadata import BucketPolicy, RowSpec, build_metadata
from hybrid_jax.models.qwen3_next import (
    Qwen3Next,
    seed_weights,
    tiny_qwen3_next,
    tiny_qwen3_next_config,
)
from hybrid_jax.models.qwen3_next_loading import load_qwen3_next, save_checkpoint
from hybrid_jax.models.safetensors_io import read_tensors, write_tensors
from hybrid_jax.models.tokenizer import ByteTokenizer
from hybrid_jax.modes import ForwardMode

M = ForwardMode
D = 4

# ---------------------------------------------------------------- the head against its oracle


def _rms(x, w, eps):
    """Zero-centred RMSNorm over the last axis: ``x / rms(x) * (1 + w)``."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _rotary(x, positions, rotary_dim, theta):
    half = rotary_dim // 2
    inv = theta ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    ang = positions[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, rest], axis=-1)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def mtp_oracle(t, c, next_tokens, hidden):
    """float64 head over one request's positions 0..n-1, from HF-named tensors ``t``:
    next_tokens ``[n]`` (t_{p+1}), hidden ``[n, H]`` (h_p). Returns (normed ``[n, H]``,
    logits ``[n, V]``)."""
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    eps, n = c.rms_norm_eps, len(next_tokens)
    p = "mtp.layers.0."
    emb = t["model.embed_tokens.weight"][np.asarray(next_tokens)]
    x = np.concatenate(
        [
            _rms(emb, t["mtp.pre_fc_norm_embedding.weight"], eps),
            _rms(np.asarray(hidden, np.float64), t["mtp.pre_fc_norm_hidden.weight"], eps),
        ],
        axis=-1,
    )
    x = x @ t["mtp.fc.weight"].T
    # Gated full attention, causal over the request's own positions.
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    h = _rms(x, t[f"{p}input_layernorm.weight"], eps)
    qg = (h @ t[f"{p}self_attn.q_proj.weight"].T).reshape(n, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = (h @ t[f"{p}self_attn.k_proj.weight"].T).reshape(n, nkv, hd)
    v = (h @ t[f"{p}self_attn.v_proj.weight"].T).reshape(n, nkv, hd)
    q = _rms(q, t[f"{p}self_attn.q_norm.weight"], eps)
    k = _rms(k, t[f"{p}self_attn.k_norm.weight"], eps)
    pos = np.arange(n, dtype=np.float64)
    rd = int(hd * c.partial_rotary_factor)
    q, k = _rotary(q, pos, rd, c.rope_theta), _rotary(k, pos, rd, c.rope_theta)
    kh = np.repeat(k, nh // nkv, axis=1)
    vh = np.repeat(v, nh // nkv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, kh) * hd**-0.5
    scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    att = np.einsum("hqk,khd->qhd", probs, vh) * _sigmoid(gate)
    x = x + att.reshape(n, nh * hd) @ t[f"{p}self_attn.o_proj.weight"].T
    # Sparse MoE with a shared expert (the tiny preset's MTP layer is sparse).
    h = _rms(x, t[f"{p}post_attention_layernorm.weight"], eps)
    router = h @ t[f"{p}mlp.gate.weight"].T
    router = np.exp(router - router.max(-1, keepdims=True))
    router /= router.sum(-1, keepdims=True)
    top = np.argsort(-router, axis=-1)[:, : c.num_experts_per_tok]
    moe = np.zeros_like(h)
    for i in range(n):
        weights = router[i, top[i]] / router[i, top[i]].sum()
        for w, e in zip(weights, top[i], strict=True):
            q_ = f"{p}mlp.experts.{e}."
            up = _silu(h[i] @ t[f"{q_}gate_proj.weight"].T) * (h[i] @ t[f"{q_}up_proj.weight"].T)
            moe[i] += w * (up @ t[f"{q_}down_proj.weight"].T)
    s = f"{p}mlp.shared_expert."
    shared = _silu(h @ t[f"{s}gate_proj.weight"].T) * (h @ t[f"{s}up_proj.weight"].T)
    shared = shared @ t[f"{s}down_proj.weight"].T
    x = x + moe + _sigmoid(h @ t[f"{p}mlp.shared_expert_gate.weight"].T) * shared
    out = _rms(x, t["mtp.norm.weight"], eps)
    return out, out @ t["lm_head.weight"].T


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """A tiny checkpoint whose mtp.* tensors are fresh random values (norm weights too),
    written with our safetensors writer; returns (folder, tensors)."""
    folder = tmp_path_factory.mktemp("mtp_ckpt")
    save_checkpoint(tiny_qwen3_next(seed=3), folder)
    tensors = dict(read_tensors(folder / "model.safetensors"))
    rng = np.random.default_rng(11)
    names = [name for name in tensors if name.startswith("mtp.")]
    assert "mtp.fc.weight" in names and "mtp.layers.0.mlp.experts.3.down_proj.weight" in names
    for name in names:
        shape = tensors[name].shape
        scale = 0.3 if len(shape) == 1 else shape[-1] ** -0.5
        tensors[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    write_tensors(folder / "model.safetensors", tensors)
    return folder, tensors


PAGE = 4
ORACLE_POLICY = BucketPolicy(
    batch_buckets=(2,), token_buckets=(16,), num_draft_tokens=D, page_size=PAGE, max_context=24
)


def test_mtp_head_matches_a_float64_oracle_of_its_definition(mtp_checkpoint):
    folder, tensors = mtp_checkpoint
    model = load_qwen3_next(folder)
    c = model.config
    assert model.has_mtp and c.num_nextn_predict_layers == 1
    graphdef, params = nnx.split(model)

    @jax.jit
    def head(params, tokens, hidden, kv, meta):
        m = nnx.merge(graphdef, params)
        out, kv = m.mtp_hidden_states(tokens, hidden, kv, meta)
        return out, m.logits(out), kv

    rng = np.random.default_rng(0)
    lens, pages = (7, 5), ((3, 9), (5, 1, 12))
    total = [lens[0], lens[1] + 3]  # the second request continues for 3 positions
    seqs = [rng.integers(0, c.vocab_size, n) for n in total]
    hid = [rng.standard_normal((n, c.hidden_size)).astype(np.float32) for n in total]
    want = [mtp_oracle(tensors, c, s, h) for s, h in zip(seqs, hid, strict=True)]
    kv = init_kv_cache(model.mtp_kv_specs(), 16, PAGE)
    kv = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), kv)  # unwritten reads would show

    def run(mode, rows, parts, kv):
        meta = build_metadata(mode, rows, ORACLE_POLICY, num_slots=4, num_pages=16)
        tokens = np.zeros(meta.num_tokens, np.int32)
        hidden = np.zeros((meta.num_tokens, c.hidden_size), np.float32)
        n = sum(len(s) for s, _ in parts)
        tokens[:n] = np.concatenate([s for s, _ in parts])
        hidden[:n] = np.concatenate([h for _, h in parts])
        out, logits, kv = head(params, jnp.asarray(tokens), jnp.asarray(hidden), kv, meta)
        return np.asarray(out)[:n], np.asarray(logits)[:n], kv

    rows = [RowSpec(1, 0, lens[0], pages[0]), RowSpec(2, 0, lens[1], pages[1])]
    parts = [(seqs[0], hid[0]), (seqs[1][: lens[1]], hid[1][: lens[1]])]
    out, logits, kv = run(M.EXTEND, rows, parts, kv)
    got_out = [out[: lens[0]], out[lens[0] :]]
    got_logits = [logits[: lens[0]], logits[lens[0] :]]
    # DRAFT_EXTEND continues the second request from its cached positions.
    cont = (seqs[1][lens[1] :], hid[1][lens[1] :])
    out, logits, kv = run(M.DRAFT_EXTEND, [RowSpec(2, lens[1], 3, pages[1])], [cont], kv)
    got_out[1] = np.concatenate([got_out[1], out])
    got_logits[1] = np.concatenate([got_logits[1], logits])
    for r in range(2):
        for got, ref in ((got_out[r], want[r][0]), (got_logits[r], want[r][1])):
            err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert err < 1e-5, f"request {r}: relative error {err:.2e}"
    # The oracle can fail: the head without its hidden input differs.
    _, blind = mtp_oracle(tensors, c, seqs[0], np.zeros_like(hid[0]))
    assert np.linalg.norm(got_logits[0] - blind) > 0.1 * np.linalg.norm(blind)
    # Only the requests' pages were written.
    others = sorted(set(range(1, 16)) - set(pages[0]) - set(pages[1]))
    assert np.isnan(np.asarray(kv.k[0])[others]).all()


def params_of(model):
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))}


def test_mtp_weights_round_trip_and_a_checkpoint_without_them_still_loads(mtp_checkpoint):
    folder, tensors = mtp_checkpoint
    model = load_qwen3_next(folder)
    np.testing.assert_array_equal(
        np.asarray(model.mtp.fc.kernel.get_value()), tensors["mtp.fc.weight"].T
    )
    np.testing.assert_array_equal(
        np.asarray(model.mtp.layers[0].mlp.gate_up_proj.get_value()[2])[
            :, : model.config.moe_intermediate_size
        ],
        tensors["mtp.layers.0.mlp.experts.2.gate_proj.weight"].T,
    )
    plain = folder.parent / "no_mtp"
    save_checkpoint(model, plain)
    written = dict(read_tensors(plain / "model.safetensors"))
    for name in tensors:
        np.testing.assert_array_equal(written[name], tensors[name], err_msg=name)
    write_tensors(
        plain / "model.safetensors", {k: v for k, v in written.items() if not k.startswith("mtp.")}
    )
    without = load_qwen3_next(plain)
    assert not without.has_mtp and without.mtp_kv_specs() == ()
    want = {p: v for p, v in params_of(model).items() if p[0] != "mtp"}
    assert params_of(without).keys() == want.keys()


def test_tiny_preset_carries_the_head_without_changing_its_other_weights():
    with_head = tiny_qwen3_next(seed=4)
    config = dataclasses.replace(tiny_qwen3_next_config(), num_nextn_predict_layers=0)
    bare = nnx.eval_shape(lambda: Qwen3Next(config, rngs=nnx.Rngs(0)))
    assert with_head.has_mtp and not bare.has_mtp
    rng = np.random.default_rng(4)
    seed_weights(bare, lambda path: rng)
    got = params_of(with_head)
    # The main weights come from the seed's stream alone, in the same order as without a head.
    for path, want in params_of(bare).items():
        np.testing.assert_array_equal(got[path], want, err_msg=str(path))


# ---------------------------------------------------------------- the engine with MTP drafts

SPEC_CONFIG = EngineConfig(
    max_batch=2,
    max_tokens=16,
    max_context=48,
    page_size=8,
    batch_buckets=(2,),
    chunk_size=12,
    impl="reference",
    speculative=SpeculativeConfig("mtp", num_draft_tokens=D),
)


engines, plain_tokens = speculative_fixtures(SPEC_CONFIG, PROMPTS)


def test_greedy_with_mtp_drafts_gives_the_tokens_without_speculation(engines, plain_tokens):
    spec, _ = engines
    assert spec.drafter is None and spec.mtp is not None
    assert generate_tokens(spec, PROMPTS, GREEDY) == plain_tokens
    assert spec.speculative_stats.steps > 0 and spec.step_times[M.DRAFT_EXTEND]
    assert not spec.step_times[M.DECODE] and not spec.mtp.drafts  # every draft was used
    assert spec.retraces == 0


def test_requests_joining_and_leaving_mid_run_match_each_alone(engines, plain_tokens):
    spec, _ = engines
    got = run_joining_and_leaving(spec, PROMPTS, GREEDY)
    assert got == [plain_tokens[0], plain_tokens[1][:3], plain_tokens[3]]
    assert spec.slots.num_used == 0 and spec.pages.num_used == 0 and not spec.mtp.drafts
    assert spec.retraces == 0


def test_after_each_verify_the_head_cache_and_drafts_equal_a_fresh_computation(
    engines, plain_tokens
):
    spec, _ = engines
    sequences = [p + t for p, t in zip(PROMPTS, plain_tokens, strict=True)]
    spec.drafter = OracleDrafter(sequences, D - 1)  # varied acceptance; the head still drafts
    fresh = FromScratch(spec)
    try:
        rid = spec.add_request(PROMPTS[3], GREEDY)
        checked, lengths = 0, set()
        while spec.has_work:
            spec.step()
            running = {r.request_id: r for r in spec.scheduler.running}
            if rid not in running or not running[rid].is_decoding:
                continue
            req = running[rid]
            lengths.add(req.num_computed)
            assert spec.mtp.drafts[rid] == fresh.assert_head_cache(spec, req)
            checked += 1
    finally:
        spec.drafter = None
    assert checked >= 3 and len(lengths) >= 3
    assert spec.speculative_stats.accepted > 0


def test_pool_after_each_verify_and_commit_equals_the_plain_run(engines, plain_tokens):
    spec, plain = engines
    sequences = [p + t for p, t in zip(PROMPTS, plain_tokens, strict=True)]
    spec.drafter = OracleDrafter(sequences, D - 1)
    plain.overlap = False
    try:
        want = states_by_position(plain, PROMPTS[0], GREEDY)
        got = states_by_position(spec, PROMPTS[0], GREEDY)
    finally:
        plain.overlap, spec.drafter = True, None
    assert_same_states(got, want, len(PROMPTS[0]))


def test_seeded_sampling_with_mtp_drafts_is_reproducible_and_batch_invariant(engines):
    spec, _ = engines
    solo, mixed, other_seed = seeded_runs(spec, PROMPTS, GREEDY)
    assert mixed == solo and len(solo) == 8
    assert other_seed != solo
    assert spec.retraces == 0


def test_agreeing_mtp_drafts_are_accepted_and_change_no_token(engines, cache_dir):
    check_agreeing_drafts_are_accepted(SPEC_CONFIG, cache_dir, agreeing_model, PROMPTS)


def test_mtp_source_on_a_model_without_the_head_is_refused_before_compiling():
    config = dataclasses.replace(tiny_qwen3_next_config(), num_nextn_predict_layers=0)
    model = Qwen3Next(config, rngs=nnx.Rngs(0))
    with pytest.raises(SpeculativeConfigError, match="source='mtp' needs a model with the"):
        Engine(model, ByteTokenizer(), dataclasses.replace(SPEC_CONFIG, cache_dir=None))


@pytest.mark.slow
def test_bench_reports_mtp_acceptance_and_tokens_per_s_with_and_without(capsys, tmp_path):
    code = run_bench(tmp_path, "--speculative", "mtp", "--num-draft-tokens", "3")
    out = capsys.readouterr().out
    assert code == 0, out
    assert "MTP drafting (ms)" in out and "speculative mtp D=3" in out
    assert re.search(r"\nmtp D=3 +[0-9.]+ +[0-9.]+ +[0-9.]+%", out)
