"""Hugging Face Qwen3-Next checkpoint folders: load into ``Qwen3Next``, and save from it.

The folder's files and the checked load are ``checkpoint.py``'s; ``tokenizer.json`` is read
separately (``tokenizer.load_tokenizer``). Every model parameter comes from one or more named
tensors through a fixed rule (``_rules``): linear weights are
transposed (HF ``[out, in]``, ours ``[in, out]``), the conv weight loses its channel axis,
per-expert matrices are stacked (HF's fused ``experts.gate_up_proj`` layout is read too).
All tensors are checked against the config before any is converted; every missing or
misshapen one is named in one ``CheckpointError``. The multi-token-prediction head is loaded
when the checkpoint has it (``mtp.fc.weight`` present: ``mtp.fc``, ``mtp.pre_fc_norm_*``,
``mtp.layers.0.*`` laid out like a full-attention decoder layer, ``mtp.norm``) and left out
otherwise, whatever ``config.json`` says. Tensors the model does not use (a tied
checkpoint's ``lm_head``) are ignored.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable, Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from hybrid_jax.layers.gdn import grouped_ba_columns, grouped_qkvz_columns
from hybrid_jax.models.checkpoint import (
    Rule,
    linear,
    load_weights,
    plain,
    read_config,
    write_checkpoint,
)
from hybrid_jax.models.checkpoint import weight_map as checkpoint_files
from hybrid_jax.models.layer_scan import ScannedRun
from hybrid_jax.models.qwen3_next import Qwen3Next, Qwen3NextConfig
from hybrid_jax.modes import LayerKind
from pallas_kernels import gdn as gdn_kernels

__all__ = ["CheckpointLayout", "load_config", "load_qwen3_next", "model_rules", "save_checkpoint"]

MTP_MARKER = "mtp.fc.weight"  # a checkpoint with this tensor carries the MTP head


@dataclasses.dataclass(frozen=True)
class CheckpointLayout:
    """How a checkpoint family names the tensors of the same model: the text model's prefix
    (``model.``; ``model.language_model.`` in Qwen3.5's vision-language folders) and whether
    the GDN input projections are Qwen3.5's four matrices (``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``) rather than Qwen3-Next's two grouped per key head."""

    text_prefix: str = "model."
    split_gdn_projections: bool = False


def _gdn_projections(m: tuple, q: str, c: Qwen3NextConfig, split: bool) -> list[Rule]:
    """The GDN input projections. Ours are Qwen3.5's order (``layers.gdn``): its four
    matrices load as they are (``in_proj_b`` and ``in_proj_a`` side by side); Qwen3-Next's
    two, grouped per key head, are reordered into ours."""
    d, h = c.gdn_config().dims, c.hidden_size
    conv, heads = 2 * d.key_dim + d.value_dim, d.num_value_heads
    if split:
        return [
            linear((*m, "in_proj_qkv", "kernel"), f"{q}in_proj_qkv.weight", conv, h),
            linear((*m, "in_proj_z", "kernel"), f"{q}in_proj_z.weight", d.value_dim, h),
            Rule(
                (*m, "in_proj_ba", "kernel"),
                tuple((f"{q}in_proj_{x}.weight", (heads, h)) for x in "ba"),
                lambda a: jnp.concatenate([a[0].T, a[1].T], axis=1),
                lambda w: [w[:, :heads].T, w[:, heads:].T],
            ),  # fmt: skip
        ]
    qkv_cols, z_cols = grouped_qkvz_columns(d)
    ba_cols = grouped_ba_columns(d)

    def qkvz_to_hf(w):
        grouped = np.empty((h, conv + d.value_dim), w[0].dtype)
        grouped[:, qkv_cols], grouped[:, z_cols] = w
        return [grouped.T]

    def ba_to_hf(w):
        grouped = np.empty_like(w)
        grouped[:, ba_cols] = w
        return [grouped.T]

    return [
        Rule(
            (*m, "in_proj_qkv", "kernel"),
            ((f"{q}in_proj_qkvz.weight", (conv + d.value_dim, h)),),
            lambda a: (a[0].T[:, qkv_cols], a[0].T[:, z_cols]),
            qkvz_to_hf,
            also=((*m, "in_proj_z", "kernel"),),
        ),  # fmt: skip
        Rule(
            (*m, "in_proj_ba", "kernel"),
            ((f"{q}in_proj_ba.weight", (2 * heads, h)),),
            lambda a: a[0].T[:, ba_cols],
            ba_to_hf,
        ),  # fmt: skip
    ]


def _experts(target, names, out_dim, in_dim) -> Rule:
    """Per-expert ``[out, in]`` matrices stacked into ours ``[E, in, out]``."""
    return Rule(
        target,
        tuple((name, (out_dim, in_dim)) for name in names),
        lambda a: jnp.stack(a).transpose(0, 2, 1),
        lambda w: [m.T for m in w],
    )


def _gate_up_experts(target, experts: list[str], inter: int, hidden: int) -> Rule:
    """Per-expert ``gate_proj`` and ``up_proj`` ``[I, H]`` into ours ``[E, H, 2I]``."""
    names = [f"{x}{name}.weight" for name in ("gate_proj", "up_proj") for x in experts]
    e = len(experts)
    return Rule(
        target,
        tuple((name, (inter, hidden)) for name in names),
        # [E, 2I, H] (each expert's gate rows, then its up rows) -> [E, H, 2I].
        lambda a: jnp.concatenate([jnp.stack(a[:e]), jnp.stack(a[e:])], 1).transpose(0, 2, 1),
        lambda w: [m.T for m in w[..., :inter]] + [m.T for m in w[..., inter:]],
    )


def _fused_experts(p, target, c: Qwen3NextConfig) -> list[Rule]:
    """HF's in-memory layout: ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``."""
    e, i, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
    gate_up = (f"{p}mlp.experts.gate_up_proj", (e, 2 * i, h))
    return [
        Rule(
            (*target, "gate_up_proj"),
            (gate_up,),
            lambda a: a[0].transpose(0, 2, 1),
            lambda w: [w.transpose(0, 2, 1)],
        ),  # fmt: skip
        Rule(
            (*target, "down_proj"),
            ((f"{p}mlp.experts.down_proj", (e, h, i)),),
            lambda a: a[0].transpose(0, 2, 1),
            lambda w: [w.transpose(0, 2, 1)],
        ),  # fmt: skip
    ]


def _mlp(p: str, target: tuple, hidden: int, inter: int) -> list[Rule]:
    return [
        linear((*target, "gate_proj", "kernel"), f"{p}gate_proj.weight", inter, hidden),
        linear((*target, "up_proj", "kernel"), f"{p}up_proj.weight", inter, hidden),
        linear((*target, "down_proj", "kernel"), f"{p}down_proj.weight", hidden, inter),
    ]


def _layer_rules(
    c: Qwen3NextConfig,
    p: str,
    t: tuple,
    kind: LayerKind,
    moe: bool,
    fused: bool,
    layout: CheckpointLayout,
) -> Iterator[Rule]:
    """One decoder layer: checkpoint prefix ``p`` (``model.layers.3.``), model path ``t``."""
    h = c.hidden_size
    g, a = c.gdn_config(), c.attention_config()
    d = g.dims
    yield plain((*t, "input_layernorm", "weight"), f"{p}input_layernorm.weight", (h,))
    yield plain(
        (*t, "post_attention_layernorm", "weight"), f"{p}post_attention_layernorm.weight", (h,)
    )
    if kind is LayerKind.GDN:
        q, m = f"{p}linear_attn.", (*t, "linear_attn")
        yield from _gdn_projections(m, q, c, layout.split_gdn_projections)
        yield Rule(
            (*m, "conv_weight"), ((f"{q}conv1d.weight", (g.conv_dim, 1, g.conv_kernel)),),
            lambda x: x[0][:, 0, :], lambda w: [w[:, None, :]],
        )  # fmt: skip
        yield Rule(
            (*m, "gate_params"),
            ((f"{q}A_log", (d.num_value_heads,)), (f"{q}dt_bias", (d.num_value_heads,))),
            lambda x: gdn_kernels.stack_gate_params(*x), lambda w: [w[0], w[1]],
        )  # fmt: skip
        yield plain((*m, "norm", "weight"), f"{q}norm.weight", (d.head_v_dim,))
        yield linear((*m, "out_proj", "kernel"), f"{q}out_proj.weight", h, d.value_dim)
    else:
        q, m = f"{p}self_attn.", (*t, "self_attn")
        heads, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        for name, out_dim, in_dim in (
            ("q_proj", 2 * heads, h), ("k_proj", kv, h), ("v_proj", kv, h),
            ("o_proj", h, heads),
        ):  # fmt: skip
            yield linear((*m, name, "kernel"), f"{q}{name}.weight", out_dim, in_dim)
            if a.attention_bias:
                yield plain((*m, name, "bias"), f"{q}{name}.bias", (out_dim,))
        yield plain((*m, "q_norm", "weight"), f"{q}q_norm.weight", (a.head_dim,))
        yield plain((*m, "k_norm", "weight"), f"{q}k_norm.weight", (a.head_dim,))
    m = (*t, "mlp")
    if not moe:
        yield from _mlp(f"{p}mlp.", m, h, c.intermediate_size)
        return
    e, inter = c.num_experts, c.moe_intermediate_size
    yield linear((*m, "gate", "kernel"), f"{p}mlp.gate.weight", e, h)
    if fused:
        yield from _fused_experts(p, m, c)
    else:
        experts = [f"{p}mlp.experts.{j}." for j in range(e)]
        yield _gate_up_experts((*m, "gate_up_proj"), experts, inter, h)
        names = [f"{x}down_proj.weight" for x in experts]
        yield _experts((*m, "down_proj"), names, h, inter)
    s = c.shared_expert_intermediate_size
    yield from _mlp(f"{p}mlp.shared_expert.", (*m, "shared_expert"), h, s)
    yield linear((*m, "shared_expert_gate", "kernel"), f"{p}mlp.shared_expert_gate.weight",
                  1, h)  # fmt: skip


def model_rules(
    c: Qwen3NextConfig,
    fused_experts: Callable[[str], bool],
    layout: CheckpointLayout = CheckpointLayout(),
) -> Iterator[Rule]:
    """Every parameter of ``Qwen3Next(c)`` and the checkpoint tensors it comes from;
    ``fused_experts(prefix)``: whether the layer at ``prefix`` stores its experts fused."""
    h, text = c.hidden_size, layout.text_prefix
    yield plain(("embed_tokens", "embedding"), f"{text}embed_tokens.weight", (c.vocab_size, h))
    yield plain(("norm", "weight"), f"{text}norm.weight", (h,))
    if not c.tie_word_embeddings:
        yield linear(("lm_head", "kernel"), "lm_head.weight", c.vocab_size, h)
    for i, kind in enumerate(c.layer_kinds):
        p = f"{text}layers.{i}."
        moe, fused = c.is_moe_layer(i), fused_experts(p)
        yield from _layer_rules(c, p, ("layers", i), kind, moe, fused, layout)
    if not c.num_nextn_predict_layers:
        return
    yield linear(("mtp", "fc", "kernel"), "mtp.fc.weight", h, 2 * h)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        yield plain(("mtp", name, "weight"), f"mtp.{name}.weight", (h,))
    p = "mtp.layers.0."
    kind = LayerKind.FULL_ATTENTION
    yield from _layer_rules(
        c, p, ("mtp", "layers", 0), kind, c.mtp_is_moe, fused_experts(p), layout
    )


def load_config(folder: str | os.PathLike, *, dtype: str | None = None) -> Qwen3NextConfig:
    """The ``Qwen3NextConfig`` of a checkpoint folder's ``config.json``."""
    return read_config(folder, Qwen3NextConfig, dtype)


def load_qwen3_next(
    folder: str | os.PathLike,
    *,
    dtype: str | None = None,
    progress: bool = False,
    check_finite: bool = True,
    mesh: Mesh | None = None,
) -> Qwen3Next:
    """A ``Qwen3Next`` with the weights of a Hugging Face checkpoint folder (and its MTP head
    when the checkpoint has ``mtp.*`` tensors).

    ``dtype`` overrides the checkpoint's dtype for weights and activations (norm weights and
    the GDN decay parameters stay float32). Raises ``CheckpointError`` naming every missing
    or misshapen tensor before any weight is converted.
    """
    folder = pathlib.Path(folder)
    config = load_config(folder, dtype=dtype)
    weight_map = checkpoint_files(folder)
    has_mtp = MTP_MARKER in weight_map
    config = dataclasses.replace(config, num_nextn_predict_layers=int(has_mtp))
    rules = list(model_rules(config, lambda p: f"{p}mlp.experts.gate_up_proj" in weight_map))
    model = nnx.eval_shape(lambda: Qwen3Next(config, rngs=nnx.Rngs(0)))
    return load_weights(
        folder, model, rules, weight_map, progress=progress, check_finite=check_finite,
        mesh=mesh,
    )  # fmt: skip


def save_checkpoint(
    model: Qwen3Next, folder: str | os.PathLike, *, max_shard_bytes: int | None = None
) -> None:
    """Writes ``model`` as a Hugging Face checkpoint folder (config.json and safetensors,
    per-expert layout); with ``max_shard_bytes``, sharded with an index. ``model`` is a
    layer-by-layer model: one whose layers ``scan_layers`` stacked (an engine's
    ``engine.model`` after ``donate_weights``, its norms folded and its SwiGLU weights
    paired) is refused."""
    if any(isinstance(layer, ScannedRun) for layer in model.layers):
        raise ValueError(
            "save_checkpoint: the model's layers are stacked for running (layer_scan."
            "scan_layers; an engine's model with donate_weights=True, whose norm weights are "
            "folded and SwiGLU weights paired); save the layer-by-layer model before an "
            "engine takes it"
        )
    rules = model_rules(model.config, lambda p: False)
    config = model.config.to_hf_dict()
    write_checkpoint(pathlib.Path(folder), config, model, rules, max_shard_bytes)
