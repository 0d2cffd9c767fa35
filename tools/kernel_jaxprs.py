"""Hashes of every public kernel op's jaxpr, to show that a refactor leaves the kernels alone.

    .venv/bin/python tools/kernel_jaxprs.py > before.txt   # then again after the change
    diff before.txt after.txt

Each op is traced (``jax.make_jaxpr``, on the CPU: nothing runs) at production-like shapes
for ``impl="reference"`` and ``impl="pallas"`` (the Mosaic GPU kernel's jaxpr, which holds the
kernel body). Source locations are cut from the printed jaxpr first, so moving code changes
no hash; any change to what the op computes does. An op that refuses an impl prints the
refusal instead of a hash (tokamax's kernels are absent on the CPU).
"""

from __future__ import annotations

import functools
import hashlib
import re

import jax
import jax.numpy as jnp

from pallas_kernels import attention, conv1d, gdn, mamba2, moe

# File paths with line numbers, and the numbered source locations Pallas keeps for a kernel.
_SOURCE = re.compile(r"[\w./<>-]+\.py:\d+(:\d+)?(-\d+(:\d+)?)?|at 0x[0-9a-f]+")

f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32


def _spec(shape, dtype=f32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _gdn_cases():
    t, n, h, hv, k, s = 256, 3, 16, 32, 128, 8
    pool = _spec((s, hv, k, k))
    varlen = (_spec((t, h, k), bf16), _spec((t, h, k), bf16), _spec((t, hv, k), bf16),
              _spec((t, hv)), _spec((t, hv)), pool, _spec((n + 1,), i32), _spec((n,), i32),
              _spec((n,), jnp.bool_))  # fmt: skip

    def rows(d):
        return (_spec((n, d, h, k), bf16), _spec((n, d, h, k), bf16),
                _spec((n, d, hv, k), bf16), _spec((n, d, hv)), _spec((n, d, hv)), pool,
                _spec((n,), i32))  # fmt: skip

    gating = (_spec((hv,)), _spec((n, 1, hv), bf16), _spec((hv,)), _spec((n, 1, hv), bf16))
    fused = (*rows(1)[:3], *gating, pool, _spec((n,), i32))
    commit = (pool, _spec((n, 4, hv, k, k)), _spec((n,), i32), _spec((n,), i32))
    return {
        "gdn.chunk_gated_delta_rule": (gdn.chunk_gated_delta_rule, varlen),
        "gdn.fused_recurrent_gated_delta_rule": (gdn.fused_recurrent_gated_delta_rule, rows(1)),
        "gdn.verify_gated_delta_rule": (gdn.verify_gated_delta_rule, rows(4)),
        "gdn.fused_gating_recurrent_gated_delta_rule": (
            gdn.fused_gating_recurrent_gated_delta_rule, fused),
        "gdn.gdn_gating": (gdn.gdn_gating, (_spec((hv,)), _spec((t, hv), bf16), _spec((hv,)),
                                            _spec((t, hv), bf16))),
        "gdn.commit_states": (gdn.commit_states, commit),
    }  # fmt: skip


def _conv_cases():
    t, n, c, w, s = 256, 3, 8192, 4, 8
    pool = _spec((s, c, w - 1), bf16)
    weight, bias = _spec((c, w), bf16), _spec((c,), bf16)
    varlen = (_spec((t, c), bf16), weight, bias, pool, _spec((n + 1,), i32),
              _spec((n,), i32), _spec((n,), jnp.bool_))  # fmt: skip
    return {
        "conv1d.causal_conv1d": (conv1d.causal_conv1d, varlen),
        "conv1d.causal_conv1d_update": (
            conv1d.causal_conv1d_update, (_spec((n, 1, c), bf16), weight, bias, pool,
                                          _spec((n,), i32))),
        "conv1d.causal_conv1d_verify": (
            conv1d.causal_conv1d_verify, (_spec((n, 4, c), bf16), weight, bias, pool,
                                          _spec((n,), i32))),
        "conv1d.commit_windows": (
            conv1d.commit_windows, (pool, _spec((n, 4, c, w - 1), bf16), _spec((n,), i32),
                                    _spec((n,), i32))),
    }  # fmt: skip


def _mamba2_cases():
    t, n, h, p, g, dn, s = 256, 3, 16, 64, 2, 128, 8
    pool = _spec((s, h, p, dn))
    params = (_spec((h,)), _spec((h,)), _spec((h,)))  # A, D, dt_bias

    def args(x_shape, bc_shape, dt_shape, rest):
        a, d, dt_bias = params
        return (_spec(x_shape, bf16), _spec(dt_shape, bf16), a, _spec(bc_shape, bf16),
                _spec(bc_shape, bf16), d, dt_bias, pool, *rest)  # fmt: skip

    varlen = args(
        (t, h, p),
        (t, g, dn),
        (t, h),
        (_spec((n + 1,), i32), _spec((n,), i32), _spec((n,), jnp.bool_)),
    )
    decode = args((n, 1, h, p), (n, 1, g, dn), (n, 1, h), (_spec((n,), i32),))
    verify = args((n, 4, h, p), (n, 4, g, dn), (n, 4, h), (_spec((n,), i32),))
    commit = (pool, _spec((n, 4, h, p, dn)), _spec((n,), i32), _spec((n,), i32))
    return {
        "mamba2.ssd_chunk_scan": (mamba2.ssd_chunk_scan, varlen),
        "mamba2.selective_state_update": (mamba2.selective_state_update, decode),
        "mamba2.verify_selective_state_update": (mamba2.verify_selective_state_update, verify),
        "mamba2.commit_states": (mamba2.commit_states, commit),
    }


def _attention_cases():
    b, heads, kv_heads, hd, pages, page, max_pages = 4, 16, 2, 256, 64, 16, 8
    k_pages = _spec((pages, page, kv_heads, hd), bf16)
    table, lens = _spec((b, max_pages), i32), _spec((b,), i32)
    decode = (_spec((b, heads, hd), bf16), k_pages, k_pages, table, lens)
    prefix = (_spec((b, 4, heads, hd), bf16), k_pages, k_pages, table, lens)
    t = 256
    segments = (_spec((t, heads, hd), bf16), _spec((t, kv_heads, hd), bf16),
                _spec((t, kv_heads, hd), bf16), _spec((t,), i32))  # fmt: skip
    scaled = functools.partial
    return {
        "attention.paged_decode_attention": (
            scaled(attention.paged_decode_attention, scale=0.0625), decode),
        "attention.paged_prefix_attention": (
            scaled(attention.paged_prefix_attention, scale=0.0625), prefix),
        "attention.segment_causal_attention": (
            scaled(attention.segment_causal_attention, scale=0.0625), segments),
        "moe.grouped_matmul": (
            moe.grouped_matmul, (_spec((64, 2048), bf16), _spec((8, 2048, 512), bf16),
                                 _spec((8,), i32))),
    }  # fmt: skip


def _digest(op, args, impl: str) -> str:
    try:
        jaxpr = jax.make_jaxpr(functools.partial(op, impl=impl))(*args)
    except (NotImplementedError, ValueError, ImportError) as err:
        return f"refused: {type(err).__name__}: {str(err).splitlines()[0]}"
    text = _SOURCE.sub("", str(jaxpr))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main() -> int:
    cases = {**_gdn_cases(), **_conv_cases(), **_mamba2_cases(), **_attention_cases()}
    for name, (op, args) in cases.items():
        for impl in ("reference", "pallas"):
            print(f"{name} {impl}: {_digest(op, args, impl)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
