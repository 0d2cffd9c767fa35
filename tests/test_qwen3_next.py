"""The Qwen3-Next model: logit parity with Hugging Face transformers in every forward mode,
pools and pages, configuration, checkpoint loading and tokenizers.

The reference logits were computed by transformers (PyTorch, float32) from the committed
checkpoints in tests/fixtures/qwen3_next (tools/make_qwen3_next_fixtures.py); this module
needs neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.engine.step import commit_verified
from hybrid_jax.kv_cache import init_kv_cache
from hybrid_jax.metadata import BucketPolicy, RowSpec, build_metadata, example_metadata
from hybrid_jax.models.loading import CheckpointError, load_qwen3_next, save_checkpoint
from hybrid_jax.models.qwen3_next import (
    ConfigError,
    Qwen3NextConfig,
    tiny_qwen3_next,
    tiny_qwen3_next_config,
)
from hybrid_jax.models.safetensors_io import read_tensors, write_tensors
from hybrid_jax.models.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer
from hybrid_jax.modes import ForwardMode, LayerKind, UnsupportedForwardModeError
from hybrid_jax.state_pool import init_state_pool

M = ForwardMode
FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "qwen3_next"
NAMES = ("moe", "tied_sparse_step")
D = 4
PAGE = 4
NUM_SLOTS, NUM_PAGES = 4, 16
# One bucket per mode, so each mode compiles once per model.
POLICY = BucketPolicy(
    batch_buckets=(2,), token_buckets=(16,), num_draft_tokens=D, page_size=PAGE, max_context=24
)
TOL = 1e-4  # float32 relative error, |ours - ref| / |ref| over a step's logits


class Runner:
    """The model's forward, jitted (one trace per (mode, bucket)); pools are not donated."""

    def __init__(self, model):
        self.model = model
        graphdef, self.params = nnx.split(model)

        def forward(params, tokens, pool, kv, meta):
            return nnx.merge(graphdef, params)(tokens, pool, kv, meta, impl="reference")

        self.forward = jax.jit(forward)

    def fresh(self, seed=0):
        """A pool of random states (rows without initial state must ignore them) and a KV
        cache poisoned with NaN (a read of an unwritten entry would show)."""
        pool = init_state_pool(self.model.state_specs(), NUM_SLOTS)
        keys = iter(jax.random.split(jax.random.key(seed), 64))
        pool = jax.tree.map(lambda a: jax.random.normal(next(keys), a.shape, a.dtype), pool)
        kv = init_kv_cache(self.model.kv_specs(), NUM_PAGES, PAGE)
        kv = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), kv)
        return pool, kv

    def step(self, mode, rows, tokens, pool, kv):
        """Logits of the real tokens ``[n, vocab]`` and the model output."""
        meta = build_metadata(mode, rows, POLICY, num_slots=NUM_SLOTS, num_pages=NUM_PAGES)
        n = sum(row.num_tokens for row in rows)
        padded = np.zeros(meta.num_tokens, np.int32)
        padded[:n] = tokens
        out = self.forward(self.params, jnp.asarray(padded), pool, kv, meta)
        return np.asarray(out.logits)[:n], out


@pytest.fixture(scope="module")
def runners():
    return {name: Runner(load_qwen3_next(FIXTURES / name)) for name in NAMES}


@pytest.fixture(scope="module")
def refs():
    return {name: dict(np.load(FIXTURES / name / "reference.npz")) for name in NAMES}


def rel_err(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def assert_close(got, want, what):
    assert got.shape == want.shape, what
    assert rel_err(got, want) < TOL, f"{what}: relative error {rel_err(got, want):.2e}"


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("name", NAMES)
def test_prefill_then_decode_steps_match_transformers(runners, refs, name):
    run, ref = runners[name], refs[name]
    prompt, tokens = ref["prompt"], ref["decode_tokens"]
    p = len(prompt)
    pages = (9, 2, 14, 5)  # scattered on purpose
    pool, kv = run.fresh()
    logits, out = run.step(M.EXTEND, [RowSpec(3, 0, p, pages)], prompt, pool, kv)
    assert_close(logits, ref["prefill_logits"], "prefill")
    for i, token in enumerate(tokens):
        row = RowSpec(3, p + i, 1, pages)
        logits, out = run.step(M.DECODE, [row], [token], out.pool, out.kv)
        assert_close(logits[0], ref["decode_logits"][i], f"decode step {i}")
    others = sorted(set(range(1, NUM_PAGES)) - set(pages))
    for k, v in zip(out.kv.k, out.kv.v, strict=True):
        assert np.isnan(np.asarray(k)[others]).all() and np.isnan(np.asarray(v)[others]).all()


def test_verify_then_commit_continues_like_transformers(runners, refs):
    run, ref = runners["moe"], refs["moe"]
    prompt, tokens = ref["prompt"], ref["decode_tokens"]
    p, pages = len(prompt), (4, 1, 7, 12)
    pool, kv = run.fresh(1)
    _, out = run.step(M.EXTEND, [RowSpec(2, 0, p, pages)], prompt, pool, kv)
    before = jax.tree.map(np.asarray, out.pool)
    logits, out = run.step(M.TARGET_VERIFY, [RowSpec(2, p, D, pages)], tokens, out.pool, out.kv)
    for i in range(D):
        assert_close(logits[i], ref["decode_logits"][i], f"verify token {i}")
    for got, want in zip(jax.tree.leaves(out.pool), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)  # verify never writes the pool
    # Accept the first two drafts (step index 1); the rejected drafts' keys stay in the pages
    # and must be overwritten, never read.
    slots = jnp.asarray([2, 0], jnp.int32)
    pool = commit_verified(out.pool, out.verify, slots, jnp.asarray([1, -1], jnp.int32))
    kv = out.kv
    for i in (2, 3):
        logits, out = run.step(M.DECODE, [RowSpec(2, p + i, 1, pages)], [tokens[i]], pool, kv)
        pool, kv = out.pool, out.kv
        assert_close(logits[0], ref["decode_logits"][i], f"decode after commit, token {i}")


def test_chunked_prefill_mixed_and_draft_extend_match_transformers(runners, refs):
    run, ref = runners["moe"], refs["moe"]
    prompt, prompt2 = ref["prompt"], ref["prompt2"]
    a, b = (3, 8, 10), (6, 11)
    pool, kv = run.fresh(2)
    logits, out = run.step(M.EXTEND, [RowSpec(1, 0, 5, a)], prompt[:5], pool, kv)
    assert_close(logits, ref["prefill_logits"][:5], "first chunk")
    # MIXED: the first request's second chunk beside a fresh request.
    rows = [RowSpec(1, 5, 4, a), RowSpec(2, 0, len(prompt2), b)]
    x = np.concatenate([prompt[5:9], prompt2])
    logits, out = run.step(M.MIXED, rows, x, out.pool, out.kv)
    assert_close(logits[:4], ref["prefill_logits"][5:9], "second chunk in MIXED")
    assert_close(logits[4:], ref["prefill2_logits"], "fresh request in MIXED")
    # DRAFT_EXTEND: the last two prompt tokens on the fixed bs x D token layout.
    logits, out = run.step(M.DRAFT_EXTEND, [RowSpec(1, 9, 2, a)], prompt[9:], out.pool, out.kv)
    assert_close(logits, ref["prefill_logits"][9:], "DRAFT_EXTEND")


# ---------------------------------------------------------------- pools, modes, structure


def test_idle_step_returns_no_logits_and_changes_nothing(runners):
    run = runners["moe"]
    pool, kv = run.fresh(3)
    pool, kv = jax.tree.map(np.asarray, (pool, kv))
    logits, out = run.step(M.IDLE, [], [], pool, kv)
    assert out.logits.shape == (0, run.model.config.vocab_size)
    for got, want in zip(jax.tree.leaves((out.pool, out.kv)), jax.tree.leaves((pool, kv)),
                         strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got), want)


def test_unsupported_mode_fails_while_tracing(runners):
    run = runners["moe"]
    pool, kv = run.fresh()
    meta = dataclasses.replace(example_metadata(M.DECODE, 2, 2, POLICY), mode=M.DLLM_EXTEND)
    tokens = jnp.zeros(2, jnp.int32)
    with pytest.raises(UnsupportedForwardModeError, match="DLLM_EXTEND") as err:
        jax.eval_shape(run.forward, run.params, tokens, pool, kv, meta)
    assert err.value.layer_kind in (LayerKind.GDN, LayerKind.FULL_ATTENTION)


def test_pool_or_cache_of_another_layout_is_refused(runners):
    run = runners["moe"]
    pool, kv = run.fresh()
    meta = example_metadata(M.DECODE, 2, 2, POLICY)
    short = dataclasses.replace(kv, k=kv.k[:1], v=kv.v[:1])
    with pytest.raises(ValueError, match="model.kv_specs"):
        jax.eval_shape(run.forward, run.params, jnp.zeros(2, jnp.int32), pool, short, meta)


def test_layer_pattern_state_and_cache_specs_follow_the_config(runners):
    tied = runners["tied_sparse_step"].model
    G, A = LayerKind.GDN, LayerKind.FULL_ATTENTION
    assert tied.layer_kinds == (G, G, A, G)  # full_attention_interval=3
    assert len(tied.state_specs()) == 3 and len(tied.kv_specs()) == 1
    assert [tied.config.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert not hasattr(tied, "lm_head")
    moe = runners["moe"].model
    assert moe.layer_kinds == (G, A, G, A)
    assert [moe.config.is_moe_layer(i) for i in range(4)] == [True, True, False, True]


# ---------------------------------------------------------------- configuration

BASE = dict(
    vocab_size=32, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, intermediate_size=8, linear_num_key_heads=1,
    linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
)  # fmt: skip


def test_config_reads_interval_top_level_rope_fields_and_derived_head_dim():
    config = Qwen3NextConfig.from_hf_dict(
        dict(
            BASE,
            full_attention_interval=2,
            rope_theta=5e5,
            partial_rotary_factor=0.5,
            eos_token_id=7,
            torch_dtype="bfloat16",
            rope_scaling=None,
        )  # fmt: skip
    )
    assert config.layer_types == ("linear_attention", "full_attention") * 2
    assert (config.rope_theta, config.partial_rotary_factor, config.head_dim) == (5e5, 0.5, 8)
    assert (config.eos_token_id, config.dtype) == ((7,), "bfloat16")
    assert Qwen3NextConfig.from_hf_dict(dict(BASE), dtype="float32").layer_types[3] == (
        "full_attention"
    )
    round_trip = Qwen3NextConfig.from_hf_dict(config.to_hf_dict())
    assert round_trip == config


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(model_type="qwen3_5_text"), "model_type='qwen3_5_text'"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
        (dict(layer_types=["full_attention"] * 3), "layer_types has 3 entries"),
        (dict(layer_types=["mamba"] * 4), r"layer_types\[0\]='mamba'"),
        (dict(num_key_value_heads=3), "num_heads=2 is not a multiple of num_kv_heads=3"),
        (dict(linear_num_key_heads=2, linear_num_value_heads=3), "num_value_heads=3 is not a"),
        (dict(num_experts=4, moe_intermediate_size=4), "shared_expert_intermediate_size"),
        (dict(mlp_only_layers=[4]), "mlp_only_layers names layer 4"),
    ],
)
def test_config_errors_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        Qwen3NextConfig.from_hf_dict(dict(BASE, **change))


def test_config_missing_required_fields_are_named():
    config = dict(BASE)
    del config["hidden_size"], config["linear_value_head_dim"]
    with pytest.raises(ConfigError, match="lacks hidden_size, linear_value_head_dim"):
        Qwen3NextConfig.from_hf_dict(config)


# ---------------------------------------------------------------- checkpoints


def params_of(model):
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))}


def test_save_then_load_round_trips_every_parameter(tmp_path):
    model = tiny_qwen3_next(seed=5)
    save_checkpoint(model, tmp_path, max_shard_bytes=100_000)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = load_qwen3_next(tmp_path)
    want, got = params_of(model), params_of(loaded)
    assert want.keys() == got.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))


def test_fused_expert_layout_loads_like_per_expert(tmp_path):
    model = tiny_qwen3_next(seed=6)
    save_checkpoint(model, tmp_path)
    tensors = dict(read_tensors(tmp_path / "model.safetensors"))
    p, e = "model.layers.0.mlp.experts.", model.config.num_experts
    gate = np.stack([tensors.pop(f"{p}{j}.gate_proj.weight") for j in range(e)])
    up = np.stack([tensors.pop(f"{p}{j}.up_proj.weight") for j in range(e)])
    down = np.stack([tensors.pop(f"{p}{j}.down_proj.weight") for j in range(e)])
    tensors[f"{p}gate_up_proj"] = np.concatenate([gate, up], axis=1)
    tensors[f"{p}down_proj"] = down
    write_tensors(tmp_path / "model.safetensors", tensors)
    want, got = params_of(model), params_of(load_qwen3_next(tmp_path))
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))


def copy_fixture(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "moe", folder)
    return folder


def test_missing_tensor_is_named(tmp_path):
    folder = copy_fixture(tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.self_attn.q_norm.weight"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors .*layers\.1\.self_attn\.q_norm"):
        load_qwen3_next(folder)


def test_misshapen_tensor_names_tensor_and_both_shapes(tmp_path):
    model = tiny_qwen3_next(seed=7)
    save_checkpoint(model, tmp_path)
    tensors = dict(read_tensors(tmp_path / "model.safetensors"))
    tensors["model.layers.0.linear_attn.A_log"] = np.zeros(3, np.float32)
    write_tensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"layers\.0\.linear_attn\.A_log has shape \(3,\), "
                       r"expected \(4,\)"):  # fmt: skip
        load_qwen3_next(tmp_path)


def test_tensor_the_index_places_in_a_file_that_lacks_it_is_named(tmp_path):
    folder = copy_fixture(tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = "model.norm.weight"
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"][name] = next(f for f in files if f != index["weight_map"][name])
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"places {name} in .* but that file lacks it"):
        load_qwen3_next(folder)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "config.json").unlink(), "config.json does not exist"),
        (lambda f: [p.unlink() for p in f.glob("model*")], "neither model.safetensors.index"),
        (lambda f: next(f.glob("model-00002*")).unlink(), "lists model-00002-of-00005"),
        (lambda f: (f / "config.json").write_text("{"), "not valid JSON"),
        (
            lambda f: next(f.glob("model-00003*")).write_bytes(
                next(f.glob("model-00003*")).read_bytes()[:-100]
            ),
            "truncated or corrupt",
        ),
    ],
    ids=["no-config", "no-weights", "no-shard", "bad-json", "truncated"],
)
def test_broken_checkpoint_folders_raise_clear_errors(tmp_path, damage, message):
    folder = copy_fixture(tmp_path)
    damage(folder)
    with pytest.raises(CheckpointError, match=message):
        load_qwen3_next(folder)


def test_bfloat16_checkpoint_loads_in_the_dtype_asked_for(tmp_path):
    model = tiny_qwen3_next(seed=8, dtype="bfloat16")
    save_checkpoint(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_qwen3_next(tmp_path, dtype="float32")
    kernel = loaded.layers[1].self_attn.q_proj.kernel.get_value()
    assert kernel.dtype == jnp.float32
    want = model.layers[1].self_attn.q_proj.kernel.get_value().astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(want))
    assert load_qwen3_next(tmp_path).config.dtype == "bfloat16"


# ---------------------------------------------------------------- tokenizers and preset


def test_byte_tokenizer_round_trips_text_and_rejects_foreign_ids():
    tok = ByteTokenizer()
    text = "Grüße, 世界!"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == text
    assert tok.vocab_size == tiny_qwen3_next_config().vocab_size
    with pytest.raises(TokenizerError, match=r"\[300\] are outside the byte vocabulary"):
        tok.decode([65, 300])


def test_missing_tokenizer_json_names_the_file_and_the_alternative(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json does not exist.*ByteTokenizer"):
        load_tokenizer(tmp_path)


def test_tokenizer_json_is_read_with_the_tokenizers_package(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.vocab_size == 3
    assert loaded.encode("hello world again") == [1, 2, 0]
    assert loaded.decode([2, 1]) == "world hello"
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(TokenizerError, match="not a readable tokenizer.json"):
        load_tokenizer(tmp_path)
