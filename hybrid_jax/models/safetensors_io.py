"""Reading and writing the safetensors format with numpy alone (bfloat16 through ml_dtypes).

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the byte
buffer that follows; an optional ``"__metadata__"`` entry of strings), then that buffer.
Reading maps the file into memory, so a tensor's bytes are touched only when it is used.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

__all__ = ["SafetensorsError", "read_header", "read_tensors", "write_tensors"]

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header


class SafetensorsError(ValueError):
    """A file that is not valid safetensors, or holds a dtype this reader does not know."""


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict], int]:
    """(the header's tensor entries, byte offset of the data buffer) of ``path``."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: {len(head)} bytes, too short for a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > _MAX_HEADER:
            raise SafetensorsError(
                f"{path}: header length {size} is over {_MAX_HEADER}; not a safetensors file"
            )
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise SafetensorsError(f"{path}: the header is not JSON ({err})") from err
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + size


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of ``path``, as read-only arrays backed by a memory map of the file."""
    header, start = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=start) if header else None
    out = {}
    for name, entry in header.items():
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise SafetensorsError(f"{path}: malformed header entry for {name!r}") from err
        if dtype_name not in _DTYPES:
            raise SafetensorsError(
                f"{path}: tensor {name!r} has dtype {dtype_name}, which this reader does not "
                f"support (supported: {', '.join(_DTYPES)}); quantised checkpoints need "
                f"dequantising to bfloat16 or float32 first"
            )
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise SafetensorsError(
                f"{path}: tensor {name!r} has shape {shape!r}; a shape is a list of integers >= 0"
            )
        if not (_is_count(begin) and _is_count(end)):
            raise SafetensorsError(
                f"{path}: tensor {name!r} has data_offsets {entry['data_offsets']!r}; they are "
                f"two integers >= 0"
            )
        dtype = _DTYPES[dtype_name]
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0 or end > data.size:
            raise SafetensorsError(
                f"{path}: tensor {name!r} claims bytes [{begin}, {end}) for shape {shape} of "
                f"{dtype_name} ({nbytes} bytes) in a {data.size}-byte buffer; the file is "
                f"truncated or corrupt"
            )
        out[name] = data[begin:end].view(dtype).reshape(shape)
    return out


def write_tensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray]) -> None:
    """Writes ``tensors`` to ``path`` in the safetensors format, in the given order.

    The file is written beside ``path`` and renamed over it at the end, so a reader never
    sees half a file, and arrays still mapped from the old file (``read_tensors``) stay valid.
    """
    header, offset = {}, 0
    arrays = {}
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        if array.dtype not in _NAMES:
            raise SafetensorsError(f"tensor {name!r}: dtype {array.dtype} cannot be written")
        header[name] = {
            "dtype": _NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        arrays[name] = array
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keeps the data buffer 8-byte aligned
    partial = f"{os.fspath(path)}.partial"
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in arrays.values():
            f.write(array.tobytes())
    os.replace(partial, path)
