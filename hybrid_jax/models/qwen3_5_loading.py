"""Hugging Face Qwen3.5 / Qwen3.6 checkpoint folders (``qwen3_5``, ``qwen3_5_moe`` and their
text-only ``*_text`` kinds), loaded into ``Qwen3Next``: the same computation.

Qwen3.5's text model is Qwen3-Next's: the same GDN layers (conv, gating, delta rule, gated
norm), gated attention with partial rotary, zero-centred norms, the MoE with a sigmoid-gated
shared expert and renormalised top-k. What differs is naming and layout, which this loader
translates once, at load time:

* the text config is nested under ``text_config`` in the vision-language folders (tying
  comes from the top level), with the text weights under ``model.language_model.*``; the
  vision tower's ``model.visual.*`` tensors are not read (text only: a prompt holding the
  image or video placeholder ids is refused by the engine, ``Qwen3NextConfig.
  vision_token_ids``);
* GDN input projections are four matrices (``in_proj_qkv`` ``[Q | K | V]``, ``in_proj_z``,
  ``in_proj_b``, ``in_proj_a``), regrouped per key head into ours;
* rotary is multi-section (``mrope_section``): for text, all three position ids are equal,
  which is exactly the partial rotary Qwen3-Next uses;
* dense models have a dense MLP in every layer, MoE models a sparse block in every layer,
  experts fused (``experts.gate_up_proj`` ``[E, 2I, H]``) or per expert;
* ``mtp.*`` tensors, when present, are the multi-token-prediction head, loaded as Qwen3-Next's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from hybrid_jax.layers.gdn import STATE_DTYPES
from hybrid_jax.models.checkpoint import CheckpointError, load_weights
from hybrid_jax.models.checkpoint import weight_map as checkpoint_files
from hybrid_jax.models.hf_config import ConfigError, hf_eos_token_ids, read_config_json
from hybrid_jax.models.qwen3_next import Qwen3Next, Qwen3NextConfig
from hybrid_jax.models.qwen3_next_loading import MTP_MARKER, CheckpointLayout, model_rules

__all__ = ["MODEL_TYPES", "load_qwen3_5", "qwen3_5_config"]

log = logging.getLogger(__name__)

MODEL_TYPES: dict[str, tuple[bool, bool]] = {
    "qwen3_5": (False, True),
    "qwen3_5_moe": (True, True),
    "qwen3_5_text": (False, False),
    "qwen3_5_moe_text": (True, False),
}
"""model_type -> (MoE, vision-language folder with the text config nested)."""

_COMMON_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim",
)  # fmt: skip
_MOE_FIELDS = (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size",
)  # fmt: skip
_VISION_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id")


def qwen3_5_config(raw: Mapping[str, Any], *, dtype: str | None = None) -> Qwen3NextConfig:
    """The ``Qwen3NextConfig`` of a Qwen3.5 ``config.json`` (as a dict); raises
    ``ConfigError`` naming the field (``text_config.<field>`` when nested)."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"model_type={model_type!r} is not a Qwen3.5 model type ({', '.join(MODEL_TYPES)})"
        )
    moe, nested = MODEL_TYPES[model_type]
    where = "text_config." if nested else ""
    text = raw.get("text_config") if nested else raw
    if not isinstance(text, Mapping):
        raise ConfigError(
            f"config.json of model_type={model_type!r} lacks text_config, the text model's "
            f"fields (a vision-language folder nests them there)"
        )
    required = _COMMON_FIELDS + (_MOE_FIELDS if moe else ("intermediate_size",))
    missing = [f"{where}{name}" for name in required if name not in text]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}")
    ssm_dtype = text.get("mamba_ssm_dtype", raw.get("mamba_ssm_dtype", "float32"))
    if ssm_dtype not in STATE_DTYPES:
        raise ConfigError(
            f"{where}mamba_ssm_dtype={ssm_dtype!r}: the GDN states are kept at one of "
            f"{list(STATE_DTYPES)}"
        )
    mtp_layers = text.get("mtp_num_hidden_layers", 1)
    if mtp_layers not in (0, 1):
        raise ConfigError(
            f"{where}mtp_num_hidden_layers={mtp_layers}: the multi-token-prediction head is "
            f"one layer (1) or none (0) here"
        )
    hf = {key: value for key, value in text.items() if key != "model_type"}
    hf["model_type"] = "qwen3_next"
    tie_source = raw if nested else text
    hf["tie_word_embeddings"] = bool(tie_source.get("tie_word_embeddings", False))
    hf["eos_token_id"] = list(hf_eos_token_ids(text) or hf_eos_token_ids(raw)) or None
    hf["dtype"] = text.get("dtype") or raw.get("dtype") or raw.get("torch_dtype")
    hf["mamba_ssm_dtype"] = ssm_dtype
    if moe:
        # Every layer is sparse and the router always renormalises its top-k.
        hf.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        hf.setdefault("intermediate_size", 0)
    else:
        hf["num_experts"] = 0
    hf["num_nextn_predict_layers"] = 0  # set by the loader from the tensors present
    config = Qwen3NextConfig.from_hf_dict(hf, dtype=dtype)
    vision = tuple(int(raw[key]) for key in _VISION_TOKENS if raw.get(key) is not None)
    return dataclasses.replace(config, vision_token_ids=vision if nested else ())


def load_qwen3_5(
    folder: str | os.PathLike,
    *,
    dtype: str | None = None,
    progress: bool = False,
    check_finite: bool = True,
    mesh: Mesh | None = None,
) -> Qwen3Next:
    """A ``Qwen3Next`` with the text weights of a Qwen3.5 checkpoint folder (its MTP head
    when ``mtp.*`` tensors are present); raises ``CheckpointError`` naming every missing or
    misshapen tensor, ``ConfigError`` naming a config field, before any weight is converted."""
    folder = pathlib.Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; a checkpoint folder needs its config.json")
    raw = read_config_json(path)
    config = qwen3_5_config(raw, dtype=dtype)
    nested = MODEL_TYPES[raw["model_type"]][1]
    layout = CheckpointLayout(
        text_prefix="model.language_model." if nested else "model.", split_gdn_projections=True
    )
    weight_map = checkpoint_files(folder)
    vision = [name for name in weight_map if name.startswith("model.visual.")]
    if vision:
        log.info(
            "%s: %d vision-tower tensors (model.visual.*) are not loaded; the text model is "
            "served, without image or video input", folder, len(vision)
        )  # fmt: skip
    config = dataclasses.replace(config, num_nextn_predict_layers=int(MTP_MARKER in weight_map))
    rules = list(
        model_rules(config, lambda p: f"{p}mlp.experts.gate_up_proj" in weight_map, layout)
    )
    model = nnx.eval_shape(lambda: Qwen3Next(config, rngs=nnx.Rngs(0)))
    return load_weights(
        folder, model, rules, weight_map, progress=progress, check_finite=check_finite,
        mesh=mesh,
    )  # fmt: skip
