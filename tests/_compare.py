"""Comparisons and argument helpers the kernel tests share (tests/kernels, tests/gpu).

A plain module, not a test module: ``tests/conftest.py`` puts ``tests/`` on ``sys.path``, so
test modules in every folder import it by its bare name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pytest

__all__ = [
    "KERNEL_CALL",
    "bits",
    "check_impl_refusals",
    "primitives_outside_kernels",
    "query_start_loc",
    "rel",
    "replace",
]

# How a Pallas Mosaic GPU kernel appears in a jaxpr in JAX 0.11.2 (interpreted or not).
KERNEL_CALL = "custom_vmap_call"


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


def primitives_outside_kernels(jaxpr) -> tuple[set[str], int]:
    """Primitive names of ``jaxpr`` and its sub-jaxprs, not looking inside kernel calls, and the
    number of kernel calls."""
    names, kernels = set(), 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == KERNEL_CALL:
            kernels += 1
            continue
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns"):
                    sub_names, sub_kernels = primitives_outside_kernels(sub)
                    names, kernels = names | sub_names, kernels + sub_kernels
    return names, kernels
