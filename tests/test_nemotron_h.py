"""The Nemotron-H model: logit parity with Hugging Face transformers in every forward mode,
configuration, checkpoint loading, and serving through the engine.

The reference logits were computed by transformers (PyTorch, float32) from the committed
checkpoints in tests/fixtures/nemotron_h (tools/make_nemotron_h_fixtures.py); this module
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

from hybrid_jax import Engine, EngineConfig
from hybrid_jax.engine.sampling import SamplingParams
from hybrid_jax.metadata import RowSpec
from hybrid_jax.models.checkpoint import CheckpointError
from hybrid_jax.models.nemotron_h import ConfigError, NemotronHConfig
from hybrid_jax.models.nemotron_h_loading import load_nemotron_h
from hybrid_jax.models.safetensors_io import read_tensors, write_tensors
from hybrid_jax.models.tokenizer import ByteTokenizer
from hybrid_jax.modes import ForwardMode, LayerKind

M = ForwardMode
FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "nemotron_h"
NAMES = ("hybrid", "biases_latent_moe")


runners, refs = parity.family_fixtures(load_nemotron_h, FIXTURES, NAMES)


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("name", NAMES)
def test_prefill_then_decode_steps_match_transformers(runners, refs, name):
    parity.check_prefill_then_decode(runners[name], refs[name])


def test_verify_then_commit_continues_like_transformers(runners, refs):
    parity.check_verify_then_commit(runners["hybrid"], refs["hybrid"])


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_mixed_and_draft_extend_match_transformers(runners, refs, name):
    parity.check_chunked_prefill_mixed_and_draft_extend(runners[name], refs[name])


# ---------------------------------------------------------------- pools, modes, structure


def test_idle_step_returns_no_logits_and_changes_nothing(runners):
    parity.check_idle_step_changes_nothing(runners["hybrid"])


def test_unsupported_mode_fails_while_tracing(runners):
    kinds = (LayerKind.MAMBA2, LayerKind.FULL_ATTENTION)
    parity.check_unsupported_mode_fails_while_tracing(runners["hybrid"], kinds)


def test_pool_of_another_layout_is_refused(runners):
    run = runners["hybrid"]
    pool, kv = run.fresh()
    short = dataclasses.replace(pool, conv=pool.conv[:1], ssm=pool.ssm[:1])
    parity.check_layout_is_refused(run, short, kv, "model.state_specs")


def test_block_pattern_state_and_cache_specs_follow_the_config(runners):
    S, A = LayerKind.MAMBA2, LayerKind.FULL_ATTENTION
    hybrid = runners["hybrid"].model  # M-M*ME
    assert hybrid.layer_kinds == (S, S, A, S)
    assert [layer.block_type for layer in hybrid.layers] == [
        "linear_attention", "mlp", "linear_attention", "full_attention", "linear_attention", "moe",
    ]  # fmt: skip
    assert len(hybrid.state_specs()) == 3 and len(hybrid.kv_specs()) == 1
    spec = hybrid.state_specs()[0]
    assert spec.ssm_shape == (4, 8, 8) and spec.conv_shape == (4 * 8 + 2 * 2 * 8, 3)
    other = runners["biases_latent_moe"].model  # *MEM*-
    assert other.layer_kinds == (A, S, S, A)
    plain = other.layers[0].mixer.config  # Nemotron-H's attention: no gate, norms or positions
    assert not plain.gated and not plain.qk_norm and plain.rotary_dim == 0
    assert other.layers[1].mixer.conv_bias is None


# ---------------------------------------------------------------- configuration

BASE = dict(
    vocab_size=32, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
    intermediate_size=8, mamba_num_heads=2, mamba_head_dim=8, n_groups=1, ssm_state_size=4,
    hybrid_override_pattern="M*-",
)  # fmt: skip


def test_config_reads_the_pattern_legacy_names_and_derived_head_dim():
    config = NemotronHConfig.from_hf_dict(
        dict(BASE, mamba_d_conv=3, mamba_dt_min=0.01, eos_token_id=[2, 7], torch_dtype="bfloat16")
    )
    assert config.layers_block_type == ("linear_attention", "full_attention", "mlp")
    assert (config.conv_kernel, config.time_step_min, config.head_dim) == (3, 0.01, 8)
    assert (config.eos_token_id, config.dtype) == ((2, 7), "bfloat16")
    assert config.mamba2_config().time_step_limit == (0.01, float("inf"))
    listed = NemotronHConfig.from_hf_dict(
        dict(BASE, layers_block_type=["mlp", "linear_attention"]), dtype="float32"
    )
    assert listed.layers_block_type == ("mlp", "linear_attention") and listed.dtype == "float32"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(model_type="mamba2"), "model_type='mamba2'"),
        (dict(mlp_hidden_act="silu"), "mlp_hidden_act='silu'"),
        (dict(mamba_hidden_act="gelu"), "mamba_hidden_act='gelu'"),
        (dict(hybrid_override_pattern="M*X"), r"characters \['X'\]"),
        (dict(hybrid_override_pattern=None), "neither layers_block_type nor"),
        (dict(layers_block_type=["mamba"]), r"layers_block_type\[0\]='mamba'"),
        (dict(num_key_value_heads=3), "num_attention_heads=2 is not a multiple of num_key_value"),
        (dict(mamba_num_heads=3, n_groups=2), "mamba_num_heads=3 is not a multiple of n_groups"),
        (dict(hybrid_override_pattern="ME"), "a 'moe' block needs n_routed_experts"),
        (
            dict(
                hybrid_override_pattern="E",
                n_routed_experts=4,
                moe_intermediate_size=4,
                moe_shared_expert_intermediate_size=4,
                num_experts_per_tok=3,
                n_group=2,
            ),
            "num_experts_per_tok=3 must be in 1..2",
        ),  # fmt: skip
    ],
)
def test_config_errors_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        NemotronHConfig.from_hf_dict(dict(BASE, **change))


def test_config_missing_required_fields_are_named():
    config = dict(BASE)
    del config["ssm_state_size"], config["mamba_head_dim"]
    with pytest.raises(ConfigError, match="lacks mamba_head_dim, ssm_state_size"):
        NemotronHConfig.from_hf_dict(config)


# ---------------------------------------------------------------- checkpoints


def copy_fixture(tmp_path, name="hybrid"):
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    return folder


def test_transformers_in_memory_layout_loads_like_the_saved_one(runners, tmp_path):
    folder = copy_fixture(tmp_path)
    tensors = dict(read_tensors(folder / "model.safetensors"))
    renamed = {k.replace("backbone.", "model.", 1): v for k, v in tensors.items()}
    p = "model.layers.5.mixer.experts."
    for name in ("up_proj", "down_proj"):
        renamed[f"{p}{name}"] = np.stack([renamed.pop(f"{p}{j}.{name}.weight") for j in range(4)])
    write_tensors(folder / "model.safetensors", renamed)
    want, got = parity.params_of(runners["hybrid"].model), parity.params_of(load_nemotron_h(folder))
    assert want.keys() == got.keys()
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))


def test_missing_tensor_is_named(tmp_path):
    folder = copy_fixture(tmp_path)
    tensors = dict(read_tensors(folder / "model.safetensors"))
    del tensors["backbone.layers.2.mixer.D"]
    write_tensors(folder / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"lacks 1 tensors .*layers\.2\.mixer\.D"):
        load_nemotron_h(folder)


def test_misshapen_tensor_names_tensor_and_both_shapes(tmp_path):
    folder = copy_fixture(tmp_path)
    tensors = dict(read_tensors(folder / "model.safetensors"))
    tensors["backbone.layers.0.mixer.conv1d.weight"] = np.zeros((64, 1, 3), np.float32)
    write_tensors(folder / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"layers\.0\.mixer\.conv1d\.weight has shape "
                       r"\(64, 1, 3\), expected \(64, 1, 4\)"):  # fmt: skip
        load_nemotron_h(folder)


@pytest.mark.parametrize(
    "damage, error, message",
    [
        (lambda f: (f / "config.json").unlink(), CheckpointError, "config.json does not exist"),
        (lambda f: (f / "model.safetensors").unlink(), CheckpointError, "neither"),
        (lambda f: (f / "config.json").write_text("{"), CheckpointError, "not valid JSON"),
        (
            lambda f: (f / "config.json").write_text(
                json.dumps(dict(json.loads((f / "config.json").read_text()), n_groups=3))
            ),
            ConfigError,
            "mamba_num_heads=4 is not a multiple of n_groups=3",
        ),
    ],
    ids=["no-config", "no-weights", "bad-json", "bad-config"],
)
def test_broken_checkpoint_folders_raise_clear_errors(tmp_path, damage, error, message):
    folder = copy_fixture(tmp_path)
    damage(folder)
    with pytest.raises(error, match=message):
        load_nemotron_h(folder)


def test_bfloat16_model_keeps_decay_and_router_float32_and_stays_near_transformers(refs):
    model = load_nemotron_h(FIXTURES / "hybrid", dtype="bfloat16")
    mixer = model.layers[0].mixer
    assert mixer.in_proj.kernel.get_value().dtype == jnp.bfloat16
    assert mixer.A_log.get_value().dtype == jnp.float32
    assert model.layers[5].mixer.gate.kernel.get_value().dtype == jnp.float32
    assert model.state_specs()[0].conv_dtype == jnp.bfloat16
    # A loose bound: bfloat16 rounding through six blocks (and a routing choice it may flip)
    # against float32 references; this pins the dtype plumbing, not the accuracy.
    ref = refs["hybrid"]
    run, p = parity.Runner(model), len(ref["prompt"])
    pool, kv = run.fresh()
    logits, out = run.step(M.EXTEND, [RowSpec(1, 0, p, (1, 2, 3))], ref["prompt"], pool, kv)
    assert parity.rel_err(logits, ref["prefill_logits"]) < 1e-1
    row = RowSpec(1, p, 1, (1, 2, 3))
    logits, _ = run.step(M.DECODE, [row], ref["decode_tokens"][:1], out.pool, out.kv)
    assert parity.rel_err(logits[0], ref["decode_logits"][0]) < 1e-1


# ---------------------------------------------------------------- served by the engine


def test_engine_serves_nemotron_h_greedy_like_the_model_step_by_step(runners, refs):
    run, prompt = runners["hybrid"], refs["hybrid"]["prompt"].tolist()
    config = EngineConfig(
        max_batch=1, max_tokens=16, max_context=24, page_size=parity.PAGE, cache_dir=None,
        impl="reference", overlap=False,
    )  # fmt: skip
    engine = Engine(run.model, ByteTokenizer(), config, progress=False)
    (result,) = engine.generate([prompt], SamplingParams(max_new_tokens=4))
    want = parity.greedy_tokens(run, prompt, (1, 2, 3, 4, 5, 6), 4)
    assert want[0] == int(np.argmax(refs["hybrid"]["prefill_logits"][-1]))
    assert result.token_ids == want
