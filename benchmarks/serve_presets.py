"""The serving benchmark's model presets (real dimensions, random weights) and the limits a
row is measured against: the bytes a decode step must move, the FLOPs of a prefill."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

from hybrid_jax.models.nemotron_h import NemotronHConfig
from hybrid_jax.models.qwen3_next import Qwen3NextConfig, tiny_qwen3_next_config
from hybrid_jax.modes import LayerKind

__all__ = [
    "PRESETS",
    "decode_bytes",
    "decode_roofline_s",
    "limit_bytes",
    "limit_flops",
    "parameter_count",
    "prefill_flops",
    "row_bytes",
]


def _qwen3_next_layers(n: int) -> tuple[str, ...]:
    """Qwen3-Next's pattern: three GDN layers, then one full-attention layer."""
    return tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n))


def _qwen_config(layers: int, **dims) -> Qwen3NextConfig:
    base = dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, partial_rotary_factor=0.25, max_position_embeddings=65536,
        intermediate_size=5120, dtype="bfloat16",
    )  # fmt: skip
    base.update(dims)
    return Qwen3NextConfig(num_hidden_layers=layers, layer_types=_qwen3_next_layers(layers), **base)


# Nemotron-H-8B's block pattern (M Mamba2, - MLP, * attention): 24 Mamba2, 24 MLP and 4
# attention blocks.
_NEMOTRON_H_8B = "M-M-M-M-*M-M-M-M-M-M-*M-M-M-M-M-M-*M-M-M-M-M-M-*M-M-"
_BLOCKS = {"M": "linear_attention", "-": "mlp", "*": "full_attention"}


def _nemotron_config(layers: int) -> NemotronHConfig:
    """Nemotron-H-8B's counts (hidden 4096, Mamba2 128 heads of 64 with 8 groups of state 128,
    attention 32 query / 8 KV heads of 128, an MLP of 21504, vocab 131072), its first
    ``layers`` blocks."""
    pattern = (_NEMOTRON_H_8B * -(-layers // len(_NEMOTRON_H_8B)))[:layers]
    return NemotronHConfig(
        vocab_size=131072, hidden_size=4096, layers_block_type=tuple(_BLOCKS[b] for b in pattern),
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=21504,
        mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128,
        max_position_embeddings=65536, dtype="bfloat16",
    )  # fmt: skip


PRESETS: dict[str, tuple[int, Callable[[int], Qwen3NextConfig | NemotronHConfig]]] = {
    "nemotron-h-8b-like": (len(_NEMOTRON_H_8B), _nemotron_config),
    # name: (default depth, config of that depth)
    "qwen3-next-80b-a3b": (
        4,
        lambda n: _qwen_config(
            n,
            vocab_size=151936,
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
        ),
    ),
    "qwen3.5-35b-a3b-like": (
        40,
        lambda n: _qwen_config(
            n,
            vocab_size=248320,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
        ),
    ),
    "qwen3-next-dense": (8, lambda n: _qwen_config(n, vocab_size=151936)),
    # Qwen3.5-9B's counts (32 layers, hidden 4096, a dense MLP of 12288, 16 query / 4 KV
    # attention heads) on the Qwen3-Next layer code, which computes the same functions.
    "qwen3.5-9b-like": (
        32,
        lambda n: _qwen_config(
            n,
            vocab_size=248320,
            hidden_size=4096,
            intermediate_size=12288,
            num_key_value_heads=4,
        ),
    ),
    # Qwen3.5-27B's counts (64 layers, hidden 5120, a dense MLP of 17408, 24 query / 4 KV
    # attention heads, GDN 16 key / 48 value heads: the ratio 3 of issue 15).
    "qwen3.5-27b-like": (
        64,
        lambda n: _qwen_config(
            n,
            vocab_size=248320,
            hidden_size=5120,
            intermediate_size=17408,
            num_attention_heads=24,
            num_key_value_heads=4,
            linear_num_value_heads=48,
        ),
    ),
    # Nemotron-H's blocks at tiny dimensions, on the CPU (``--smoke --preset nemotron-smoke``).
    "nemotron-smoke": (
        8,
        lambda n: dataclasses.replace(
            _nemotron_config(n),
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            mamba_num_heads=4,
            mamba_head_dim=16,
            n_groups=2,
            ssm_state_size=16,
            dtype="float32",
        ),  # fmt: skip
    ),
    # The built-in tiny model at any depth, without its MTP head (the rows never draft).
    "smoke": (
        4,
        lambda n: dataclasses.replace(
            tiny_qwen3_next_config(),
            num_hidden_layers=n,
            layer_types=_qwen3_next_layers(n),
            mlp_only_layers=(),
            num_nextn_predict_layers=0,
        ),
    ),
}


# ------------------------------------------------------------------------------- limits


def _itemsize(c: Qwen3NextConfig) -> int:
    return jnp.dtype(c.dtype).itemsize


def _mixer_params(c: Qwen3NextConfig, kind: LayerKind) -> int:
    h = c.hidden_size
    if kind is LayerKind.GDN:
        g = c.gdn_config()
        d = g.dims
        qkvz = h * (2 * d.key_dim + 2 * d.value_dim)
        return qkvz + h * 2 * g.num_value_heads + d.value_dim * h + g.conv_dim * g.conv_kernel
    a = c.attention_config()
    q = h * a.num_heads * a.head_dim * 2  # query and its output gate
    kv = h * a.num_kv_heads * a.head_dim * 2
    return q + kv + a.num_heads * a.head_dim * h


def _mlp_params(c: Qwen3NextConfig, i: int) -> tuple[int, int, int]:
    """(always-read params, params of one routed expert, experts) of layer i's feed-forward."""
    h = c.hidden_size
    if not c.is_moe_layer(i):
        return 3 * h * c.intermediate_size, 0, 0
    m = c.moe_config()
    fixed = h * m.num_experts + 3 * h * m.shared_intermediate_size + h
    return fixed, 3 * h * m.intermediate_size, m.num_experts


def _expected_experts(c: Qwen3NextConfig, experts: int, batch: int) -> float:
    """Distinct experts ``batch`` tokens hit under uniform routing."""
    return experts * (1 - (1 - c.num_experts_per_tok / experts) ** batch)


def row_bytes(c: Qwen3NextConfig, batch: int, context: int) -> float:
    """Bytes of the rows' own state in a decode step: recurrent states and conv windows read
    and written, KV entries read."""
    item = _itemsize(c)
    total = 0.0
    for kind in c.layer_kinds:
        if kind is LayerKind.GDN:
            g = c.gdn_config()
            total += batch * 2 * (g.num_value_heads * g.head_k_dim * g.head_v_dim * 4)
            total += batch * 2 * g.conv_dim * (g.conv_kernel - 1) * item
        else:
            a = c.attention_config()
            total += batch * context * 2 * a.num_kv_heads * a.head_dim * item
    return total


def decode_bytes(c: Qwen3NextConfig, batch: int, context: int) -> float:
    """Bytes one decode step of ``batch`` rows at ``context`` positions must move: the weights
    it touches once (the experts its tokens hit) and the rows' states and KV entries."""
    # The roofline at one byte per second and unbounded FLOP/s: every product is its bytes.
    return decode_roofline_s(c, batch, context, 1.0, math.inf)


def decode_roofline_s(
    c: Qwen3NextConfig, batch: int, context: int, bandwidth: float, flops: float
) -> float:
    """Seconds of a decode step when each weight product takes the longer of its bytes and
    its FLOPs (2 x rows x parameters): above ``flops / bandwidth`` rows a product is bound by
    its FLOPs, which ``decode_bytes`` leaves out. States and KV entries count as bytes."""
    item = _itemsize(c)

    def product(params: float, rows: float) -> float:
        return max(params * item / bandwidth, 2 * rows * params / flops)

    total = product(c.vocab_size * c.hidden_size, batch)
    for i, kind in enumerate(c.layer_kinds):
        fixed, expert, experts = _mlp_params(c, i)
        total += product(_mixer_params(c, kind), batch) + product(fixed, batch)
        hit = _expected_experts(c, experts, batch) if experts else 0.0
        if hit:
            # The routed rows spread over the experts they hit.
            total += hit * product(expert, batch * c.num_experts_per_tok / hit)
    return total + row_bytes(c, batch, context) / bandwidth


def parameter_count(model) -> int:
    """Parameters of every weight a token's step reads: all but the embedding table (one row
    per token)."""
    leaves = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return sum(v.get_value().size for path, v in leaves if "embed" not in "/".join(map(str, path)))


def limit_bytes(model, c, batch: int, context: int) -> float:
    """``decode_bytes`` for Qwen3-Next-family configs; for a model without routed experts
    (Nemotron-H), every weight once, each row's recurrent states read and written, and its
    KV entries read."""
    if isinstance(c, Qwen3NextConfig):
        return decode_bytes(c, batch, context)
    item = jnp.dtype(c.dtype).itemsize
    states = sum(spec.slot_bytes for spec in model.state_specs())
    kv = sum(2 * s.num_kv_heads * s.head_dim * s.dtype.itemsize for s in model.kv_specs())
    return parameter_count(model) * item + batch * (2 * states + context * kv)


def limit_flops(model, c, prompts: int, length: int) -> float:
    """``prefill_flops`` for Qwen3-Next-family configs; otherwise 2 x every weight per token
    plus causal attention's FLOPs."""
    if isinstance(c, Qwen3NextConfig):
        return prefill_flops(c, prompts, length)
    heads = c.attention_config().num_heads * len(model.kv_specs())
    head_dim = c.attention_config().head_dim
    attention = prompts * 2 * heads * head_dim * length**2
    return 2 * parameter_count(model) * prompts * length + attention


def prefill_flops(c: Qwen3NextConfig, prompts: int, length: int) -> float:
    """Weight FLOPs (2 x active params per token) plus causal attention's, of the prompts."""
    tokens = prompts * length
    flops = 0.0
    for i, kind in enumerate(c.layer_kinds):
        fixed, expert, _ = _mlp_params(c, i)
        active = _mixer_params(c, kind) + fixed + c.num_experts_per_tok * expert * bool(expert)
        flops += 2 * active * tokens
        if kind is LayerKind.FULL_ATTENTION:
            a = c.attention_config()
            flops += prompts * 2 * a.num_heads * a.head_dim * length * length  # QK^T, PV, causal
    return flops + prompts * 2 * c.vocab_size * c.hidden_size  # the last token's logits
