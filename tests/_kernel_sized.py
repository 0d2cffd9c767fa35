"""The built-in Qwen3-Next model at dimensions the GPU kernels take, for the engine-level GPU
tests and the check that their steps lower for the GPU (a plain module: the tests import it
by its bare name, ``tests`` being on ``sys.path``)."""

from __future__ import annotations

import dataclasses

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
