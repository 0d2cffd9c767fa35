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

import _model_parity as parity
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.layers import linear as linear_layer
from hybrid_jax.layers.attention import Attention, AttentionConfig
from hybrid_jax.models.checkpoint import CheckpointError
from hybrid_jax.models.layer_scan import scan_layers
from hybrid_jax.models.qwen3_next import (
    ConfigError,
    Qwen3Next,
    Qwen3NextConfig,
    _seeded_value,
    tiny_qwen3_next,
    tiny_qwen3_next_config,
)
from hybrid_jax.models.qwen3_next_loading import load_qwen3_next, save_checkpoint
from hybrid_jax.models.safetensors_io import read_tensors, write_tensors
from hybrid_jax.models.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer
from hybrid_jax.modes import LayerKind

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "qwen3_next"
NAMES = ("moe", "tied_sparse_step")


runners, refs = parity.family_fixtures(load_qwen3_next, FIXTURES, NAMES)


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("name", NAMES)
def test_prefill_then_decode_steps_match_transformers(runners, refs, name):
    parity.check_prefill_then_decode(runners[name], refs[name])


def test_verify_then_commit_continues_like_transformers(runners, refs):
    parity.check_verify_then_commit(runners["moe"], refs["moe"])


def test_chunked_prefill_mixed_and_draft_extend_match_transformers(runners, refs):
    parity.check_chunked_prefill_mixed_and_draft_extend(runners["moe"], refs["moe"])


def test_reduces_for_short_sums_keep_parity_with_transformers(refs, monkeypatch):
    """``layers.linear.ADDS_FOR_SHORT_SUMS`` off (the MoE softmax and combine as reduces) on
    a fresh runner: a switch is read while tracing."""
    monkeypatch.setattr(linear_layer, "ADDS_FOR_SHORT_SUMS", False)
    parity.check_prefill_then_decode(parity.Runner(load_qwen3_next(FIXTURES / "moe")), refs["moe"])


def test_the_tiny_model_draws_gate_params_as_the_checkpoint_s_a_log_and_dt_bias():
    """``seed_weights`` draws a GDN layer's ``[A_log; dt_bias]`` as the checkpoint's two
    tensors in their own places among the paths (A_log before the conv weight, dt_bias after
    it): the weights a seed gives follow the checkpoint's tensors."""
    model = tiny_qwen3_next(seed=3)
    gdn = model.layers[0].linear_attn
    hv = gdn.gate_params.shape[1]
    layer = ("layers", 0, "linear_attn")
    rng = np.random.default_rng(3)
    _seeded_value(("embed_tokens", "embedding"), model.embed_tokens.embedding.shape, rng)
    _seeded_value(("layers", 0, "input_layernorm", "weight"), (64,), rng)
    a_log = _seeded_value((*layer, "A_log"), (hv,), rng)
    _seeded_value((*layer, "conv_weight"), gdn.conv_weight.shape, rng)
    dt_bias = _seeded_value((*layer, "dt_bias"), (hv,), rng)
    want = np.stack([a_log, dt_bias]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(gdn.gate_params[...]), want)


# ---------------------------------------------------------------- pools, modes, structure


def test_idle_step_returns_no_logits_and_changes_nothing(runners):
    parity.check_idle_step_changes_nothing(runners["moe"])


def test_unsupported_mode_fails_while_tracing(runners):
    kinds = (LayerKind.GDN, LayerKind.FULL_ATTENTION)
    parity.check_unsupported_mode_fails_while_tracing(runners["moe"], kinds)


def test_pool_or_cache_of_another_layout_is_refused(runners):
    run = runners["moe"]
    pool, kv = run.fresh()
    short = dataclasses.replace(kv, k=kv.k[:1], v=kv.v[:1])
    parity.check_layout_is_refused(run, pool, short, "model.kv_specs")


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


def test_attention_config_without_positions_and_with_an_odd_rotary_part():
    plain = AttentionConfig.plain(16, 2, 1, 8)  # Nemotron-H's attention
    assert (plain.rotary_dim, plain.gated, plain.qk_norm, plain.attention_bias) == (0, 0, 0, 0)
    assert Attention(plain, rngs=nnx.Rngs(0)).q_norm is None
    with pytest.raises(ValueError, match="rotary part of 3 of head_dim=8; it must be even"):
        AttentionConfig(16, 2, 1, 8, partial_rotary_factor=0.375)


def test_config_missing_required_fields_are_named():
    config = dict(BASE)
    del config["hidden_size"], config["linear_value_head_dim"]
    with pytest.raises(ConfigError, match="lacks hidden_size, linear_value_head_dim"):
        Qwen3NextConfig.from_hf_dict(config)


# ---------------------------------------------------------------- checkpoints


def test_save_then_load_round_trips_every_parameter(tmp_path):
    model = tiny_qwen3_next(seed=5)
    save_checkpoint(model, tmp_path, max_shard_bytes=100_000)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = load_qwen3_next(tmp_path)
    want, got = parity.params_of(model), parity.params_of(loaded)
    assert want.keys() == got.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))


def test_a_model_with_stacked_layers_is_refused_before_anything_is_written(tmp_path):
    """A scanned model (an engine's, with donated weights: folded and paired) is not a
    checkpoint's layout; saving it says so instead of failing on a missing attribute."""
    config = dataclasses.replace(
        tiny_qwen3_next_config(), num_hidden_layers=6,
        layer_types=("linear_attention", "linear_attention", "full_attention") * 2,
        mlp_only_layers=(), num_nextn_predict_layers=0,
    )  # fmt: skip
    scanned = scan_layers(Qwen3Next(config, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="layers are stacked for running"):
        save_checkpoint(scanned, tmp_path)
    assert not list(tmp_path.iterdir())


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
    want, got = parity.params_of(model), parity.params_of(load_qwen3_next(tmp_path))
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
