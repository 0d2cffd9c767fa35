"""Cases and the float64 oracle of the attention rows kernel (``pallas_kernels.attention.rows``)
that its CPU tests (tests/kernels) and GPU tests (tests/gpu) share.

A plain module, not a test module: ``tests/conftest.py`` puts ``tests/`` on ``sys.path``, so
test modules in every folder import it by its bare name.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from _compare import rel

__all__ = ["EPS", "check", "case", "oracle"]

EPS = 1e-6


def case(seed, *, rows, heads, kv_heads, head_dim, gated=True, page_size=16, max_pages=4,
          normed=True):  # fmt: skip
    """Rows at random positions (one mid-page, one at a page's first offset, the last a padded
    row: pad page 0 and position 0), each with its own pages; every page entry NaN."""
    rng = np.random.default_rng(seed)
    num_pages = rows * max_pages + 1
    width = (2 if gated else 1) * head_dim
    q = rng.standard_normal((rows, heads, width)).astype(np.float32)
    k = rng.standard_normal((rows, kv_heads, head_dim)).astype(np.float32) * 3
    v = rng.standard_normal((rows, kv_heads, head_dim)).astype(np.float32)
    pages = rng.permutation(np.arange(1, num_pages)).reshape(rows, max_pages).astype(np.int32)
    positions = rng.integers(0, max_pages * page_size, rows).astype(np.int32)
    positions[0] = 2 * page_size + 7
    positions[1 % rows] = page_size
    pages[-1], positions[-1] = 0, 0  # a padded row
    cache = np.full((num_pages, page_size, kv_heads, head_dim), np.nan, np.float32)
    scale = lambda: (1.0 + 0.3 * rng.standard_normal(head_dim)).astype(np.float32)  # noqa: E731
    bf16 = jnp.bfloat16
    return dict(
        q=jnp.asarray(q, bf16), k=jnp.asarray(k, bf16), v=jnp.asarray(v, bf16),
        k_pages=jnp.asarray(cache, bf16), v_pages=jnp.asarray(cache, bf16),
        page_table=jnp.asarray(pages), positions=jnp.asarray(positions),
        q_scale=jnp.asarray(scale()) if normed else None,
        k_scale=jnp.asarray(scale()) if normed else None,
    )  # fmt: skip


def oracle(q, k, v, k_pages, v_pages, page_table, positions, q_scale, k_scale, *, rotary_dim,
            theta):  # fmt: skip
    """float64 numpy from the bf16 inputs, head by head; the pages as dicts of written
    entries ``(page, offset) -> [KVH, D]``."""
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    q, k, v = f64(q), f64(k), f64(v)
    head_dim = k.shape[-1]
    half = rotary_dim // 2

    def head(x, scale, pos):
        if scale is not None:
            x = x / np.sqrt(np.mean(x * x) + EPS) * f64(scale)
        x = x.copy()
        if half:
            freqs = theta ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
            cos, sin = np.cos(pos * freqs), np.sin(pos * freqs)
            a, b = x[:half].copy(), x[half:rotary_dim].copy()
            x[:half], x[half:rotary_dim] = a * cos - b * sin, b * cos + a * sin
        return x

    q_out = np.zeros((q.shape[0], q.shape[1], head_dim))
    keys, values = {}, {}
    size = k_pages.shape[1]
    for n, pos in enumerate(np.asarray(positions)):
        for h in range(q.shape[1]):
            q_out[n, h] = head(q[n, h, :head_dim], q_scale, pos)
        at = (int(np.asarray(page_table)[n, pos // size]), int(pos % size))
        keys[at] = np.stack([head(k[n, g], k_scale, pos) for g in range(k.shape[1])])
        values[at] = v[n]
    return q_out, keys, values


def check(got, case, *, rotary_dim, theta, tol):
    q_out, k_pages, v_pages = got
    want_q, keys, values = oracle(**case, rotary_dim=rotary_dim, theta=theta)
    assert q_out.shape == want_q.shape and q_out.dtype == case["q"].dtype
    assert rel(q_out, want_q) < tol
    written = np.zeros(k_pages.shape[:2], bool)
    for (page, offset), want in keys.items():
        if page == 0:
            continue  # the pad page: the padded row's entry, which nothing reads
        written[page, offset] = True
        assert rel(k_pages[page, offset], want) < tol
        got_v = np.asarray(v_pages[page, offset], np.float64)
        np.testing.assert_array_equal(got_v, values[(page, offset)])
    written[0] = True
    for pages in (k_pages, v_pages):  # nothing else written: still NaN
        assert np.isnan(np.asarray(pages, np.float32)[~written]).all()
