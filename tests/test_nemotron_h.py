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

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.engine.sampling import SamplingParams
from hybrid_jax.engine.step import commit_verified
from hybrid_jax.kv_cache import init_kv_cache
from hybrid_jax.metadata import BucketPolicy, RowSpec, build_metadata, example_metadata
from hybrid_jax.models.loading import CheckpointError
from hybrid_jax.models.nemotron_h import ConfigError, NemotronHConfig
from hybrid_jax.models.nemotron_h_loading import load_nemotron_h
from hybrid_jax.models.safetensors_io import read_tensors, write_tensors
from hybrid_jax.models.tokenizer import ByteTokenizer
from hybrid_jax.modes import ForwardMode, LayerKind, UnsupportedForwardModeError
from hybrid_jax.state_pool import init_state_pool

M = ForwardMode
FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "nemotron_h"
NAMES = ("hybrid", "biases_latent_moe")
D = 4
PAGE = 4
NUM_SLOTS, NUM_PAGES = 4, 16
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
    return {name: Runner(load_nemotron_h(FIXTURES / name)) for name in NAMES}


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
    run, ref = runners["hybrid"], refs["hybrid"]
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
    assert len(out.verify) == len(run.model.state_specs())
    # Accept the first two drafts (step index 1), then decode the rest.
    slots = jnp.asarray([2, 0], jnp.int32)
    pool = commit_verified(out.pool, out.verify, slots, jnp.asarray([1, -1], jnp.int32))
    kv = out.kv
    for i in (2, 3):
        logits, out = run.step(M.DECODE, [RowSpec(2, p + i, 1, pages)], [tokens[i]], pool, kv)
        pool, kv = out.pool, out.kv
        assert_close(logits[0], ref["decode_logits"][i], f"decode after commit, token {i}")


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_mixed_and_draft_extend_match_transformers(runners, refs, name):
    run, ref = runners[name], refs[name]
    prompt, prompt2 = ref["prompt"], ref["prompt2"]
    a, b = (3, 8, 10), (6, 11)
    pool, kv = run.fresh(2)
    logits, out = run.step(M.EXTEND, [RowSpec(1, 0, 5, a)], prompt[:5], pool, kv)
    assert_close(logits, ref["prefill_logits"][:5], "first chunk")
    rows = [RowSpec(1, 5, 4, a), RowSpec(2, 0, len(prompt2), b)]
    x = np.concatenate([prompt[5:9], prompt2])
    logits, out = run.step(M.MIXED, rows, x, out.pool, out.kv)
    assert_close(logits[:4], ref["prefill_logits"][5:9], "second chunk in MIXED")
    assert_close(logits[4:], ref["prefill2_logits"], "fresh request in MIXED")
    logits, out = run.step(M.DRAFT_EXTEND, [RowSpec(1, 9, 2, a)], prompt[9:], out.pool, out.kv)
    assert_close(logits, ref["prefill_logits"][9:], "DRAFT_EXTEND")


# ---------------------------------------------------------------- pools, modes, structure


def test_idle_step_returns_no_logits_and_changes_nothing(runners):
    run = runners["hybrid"]
    pool, kv = jax.tree.map(np.asarray, run.fresh(3))
    _, out = run.step(M.IDLE, [], [], pool, kv)
    assert out.logits.shape == (0, run.model.config.vocab_size)
    for got, want in zip(jax.tree.leaves((out.pool, out.kv)), jax.tree.leaves((pool, kv)),
                         strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got), want)


def test_unsupported_mode_fails_while_tracing(runners):
    run = runners["hybrid"]
    pool, kv = run.fresh()
    meta = dataclasses.replace(example_metadata(M.DECODE, 2, 2, POLICY), mode=M.DLLM_EXTEND)
    with pytest.raises(UnsupportedForwardModeError, match="DLLM_EXTEND") as err:
        jax.eval_shape(run.forward, run.params, jnp.zeros(2, jnp.int32), pool, kv, meta)
    assert err.value.layer_kind in (LayerKind.MAMBA2, LayerKind.FULL_ATTENTION)


def test_pool_of_another_layout_is_refused(runners):
    run = runners["hybrid"]
    pool, kv = run.fresh()
    meta = example_metadata(M.DECODE, 2, 2, POLICY)
    short = dataclasses.replace(pool, conv=pool.conv[:1], ssm=pool.ssm[:1])
    with pytest.raises(ValueError, match="model.state_specs"):
        jax.eval_shape(run.forward, run.params, jnp.zeros(2, jnp.int32), short, kv, meta)


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
    assert other.layers[0].mixer.__class__.__name__ == "PlainAttention"
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


def params_of(model):
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))}


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
    want, got = params_of(runners["hybrid"].model), params_of(load_nemotron_h(folder))
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
    run, p = Runner(model), len(ref["prompt"])
    pool, kv = run.fresh()
    logits, out = run.step(M.EXTEND, [RowSpec(1, 0, p, (1, 2, 3))], ref["prompt"], pool, kv)
    assert rel_err(logits, ref["prefill_logits"]) < 1e-1
    row = RowSpec(1, p, 1, (1, 2, 3))
    logits, _ = run.step(M.DECODE, [row], ref["decode_tokens"][:1], out.pool, out.kv)
    assert rel_err(logits[0], ref["decode_logits"][0]) < 1e-1


# ---------------------------------------------------------------- served by the engine


def test_engine_serves_nemotron_h_greedy_like_the_model_step_by_step(runners, refs):
    run, prompt = runners["hybrid"], refs["hybrid"]["prompt"].tolist()
    config = EngineConfig(
        max_batch=1, max_tokens=16, max_context=24, page_size=PAGE, cache_dir=None,
        impl="reference", overlap=False,
    )  # fmt: skip
    engine = Engine(run.model, ByteTokenizer(), config, progress=False)
    (result,) = engine.generate([prompt], SamplingParams(max_new_tokens=4))
    pool, kv = run.fresh()
    pages = (1, 2, 3, 4, 5, 6)
    logits, out = run.step(M.EXTEND, [RowSpec(1, 0, len(prompt), pages)], prompt, pool, kv)
    want = [int(np.argmax(logits[-1]))]
    for i in range(3):
        row = RowSpec(1, len(prompt) + i, 1, pages)
        logits, out = run.step(M.DECODE, [row], want[-1:], out.pool, out.kv)
        want.append(int(np.argmax(logits[0])))
    assert want[0] == int(np.argmax(refs["hybrid"]["prefill_logits"][-1]))
    assert result.token_ids == want
