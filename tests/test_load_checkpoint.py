"""``load_checkpoint`` picks the model by config.json's model_type and names what it refuses."""

import json
import os
import pathlib
import re
import shutil

import pytest

from hybrid_jax.models.auto import MODEL_LOADERS, load_checkpoint
from hybrid_jax.models.checkpoint import CheckpointError, resolve_checkpoint
from hybrid_jax.models.nemotron_h import NemotronH
from hybrid_jax.models.qwen3_next import Qwen3Next

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.mark.parametrize(
    ("folder", "model_class"),
    [(FIXTURES / "qwen3_next" / "moe", Qwen3Next), (FIXTURES / "nemotron_h" / "hybrid", NemotronH)],
)
def test_each_fixture_loads_as_its_model_type(folder, model_class):
    assert isinstance(load_checkpoint(folder), model_class)


@pytest.mark.parametrize(
    "folder", [FIXTURES / "qwen3_next" / "moe", FIXTURES / "nemotron_h" / "hybrid"]
)
def test_loading_reports_progress_per_parameter_only_when_asked(folder, capsys):
    load_checkpoint(folder)
    assert capsys.readouterr().err == ""
    load_checkpoint(folder, progress=True)
    lines = capsys.readouterr().err.strip().splitlines()
    total = int(lines[-1].split()[1].split("/")[1])
    assert re.fullmatch(rf"loaded {total}/{total} parameters in \d+ s", lines[-1]) and total > 8
    assert re.fullmatch(r"loaded 8/\d+ parameters \d+ s, ~\d+ s left", lines[0])
    assert len(lines) == total // 8 + (total % 8 != 0)


def test_unknown_model_type_names_the_supported_ones(tmp_path):
    shutil.copytree(FIXTURES / "nemotron_h" / "hybrid", tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["model_type"] = "llama"
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model_type='llama' is not served here; supported: "):
        load_checkpoint(tmp_path / "ckpt")
    assert sorted(MODEL_LOADERS) == [
        "nemotron_h", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next",
    ]  # fmt: skip


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="needs its config.json"):
        load_checkpoint(tmp_path)


def _corrupt(tmp_path, source, change):
    """A copy of the fixture folder ``source`` with ``change(tensors)`` applied to the
    tensors of its first safetensors file; the name of the tensor changed."""
    import numpy as np

    from hybrid_jax.models.safetensors_io import read_tensors, write_tensors

    folder = tmp_path / "ckpt"
    shutil.copytree(source, folder)
    path = sorted(folder.glob("*.safetensors"))[0]
    tensors = {k: np.array(v) for k, v in read_tensors(path).items()}
    name = change(tensors)
    write_tensors(path, tensors)
    return folder, name


@pytest.mark.parametrize(
    "source", [FIXTURES / "qwen3_next" / "moe", FIXTURES / "nemotron_h" / "hybrid"]
)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_weight_holding_inf_or_nan_is_refused_naming_it(tmp_path, source, bad):
    def poison(tensors):
        name = sorted(n for n, t in tensors.items() if t.ndim == 2)[0]
        tensors[name].flat[3] = bad
        return name

    folder, name = _corrupt(tmp_path, source, poison)
    with pytest.raises(CheckpointError, match=f"1 tensors hold inf or NaN: {name}"):
        load_checkpoint(folder)
    load_checkpoint(folder, check_finite=False)  # a trusted checkpoint skips the check


@pytest.mark.parametrize("dtype", ["int32", "bool"])
def test_an_integer_or_bool_tensor_where_a_weight_belongs_is_refused(tmp_path, dtype):
    def retype(tensors):
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].astype(dtype)
        return name

    folder, name = _corrupt(tmp_path, FIXTURES / "qwen3_next" / "moe", retype)
    with pytest.raises(CheckpointError, match=f"not floating point.*{name} \\({dtype}\\)"):
        load_checkpoint(folder)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("tie_word_embeddings", "false", "tie_word_embeddings='false' must be true or false"),
        ("eos_token_id", "2", "eos_token_id='2' must be a token id"),
        ("eos_token_id", True, "eos_token_id=True must be a token id"),
        ("eos_token_id", 10**6, r"eos_token_id \[1000000\] is outside the vocabulary"),
        ("max_position_embeddings", "1024", "max_position_embeddings='1024' must be an integer"),
        ("rms_norm_eps", "1e-6", "rms_norm_eps='1e-6' must be a number"),
        ("hidden_size", "64", "hidden_size='64' must be an integer"),
        ("mlp_only_layers", 3, "mlp_only_layers=3 must be a list of integers"),
    ],
)
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_config_values_of_the_wrong_type_are_refused_naming_the_field(
    tmp_path, family, field, value, message
):
    source = FIXTURES / family / ("moe" if family == "qwen3_next" else "hybrid")
    config = json.loads((source / "config.json").read_text())
    if family == "nemotron_h" and field in ("mlp_only_layers", "tie_word_embeddings"):
        pytest.skip(f"Nemotron-H's config has no {field}")
    if family == "nemotron_h" and field == "rms_norm_eps":
        field, message = "layer_norm_epsilon", message.replace(field, "layer_norm_epsilon")
    config[field] = value
    shutil.copytree(source, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_checkpoint(tmp_path / "ckpt")


def test_an_index_pointing_outside_the_folder_is_refused(tmp_path):
    shutil.copytree(FIXTURES / "qwen3_next" / "moe", tmp_path / "ckpt")
    (tmp_path / "outside.safetensors").write_bytes(b"")
    index_path = next((tmp_path / "ckpt").glob("*.index.json"))
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../outside.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside .*every shard must be a file"):
        load_checkpoint(tmp_path / "ckpt")
    index["weight_map"] = ["a list"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="weight_map must map tensor names"):
        load_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"shape": None}, "has shape None; a shape is a list of integers >= 0"),
        ({"shape": ["2"]}, r"has shape \['2'\]"),
        ({"shape": [-1, 2]}, r"has shape \[-1, 2\]"),
        ({"data_offsets": ["0", "8"]}, "has data_offsets .* two integers >= 0"),
        ({"data_offsets": [0, 4]}, "claims bytes"),
    ],
)
def test_a_malformed_safetensors_header_is_refused_naming_the_tensor(tmp_path, entry, message):
    import struct

    from hybrid_jax.models.safetensors_io import SafetensorsError, read_tensors

    header = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], **entry}}
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(SafetensorsError, match=f"tensor 'w' {message}"):
        read_tensors(path)


def test_a_hugging_face_id_resolves_to_its_snapshot_in_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--acme--tiny-hybrid"
    shutil.copytree(FIXTURES / "qwen3_next" / "moe", repo / "snapshots" / "abc123")
    shutil.copytree(FIXTURES / "qwen3_next" / "moe", repo / "snapshots" / "older")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    assert resolve_checkpoint("acme/tiny-hybrid") == repo / "snapshots" / "abc123"
    assert isinstance(load_checkpoint(resolve_checkpoint("acme/tiny-hybrid")), Qwen3Next)
    (repo / "refs" / "main").unlink()  # no ref: the newest snapshot
    os.utime(repo / "snapshots" / "older" / "config.json", (1, 1))
    assert resolve_checkpoint("acme/tiny-hybrid") == repo / "snapshots" / "abc123"
    with pytest.raises(CheckpointError, match=r"acme/missing is not a folder here.*hub"):
        resolve_checkpoint("acme/missing")
    assert resolve_checkpoint(tmp_path) == tmp_path  # a folder is itself
