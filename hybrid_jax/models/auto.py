"""Loads any supported Hugging Face checkpoint folder by its config.json's ``model_type``."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable

from flax import nnx
from jax.sharding import Mesh

from hybrid_jax.models.checkpoint import CheckpointError
from hybrid_jax.models.nemotron_h_loading import load_nemotron_h
from hybrid_jax.models.qwen3_5_loading import MODEL_TYPES as QWEN3_5_TYPES
from hybrid_jax.models.qwen3_5_loading import load_qwen3_5
from hybrid_jax.models.qwen3_next_loading import load_qwen3_next

__all__ = ["MODEL_LOADERS", "load_checkpoint"]

MODEL_LOADERS: dict[str, Callable[..., nnx.Module]] = {
    "qwen3_next": load_qwen3_next,
    "nemotron_h": load_nemotron_h,
    **dict.fromkeys(QWEN3_5_TYPES, load_qwen3_5),
}
"""config.json ``model_type`` -> the loader that builds that model."""


def load_checkpoint(
    folder: str | os.PathLike,
    *,
    dtype: str | None = None,
    progress: bool = False,
    check_finite: bool = True,
    mesh: Mesh | None = None,
) -> nnx.Module:
    """The model of a checkpoint folder, chosen by the ``model_type`` of its config.json;
    ``progress`` draws a bar on stderr while the weights load; ``check_finite`` refuses a
    weight holding inf or NaN (one reduction per tensor on the device; turn it off for a
    huge trusted checkpoint); ``mesh``: each weight goes to the devices of tensor parallelism
    as slices (``parallel.Placement``), never whole onto one."""
    path = pathlib.Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; a checkpoint folder needs its config.json")
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err
    if model_type not in MODEL_LOADERS:
        raise CheckpointError(
            f"{path}: model_type={model_type!r} is not served here; supported: "
            f"{', '.join(sorted(MODEL_LOADERS))}"
        )
    return MODEL_LOADERS[model_type](
        folder, dtype=dtype, progress=progress, check_finite=check_finite, mesh=mesh
    )
