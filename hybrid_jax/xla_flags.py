"""XLA flags the serving steps rely on, added to ``XLA_FLAGS`` when hybrid_jax is imported.

XLA reads ``XLA_FLAGS`` once, when JAX starts its first backend, so they are added at import
(``hybrid_jax/__init__.py`` runs this first) and only when absent: a flag the user set keeps
its value. ``HYBRID_JAX_KEEP_XLA_FLAGS=1`` leaves ``XLA_FLAGS`` untouched.

* ``--xla_gpu_enable_triton_gemm=false`` and ``--xla_gpu_enable_dynamic_slice_fusion=true``:
  under ``lax.scan`` each layer's weights are a slice of the stacked weights. A Triton GEMM
  fusion reads its operand from a buffer of its own, so each step would copy every layer's
  weights first; a cuBLAS GEMM with the slice fused into its operand address reads them
  where they lie (``benchmarks/RESULTS_serve.md``).
* ``--xla_gpu_dot_merger_threshold_mb=0``: XLA merges products that share an input (an
  attention layer's q, k and v projections) into one product over the concatenated weights.
  The weights are arguments of the step, not constants, so the merged weight would be
  concatenated again every step.

``HYBRID_JAX_STEP_GRAPHS=1`` compiles decode steps to run whole as CUDA graphs
(``STEP_GRAPH_OPTIONS``, given to a decode step's compile alone by ``step_compiler_options``:
XLA's command buffers over every kind of thunk, ``WHILE`` and ``CONDITIONAL`` among them, at
any size); prefill steps compile as XLA chooses either way. They are opt-in: on the H100 they
took 6% off a batch-1 step, on the H200, whose batch-1 step is the device's, nothing
(benchmarks/RESULTS_serve.md, sessions 38-39). Command-buffer options in ``XLA_FLAGS`` take
their place (a user's choice wins).
"""

from __future__ import annotations

import logging
import os

__all__ = [
    "SERVING_XLA_FLAGS",
    "STEP_GRAPHS",
    "STEP_GRAPH_OPTIONS",
    "add_serving_flags",
    "step_compiler_options",
]

SERVING_XLA_FLAGS = (
    "--xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_enable_dynamic_slice_fusion=true",
    "--xla_gpu_dot_merger_threshold_mb=0",
)

STEP_GRAPH_OPTIONS = {
    "xla_gpu_enable_command_buffer": (
        "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
    ),
    "xla_gpu_graph_min_graph_size": 1,
}
"""XLA's options for a step that runs whole as CUDA graphs (``step_compiler_options``)."""

STEP_GRAPHS = os.environ.get("HYBRID_JAX_STEP_GRAPHS") == "1"
"""Whether decode steps compile with ``STEP_GRAPH_OPTIONS`` (``HYBRID_JAX_STEP_GRAPHS=1``).
Read when a step compiles."""

log = logging.getLogger(__name__)


def add_serving_flags() -> None:
    """Adds each of ``SERVING_XLA_FLAGS`` that ``XLA_FLAGS`` does not name yet."""
    if os.environ.get("HYBRID_JAX_KEEP_XLA_FLAGS") == "1":
        return
    current = os.environ.get("XLA_FLAGS", "")
    missing = [f for f in SERVING_XLA_FLAGS if f.split("=")[0] not in current]
    if not missing:
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        log.warning(
            "JAX started its backend before hybrid_jax was imported, so XLA runs without %s; "
            "import hybrid_jax first, or put them in XLA_FLAGS",
            " ".join(missing),
        )
        return
    os.environ["XLA_FLAGS"] = " ".join([current, *missing]).strip()


def step_compiler_options(graphs: bool) -> dict[str, str | int]:
    """The options a step executable compiles with: ``STEP_GRAPH_OPTIONS`` for a step that
    asks for ``graphs`` (a decode step's program) while ``STEP_GRAPHS`` is on, unless
    ``XLA_FLAGS`` names those options itself; else none (XLA's defaults)."""
    if not (graphs and STEP_GRAPHS):
        return {}
    current = os.environ.get("XLA_FLAGS", "")
    if any(f"--{name}" in current for name in STEP_GRAPH_OPTIONS):
        return {}
    return dict(STEP_GRAPH_OPTIONS)
