"""Hugging Face Qwen3-Next checkpoint folders: load into ``Qwen3Next``, and save from it.

A folder holds ``config.json`` and the weights, either one ``model.safetensors`` or shards
listed by ``model.safetensors.index.json`` (``{"weight_map": {tensor: file}}``);
``tokenizer.json`` is read separately (``tokenizer.load_tokenizer``). Every model parameter
comes from one or more named tensors through a fixed rule (``_rules``): linear weights are
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
import json
import os
import pathlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.models.qwen3_next import Qwen3Next, Qwen3NextConfig
from hybrid_jax.models.safetensors_io import (
    SafetensorsError,
    read_header,
    read_tensors,
    write_tensors,
)
from hybrid_jax.modes import LayerKind

__all__ = ["CheckpointError", "load_config", "load_qwen3_next", "save_checkpoint"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MTP_MARKER = "mtp.fc.weight"  # a checkpoint with this tensor carries the MTP head


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded: missing files, tensors or shapes."""


@dataclasses.dataclass(frozen=True)
class _Rule:
    """Parameter ``target`` (attribute path in the model) from HF tensors ``sources``."""

    target: tuple[str | int, ...]
    sources: tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) in the checkpoint
    to_ours: Callable[[Sequence[np.ndarray]], np.ndarray]
    to_hf: Callable[[np.ndarray], list[np.ndarray]]


def _plain(target, name, shape) -> _Rule:
    return _Rule(target, ((name, shape),), lambda a: a[0], lambda w: [w])


def _linear(target, name, out_dim, in_dim) -> _Rule:
    return _Rule(target, ((name, (out_dim, in_dim)),), lambda a: a[0].T, lambda w: [w.T])


def _experts(target, names, out_dim, in_dim) -> _Rule:
    """Per-expert ``[out, in]`` matrices stacked into ours ``[E, in, out]``."""
    return _Rule(
        target,
        tuple((name, (out_dim, in_dim)) for name in names),
        lambda a: np.stack([m.T for m in a]),
        lambda w: [m.T for m in w],
    )


def _fused_experts(p, target, c: Qwen3NextConfig) -> list[_Rule]:
    """HF's in-memory layout: ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``."""
    e, i, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
    gate_up = (f"{p}mlp.experts.gate_up_proj", (e, 2 * i, h))
    return [
        _Rule(
            (*target, "gate_proj"),
            (gate_up,),
            lambda a: a[0][:, :i].transpose(0, 2, 1),
            lambda w: [w.transpose(0, 2, 1)],
        ),  # fmt: skip
        _Rule(
            (*target, "up_proj"),
            (gate_up,),
            lambda a: a[0][:, i:].transpose(0, 2, 1),
            lambda w: [w.transpose(0, 2, 1)],
        ),  # fmt: skip
        _Rule(
            (*target, "down_proj"),
            ((f"{p}mlp.experts.down_proj", (e, h, i)),),
            lambda a: a[0].transpose(0, 2, 1),
            lambda w: [w.transpose(0, 2, 1)],
        ),  # fmt: skip
    ]


def _mlp(p: str, target: tuple, hidden: int, inter: int) -> list[_Rule]:
    return [
        _linear((*target, "gate_proj", "kernel"), f"{p}gate_proj.weight", inter, hidden),
        _linear((*target, "up_proj", "kernel"), f"{p}up_proj.weight", inter, hidden),
        _linear((*target, "down_proj", "kernel"), f"{p}down_proj.weight", hidden, inter),
    ]


def _layer_rules(
    c: Qwen3NextConfig, p: str, t: tuple, kind: LayerKind, moe: bool, fused: bool
) -> Iterator[_Rule]:
    """One decoder layer: checkpoint prefix ``p`` (``model.layers.3.``), model path ``t``."""
    h = c.hidden_size
    g, a = c.gdn_config(), c.attention_config()
    d = g.dims
    yield _plain((*t, "input_layernorm", "weight"), f"{p}input_layernorm.weight", (h,))
    yield _plain(
        (*t, "post_attention_layernorm", "weight"), f"{p}post_attention_layernorm.weight", (h,)
    )
    if kind is LayerKind.GDN:
        q, m = f"{p}linear_attn.", (*t, "linear_attn")
        qkvz = 2 * d.key_dim + 2 * d.value_dim
        yield _linear((*m, "in_proj_qkvz", "kernel"), f"{q}in_proj_qkvz.weight", qkvz, h)
        yield _linear((*m, "in_proj_ba", "kernel"), f"{q}in_proj_ba.weight",
                      2 * d.num_value_heads, h)  # fmt: skip
        yield _Rule(
            (*m, "conv_weight"), ((f"{q}conv1d.weight", (g.conv_dim, 1, g.conv_kernel)),),
            lambda x: x[0][:, 0, :], lambda w: [w[:, None, :]],
        )  # fmt: skip
        yield _plain((*m, "dt_bias"), f"{q}dt_bias", (d.num_value_heads,))
        yield _plain((*m, "A_log"), f"{q}A_log", (d.num_value_heads,))
        yield _plain((*m, "norm", "weight"), f"{q}norm.weight", (d.head_v_dim,))
        yield _linear((*m, "out_proj", "kernel"), f"{q}out_proj.weight", h, d.value_dim)
    else:
        q, m = f"{p}self_attn.", (*t, "self_attn")
        heads, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        for name, out_dim, in_dim in (
            ("q_proj", 2 * heads, h), ("k_proj", kv, h), ("v_proj", kv, h),
            ("o_proj", h, heads),
        ):  # fmt: skip
            yield _linear((*m, name, "kernel"), f"{q}{name}.weight", out_dim, in_dim)
            if a.attention_bias:
                yield _plain((*m, name, "bias"), f"{q}{name}.bias", (out_dim,))
        yield _plain((*m, "q_norm", "weight"), f"{q}q_norm.weight", (a.head_dim,))
        yield _plain((*m, "k_norm", "weight"), f"{q}k_norm.weight", (a.head_dim,))
    m = (*t, "mlp")
    if not moe:
        yield from _mlp(f"{p}mlp.", m, h, c.intermediate_size)
        return
    e, inter = c.num_experts, c.moe_intermediate_size
    yield _linear((*m, "gate", "kernel"), f"{p}mlp.gate.weight", e, h)
    if fused:
        yield from _fused_experts(p, m, c)
    else:
        experts = [f"{p}mlp.experts.{j}." for j in range(e)]
        for name, out_dim, in_dim in (
            ("gate_proj", inter, h), ("up_proj", inter, h), ("down_proj", h, inter),
        ):  # fmt: skip
            names = [f"{x}{name}.weight" for x in experts]
            yield _experts((*m, name), names, out_dim, in_dim)
    s = c.shared_expert_intermediate_size
    yield from _mlp(f"{p}mlp.shared_expert.", (*m, "shared_expert"), h, s)
    yield _linear((*m, "shared_expert_gate", "kernel"), f"{p}mlp.shared_expert_gate.weight",
                  1, h)  # fmt: skip


def _rules(c: Qwen3NextConfig, fused_experts: Callable[[str], bool]) -> Iterator[_Rule]:
    """Every parameter of ``Qwen3Next(c)`` and the checkpoint tensors it comes from."""
    h = c.hidden_size
    yield _plain(("embed_tokens", "embedding"), "model.embed_tokens.weight", (c.vocab_size, h))
    yield _plain(("norm", "weight"), "model.norm.weight", (h,))
    if not c.tie_word_embeddings:
        yield _linear(("lm_head", "kernel"), "lm_head.weight", c.vocab_size, h)
    for i, kind in enumerate(c.layer_kinds):
        p = f"model.layers.{i}."
        yield from _layer_rules(c, p, ("layers", i), kind, c.is_moe_layer(i), fused_experts(p))
    if not c.num_nextn_predict_layers:
        return
    yield _linear(("mtp", "fc", "kernel"), "mtp.fc.weight", h, 2 * h)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        yield _plain(("mtp", name, "weight"), f"mtp.{name}.weight", (h,))
    p = "mtp.layers.0."
    yield from _layer_rules(
        c, p, ("mtp", "layers", 0), LayerKind.FULL_ATTENTION, c.mtp_is_moe, fused_experts(p)
    )


def _param(model: nnx.Module, path: tuple[str | int, ...]) -> nnx.Variable:
    node = model
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def load_config(folder: str | os.PathLike, *, dtype: str | None = None) -> Qwen3NextConfig:
    """The ``Qwen3NextConfig`` of a checkpoint folder's ``config.json``."""
    path = pathlib.Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; a checkpoint folder needs its config.json")
    try:
        return Qwen3NextConfig.from_json(path, dtype=dtype)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err


def _weight_map(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> the file that holds it."""
    index = folder / INDEX
    if index.is_file():
        try:
            names = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} has no readable 'weight_map': {err}") from err
        files = {file: folder / file for file in set(names.values())}
        for file, path in files.items():
            if not path.is_file():
                raise CheckpointError(f"{index} lists {file}, which is not in {folder}")
        return {name: files[file] for name, file in names.items()}
    single = folder / SINGLE
    if not single.is_file():
        raise CheckpointError(
            f"{folder} has neither {INDEX} nor {SINGLE}; a checkpoint folder needs its weights"
        )
    try:
        header, _ = read_header(single)
    except SafetensorsError as err:
        raise CheckpointError(str(err)) from err
    return dict.fromkeys(header, single)


def _read(weight_map: Mapping[str, pathlib.Path], names: set[str]) -> dict[str, np.ndarray]:
    """The tensors ``names``, reading each file once; every file's header is checked."""
    out = {}
    for path in sorted({weight_map[n] for n in names}):
        try:
            tensors = read_tensors(path)
        except SafetensorsError as err:
            raise CheckpointError(str(err)) from err
        for name in names:
            if weight_map[name] == path:
                if name not in tensors:
                    raise CheckpointError(
                        f"the index places {name} in {path.name}, but that file lacks it"
                    )
                out[name] = tensors[name]
    return out


def load_qwen3_next(folder: str | os.PathLike, *, dtype: str | None = None) -> Qwen3Next:
    """A ``Qwen3Next`` with the weights of a Hugging Face checkpoint folder (and its MTP head
    when the checkpoint has ``mtp.*`` tensors).

    ``dtype`` overrides the checkpoint's dtype for weights and activations (norm weights and
    the GDN decay parameters stay float32). Raises ``CheckpointError`` naming every missing
    or misshapen tensor before any weight is converted.
    """
    folder = pathlib.Path(folder)
    config = load_config(folder, dtype=dtype)
    weight_map = _weight_map(folder)
    has_mtp = MTP_MARKER in weight_map
    config = dataclasses.replace(config, num_nextn_predict_layers=int(has_mtp))
    rules = list(_rules(config, lambda p: f"{p}mlp.experts.gate_up_proj" in weight_map))
    needed = {name for rule in rules for name, _ in rule.sources}
    missing = sorted(needed - set(weight_map))
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointError(
            f"{folder} lacks {len(missing)} tensors the config requires: {shown}; the "
            f"checkpoint does not match its config.json (or is incomplete)"
        )
    tensors = _read(weight_map, needed)
    wrong = [
        f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}"
        for rule in rules
        for name, shape in rule.sources
        if tuple(tensors[name].shape) != shape
    ]
    if wrong:
        raise CheckpointError(
            f"{folder}: {len(dict.fromkeys(wrong))} tensors do not match config.json: "
            + "; ".join(list(dict.fromkeys(wrong))[:5])
        )
    model = nnx.eval_shape(lambda: Qwen3Next(config, rngs=nnx.Rngs(0)))
    for rule in rules:
        param = _param(model, rule.target)
        value = rule.to_ours([tensors[name] for name, _ in rule.sources])
        param.set_value(jnp.asarray(np.asarray(value), param.get_value().dtype))
    return model


def save_checkpoint(
    model: Qwen3Next, folder: str | os.PathLike, *, max_shard_bytes: int | None = None
) -> None:
    """Writes ``model`` as a Hugging Face checkpoint folder (config.json and safetensors,
    per-expert layout); with ``max_shard_bytes``, sharded with an index."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    tensors: dict[str, np.ndarray] = {}
    for rule in _rules(config, lambda p: False):
        value = np.asarray(_param(model, rule.target).get_value())
        for (name, _), array in zip(rule.sources, rule.to_hf(value), strict=True):
            tensors[name] = array
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    if max_shard_bytes is None:
        write_tensors(folder / SINGLE, tensors)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        write_tensors(folder / file, shard)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(a.nbytes for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
