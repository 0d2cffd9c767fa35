"""Qwen3.5 checkpoints served as Qwen3-Next models: logit parity with transformers on the tiny
random checkpoints in tests/fixtures/qwen3_5 (tools/make_qwen3_5_fixtures.py: vision-language
and text-only folders, dense and MoE, GDN value/key head ratios 1, 2 and 3, fused and
per-expert experts, tied and untied), the config's nesting and errors, and the engine (greedy
generation, MTP drafting, image and video placeholders refused), and the chat template that
comes with the tokenizer."""

from __future__ import annotations

import json
import pathlib
import shutil

import _model_parity as parity
import numpy as np
import pytest
from _engine_helpers import engine_pair, generate_tokens

from hybrid_jax import Engine, EngineConfig, SamplingParams
from hybrid_jax.engine.scheduler import RequestError
from hybrid_jax.engine.speculative import SpeculativeConfig
from hybrid_jax.models.auto import load_checkpoint
from hybrid_jax.models.checkpoint import CheckpointError
from hybrid_jax.models.hf_config import ConfigError
from hybrid_jax.models.qwen3_5_loading import qwen3_5_config
from hybrid_jax.models.qwen3_next import Qwen3Next
from hybrid_jax.models.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer
from hybrid_jax.modes import LayerKind

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "qwen3_5"
NAMES = ("dense_vl", "moe_vl", "moe_text", "dense_text_r3")


runners, refs = parity.family_fixtures(load_checkpoint, FIXTURES, NAMES)


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("name", NAMES)
def test_prefill_then_decode_steps_match_transformers(runners, refs, name):
    parity.check_prefill_then_decode(runners[name], refs[name])


def test_verify_then_commit_continues_like_transformers(runners, refs):
    parity.check_verify_then_commit(runners["moe_vl"], refs["moe_vl"])


def test_chunked_prefill_mixed_and_draft_extend_match_transformers(runners, refs):
    parity.check_chunked_prefill_mixed_and_draft_extend(runners["dense_vl"], refs["dense_vl"])


def test_unsupported_mode_fails_while_tracing(runners):
    kinds = (LayerKind.GDN, LayerKind.FULL_ATTENTION)
    parity.check_unsupported_mode_fails_while_tracing(runners["moe_text"], kinds)


# ---------------------------------------------------------------- config and checkpoint


def test_each_folder_kind_builds_the_model_it_describes(runners):
    dense_vl, moe_vl = runners["dense_vl"].model, runners["moe_vl"].model
    moe_text, ratio3 = runners["moe_text"].model, runners["dense_text_r3"].model
    assert all(isinstance(r.model, Qwen3Next) for r in runners.values())
    # Vision-language folders: the text config nested, tying from the top level, the MTP
    # head from the mtp.* tensors, the placeholders to refuse.
    assert dense_vl.has_mtp and moe_vl.has_mtp and not moe_text.has_mtp
    assert dense_vl.config.vision_token_ids == (250, 251, 252)
    assert moe_text.config.vision_token_ids == ()
    assert not dense_vl.config.tie_word_embeddings and moe_text.config.tie_word_embeddings
    # Dense models are dense in every layer, MoE models sparse in every layer.
    assert dense_vl.config.num_experts == 0
    assert all(moe_vl.config.is_moe_layer(i) for i in range(4)) and moe_vl.config.norm_topk_prob
    ratios = {n: r.model.config.gdn_config() for n, r in runners.items()}
    got = {n: g.num_value_heads // g.num_key_heads for n, g in ratios.items()}
    assert got == {"dense_vl": 2, "moe_vl": 2, "moe_text": 1, "dense_text_r3": 3}
    assert ratio3.config.head_dim == 32 != ratio3.config.hidden_size // 4
    assert ratio3.config.partial_rotary_factor == 0.25


def test_nested_config_takes_eos_ids_from_either_level_and_tying_from_the_top():
    raw = _config("dense_vl")
    raw["text_config"] = {**raw["text_config"], "eos_token_id": [250, 248]}
    raw["tie_word_embeddings"], raw["text_config"]["tie_word_embeddings"] = True, False
    config = qwen3_5_config(raw)
    assert config.eos_token_id == (250, 248) and config.tie_word_embeddings
    raw["text_config"]["eos_token_id"], raw["eos_token_id"] = None, 250
    assert qwen3_5_config(raw).eos_token_id == (250,)
    assert qwen3_5_config(raw, dtype="bfloat16").dtype == "bfloat16"
    raw["eos_token_id"] = 248046  # Qwen3.5's real id, past this fixture's 256 tokens
    with pytest.raises(ConfigError, match=r"eos_token_id \[248046\] is outside the vocab"):
        qwen3_5_config(raw)


def _config(name):
    return json.loads((FIXTURES / name / "config.json").read_text())


def _nested(change):
    raw = _config("dense_vl")
    raw["text_config"] = {**raw["text_config"], **change}
    return raw


@pytest.mark.parametrize(
    "raw, message",
    [
        ({**_config("dense_vl"), "text_config": None}, "lacks text_config"),
        (
            {**_config("dense_vl"), "text_config": {"hidden_size": 64}},
            "lacks text_config.vocab_size, text_config.num_hidden_layers",
        ),
        (_nested({"layer_types": ["linear_attention", "mamba"] * 2}), r"layer_types\[1\]='mamba'"),
        (_nested({"mamba_ssm_dtype": "int8"}), "text_config.mamba_ssm_dtype='int8'"),
        (_nested({"mtp_num_hidden_layers": 2}), "mtp_num_hidden_layers=2"),
        (
            {k: v for k, v in _config("moe_text").items() if k != "num_experts"},
            "lacks num_experts",
        ),
        ({**_config("moe_text"), "model_type": "qwen3_6"}, "not a Qwen3.5 model type"),
    ],
)
def test_bad_configs_raise_naming_the_field(raw, message):
    with pytest.raises(ConfigError, match=message):
        qwen3_5_config(raw)


def test_the_vision_tower_is_left_unread_with_a_note(caplog):
    with caplog.at_level("INFO", logger="hybrid_jax.models.qwen3_5_loading"):
        model = load_checkpoint(FIXTURES / "dense_vl")
    index = json.loads((FIXTURES / "dense_vl" / "model.safetensors.index.json").read_text())
    vision = [k for k in index["weight_map"] if k.startswith("model.visual.")]
    assert vision and f"{len(vision)} vision-tower tensors (model.visual.*) are not loaded" in (
        caplog.text
    )
    assert not any("visual" in str(path) for path in parity.params_of(model))


def test_mismatched_fused_experts_are_named_with_both_shapes(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "moe_vl", folder)
    raw = _config("moe_vl")
    raw["text_config"]["moe_intermediate_size"] = 20
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        CheckpointError, match=r"layers\.0\.mlp\.experts\.gate_up_proj has shape \(4, 48, 64\), "
        r"expected \(4, 40, 64\)",
    ):  # fmt: skip
        load_checkpoint(folder)


def test_missing_gdn_projection_is_named(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "dense_text_r3", folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.linear_attn.in_proj_z.weight"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=r"lacks 1 tensors .*layers\.2\.linear_attn\.in_proj_z"
    ):
        load_checkpoint(folder)


# ---------------------------------------------------------------- served by the engine

ENGINE = EngineConfig(
    max_batch=2, max_tokens=16, max_context=48, page_size=8, batch_buckets=(2,), chunk_size=12,
    impl="reference",
)  # fmt: skip
# Text ids below the fixtures' vision placeholders (250..253).
PROMPTS = [list(b"abcabcabcabc"), [7, 7, 7, 7, 7], list(b"the cat the cat the cat")]


@pytest.fixture(scope="module")
def mtp_engines(cache_dir):
    """(MTP-speculative, plain) engines of the dense vision-language checkpoint."""
    config = EngineConfig(**{**ENGINE.__dict__, "speculative": SpeculativeConfig("mtp", 4)})
    return engine_pair(config, cache_dir, model=lambda: load_checkpoint(FIXTURES / "dense_vl"))


def test_greedy_with_mtp_drafts_gives_the_tokens_without_speculation(mtp_engines):
    spec, plain = mtp_engines
    greedy = SamplingParams(max_new_tokens=8)
    want = generate_tokens(plain, PROMPTS, greedy)
    assert generate_tokens(spec, PROMPTS, greedy) == want
    assert spec.mtp is not None and spec.speculative_stats.steps > 0


def test_engine_greedy_matches_the_model_step_by_step(runners, refs):
    run, prompt = runners["moe_text"], refs["moe_text"]["prompt"].tolist()
    config = EngineConfig(
        max_batch=1, max_tokens=16, max_context=24, page_size=parity.PAGE, cache_dir=None,
        impl="reference", overlap=False,
    )  # fmt: skip
    engine = Engine(run.model, ByteTokenizer(), config, progress=False)
    (result,) = engine.generate([prompt], SamplingParams(max_new_tokens=4))
    want = parity.greedy_tokens(run, prompt, (1, 2, 3, 4, 5, 6), 4)
    assert want[0] == int(np.argmax(refs["moe_text"]["prefill_logits"][-1]))
    assert result.token_ids == want


def test_image_and_video_placeholders_are_refused_and_nothing_changes(mtp_engines):
    _, plain = mtp_engines
    before = (plain.slots.num_used, plain.pages.num_used)
    for token in (250, 251, 252):
        with pytest.raises(RequestError, match=f"token_ids\\[2\\]={token} is an image or video"):
            plain.add_request([1, 2, token, 3], SamplingParams(max_new_tokens=2))
    assert (plain.slots.num_used, plain.pages.num_used) == before
    # A text request afterwards is served as usual.
    (result,) = plain.generate([PROMPTS[1]], SamplingParams(max_new_tokens=2))
    assert len(result.token_ids) == 2


# ---------------------------------------------------------------- the chat template

# The part of Qwen3.5's template that decides the opening of the answer.
THINK_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def _tokenizer_folder(tmp_path, config):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(tmp_path)


def test_chat_template_loads_with_the_tokenizer_and_renders_the_think_switch(tmp_path):
    pytest.importorskip("jinja2")
    tok = _tokenizer_folder(tmp_path, {"chat_template": THINK_TEMPLATE, "eos_token": "<|im_end|>"})
    messages = [{"role": "user", "content": "hi"}]
    thinking = tok.apply_chat_template(messages)
    assert thinking == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    plain = tok.apply_chat_template(messages, enable_thinking=False)
    assert plain == thinking + "<think>\n\n</think>\n\n"
    assert tok.special_tokens == {"eos_token": "<|im_end|>"}
    # A chat_template.jinja file takes precedence, as in Hugging Face's loader.
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content | tojson }}")
    assert load_tokenizer(tmp_path).apply_chat_template(messages) == '"hi"'


def test_bos_is_added_once_when_the_tokenizer_config_asks(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    vocab = {"[UNK]": 0, "hello": 1, "<s>": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "chat_template": "{{ bos_token }}{{ messages[0].content }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(tmp_path).encode("hello") == [1]  # add_bos_token absent: no BOS
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    with_bos = load_tokenizer(tmp_path)
    assert with_bos.encode("hello") == [2, 1]
    chat = with_bos.apply_chat_template([{"role": "user", "content": "hello"}])
    assert with_bos.encode(chat) == [2, 1]  # the template's own BOS, not a second one
    bad = {**config, "add_bos_token": True, "bos_token": "<bos>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(bad))
    with pytest.raises(TokenizerError, match="bos_token='<bos>' is not a token"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": "yes"}))
    with pytest.raises(TokenizerError, match="add_bos_token='yes' must be true or false"):
        load_tokenizer(tmp_path)


def test_missing_or_broken_chat_template_is_a_clear_error(tmp_path):
    pytest.importorskip("jinja2")
    tok = _tokenizer_folder(tmp_path, {})
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    broken = "{{ raise_exception('system messages only') }}"
    tok = _tokenizer_folder(tmp_path, {"chat_template": broken})
    with pytest.raises(TokenizerError, match="refused the conversation: system messages only"):
        tok.apply_chat_template([])
