"""Hugging Face Nemotron-H checkpoint folders: load into ``NemotronH``.

A folder holds ``config.json`` and the weights (one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``), read with the helpers of ``loading.py``. Tensor names are
those of NVIDIA's checkpoints (``backbone.`` prefix, one tensor per expert) or of
transformers' in-memory layout (``model.`` prefix, experts stacked as ``mixer.experts.up_proj
[E, I, in]`` / ``down_proj [E, in, I]``); both are read. Linear weights are transposed (HF
``[out, in]``, ours ``[in, out]``), the conv weight loses its channel axis. All tensors are
checked against the config before any is converted; every missing or misshapen one is named in
one ``CheckpointError``. Tensors the model does not use (the multi-token-prediction head
``mtp.*``) are ignored.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from hybrid_jax.models.checkpoint import Rule, linear, load_weights, plain, read_config
from hybrid_jax.models.checkpoint import weight_map as checkpoint_files
from hybrid_jax.models.nemotron_h import NemotronH, NemotronHConfig

__all__ = ["load_nemotron_h", "load_nemotron_h_config"]


def _experts(target, p: str, name: str, shape: tuple[int, int], e: int, fused: bool) -> Rule:
    """Expert matrices ``[out, in]`` (one per expert, or stacked) into ours ``[E, in, out]``."""
    if fused:
        return Rule(
            target, ((f"{p}{name}", (e, *shape)),), lambda a: a[0].transpose(0, 2, 1),
            lambda w: [w.transpose(0, 2, 1)],
        )  # fmt: skip
    return Rule(
        target,
        tuple((f"{p}{j}.{name}.weight", shape) for j in range(e)),
        lambda a: jnp.stack(a).transpose(0, 2, 1),
        lambda w: [m.T for m in w],
    )


def _mlp(p: str, target: tuple, hidden: int, inter: int, bias: bool) -> Iterator[Rule]:
    yield linear((*target, "up_proj", "kernel"), f"{p}up_proj.weight", inter, hidden)
    yield linear((*target, "down_proj", "kernel"), f"{p}down_proj.weight", hidden, inter)
    if bias:
        yield plain((*target, "up_proj", "bias"), f"{p}up_proj.bias", (inter,))
        yield plain((*target, "down_proj", "bias"), f"{p}down_proj.bias", (hidden,))


def _rules(c: NemotronHConfig, prefix: str, fused: Callable[[str], bool]) -> Iterator[Rule]:
    """Every parameter of ``NemotronH(c)`` and the checkpoint tensors it comes from."""
    h = c.hidden_size
    yield plain(("embeddings", "embedding"), f"{prefix}embeddings.weight", (c.vocab_size, h))
    yield plain(("norm_f", "weight"), f"{prefix}norm_f.weight", (h,))
    yield linear(("lm_head", "kernel"), "lm_head.weight", c.vocab_size, h)
    m2, at = c.mamba2_config(), c.attention_config()
    for i, kind in enumerate(c.layers_block_type):
        p, t = f"{prefix}layers.{i}.", ("layers", i)
        yield plain((*t, "norm", "weight"), f"{p}norm.weight", (h,))
        q, m = f"{p}mixer.", (*t, "mixer")
        if kind == "linear_attention":
            proj = m2.inner_dim + m2.conv_dim + m2.num_heads
            yield linear((*m, "in_proj", "kernel"), f"{q}in_proj.weight", proj, h)
            yield linear((*m, "out_proj", "kernel"), f"{q}out_proj.weight", h, m2.inner_dim)
            if m2.use_bias:
                yield plain((*m, "in_proj", "bias"), f"{q}in_proj.bias", (proj,))
                yield plain((*m, "out_proj", "bias"), f"{q}out_proj.bias", (h,))
            yield Rule(
                (*m, "conv_weight"), ((f"{q}conv1d.weight", (m2.conv_dim, 1, m2.conv_kernel)),),
                lambda x: x[0][:, 0, :], lambda w: [w[:, None, :]],
            )  # fmt: skip
            if m2.use_conv_bias:
                yield plain((*m, "conv_bias"), f"{q}conv1d.bias", (m2.conv_dim,))
            for name in ("dt_bias", "A_log", "D"):
                yield plain((*m, name), f"{q}{name}", (m2.num_heads,))
            yield plain((*m, "norm", "weight"), f"{q}norm.weight", (m2.inner_dim,))
        elif kind == "full_attention":
            heads, kv = at.num_heads * at.head_dim, at.num_kv_heads * at.head_dim
            for name, out_dim, in_dim in (
                ("q_proj", heads, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, heads),
            ):  # fmt: skip
                yield linear((*m, name, "kernel"), f"{q}{name}.weight", out_dim, in_dim)
        elif kind == "mlp":
            yield from _mlp(q, m, h, c.intermediate_size, c.mlp_bias)
        else:
            moe = c.moe_config()
            e, inter, w = moe.num_experts, moe.intermediate_size, moe.expert_width
            yield linear((*m, "gate", "kernel"), f"{q}gate.weight", e, h)
            yield plain((*m, "e_score_correction_bias"), f"{q}gate.e_score_correction_bias", (e,))
            stacked = fused(q)
            x = f"{q}experts."
            yield _experts((*m, "up_proj"), x, "up_proj", (inter, w), e, stacked)
            yield _experts((*m, "down_proj"), x, "down_proj", (w, inter), e, stacked)
            yield from _mlp(f"{q}shared_experts.", (*m, "shared_experts"), h,
                            moe.shared_intermediate_size, c.mlp_bias)  # fmt: skip
            if moe.latent_size is not None:
                latent = moe.latent_size
                for name, out_dim, in_dim in (
                    ("fc1_latent_proj", latent, h), ("fc2_latent_proj", h, latent),
                ):  # fmt: skip
                    yield linear((*m, name, "kernel"), f"{q}{name}.weight", out_dim, in_dim)
                    if c.mlp_bias:
                        yield plain((*m, name, "bias"), f"{q}{name}.bias", (out_dim,))


def load_nemotron_h_config(
    folder: str | pathlib.Path, *, dtype: str | None = None
) -> NemotronHConfig:
    """The ``NemotronHConfig`` of a checkpoint folder's ``config.json``."""
    return read_config(folder, NemotronHConfig, dtype)


def _prefix(names: set[str]) -> str:
    """``backbone.`` (NVIDIA's checkpoints) or ``model.`` (transformers' layout)."""
    return "backbone." if any(n.startswith("backbone.") for n in names) else "model."


def load_nemotron_h(
    folder: str | pathlib.Path,
    *,
    dtype: str | None = None,
    progress: bool = False,
    check_finite: bool = True,
    mesh: Mesh | None = None,
) -> NemotronH:
    """A ``NemotronH`` with the weights of a Hugging Face checkpoint folder.

    ``dtype`` overrides the checkpoint's dtype for weights and activations (the Mamba2 decay
    parameters and the MoE router stay float32). Raises ``CheckpointError`` naming every
    missing or misshapen tensor before any weight is converted, and ``ConfigError`` for a
    config.json this implementation cannot build.
    """
    folder = pathlib.Path(folder)
    config = load_nemotron_h_config(folder, dtype=dtype)
    weight_map = checkpoint_files(folder)
    prefix = _prefix(set(weight_map))
    rules = list(_rules(config, prefix, lambda q: f"{q}experts.up_proj" in weight_map))
    model = nnx.eval_shape(lambda: NemotronH(config, rngs=nnx.Rngs(0)))
    return load_weights(
        folder, model, rules, weight_map, progress=progress, check_finite=check_finite,
        mesh=mesh,
    )  # fmt: skip
