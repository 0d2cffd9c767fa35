"""The attention rows kernel (``pallas_kernels.attention.rows``) on an sm_90 GPU at the
Qwen3-Next attention shape and at Nemotron-H's plain rows: the kernel against the float64
oracle of ``tests/_attention_rows.py``, with pages poisoned with NaN wherever
nothing is written and donated to a jitted call, as a step donates its cache."""

from __future__ import annotations

import functools

import jax
import pytest
from _attention_rows import EPS, check
from _attention_rows import case as make_case

from pallas_kernels._common import on_hopper_gpu
from pallas_kernels.attention import rows as ar

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not on_hopper_gpu(), reason="needs an sm_90 GPU"),
]


@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "head_dim", "rotary_dim", "gated", "normed"),
    [(8, 16, 2, 256, 64, True, True), (64, 16, 2, 256, 64, True, True),
     (8, 32, 8, 128, 0, False, False)],
)  # fmt: skip
def test_kernel_matches_the_float64_oracle(rows, heads, kv_heads, head_dim, rotary_dim, gated,
                                           normed):  # fmt: skip
    setup = make_case(rows, rows=rows, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                 gated=gated, normed=normed, max_pages=16)  # fmt: skip
    assert ar.unsupported_reason(setup["q"], setup["k"], setup["k_pages"], rotary_dim) is None
    call = functools.partial(ar.attention_rows, eps=EPS, rotary_dim=rotary_dim, theta=1e7,
                             impl="pallas")  # fmt: skip
    got = jax.jit(call, donate_argnames=("k_pages", "v_pages"))(**setup)
    fresh = make_case(rows, rows=rows, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                  gated=gated, normed=normed, max_pages=16)  # fmt: skip
    check(jax.device_get(got), fresh, rotary_dim=rotary_dim, theta=1e7, tol=8e-3)


def test_the_norms_offset_added_in_the_kernel_matches_the_float64_oracle():
    """A zero-centred norm's weights with ``scale_offset=1``: the scales ``1 + w``."""
    setup = make_case(5, rows=8, heads=16, kv_heads=2, head_dim=256, max_pages=16)
    weights = {name: setup[name] - 1.0 for name in ("q_scale", "k_scale")}
    call = functools.partial(ar.attention_rows, eps=EPS, rotary_dim=64, theta=1e7,
                             scale_offset=1.0, impl="pallas")  # fmt: skip
    got = jax.jit(call, donate_argnames=("k_pages", "v_pages"))(**{**setup, **weights})
    fresh = make_case(5, rows=8, heads=16, kv_heads=2, head_dim=256, max_pages=16)
    check(jax.device_get(got), fresh, rotary_dim=64, theta=1e7, tol=8e-3)
