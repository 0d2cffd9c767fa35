"""Probe: a product of 128-256 rows with a 4096-column weight, split over K, beside cuBLAS.

At 256 decode rows the 9B-like step's 4096-column products (``out_proj``, ``z``, ``o_proj``,
the MLP's down) run cuBLAS's ``128x64`` tiles over the whole K: every one of its 128 CTAs
reads its 128 rows of activations from L2 again. This probe times programs of all the rows
(two consumer warpgroups of half the rows each, a third warpgroup streaming the tiles) times
``tile_n`` columns over a part of K, its float32 partials either stored and summed with the
residual by XLA or added by the TMA's reduce-add store into a float32 copy of the residual,
against ``x @ w + residual`` as XLA compiles it. A probe, not a kernel of the
library: it decides whether such a kernel is worth building.

    python3 benchmarks/wide_rows_probe.py [--rows 256] [--check]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_time import device_time  # noqa: E402

from pallas_kernels._common import interpret_params  # noqa: E402

F32 = jnp.float32
EPI = 64  # the epilogue's tile edge: float32 partials leave through 64 x 64 SMEM tiles


def split_k_partials(x, w, *, parts: int, tile_n: int, tile_k: int = 64, stages: int = 3,
                     interpret: bool = False, into=None, delay: int = 0):  # fmt: skip
    """float32 ``[parts, R, N]``: ``x[:, part] @ w[part]`` for each of ``parts`` equal parts
    of K. A program per (``tile_n`` columns, part); its two compute warpgroups take R / 2
    rows each. With ``into`` (a float32 ``[R, N]`` Ref) each part is added into it by the
    TMA's reduce-add store instead, and nothing is returned."""
    rows, k = x.shape
    n = w.shape[1]
    half = rows // 2
    if rows % 128 or n % tile_n or k % (parts * tile_k):
        raise ValueError(f"rows {rows} (a multiple of 128), N {n} / {tile_n}, "
                         f"K {k} / {parts}x{tile_k}")  # fmt: skip
    k_part = k // parts
    slots = 1 if delay else 2  # SMEM for the deeper ring
    swizzle = plgpu.find_swizzle(tile_k * jnp.dtype(x.dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(x.dtype).itemsize
    transforms = (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(EPI * 4 * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // 4)),
                      plgpu.SwizzleTransform(out_swizzle))  # fmt: skip

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_part // tile_k,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(
                    (rows, tile_k),
                    lambda j: (0, j),
                    transforms=transforms,
                    memory_space=plgpu.SMEM,
                    delay_release=delay,
                ),  # fmt: skip
                plgpu.BlockSpec(
                    (tile_k, tile_n),
                    lambda j: (j, 0),
                    transforms=transforms,
                    memory_space=plgpu.SMEM,
                    delay_release=delay,
                ),  # fmt: skip
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=context,
        )

    def kernel(x_gmem, w_gmem, out_gmem):
        reduce = into is not None  # out_gmem is ``into`` [R, N], else the partials
        col = lax.axis_index("n")
        part = lax.axis_index("p")
        dst = out_gmem if reduce else out_gmem.at[part]
        ks = pl.ds(part * k_part, k_part)
        cols = pl.ds(col * tile_n, tile_n)
        ignore = lambda *_, **__: None  # noqa: E731

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(ignore, ignore).get_allocations(x_gmem.at[:, ks], w_gmem.at[ks, cols]),
            out_s=plgpu.SMEM((2, slots, EPI, EPI), F32, transforms=out_transforms),
            collective_axes="wg",
        )
        def scope(allocs, out_s):
            wg = lax.axis_index("wg")
            my_rows = pl.ds(wg * half, half)

            def context(run):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((half, tile_n), F32))
                def _(acc_ref):
                    run(acc_ref)
                    acc = acc_ref[...]
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    tiles = [(i, j) for i in range(half // EPI) for j in range(tile_n // EPI)]
                    for t, (i, j) in enumerate(tiles):
                        slot = t % slots
                        plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
                        out_s[wg, slot] = acc[i * EPI : (i + 1) * EPI, j * EPI : (j + 1) * EPI]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            out_s.at[wg, slot],
                            dst.at[my_rows, cols].at[pl.ds(i * EPI, EPI), pl.ds(j * EPI, EPI)],
                            reduction_op="add" if reduce else None,
                        )  # fmt: skip

            def body(_, x_s, w_s, acc_ref):
                plgpu.wgmma(acc_ref, x_s.at[my_rows], w_s)
                plgpu.wgmma_wait(delay)
                return acc_ref

            pipeline(body, context)(x_gmem.at[:, ks], w_gmem.at[ks, cols], allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    operands = (x, w) if into is None else (x, w, into)
    out_type = jax.ShapeDtypeStruct((parts, rows, n), F32) if into is None else ()
    partials = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(n // tile_n, parts),
        grid_names=("n", "p"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params(interpret),
    )(*operands)
    return partials if into is None else None


def split_k_add(x, w, residual, **kw):
    """``residual + x @ w`` (x's dtype) from ``split_k_partials``, summed by XLA."""
    partials = split_k_partials(x, w, **kw)
    return (partials.sum(0) + residual.astype(F32)).astype(x.dtype)


def split_k_reduce_add(x, w, residual, **kw):
    """``residual + x @ w`` (x's dtype): the parts reduce-added into the float32 residual."""
    acc = jax.new_ref(residual.astype(F32))
    split_k_partials(x, w, into=acc, **kw)
    return jax.freeze(acc).astype(x.dtype)


def xla_add(x, w, residual):
    return x @ w + residual


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--check", action="store_true", help="small shapes in interpret mode")
    args = parser.parse_args()
    if args.check:
        x = jax.random.normal(jax.random.key(0), (128, 256), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(1), (256, 128), jnp.bfloat16)
        r = jax.random.normal(jax.random.key(2), (128, 128), jnp.bfloat16)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(r, np.float64)
        # split_k_add only: the interpreter has no reduce-add store.
        got = split_k_add(x, w, r, parts=2, tile_n=64, interpret=True, stages=2, delay=1)
        err = np.abs(np.asarray(got, np.float64) - want).max()
        print(f"split_k_add interpret check: max |err| {err:.3g} "
              f"(bf16 of values ~{np.abs(want).max():.1f})")  # fmt: skip
        assert err < 0.02 * np.abs(want).max(), err
        return
    rows = args.rows
    print(jax.devices()[0].device_kind, jax.__version__)
    # name: (K, N) of the 9B-like step's products of 4096 columns
    cases = {"out_proj/o_proj/z": (4096, 4096), "down": (12288, 4096)}
    for name, (k, n) in cases.items():
        copies = 6  # distinct weights per timed call, as a step's layers read
        keys = jax.random.split(jax.random.key(7), copies + 2)
        ws = [jax.random.normal(keys[i], (k, n), jnp.bfloat16) * 0.02 for i in range(copies)]
        x = jax.random.normal(keys[-2], (rows, k), jnp.bfloat16)
        r = jax.random.normal(keys[-1], (rows, n), jnp.bfloat16)
        want = np.asarray(xla_add(x, ws[0], r), np.float32)
        flops = 2 * rows * k * n
        variants = {"xla": xla_add}
        grid = [(128, 4, 3, 0), (128, 4, 4, 1), (128, 2, 4, 1), (64, 2, 4, 1), (64, 2, 3, 0)]
        for tile_n, parts, stages, delay in grid:
            for fn in (split_k_add, split_k_reduce_add):
                tag = "sum" if fn is split_k_add else "red"
                label = f"{tag} tile_n={tile_n} parts={parts} stages={stages} delay={delay}"
                variants[label] = functools.partial(
                    fn, parts=parts, tile_n=tile_n, stages=stages, delay=delay
                )
        print(f"== {name}: R={rows} K={k} N={n}, {flops / 1e9:.1f} GFLOP, "
              f"{k * n * 2 / 1e6:.1f} MB of weight")  # fmt: skip
        for label, fn in variants.items():
            try:
                step = jax.jit(lambda x, r, *ws, fn=fn: [fn(x, w, r) for w in ws])
                got = np.asarray(step(x, r, *ws)[0], np.float32)
                err = np.abs(got - want).max()
                t = device_time(functools.partial(step, x, r, *ws))
            except Exception as e:  # noqa: BLE001 - a probe reports what fails to build
                print(f"  {label:32s} failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
                continue
            us = t.us / copies
            print(f"  {label:32s} {us:7.1f} us  {flops / us / 1e6:6.0f} TFLOP/s  err {err:.3g}  "
                  f"[{t.breakdown(2)}]")  # fmt: skip


if __name__ == "__main__":
    main()
