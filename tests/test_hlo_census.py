"""benchmarks/hlo_census.py counts what an executable launches from its optimised HLO: the
entry's kernels once, a while loop's body once per pass, each launch by kind."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from hlo_census import census  # noqa: E402

# An optimised GPU step as XLA prints it, cut to one launch of each kind: a layer loop of 10
# passes whose body slices a weight by an asynchronous copy, runs a Pallas kernel with its
# weight sliced in place (a dynamic-slice fusion), a bare Pallas kernel, a Triton reduction
# and a loop fusion; outside it, a cuBLAS product.
GPU_STEP = """HloModule jit_step

%fused_slice (p0: f32[10,32], p1: s32[]) -> f32[1,32] {
  %p0 = f32[10,32]{1,0} parameter(0)
  ROOT %ds = f32[1,32]{1,0} dynamic-slice(%p0, %p1, %c), dynamic_slice_sizes={1,32}
}

%dynamic-slice-fusion (p0: bf16[10,64,8], p1: s32[], p2: bf16[8,64]) -> bf16[8,8] {
  %p0 = bf16[10,64,8]{2,1,0} parameter(0)
  %ds = bf16[1,64,8]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,64,8}
  ROOT %mpmd_map.1 = bf16[8,8]{1,0} custom-call(%p2, %ds), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step)/while/body/projections/mpmd_map"}
}

%triton_reduce (p0: f32[8,8]) -> f32[8] {
  ROOT %r = f32[8]{0} reduce(%p0, %c), dimensions={1}
}

%fused_add (p0: f32[8], p1: f32[8]) -> f32[8] {
  ROOT %a = f32[8]{0} add(%p0, %p1)
}

%body (arg: (s32[], f32[8])) -> (s32[], f32[8]) {
  %arg = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %fusion-start.1 = ((f32[10,32]{1,0}, s32[]), f32[1,32]{1,0}, u32[]) fusion-start(%w, %i), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(step)/while/body/dynamic_slice"}
  %fusion-done.1 = f32[1,32]{1,0} fusion-done(%fusion-start.1)
  %dynamic_slice_fusion = bf16[8,8]{1,0} fusion(%ws, %i, %x), kind=kCustom, calls=%dynamic-slice-fusion
  %mpmd_map.2 = (bf16[8,8]{1,0}, f32[4,32]{1,0}) custom-call(%x, %fusion-done.1), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step)/while/body/gdn_decode_ring/mpmd_map"}
  %input_reduce_fusion = f32[8]{0} fusion(%y), kind=kCustom, calls=%triton_reduce, backend_config={"fusion_backend_config":{"kind":"__triton"}}
  %loop_add_fusion = f32[8]{0} fusion(%input_reduce_fusion, %z), kind=kLoop, calls=%fused_add
  ROOT %t = (s32[], f32[8]) tuple(%i, %loop_add_fusion)
}

%cond (arg: (s32[], f32[8])) -> pred[] {
  %arg = (s32[], f32[8]) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main.1 (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %while.1 = (s32[], f32[8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"10"}}
  %custom-call.1 = f32[8,8]{1,0} custom-call(%a, %b), custom_call_target="__cublas$gemm"
  ROOT %out = f32[8]{0} get-tuple-element(%while.1), index=1
}
"""  # noqa: E501 (instruction lines as XLA prints them)


def test_a_gpu_step_is_counted_per_pass_and_by_kind():
    c = census(GPU_STEP)
    assert dict(c.outside) == {"cublas": 1}
    ((trips, kinds),) = c.loops
    assert trips == 10
    assert dict(kinds) == {
        "copy": 1, "pallas projections": 1, "pallas gdn_decode_ring": 1, "triton": 1,
        "xla loop": 1,
    }  # fmt: skip
    assert c.total == 1 + 10 * 5
    assert c.describe().startswith("51 kernels a step, 1 outside loops; 10 passes of 5 (")


def test_a_scanned_program_compiled_here_counts_its_callback_once_per_pass():
    def step(x, ws):
        def body(carry, w):
            seen = jax.pure_callback(
                lambda a: np.asarray(a), jax.ShapeDtypeStruct(carry.shape, carry.dtype), carry
            )
            return jnp.tanh(seen @ w), None

        return jax.lax.scan(body, x, ws)[0]

    text = jax.jit(step).lower(jnp.ones((4, 8)), jnp.ones((7, 8, 8))).compile().as_text()
    ((trips, kinds),) = census(text).loops
    assert trips == 7
    assert kinds["custom-call xla_ffi_python_cpu_callback"] == 1
