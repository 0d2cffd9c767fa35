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

``HYBRID_JAX_STEP_GRAPHS=1`` adds ``STEP_GRAPH_XLA_FLAGS`` too: the whole step, the layer
loop included, as CUDA graphs (XLA's command buffers over every kind of thunk, ``WHILE`` and
``CONDITIONAL`` among them, at any size). The host then launches a step's graphs instead of
updating the loop body's graphs at every repeat, whose weights lie at other addresses. It is
opt-in while it is measured on the batch-1 decode row only (benchmarks/RESULTS_serve.md).
"""

from __future__ import annotations

import logging
import os

__all__ = ["SERVING_XLA_FLAGS", "STEP_GRAPH_XLA_FLAGS", "add_serving_flags"]

SERVING_XLA_FLAGS = (
    "--xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_enable_dynamic_slice_fusion=true",
    "--xla_gpu_dot_merger_threshold_mb=0",
)

STEP_GRAPH_XLA_FLAGS = (
    "--xla_gpu_enable_command_buffer="
    "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL",
    "--xla_gpu_graph_min_graph_size=1",
)

log = logging.getLogger(__name__)


def add_serving_flags() -> None:
    """Adds each of ``SERVING_XLA_FLAGS`` (and ``STEP_GRAPH_XLA_FLAGS`` under
    ``HYBRID_JAX_STEP_GRAPHS=1``) that ``XLA_FLAGS`` does not name yet."""
    if os.environ.get("HYBRID_JAX_KEEP_XLA_FLAGS") == "1":
        return
    wanted = SERVING_XLA_FLAGS
    if os.environ.get("HYBRID_JAX_STEP_GRAPHS") == "1":
        wanted += STEP_GRAPH_XLA_FLAGS
    current = os.environ.get("XLA_FLAGS", "")
    missing = [f for f in wanted if f.split("=")[0] not in current]
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
