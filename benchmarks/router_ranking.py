"""What ranking a MoE block's router logits costs a decode step: the router's launch alone
(the 35B-like router, its paired shared gate/up and widened gate, rows normed in the launch),
the launch with the two XLA reductions of ``moe.top_k_exps`` after it, and the launch that
ranks the logits itself (``projections.ranked_projections``), each with whole-K programs and
with the products over parts of K combined in the launch (``splits``;
``benchmarks/RESULTS_serve.md``).

Each case runs 400 launches on fresh rows in one jitted ``lax.scan`` whose carry sums every
output (so none is dead code); a launch's cost is the best of 5 wall times over 400, gaps
between kernels included, as a step pays them. Usage: ``python3 benchmarks/router_ranking.py``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import moe, projections

CASES = ((8, 256, 8), (1, 256, 8), (8, 512, 10))  # (rows, experts, top k)
LAUNCHES, HIDDEN = 400, 2048


def _best_time(f, *args, repeats: int = 5) -> float:
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - start)
    return best


def _looped(step):
    """``step(rows, square_sums, counters)`` over the scanned inputs, every output summed;
    the launches share one counters buffer, as a step's do."""

    @jax.jit
    def run(xs, sums):
        counters = jax.new_ref(jnp.zeros((8,), jnp.int32))

        def body(total, inputs):
            outs = jax.tree.leaves(step(*inputs, counters))
            return total + sum(jnp.sum(o.astype(jnp.float32)) for o in outs), None

        return jax.lax.scan(body, jnp.float32(0), (xs, sums))[0]

    return run


def _steps(rows: int, experts: int, top_k: int, ws) -> dict:
    """The ways of one case, each a function of (rows, square sums, counters): whole-K
    programs, and products over parts of K combined in the launch (``splits``)."""
    valid = jnp.arange(rows) < 1
    kw = dict(rms_eps=1e-6, paired=(False, True, False), impl="pallas")
    splits = projections.partial_splits(HIDDEN, [w.shape[1] for w in ws])
    ways = {}
    for parts, name in ((1, "launch"), (splits, f"{splits} parts")):

        def launch(x, s, counters, parts=parts):
            return projections.projections(
                x, ws, row_scale=s, splits=parts, counters=counters if parts > 1 else None, **kw
            )

        def launch_then_xla(x, s, counters, launch=launch):
            products = launch(x, s, counters)
            return products, moe.top_k_exps(products[0].astype(jnp.float32), top_k, valid)

        def ranked(x, s, counters, parts=parts):
            return projections.ranked_projections(
                x, ws, top_k=top_k, valid=valid, row_scale=s, splits=parts, counters=counters,
                **kw,
            )  # fmt: skip

        ways[name] = launch
        ways[f"{name} + XLA ranking"] = launch_then_xla
        ways[f"{name}, ranked"] = ranked
    return ways


def main() -> None:
    print(jax.devices()[0].device_kind)
    for rows, experts, top_k in CASES:
        rng = np.random.default_rng(rows + experts)
        xs = jnp.asarray(rng.standard_normal((LAUNCHES, rows, HIDDEN)), jnp.bfloat16)
        sums = jnp.asarray(rng.uniform(0.05, 4.0, (LAUNCHES, rows)) * HIDDEN, jnp.float32)
        ws = [jnp.asarray(rng.standard_normal((HIDDEN, n)) / np.sqrt(HIDDEN), jnp.bfloat16)
              for n in (experts, 1024, 128)]  # fmt: skip
        ws[1] = moe.pair_halves(ws[1])
        for name, step in _steps(rows, experts, top_k, ws).items():
            seconds = _best_time(_looped(step), xs, sums) / LAUNCHES
            print(f"{rows} rows, {experts} experts, top {top_k}: {name:24s} "
                  f"{seconds * 1e6:7.2f} us a launch", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
