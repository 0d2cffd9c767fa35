"""Hugging Face checkpoint folders, whatever the model: their files, the rules that map
checkpoint tensors to a model's parameters, and the checked load and the sharded save.

A folder holds ``config.json`` and the weights, either one ``model.safetensors`` or shards
listed by ``model.safetensors.index.json`` (``{"weight_map": {tensor: file}}``). Every model
parameter comes from one or more named tensors through a ``Rule``; ``load_weights`` checks
every tensor the rules name against its expected shape before any is converted, and names
every missing or misshapen one in one ``CheckpointError``. The model loaders
(``qwen3_next_loading``, ``nemotron_h_loading``) give the rules.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from hybrid_jax.models.safetensors_io import (
    SafetensorsError,
    read_header,
    read_tensors,
    write_tensors,
)
from hybrid_jax.parallel import Placement
from hybrid_jax.progress import Progress

__all__ = [
    "CheckpointError",
    "Rule",
    "linear",
    "load_weights",
    "param_at",
    "plain",
    "read",
    "read_config",
    "resolve_checkpoint",
    "weight_map",
    "write_checkpoint",
]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded: missing files, tensors or shapes."""


def _hub_caches() -> list[pathlib.Path]:
    """Where the Hugging Face hub keeps downloads: ``HF_HUB_CACHE``, else ``HF_HOME/hub``,
    else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return [pathlib.Path(os.environ["HF_HUB_CACHE"]).expanduser()]
    home = os.environ.get("HF_HOME", os.path.join("~", ".cache", "huggingface"))
    return [pathlib.Path(home).expanduser() / "hub"]


def resolve_checkpoint(name: str | os.PathLike) -> pathlib.Path:
    """The folder of checkpoint ``name``: a folder as it is, or a Hugging Face id
    (``org/model``) found in the local hub cache (the snapshot ``refs/main`` names, else the
    newest one). Nothing is downloaded: an id not in the cache raises ``CheckpointError``
    saying where it looked."""
    path = pathlib.Path(name).expanduser()
    if path.exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", str(name)):
        return path
    org, model = str(name).split("/")
    caches = _hub_caches()
    for cache in caches:
        repo = cache / f"models--{org}--{model}"
        ref = repo / "refs" / "main"
        snapshots = repo / "snapshots"
        if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
            return snapshots / ref.read_text().strip()
        found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1].parent
    raise CheckpointError(
        f"{name} is not a folder here and has no snapshot in the local Hugging Face cache "
        f"({', '.join(str(c) for c in caches)}); download it first (huggingface-cli download "
        f"{name}) or pass its folder"
    )


@dataclasses.dataclass(frozen=True)
class Rule:
    """Parameter ``target`` (attribute path in the model) from HF tensors ``sources``.

    ``also``: further parameters filled from the same tensors (one tensor split into
    several of ours); ``to_ours`` then returns one array per target (``target`` first) and
    ``to_hf`` takes them in that order.
    """

    target: tuple[str | int, ...]
    sources: tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) in the checkpoint
    to_ours: Callable[[Sequence[jax.Array]], Any]  # in jnp: it runs where the tensors are
    to_hf: Callable[[Any], list[np.ndarray]]
    also: tuple[tuple[str | int, ...], ...] = ()

    @property
    def targets(self) -> tuple[tuple[str | int, ...], ...]:
        return (self.target, *self.also)

    def ours(self, tensors: Sequence[jax.Array]) -> list[jax.Array]:
        """One array per target, from the source tensors."""
        values = self.to_ours(tensors)
        return list(values) if self.also else [values]

    def hf(self, values: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The source tensors, from one array per target."""
        return self.to_hf(list(values) if self.also else values[0])


def read_config[C](folder: str | pathlib.Path, config_cls: type[C], dtype: str | None) -> C:
    """``config_cls.from_json`` of the folder's ``config.json``, with the folder's faults
    (no file, not JSON) as ``CheckpointError``."""
    path = pathlib.Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; a checkpoint folder needs its config.json")
    try:
        return config_cls.from_json(path, dtype=dtype)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err


def plain(target, name, shape) -> Rule:
    """A parameter stored as it is."""
    return Rule(target, ((name, shape),), lambda a: a[0], lambda w: [w])


def linear(target, name, out_dim, in_dim) -> Rule:
    """A linear weight: HF ``[out, in]``, ours ``[in, out]``."""
    return Rule(target, ((name, (out_dim, in_dim)),), lambda a: a[0].T, lambda w: [w.T])


def param_at(model: nnx.Module, path: tuple[str | int, ...]) -> nnx.Variable:
    node = model
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def weight_map(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> the file that holds it."""
    index = folder / INDEX
    if index.is_file():
        try:
            names = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} has no readable 'weight_map': {err}") from err
        if not isinstance(names, dict) or not all(isinstance(f, str) for f in names.values()):
            raise CheckpointError(
                f"{index}: weight_map must map tensor names to file names, got "
                f"{type(names).__name__}"
            )
        files = {file: folder / file for file in set(names.values())}
        root = folder.resolve()
        for file, path in files.items():
            if path.resolve().parent != root:
                raise CheckpointError(
                    f"{index} lists {file!r}, outside {folder}; every shard must be a file of "
                    f"the checkpoint folder itself"
                )
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


def read(weight_map: Mapping[str, pathlib.Path], names: set[str]) -> dict[str, np.ndarray]:
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


@jax.jit
def _all_finite(array: jax.Array) -> jax.Array:
    """Whether every entry of ``array`` is finite, as one fused reduction on its device (no
    boolean copy of the array; one dispatch)."""
    return jnp.isfinite(array).all()


def load_weights(
    folder: pathlib.Path,
    model: nnx.Module,
    rules: Iterable[Rule],
    tensor_files: Mapping[str, pathlib.Path],
    *,
    progress: bool = False,
    check_finite: bool = True,
    mesh: Mesh | None = None,
) -> nnx.Module:
    """Sets every parameter of ``model`` (an abstract one, from ``nnx.eval_shape``) from its
    rule's tensors, after checking that every tensor exists with its expected shape and a
    floating dtype. Each tensor goes to the device once, as stored, from the memory-mapped
    file, and becomes ours (layout, dtype) there (``progress``: a bar on stderr, one step per
    parameter); with ``mesh``, each device gets only its slice (``parallel.Placement``: the
    model is then ready for a tensor-parallel engine on that mesh). ``check_finite``: then
    refuses parameters holding inf or NaN (as stored, or after the cast to the model's dtype),
    naming their tensors."""
    rules = list(rules)
    needed = {name for rule in rules for name, _ in rule.sources}
    missing = sorted(needed - set(tensor_files))
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointError(
            f"{folder} lacks {len(missing)} tensors the config requires: {shown}; the "
            f"checkpoint does not match its config.json (or is incomplete)"
        )
    tensors = read(tensor_files, needed)
    wrong = list(
        dict.fromkeys(
            f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}"
            for rule in rules
            for name, shape in rule.sources
            if tuple(tensors[name].shape) != shape
        )
    )
    if wrong:
        raise CheckpointError(
            f"{folder}: {len(wrong)} tensors do not match config.json: " + "; ".join(wrong[:5])
        )
    not_float = list(
        dict.fromkeys(
            f"{name} ({tensors[name].dtype})"
            for rule in rules
            for name, _ in rule.sources
            if not jnp.issubdtype(tensors[name].dtype, jnp.floating)
        )
    )
    if not_float:
        raise CheckpointError(
            f"{folder}: {len(not_float)} tensors are not floating point where weights belong: "
            + ", ".join(not_float[:5])
            + "; the checkpoint is corrupt or not this model's"
        )
    placement = None if mesh is None else Placement(model, mesh)
    bar = Progress(len(rules), progress, doing="loading", done="loaded", items="parameters")
    placed = []
    for rule in rules:
        sources = [tensors[name] for name, _ in rule.sources]
        if placement is None:
            # Each tensor goes to the device as stored, straight from its file's pages; the
            # layout change (transposes, expert stacks) and the cast run there, where they
            # are a copy at the device's bandwidth instead of a strided one on the host.
            values = rule.ours([jax.device_put(tensor) for tensor in sources])
        else:
            # On a mesh no device holds a whole tensor: the layout changes on the host, and
            # each device gets its slice of the result.
            with jax.default_device(jax.devices("cpu")[0]):
                values = rule.ours(sources)
        for target, value in zip(rule.targets, values, strict=True):
            param = param_at(model, target)
            dtype = param.get_value().dtype
            if placement is None:
                array = jnp.asarray(value, dtype)
            else:
                array = placement.place(target, np.asarray(value).astype(dtype))
            param.set_value(array)
            placed.append((rule, array))
        bar(".".join(map(str, rule.target))[-24:])
    if not check_finite:
        return model
    # Checked after the loop, so that no check stands between one transfer and the next.
    finite = [_all_finite(array) for _, array in placed]
    flags = jax.device_get(finite)  # one read-back for every parameter
    bad = [rule for (rule, _), ok in zip(placed, flags, strict=True) if not ok]
    if bad:
        names = list(dict.fromkeys(name for rule in bad for name, _ in rule.sources))
        raise CheckpointError(
            f"{folder}: {len(names)} tensors hold inf or NaN: {', '.join(names[:5])}"
            + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            + "; the checkpoint is corrupt (check_finite=False skips this check)"
        )
    return model


def write_checkpoint(
    folder: pathlib.Path,
    config: Mapping[str, object],
    model: nnx.Module,
    rules: Iterable[Rule],
    max_shard_bytes: int | None,
) -> None:
    """Writes ``config.json`` and the rules' tensors of ``model`` (one file, or shards of at
    most ``max_shard_bytes`` with an index)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for rule in rules:
        values = [np.asarray(param_at(model, t).get_value()) for t in rule.targets]
        for (name, _), array in zip(rule.sources, rule.hf(values), strict=True):
            tensors[name] = array
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
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
    index_map = {}
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        write_tensors(folder / file, shard)
        index_map.update(dict.fromkeys(shard, file))
    total = sum(a.nbytes for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": index_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
