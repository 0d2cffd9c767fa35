"""The built-in Qwen3-Next model, and a Nemotron-H model, at dimensions the GPU kernels take,
for the engine-level GPU tests and the check that their steps lower for the GPU (a plain
module: the tests import it by its bare name, ``tests`` being on ``sys.path``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.models.nemotron_h import NemotronHConfig
from hybrid_jax.models.qwen3_next import Qwen3NextConfig, tiny_qwen3_next_config


def kernel_sized_qwen3_next_config(**changes) -> Qwen3NextConfig:
    """bf16, hidden 1024, Qwen3-Next's attention (16 query / 2 KV heads of 256) and GDN
    (16 key / 32 value heads of 128) head shapes, no MTP head; then ``changes``."""
    config = dataclasses.replace(
        tiny_qwen3_next_config("bfloat16"), hidden_size=1024, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, intermediate_size=1024, num_nextn_predict_layers=0,
    )  # fmt: skip
    return dataclasses.replace(config, **changes)


def repeated_moe_qwen3_next_config(**changes) -> Qwen3NextConfig:
    """``kernel_sized_qwen3_next_config`` as two repeats of Qwen3-Next's block (three GDN
    layers, then attention), each layer's MLP a MoE of 64 experts top 8: what a scan stacks
    and the by-id MoE launches run; then ``changes``."""
    block = ("linear_attention",) * 3 + ("full_attention",)
    moe = dict(num_experts=64, num_experts_per_tok=8, num_hidden_layers=8, mlp_only_layers=())
    return kernel_sized_qwen3_next_config(**{**moe, "layer_types": block * 2, **changes})


def kernel_sized_nemotron_h_config(**changes) -> NemotronHConfig:
    """bf16, hidden 1024, Nemotron-H-8B's head shapes (Mamba2 heads of 64 with a state of 128
    in 8 groups, attention heads of 128 with 4 query heads a KV head) at fewer heads, its
    block pattern's first 8 blocks (Mamba2, MLP and one attention block); then ``changes``."""
    blocks = {"M": "linear_attention", "-": "mlp", "*": "full_attention"}
    config = NemotronHConfig(
        vocab_size=256, hidden_size=1024, layers_block_type=tuple(blocks[b] for b in "M-M-*M-M"),
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, intermediate_size=2048,
        mamba_num_heads=32, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
        max_position_embeddings=4096, dtype="bfloat16",
    )  # fmt: skip
    return dataclasses.replace(config, **changes)


def with_zero_weights[Model: nnx.Module](build: Callable[[], Model]) -> Model:
    """The model ``build`` makes, its weights zeros: lowering reads shapes only, and zeros
    spare the random initialisation's time."""
    graphdef, shapes = nnx.split(nnx.eval_shape(build))
    return nnx.merge(graphdef, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes))
