"""The Gated DeltaNet decode kernel with the output norm at a few rows: one program per
``(value head, row)``, the head's ``V`` columns split over ``V / 64`` warpgroups.

The gated output norm needs a whole head's output, so the pipelined grid's normed items are
whole heads: at one real row that is 32 programs, each streaming a 64 KiB state and running
the whole head's update on one warpgroup. Here each warpgroup of a program loads, updates
and stores its own ``[K, 64]`` slice of the head's state (the 64-column block the un-normed
kernel's items take), and the norm's sum of squares is added across the warpgroups through
shared memory, a barrier per token. A padded row's program reads nothing and writes zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import interpret_params
from pallas_kernels._prefetch import issue_prefetches, spare_rows
from pallas_kernels.gdn._decode_grids import (
    DecodeVariant,
    _decays,
    _key,
    _layouts,
    _load_gates,
    _update,
    _value,
    _wait_stores_read,
    _zeros_o,
)

__all__ = ["SLICE", "one_head_per_program"]

SLICE = 64  # value columns of a warpgroup's slice of the head


def one_head_per_program(q, k, v, gates_in, pool_ref, idx, *, heads, cols, scale, l2,
                         out_norm, interpret, prefetch=()):  # fmt: skip
    """Grid (value head, row), ``V / SLICE`` warpgroups a program. q, k, v ``[N, D, width]``
    with heads at ``cols``; ``gates_in`` as ``one_item_per_program``; ``out_norm`` ``(z [N,
    D, HV V], weight float32 [V], eps)``: the output comes gated-normed. ``prefetch``: ``[R,
    C]`` arrays that the programs of rows past the N bring into L2 (``_prefetch``)."""
    n_rows, n_tokens = q.shape[:2]
    h, k_dim, hv, v_dim = heads
    group = hv // h
    slices = v_dim // SLICE
    layouts = _layouts(DecodeVariant("cols"), SLICE)
    z, weight, eps = out_norm
    n_gates = len(gates_in)
    raw = n_gates > 2
    # Prefetching programs take whole rows of the grid after the N rows.
    spare = spare_rows(prefetch, hv * n_rows, hv)

    def body(idx_ref, q_ref, k_ref, v_ref, *refs):
        gate_refs, refs = refs[:n_gates], refs[n_gates:]
        (z_ref, weight_ref), refs = refs[:2], refs[2:]
        prefetch_refs, refs = refs[: len(prefetch)], refs[len(prefetch) :]
        pool, o_ref, state_s, q_s, k_s, v_s, z_s, w_s, o_s, sums_s, *bars = refs
        qk_bar, slice_bars, token_bars = bars
        head, n, part = lax.axis_index("h"), lax.axis_index("n"), lax.axis_index("wg")
        columns = pl.ds(part * SLICE, SLICE)

        def across(t, partial):
            """Token t's sum of squares over the head: each warpgroup's partial through
            SMEM, after every warpgroup has stored its own."""
            sums_s[t, part] = partial
            plgpu.barrier_arrive(token_bars.at[t])
            plgpu.barrier_wait(token_bars.at[t])
            return sum(sums_s[t, i] for i in range(slices)), v_dim

        def head_slice():
            """Program (head, row n)'s warpgroup ``part``: its slice of the head."""
            slot = idx_ref[n]
            gates = _load_gates(gate_refs, cols, n, head, n_tokens)  # in flight with the copies

            @pl.when(slot != 0)
            def _real_row():
                key = head // group

                @pl.when(part == 0)  # q and k are the whole key head's: one warpgroup copies
                def _():
                    plgpu.copy_gmem_to_smem(q_ref.at[n, :, _key(cols.q, key, k_dim)], q_s, qk_bar)
                    plgpu.copy_gmem_to_smem(k_ref.at[n, :, _key(cols.k, key, k_dim)], k_s, qk_bar)

                bar = slice_bars.at[part]
                plgpu.copy_gmem_to_smem(pool.at[slot, head, :, columns], state_s.at[part], bar)
                plgpu.copy_gmem_to_smem(v_ref.at[n, :, _value(cols.v, head, v_dim, part, SLICE)],
                                        v_s.at[part], bar)  # fmt: skip
                plgpu.copy_gmem_to_smem(z_ref.at[n, :, _value(0, head, v_dim, part, SLICE)],
                                        z_s.at[part], bar)  # fmt: skip
                plgpu.copy_gmem_to_smem(weight_ref.at[columns], w_s.at[part], bar)
                plgpu.barrier_wait(qk_bar)
                plgpu.barrier_wait(bar)
                state = plgpu.load(state_s.at[part], layout=layouts[0])
                norm = (z_s.at[part], plgpu.load(w_s.at[part], layout=layouts[2]), eps, across)
                state = _update(state, q_s, k_s, v_s.at[part], o_s.at[part], _decays(gates, raw),
                                layouts=layouts, scale=scale, use_qk_l2norm=l2, one_pass=True,
                                out_norm=norm)  # fmt: skip
                state_s[part] = state
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(state_s.at[part], pool.at[slot, head, :, columns])

            @pl.when(slot == 0)
            def _padded_row():
                _zeros_o(o_s.at[part], n_tokens, SLICE, layouts[2])
                plgpu.commit_smem()

            plgpu.copy_smem_to_gmem(o_s.at[part], o_ref.at[n, :, head, columns])
            _wait_stores_read()

        if not prefetch:
            head_slice()
            return
        program = (n - n_rows) * hv + head
        pl.when((n >= n_rows) & (part == 0))(
            lambda: issue_prefetches(prefetch_refs, program, spare * hv)
        )
        pl.when(n < n_rows)(head_slice)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((n_rows, n_tokens, hv, v_dim), v.dtype),
        grid=(hv, n_rows + spare),
        grid_names=("h", "n"),
        num_threads=slices,
        thread_name="wg",
        scratch_types=[
            plgpu.SMEM((slices, k_dim, SLICE), jnp.float32),
            plgpu.SMEM((n_tokens, k_dim), q.dtype),
            plgpu.SMEM((n_tokens, k_dim), k.dtype),
            plgpu.SMEM((slices, n_tokens, SLICE), v.dtype),
            plgpu.SMEM((slices, n_tokens, SLICE), z.dtype),
            plgpu.SMEM((slices, SLICE), jnp.float32),
            plgpu.SMEM((slices, n_tokens, SLICE), v.dtype),
            plgpu.SMEM((n_tokens, slices), jnp.float32),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_arrivals=4, num_barriers=slices),
            plgpu.Barrier(num_arrivals=slices, num_barriers=n_tokens),
        ],
        interpret=interpret_params(interpret),
        kernel_name="gdn_decode_heads",
    )
    return kernel(idx, q, k, v, *gates_in, z, weight, *prefetch, pool_ref)
