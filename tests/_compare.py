"""Comparisons and argument helpers the kernel tests share (tests/kernels, tests/gpu).

A plain module, not a test module: ``tests/conftest.py`` puts ``tests/`` on ``sys.path``, so
test modules in every folder import it by its bare name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pytest

__all__ = ["bits", "check_impl_refusals", "query_start_loc", "rel", "replace"]


def rel(x, ref) -> float:
    """``|x - ref| / |ref|`` (Frobenius norms) in float64."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def bits(x) -> np.ndarray:
    """The raw bits of a 2- or 4-byte float array, for bit-exact comparisons (NaN included)."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.itemsize])


def query_start_loc(lengths: Sequence[int]) -> np.ndarray:
    """``query_start_loc`` of sequences of ``lengths``: int32 ``[0, cumsum(lengths)]``."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def replace(args: tuple, position: int, value) -> tuple:
    """``args`` with the argument at ``position`` replaced by ``value``."""
    return (*args[:position], value, *args[position + 1 :])


def check_impl_refusals(calls: Mapping[str, Callable[[], object]], impl: str) -> None:
    """Each call (by its op's name) refuses ``impl``, naming the op and the impl."""
    for op, call in calls.items():
        with pytest.raises(
            NotImplementedError, match=f"{op}: impl='{impl}' cannot take this call: "
        ):
            call()
