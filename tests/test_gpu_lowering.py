"""The steps of the engine-level GPU tests, and a Nemotron-H model's, lower for the GPU here,
without one: with ``impl="auto"`` deciding as it does on an H200, every Pallas kernel of a
DECODE and an EXTEND step goes through Mosaic GPU's lowering (its register layout inference
included) at the model's own shapes, which the kernels' tests at their fixed shapes may not
reach (a half-turned attention head of 256 with 2 KV heads once found no layout there)."""

from __future__ import annotations

import functools
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from _kernel_sized import (
    kernel_sized_nemotron_h_config,
    repeated_moe_qwen3_next_config,
    with_zero_weights,
)
from flax import nnx

from hybrid_jax import EngineConfig
from hybrid_jax.backend import attention as attention_backend
from hybrid_jax.backend import gdn as gdn_backend
from hybrid_jax.engine.engine import model_for_steps
from hybrid_jax.engine.lm_step import LastTokenLogits, ServingState
from hybrid_jax.engine.step import StepFunctions
from hybrid_jax.kv_cache import init_kv_cache
from hybrid_jax.layers import linear
from hybrid_jax.layers import moe as moe_layer
from hybrid_jax.metadata import example_metadata
from hybrid_jax.models.nemotron_h import NemotronH
from hybrid_jax.models.qwen3_next import Qwen3Next
from hybrid_jax.modes import ForwardMode
from hybrid_jax.state_pool import init_state_pool
from pallas_kernels import _common

DECODE_KERNELS = (
    "attention_rows", "paged_decode_attention", "gdn_decode", "projections", "expert_mlp",
    "combine_pairs",
)  # fmt: skip
NEMOTRON_DECODE_KERNELS = (
    "attention_rows", "paged_decode_attention", "conv1d_update", "mamba2_state_update",
    "projections",
)  # fmt: skip
ENGINE = EngineConfig(max_batch=8, max_tokens=64, max_context=256, cache_dir=None)


def _qwen3_next() -> Qwen3Next:
    """The model of ``tests/gpu/test_norms_in_launch_gpu.py``: two scanned repeats of a
    block, 64 experts top 8."""
    return Qwen3Next(repeated_moe_qwen3_next_config(), rngs=nnx.Rngs(0))


def _nemotron_h() -> NemotronH:
    return NemotronH(kernel_sized_nemotron_h_config(), rngs=nnx.Rngs(0))


def _steps_and_state(build):
    """The model ``build`` makes, as an engine prepares it, and its serving state's shapes."""
    model = model_for_steps(with_zero_weights(build), ENGINE, None, donate_weights=True)
    policy = ENGINE.policy(model.config.max_position_embeddings)
    state = jax.eval_shape(
        lambda: ServingState(
            init_state_pool(model.state_specs(), 9),
            init_kv_cache(model.kv_specs(), 64, policy.page_size),
            jnp.zeros(9, jnp.int32),
        )
    )
    return StepFunctions(LastTokenLogits(model, False), impl="auto"), state, policy


@pytest.mark.parametrize(
    ("build", "mode", "tokens", "kernels"),
    [
        (_qwen3_next, ForwardMode.DECODE, 8, DECODE_KERNELS),
        # 8 x 64 pairs are the grouped product's (tokamax's, not installed here).
        (_qwen3_next, ForwardMode.EXTEND, 64, ("projections", "conv1d_prefill", "gdn_chunk_intra")),
        (_nemotron_h, ForwardMode.DECODE, 8, NEMOTRON_DECODE_KERNELS),
        pytest.param(
            _nemotron_h,
            ForwardMode.EXTEND,
            64,
            ("conv1d_prefill", "mamba2_ssd_chunk_scan"),
            marks=pytest.mark.slow,  # a minute on two cores; its kernels' own tests lower them
        ),
    ],
    ids=["qwen3-next-decode", "qwen3-next-extend", "nemotron-h-decode", "nemotron-h-extend"],
)
def test_the_gpu_tests_steps_lower_for_the_gpu_with_their_kernels(
    build, mode, tokens, kernels, monkeypatch
):
    monkeypatch.setattr(_common, "on_hopper_gpu", lambda: True)  # "auto" decides as on a GPU
    text = _step_text(build, mode, tokens, _switches())
    missing = [name for name in kernels if name not in text]
    assert not missing, f"{mode.name} lowered without {missing}"


def _switches() -> tuple:
    """The values of the switches these tests set, as the lowering reads them now."""
    return (
        _common.on_hopper_gpu(), moe_layer.EXPERTS_IN_ONE_LAUNCH, moe_layer.SPLIT_ROUTER_LAUNCH,
        moe_layer.RANKING_IN_ROUTER_LAUNCH, linear.ADD_IN_OUTPUT_LAUNCH,
        gdn_backend.CONV_IN_DECODE_KERNEL, attention_backend.MERGE_IN_LAUNCH,
    )  # fmt: skip


@functools.cache
def _step_text(build, mode: ForwardMode, tokens: int, switches: tuple) -> str:
    """The CUDA lowering of a ``mode`` step of 8 rows and ``tokens`` tokens of the model
    ``build`` makes, with the ``switches`` in force (``_switches()``), from steps of their
    own: steps cache their traces, which hold the switches they were made with. Tests that
    set the same switches share one lowering."""
    assert switches == _switches()
    steps, state, policy = _steps_and_state(build)
    meta = example_metadata(mode, 8, tokens, policy)
    x = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    return steps.lower(mode, state, x, meta, platforms=("cuda",)).as_text()


def _switched_decode_text(build) -> str:
    """``_step_text`` of a DECODE step of 8 rows, with the switches the test has set."""
    return _step_text(build, ForwardMode.DECODE, 8, _switches())


@pytest.mark.parametrize(
    "conv_in_kernel",
    [pytest.param(False, marks=pytest.mark.slow), True],  # slow: the switch's other value
    ids=["conv-launch", "conv-in-kernel"],
)
def test_a_decode_step_s_launches_count_in_one_buffer_the_scan_carries(monkeypatch, conv_in_kernel):
    """With ``EXPERTS_IN_ONE_LAUNCH`` each MoE block's ``expert_mlp`` launch, with
    ``ADD_IN_OUTPUT_LAUNCH`` each split output projection's add launch (GDN's and
    attention's: no partial products left for XLA to sum), and with
    ``CONV_IN_DECODE_KERNEL`` each GDN decode kernel forming its conv, counts in the
    forward's one buffer (``LayerStates.counters``, 8 tokens x 16, the GDN layers' key
    heads, more than the top 8), which the layer scan carries: no launch makes zeros of its
    own."""
    monkeypatch.setattr(_common, "on_hopper_gpu", lambda: True)
    monkeypatch.setattr(moe_layer, "EXPERTS_IN_ONE_LAUNCH", True)
    monkeypatch.setattr(linear, "ADD_IN_OUTPUT_LAUNCH", True)
    monkeypatch.setattr(gdn_backend, "CONV_IN_DECODE_KERNEL", conv_in_kernel)
    text = _switched_decode_text(_qwen3_next)
    assert "expert_mlp" in text and "expert_hidden" not in text
    assert "projection_add" in text and "projection_partials" not in text
    assert "tensor<128xi1>) -> tensor<128xi32>" not in text
    zeros = [line for line in text.splitlines() if "(tensor<i32>) -> tensor<128xi32>" in line]
    assert len(zeros) == 1, "the forward's buffer, and no launch's own"
    (loop,) = [line for line in text.splitlines() if "stablehlo.while" in line]
    assert "tensor<128xi32>" in loop
    assert ("gdn_decode_ring_conv" in text) == conv_in_kernel
    assert ("conv1d_update" in text) != conv_in_kernel


def _qwen3_next_128_experts() -> Qwen3Next:
    """``_qwen3_next`` with 128 experts: a router launch its row programs can combine."""
    return Qwen3Next(repeated_moe_qwen3_next_config(num_experts=128), rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    ("build", "split", "ranked", "launch"),
    [
        # 64 experts: widths the row programs cannot combine, so the launch stays whole-K.
        (_qwen3_next, True, True, "projections_ranked"),
        pytest.param(  # slow: the default ranks in the launch (the next row)
            _qwen3_next_128_experts, True, False, "projections_combined", marks=pytest.mark.slow
        ),
        (_qwen3_next_128_experts, True, True, "projections_combined"),
    ],
    ids=["ranked", "split", "split-ranked"],
)
def test_a_decode_step_s_router_launch_as_switched_lowers(monkeypatch, build, split, ranked,
                                                          launch):  # fmt: skip
    """With ``RANKING_IN_ROUTER_LAUNCH`` each MoE block's router launch ranks its logits
    (``projections_ranked``: 64 experts beside the paired shared gate/up); with
    ``SPLIT_ROUTER_LAUNCH`` it runs over parts of K, combined by row
    (``projections_combined``, 128 experts; ranking there too where both are on). Either
    way it counts in the forward's one buffer and lowers for the GPU."""
    monkeypatch.setattr(_common, "on_hopper_gpu", lambda: True)
    monkeypatch.setattr(moe_layer, "RANKING_IN_ROUTER_LAUNCH", ranked)
    monkeypatch.setattr(moe_layer, "SPLIT_ROUTER_LAUNCH", split)
    text = _switched_decode_text(build)
    assert launch in text and "expert_mlp" in text
    others = {"projections_ranked", "projections_combined"} - {launch}
    assert not any(other in text for other in others)
    zeros = [line for line in text.splitlines() if "(tensor<i32>) -> tensor<128xi32>" in line]
    assert len(zeros) == 1, "the forward's buffer, and no launch's own"


@pytest.mark.parametrize(
    "merged",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # slow: the switch's other value
    ids=["merge-after", "merge-in-launch"],
)
def test_a_decode_step_s_attention_merges_its_splits_as_switched(monkeypatch, merged):
    """With ``MERGE_IN_LAUNCH`` the paged decode kernel of a DECODE step of 8 rows (2 KV
    heads of 256, split over the page table's blocks) takes the attention's packed ``[q |
    gate]`` rows and the forward's one counters buffer, and gives the merged, gated rows
    itself; off, its splits and their log-sum-exps alone."""
    monkeypatch.setattr(_common, "on_hopper_gpu", lambda: True)
    monkeypatch.setattr(attention_backend, "MERGE_IN_LAUNCH", merged)
    text = _switched_decode_text(_qwen3_next)
    (call,) = [line for line in text.splitlines() if "paged_decode_attention" in line]
    results = call.rsplit("->", 1)[1]
    merged_rows = "tensor<8x2x8x256xbf16>"  # [rows, KV heads, tile rows, head_dim]
    assert (merged_rows in results) == merged
    assert ("tensor<8x1x16x512xbf16>" in call) == merged  # the packed [q | gate] rows
    assert ("tensor<128xi32>" in results) == merged
    zeros = [line for line in text.splitlines() if "(tensor<i32>) -> tensor<128xi32>" in line]
    assert len(zeros) == 1, "the forward's buffer, and no launch's own"


def test_a_decode_step_converts_its_rows_validity_once_before_the_layer_scan(monkeypatch):
    """The MoE blocks' ranked router launches read the tokens' validity as int32: the
    forward converts it once, before the layer scan (``LayerStates.real_flags``), so the
    scan's body holds neither the comparison nor the conversion, each of which XLA would
    run as a launch every repeat."""
    monkeypatch.setattr(_common, "on_hopper_gpu", lambda: True)
    monkeypatch.setattr(moe_layer, "RANKING_IN_ROUTER_LAUNCH", True)
    lines = _switched_decode_text(_qwen3_next).splitlines()
    assert any("projections_ranked" in line or "projections_combined" in line for line in lines)
    (loop,) = [i for i, line in enumerate(lines) if "stablehlo.while" in line]
    converts = [i for i, line in enumerate(lines) if "tensor<8xi1>) -> tensor<8xi32>" in line]
    assert len(converts) == 1 and converts[0] < loop, converts
    in_body = [line for line in lines if "compare" in line and "%iterArg" in line]
    assert all("tensor<8xi32>" not in line for line in in_body), in_body


# The kernels each step of a model cut over two GPUs holds (on one GPU a Qwen3-Next decode
# step's MoE blocks run ``expert_mlp`` and its attention rows their own launch; cut, each
# GPU's MoE slice runs by id and the rows of its one KV head of 2, a rotary of 128, in XLA).
TP_KERNELS = {
    "qwen_DECODE": {"gdn_decode_ring_conv", "paged_decode_attention", "projections",
                    "expert_matmul"},
    "qwen_EXTEND": {"projections", "conv1d_prefill", "gdn_chunk_intra"},
    "nemotron_DECODE": {"attention_rows", "paged_decode_attention", "conv1d_update",
                        "mamba2_state_update", "projections"},
    "nemotron_EXTEND": {"conv1d_prefill", "mamba2_ssd_chunk_scan"},
}  # fmt: skip


@pytest.mark.slow  # two to three minutes on two cores, in a process of its own
def test_steps_cut_over_two_gpus_lower_for_the_gpu_with_their_kernels():
    """Under tensor parallelism each GPU's slice of a block runs inside ``shard_map``, where
    the kernels see their share of the heads (one KV head of two) and a constant evaluated
    while tracing must not take the mesh's manual axes: both models' DECODE and EXTEND steps,
    cut over two devices, lower for the GPU with their kernels (in a process of its own with
    four host devices: ``tests/_tp_checks.py lowering``)."""
    script = pathlib.Path(__file__).with_name("_tp_checks.py")
    done = subprocess.run(
        [sys.executable, str(script), "lowering"], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    for step, kernels in TP_KERNELS.items():
        assert isinstance(seen[step], list), f"{step}: {seen[step]}"
        assert kernels <= set(seen[step]), f"{step} lowered without {kernels - set(seen[step])}"
