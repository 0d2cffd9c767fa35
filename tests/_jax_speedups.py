"""Faster paths through JAX's private internals for the test suite, giving the same results.

Applied by ``conftest.py`` in every test process, and by the notebook tests' kernels (an
IPython startup file). jax is pinned (``pyproject.toml``), so the private names patched here
are those of the version tested; a jax upgrade must check them again. Measurements are in
``benchmarks/RESULTS_test_suite.md``.
"""

from __future__ import annotations

import shutil

WITHOUT_NVIDIA_GPU = shutil.which("nvidia-smi") is None


def apply() -> None:
    """Both speed-ups; the interpreter's only where kernels run in it (no NVIDIA GPU)."""
    if WITHOUT_NVIDIA_GPU:
        interpreter_callbacks_on_host_arrays()
    layout_inference_sorts_by_one_numbering()


def interpreter_callbacks_on_host_arrays() -> None:
    """Hands the Mosaic GPU interpreter's host callbacks XLA's NumPy arrays as they come.

    The interpreter runs every load, store, barrier and TMA copy of a kernel as an
    ``io_callback``, tens of thousands a kernel test. JAX's ``io_callback_impl`` first
    ``device_put``s each callback's arguments onto the CPU device, which costs more than the
    callback's own work (``benchmarks/RESULTS_test_suite.md``). The callbacks only read their
    arguments on the host, so they take the NumPy arrays XLA passes instead; the one place
    that insists on a ``jax.Array`` (the interpreter's ``_to_int``, for the scalar ids of a
    thread or device) gets NumPy scalars too. What a kernel computes is unchanged: its
    arithmetic runs in XLA either way, and the callbacks move the same bytes.
    """
    import numpy as np
    from jax._src import callback as jax_callback
    from jax._src import tree_util
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        del result_avals, sharding, ordered
        return tree_util.tree_map(np.asarray, callback(*args))

    array_to_int = shared_memory._to_int

    def to_int(x):
        return x.item() if isinstance(x, np.ndarray | np.generic) else array_to_int(x)

    jax_callback.io_callback_impl = io_callback_impl
    shared_memory._to_int = to_int


def layout_inference_sorts_by_one_numbering() -> None:
    """Lets Mosaic GPU's layout inference name its variables from one numbering of the IR.

    ``constraints.compute_transitively_equal_vars`` sorts a kernel's variables by their
    names, and each name (``layout_inference.ValueSite.__str__``) prints its operation with
    ``str``, which numbers the SSA values of the whole enclosing module again: a few
    milliseconds a variable, about a fifth of lowering a step's kernels for CUDA
    (``benchmarks/RESULTS_test_suite.md``). While that function runs, the names are printed
    with one ``ir.AsmState`` of the module instead, which gives the same text, so the sort,
    and every layout inferred, is unchanged. The IR does not change while it runs: it only
    reads a constraint system.
    """
    import dataclasses
    import io

    from jax.experimental.mosaic.gpu import constraints, layout_inference
    from jaxlib.mlir import ir

    numberings: list[tuple[ir.Operation, ir.AsmState]] | None = None
    site_name = layout_inference.ValueSite.__str__
    transitively_equal_vars = constraints.compute_transitively_equal_vars

    def outermost(op: ir.Operation) -> ir.Operation:
        while (parent := op.parent) is not None:
            op = parent.operation
        return op

    def name_from_one_numbering(site) -> str:
        if numberings is None:
            return site_name(site)
        op = site.operation.operation
        root = outermost(op)
        state = next((state for known, state in numberings if known == root), None)
        if state is None:
            state = ir.AsmState(root)
            numberings.append((root, state))
        text = io.StringIO()
        op.print(state, file=text)
        # The name reads only the operation's text, its role and its index.
        return site_name(dataclasses.replace(site, operation=text.getvalue()))

    def equal_vars_named_from_one_numbering(system):
        nonlocal numberings
        numberings = []
        try:
            return transitively_equal_vars(system)
        finally:
            numberings = None

    layout_inference.ValueSite.__str__ = name_from_one_numbering
    constraints.compute_transitively_equal_vars = equal_vars_named_from_one_numbering
