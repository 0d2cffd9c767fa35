"""Suite-wide setup that must run before any test module initialises a JAX backend.

The Mosaic GPU interpreter runs each warpgroup of a CTA as a host thread whose callbacks
(barrier waits among them) execute on the XLA CPU client's worker pool. That pool's size is
read from ``NPROC`` (default: the CPU count) when the CPU client is created. A warp-specialised
kernel (``pallas_kernels/gdn/_chunk_state.py``: three warpgroups, each blocked in barrier
waits while another must run) deadlocks the interpreter on a 2-CPU machine with the default.
This file is imported before every test module of the suite (also by each xdist worker), so
setting the variables here precedes the first backend in any order of collection, and so
does importing ``hybrid_jax``, which adds its serving flags to ``XLA_FLAGS``.

On a machine without an NVIDIA GPU, XLA's CPU backend compiles at LLVM optimisation level 0:
the suite's shapes are tiny, so compiling is most of its time (an engine's start-up is about
30% shorter) and running the unoptimised code costs little. Child processes (notebook
kernels, the README's commands) inherit it. A GPU machine keeps XLA's defaults, since there
the same flag would also apply to the GPU kernels XLA emits.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import _jax_speedups
import pytest

os.environ.setdefault("NPROC", "16")
optimising = "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
if _jax_speedups.WITHOUT_NVIDIA_GPU and not optimising:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

# One persistent compilation cache for the whole run: the xdist workers (started after this
# file is imported in the controller, they inherit its environment) and the child processes
# share it, so an executable that several modules build (the tiny engines' samplers and
# steps, a kernel's call) compiles once. Its key is the compiled program and its options, so
# a monkeypatched switch that changes the program is a miss, never a stale hit. Engines given
# a cache_dir of their own point JAX there while they build (and the tests put it back).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _run_cache = tempfile.mkdtemp(prefix="hybrid_jax_tests_xla_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _run_cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    # The process that made it (the controller under xdist) exits after everything using it.
    atexit.register(shutil.rmtree, _run_cache, ignore_errors=True)


# Faster JAX internals, the same results (tests/_jax_speedups.py).
_jax_speedups.apply()

# hybrid_jax adds its serving flags to XLA_FLAGS when imported, unless a backend has already
# started: imported here, it adds them whichever test module first starts one (a module that
# imports only pallas_kernels would otherwise leave the later engine tests without them).
import hybrid_jax  # noqa: E402, F401


@pytest.fixture(scope="module")
def cache_dir():
    """The run's persistent cache for a module's engines, its program store included, so
    that engines of one configuration in several modules compile once (the engine sets
    JAX's cache options process-wide: they are restored after the module)."""
    from _engine_helpers import restored_cache_options

    with restored_cache_options():
        yield os.environ["JAX_COMPILATION_CACHE_DIR"]


# Modules whose tests take minutes together (a child process, a served engine, notebooks).
# ``./dev test`` hands whole modules to its two workers in collection order; started first,
# these run beside the many short modules instead of alone at the end.
LONG_MODULES = (
    "test_tensor_parallel.py",
    "test_server.py",
    "test_notebooks.py",
    "test_serve_benchmark.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONG_MODULES.index(name) if name in LONG_MODULES else len(LONG_MODULES)

    items.sort(key=rank)  # stable: every other test keeps its place


# (_skinny.OVERLAP_PRODUCTS, _skinny.SWAP_OPERANDS): the default and the switches turned off.
PRODUCT_VARIANTS = {"default": (True, True), "unswapped": (True, False), "plain": (False, False)}
GPU_PRODUCT_VARIANTS = ("default", "plain")


@pytest.fixture(params=list(PRODUCT_VARIANTS))
def product_variant(request, monkeypatch):
    """Runs a test of the small-batch product kernels (``pallas_kernels._skinny``) with the
    default product and with its variants turned off. On the GPU, where every case compiles
    its own programs, with the default and the plain product only (the one float32 partial
    products always take)."""
    from pallas_kernels import _skinny

    if request.param not in GPU_PRODUCT_VARIANTS and request.node.get_closest_marker("gpu"):
        pytest.skip(f"the {request.param!r} product runs in the CPU tests only")

    overlap, swap = PRODUCT_VARIANTS[request.param]
    monkeypatch.setattr(_skinny, "OVERLAP_PRODUCTS", overlap)
    monkeypatch.setattr(_skinny, "SWAP_OPERANDS", swap)
    return request.param
