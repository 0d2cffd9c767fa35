"""Tensor parallelism (hybrid_jax.parallel): on four host CPU devices, in a process of their own
(tests/_tp_checks.py), a model cut over 2 and 4 devices computes what it computes on one; and
the refusals, in this process."""

import json
import pathlib
import subprocess
import sys

import pytest
from flax import nnx

from hybrid_jax import Engine, EngineConfig, parallel
from hybrid_jax.cli import main
from hybrid_jax.models.qwen3_next import Qwen3Next, tiny_qwen3_next_config

CHECKS = pathlib.Path(__file__).with_name("_tp_checks.py")
# The blocks each forward all-reduces: 4 mixers and 4 feed-forward blocks (Qwen), 5 blocks
# (Nemotron-H), plus the vocabulary-cut embedding lookup.
ALL_REDUCES = {"qwen": 4 + 4 + 1, "nemotron": 5 + 1}


def _child(*args: str) -> dict:
    """What ``_tp_checks.py`` reports, run with ``args`` in a process of its own (it keeps
    the suite's XLA_FLAGS, conftest.py, and adds its device count)."""
    done = subprocess.run(
        [sys.executable, str(CHECKS), *args], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def seen():
    return _child()


@pytest.fixture(scope="module")
def engines():
    """Five engines compiled in the child (one device, four, and two with each kind of
    drafts): minutes on two cores, so their test is slow."""
    return _child("engines")


@pytest.mark.parametrize("model", ["qwen", "nemotron"])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_model_cut_over_devices_computes_what_one_device_does(seen, model, tp):
    assert seen["devices"] == 4
    got = seen[f"{model}_tp{tp}"]
    assert max(got["logits_rel"]) < 1e-5  # an EXTEND step, then a DECODE step
    assert got["states_rel"] < 1e-5  # the slot pool's states after both, gathered
    # One all-reduce per block, and the pools and caches never gathered (no all-gather at all).
    assert got["all_reduce"] == ALL_REDUCES[model]
    assert got["all_gather_shapes"] == []


@pytest.mark.parametrize("tp", [2, 4])
def test_scanned_layers_with_their_norms_folded_compute_across_devices_what_one_does(seen, tp):
    """Two repeats of a block of MoE layers, scanned and their norm weights folded into the
    products (the shared gate widened), cut over devices: what one device computes, and the
    pools and caches never gathered."""
    got = seen[f"qwen_folded_tp{tp}"]
    assert max(got["logits_rel"]) < 1e-5 and got["states_rel"] < 1e-5
    assert got["all_gather_shapes"] == []


@pytest.mark.slow
def test_an_engine_cut_over_devices_serves_the_tokens_of_one_device(engines):
    want = engines["tp1"]["tokens"]
    assert len(want) == 2 and all(len(t) == 8 for t in want)
    for name, devices in (("tp4", 4), ("tp2_ngram", 2), ("tp2_mtp", 2), ("tp2_mtp_tree", 2)):
        got = engines[name]
        assert got["tokens"] == want, name
        assert got["retraces"] == 0 and got["pool_devices"] == devices
    # Drafts (n-gram, the MTP head's chain and tree) verified and committed under TP.
    for name in ("tp2_ngram", "tp2_mtp", "tp2_mtp_tree"):
        assert engines[name]["verify_steps"] > 0, name
    assert engines["tp2_mtp"]["head_kv_devices"] == 2  # the head's cache cut like the target's


def test_a_checkpoint_loads_onto_the_devices_in_slices(seen):
    got = seen["checkpoint"]
    assert got["placed"]  # the engine uses the loaded model as it is
    # GDN's [Q|K|V] input projection: each device holds half, none the whole.
    assert got["shard_sizes"] == [got["size"] // 2] * 2
    assert got["tokens"] == got["want"] and len(got["want"]) == 6


def test_tensor_parallel_is_checked_before_anything_is_built():
    with pytest.raises(ValueError, match=r"EngineConfig.tensor_parallel=0 must be an int >= 1"):
        EngineConfig(tensor_parallel=0)
    with pytest.raises(ValueError, match=r"tensor_parallel=2 needs 2 devices but JAX sees 1"):
        parallel.make_mesh(2)
    with pytest.raises(ValueError, match=r"tensor_parallel=2 needs 2 devices"):
        Engine.from_preset("tiny", EngineConfig(tensor_parallel=2, cache_dir=None))


def test_a_split_that_does_not_divide_a_block_names_the_block_and_size():
    model = nnx.eval_shape(lambda: Qwen3Next(tiny_qwen3_next_config(), rngs=nnx.Rngs(0)))
    parallel.check_divisible(model, 2)  # the tiny preset: 2 key heads, 2 KV heads
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel=4 does not divide layers\.0\.linear_attn's num_key_heads=2; "
        r"each GPU takes whole heads",
    ):
        parallel.check_divisible(model, 4)


@pytest.mark.parametrize(
    ("flag", "message"),
    [("0", "--tp=0 must be an int >= 1"), ("2", "--tp=2 needs 2 devices but JAX sees 1")],
)
def test_cli_names_the_tp_flag_before_building_a_model(capsys, flag, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--tp", flag, "--cache-dir", ""])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
