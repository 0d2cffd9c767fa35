"""attention_rows: what a decode step does to its new query, key and value rows before
attention reads them, in one launch: the q and k heads RMS-normed (each norm's float32
scale, a zero-centred norm's ``1 + weight``), the first ``rotary_dim`` features of every head
turned by the row's position (GPT-NeoX halves: feature i < rotary_dim / 2 pairs with
i + rotary_dim / 2), the keys and values written into the row's page at that position, and
the queries returned. In XLA these are a fusion per norm, a slice, a concatenation and a
scatter per cache: seven kernels of a few microseconds each at a decode step's few rows.

Row ``n`` is one token at ``positions[n]``: its key and value go to page
``page_table[n, p // page_size]``, offset ``p % page_size`` (a padded row's table and
position name its pad page). ``q`` ``[N, H, W]`` holds a head's query in its first ``D``
features (``W > D``: Qwen3-Next's query then output gate, which is left where it is).

The Mosaic GPU kernel (sm_90): one program per row. A head is read as ``D / P`` column
pieces of ``P`` features (``P = rotary_dim / 2``, or 32 without rotary), each a contiguous
SMEM tile ``[rows, P]`` that one TMA fills, so the rotary's two halves are two tiles and
every array of the program shares one register layout (no exchange between lanes). The
square sums add the pieces' row sums; the norm's roundings follow the reference (normed rows
rounded to the activations' dtype before the rotation).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import interpret_params, resolve_impl, round_up
from pallas_kernels._mgpu_chunks import columns_over_warps

__all__ = [
    "apply_rotary",
    "attention_rows",
    "attention_rows_reference",
    "inverse_frequencies",
    "unsupported_reason",
]

_OP = "attention_rows"
_HEAD_DIMS = (64, 128, 256)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_PIECE = 32  # features of a piece when the layer turns none
_VEC = 2  # float32 values a thread holds side by side along a piece
_REDUCTION_SCRATCH = 128 * 4 * 4  # SMEM bytes of the square sums' cross-warp reduction
_F32 = jnp.float32


def _piece(head_dim: int, rotary_dim: int) -> int:
    return rotary_dim // 2 if rotary_dim else min(_PIECE, head_dim)


def unsupported_reason(
    q: jax.Array, k: jax.Array, k_pages: jax.Array, rotary_dim: int
) -> str | None:
    """Why the kernel cannot take this call (shapes and dtypes only), or None when it can."""
    heads, head_dim = q.shape[1], k.shape[-1]
    piece = _piece(head_dim, rotary_dim)
    if head_dim not in _HEAD_DIMS:
        return f"head_dim={head_dim} is not one of {_HEAD_DIMS}"
    if piece % (4 * _VEC) or head_dim % piece or piece > 64:
        return (
            f"rotary_dim={rotary_dim}: its half ({piece}) must divide head_dim={head_dim}, be "
            f"a multiple of {4 * _VEC} and at most 64"
        )
    if q.dtype not in _DTYPES or k.dtype != q.dtype or k_pages.dtype != q.dtype:
        return (
            f"q, k and the pages must share a 16-bit float dtype (got {q.dtype}, {k.dtype}, "
            f"{k_pages.dtype})"
        )
    if heads > 64:
        return f"H={heads} query heads are over 64"
    # Mosaic GPU's layout inference finds no solution for these (jax 0.11.2).
    if piece < 32:
        return f"rotary_dim={rotary_dim}: its half ({piece}) is under 32 features"
    kv_heads = k.shape[1]
    if piece == 64 and kv_heads % 2:
        return f"rotary_dim={rotary_dim} (pieces of 64) needs an even KVH, not {kv_heads}"
    return None


def _check(q, k, v, k_pages, v_pages, page_table, positions, q_scale, k_scale, rotary_dim):
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"{_OP}: q must be [N, H, W] and k, v [N, KVH, D] with one N; got {q.shape}, "
            f"{k.shape}, {v.shape}"
        )
    rows, kv_heads, head_dim = k.shape
    if q.shape[2] < head_dim or q.shape[1] % kv_heads:
        raise ValueError(
            f"{_OP}: q {q.shape} must hold H (a multiple of KVH={kv_heads}) heads of at least "
            f"D={head_dim} features"
        )
    if (
        k_pages.ndim != 4
        or v_pages.shape != k_pages.shape
        or k_pages.shape[2:] != (kv_heads, head_dim)
    ):
        raise ValueError(
            f"{_OP}: k_pages and v_pages must both be [P, page_size, {kv_heads}, {head_dim}]; "
            f"got {k_pages.shape}, {v_pages.shape}"
        )
    if page_table.ndim != 2 or page_table.shape[0] != rows or page_table.dtype != jnp.int32:
        raise ValueError(
            f"{_OP}: page_table must be int32 [N={rows}, max_pages]; got {page_table.dtype} "
            f"{page_table.shape}"
        )
    if positions.shape != (rows,) or positions.dtype != jnp.int32:
        raise ValueError(
            f"{_OP}: positions must be int32 [N={rows}]; got {positions.dtype} {positions.shape}"
        )
    for name, scale in (("q_scale", q_scale), ("k_scale", k_scale)):
        if scale is not None and scale.shape != (head_dim,):
            raise ValueError(f"{_OP}: {name} {scale.shape} must be [D] = [{head_dim}]")
    if (q_scale is None) != (k_scale is None):
        raise ValueError(f"{_OP}: q_scale and k_scale come together (both norms) or not at all")
    if rotary_dim % 2 or not 0 <= rotary_dim <= head_dim:
        raise ValueError(f"{_OP}: rotary_dim={rotary_dim} must be even and in 0..{head_dim}")


def inverse_frequencies(rotary_dim: int, theta: float) -> jax.Array:
    """float32 ``[rotary_dim / 2]``: ``theta ** (-2 i / rotary_dim)``."""
    return 1.0 / theta ** (jnp.arange(0, rotary_dim, 2, dtype=_F32) / rotary_dim)


def _constant(make: Callable[[], jax.Array]) -> jax.Array:
    """``make()`` evaluated now, a constant of the program rather than a kernel. Under no
    mesh: inside ``shard_map`` (tensor parallelism) the traced mesh's manual axes would
    otherwise reach the eager computation, which cannot place its result on them."""
    empty = jax.sharding.AbstractMesh((), ())
    with jax.sharding.use_abstract_mesh(empty), jax.ensure_compile_time_eval():
        return make()


def apply_rotary(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
    """Rotary embedding on the first ``rotary_dim`` features of each head (the layers' jnp
    path, and this kernel's reference).

    x: ``[T, heads, head_dim]``; positions: int32 ``[T]``. Feature i < rotary_dim/2 pairs
    with i + rotary_dim/2 (NeoX layout); frequencies ``inverse_frequencies``. The angles are
    float32 and cos/sin are cast to x's dtype before use, as the reference does.
    """
    half = rotary_dim // 2
    angles = positions.astype(_F32)[:, None] * inverse_frequencies(rotary_dim, theta)
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    turned = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + turned * sin, rest], axis=-1)


def attention_rows_reference(q, k, v, k_pages, v_pages, page_table, positions, *, q_scale,
                             k_scale, eps: float, rotary_dim: int, theta: float):  # fmt: skip
    """jnp ``attention_rows``: the norms (float32, rounded to the rows' dtype), then the
    rotation in that dtype (cos and sin rounded to it), then the writes."""
    head_dim = k.shape[-1]

    def norm(x, scale):
        if scale is None:
            return x
        x32 = x.astype(_F32)
        x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (x32 * scale).astype(x.dtype)

    def rotate(x):
        return apply_rotary(x, positions, rotary_dim, theta) if rotary_dim else x

    q_out = rotate(norm(q[..., :head_dim], q_scale))
    k_new = rotate(norm(k, k_scale))
    size, max_pages = k_pages.shape[1], page_table.shape[1]
    slot = jnp.minimum(positions // size, max_pages - 1)
    page = jnp.take_along_axis(page_table, slot[:, None], axis=1)[:, 0]
    flat = page * size + positions % size

    def write(pages, new):
        rows = pages.reshape(-1, *pages.shape[2:]).at[flat].set(new.astype(pages.dtype))
        return rows.reshape(pages.shape)

    return q_out, write(k_pages, k_new), write(v_pages, v)


def attention_rows(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    *,
    q_scale: jax.Array | None,
    k_scale: jax.Array | None,
    eps: float,
    rotary_dim: int,
    theta: float,
    scale_offset: float = 0.0,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns ``(q_out [N, H, D], k_pages, v_pages)``: q's and k's heads normed (times
    ``scale_offset + q_scale`` / ``scale_offset + k_scale``, float32 ``[D]``; None for both:
    no norms) and turned, k and v written at each row's position (module docstring). A
    zero-centred norm passes its weight and ``scale_offset=1``: the kernel adds the one, so no
    kernel forms ``1 + weight`` before the launch. Under ``jit`` with the pages donated the
    kernel writes them in place."""
    _check(q, k, v, k_pages, v_pages, page_table, positions, q_scale, k_scale, rotary_dim)
    impl = resolve_impl(_OP, impl, unsupported_reason(q, k, k_pages, rotary_dim))
    if impl == "reference":
        q_scale, k_scale = (None if s is None else scale_offset + s.astype(_F32)
                            for s in (q_scale, k_scale))  # fmt: skip
        return attention_rows_reference(
            q, k, v, k_pages, v_pages, page_table, positions, q_scale=q_scale, k_scale=k_scale,
            eps=eps, rotary_dim=rotary_dim, theta=theta,
        )  # fmt: skip
    head_dim = k.shape[-1]
    piece = _piece(head_dim, rotary_dim)
    pieces = head_dim // piece
    # Each a few rows of the program's constants, copied in by a TMA of its own: a
    # concatenation of them would be a kernel before the launch.
    scales = [s.astype(_F32).reshape(pieces, piece) for s in (q_scale, k_scale) if s is not None]
    freqs = _constant(
        lambda: inverse_frequencies(rotary_dim, theta) if rotary_dim else jnp.zeros(piece, _F32)
    )
    k_ref, v_ref = jax.new_ref(k_pages), jax.new_ref(v_pages)
    q_out = _kernel(
        q, k, v, (*scales, freqs[None]), page_table, positions, k_ref, v_ref, piece=piece,
        eps=float(eps), scale_offset=float(scale_offset), rotary=bool(rotary_dim),
        interpret=impl == "interpret",
    )  # fmt: skip
    return q_out, jax.freeze(k_ref), jax.freeze(v_ref)


def _layouts(piece: int):
    """(tile ``[rows, piece]``, its row vector, its column vector) register layouts, and the
    lanes its rows spread over (``rows`` a multiple of them): ``columns_over_warps``."""
    tile, row_lanes = columns_over_warps(piece, _VEC)
    return tile, tile.reduce(1), tile.reduce(0), row_lanes


def _kernel(q, k, v, consts, page_table, positions, k_pages, v_pages, *, piece, eps, scale_offset,
            rotary, interpret):  # fmt: skip
    """``consts``: the norms' scales ``[D / piece, piece]`` each (none: no norms), then the
    rotary's frequencies ``[1, piece]``; they fill the rows of one SMEM buffer."""
    n_rows, heads = q.shape[:2]
    normed = len(consts) > 1
    const_rows = sum(c.shape[0] for c in consts)
    n_consts = len(consts)
    kv_heads, head_dim = k.shape[1:]
    dtype = q.dtype
    page_size = k_pages.shape[1]
    max_pages = page_table.shape[1]
    pieces = head_dim // piece
    tile, _, col_vec, row_lanes = _layouts(piece)
    # Each buffer holds at least 8 rows: Mosaic GPU's layout inference finds no layout for a
    # [4, 64] tile of this layout (a half-turned head of 256, 2 or 4 KV heads).
    rows_held = max(row_lanes, 8)
    held = {name: round_up(count, rows_held) for name, count in (("q", heads), ("k", kv_heads))}

    def body(q_ref, k_ref, v_ref, *refs):
        consts_refs, refs = refs[:n_consts], refs[n_consts:]
        table_ref, pos_ref, k_pages_ref, v_pages_ref, out_ref, q_s, k_s, v_s, c_s, bar = refs
        n = lax.axis_index("n")
        for j in range(pieces):
            cols = pl.ds(j * piece, piece)
            plgpu.copy_gmem_to_smem(q_ref.at[n, :, cols], q_s.at[j, pl.ds(0, heads)], bar)
            plgpu.copy_gmem_to_smem(k_ref.at[n, :, cols], k_s.at[j, pl.ds(0, kv_heads)], bar)
        plgpu.copy_gmem_to_smem(v_ref.at[n], v_s, bar)
        row = 0
        for ref in consts_refs:
            plgpu.copy_gmem_to_smem(ref, c_s.at[pl.ds(row, ref.shape[0])], bar)
            row += ref.shape[0]
        pos = pos_ref[n]
        page = table_ref[n, jnp.minimum(pos // page_size, max_pages - 1)]
        offset = pos % page_size
        plgpu.barrier_wait(bar)
        if rotary:
            freqs = plgpu.load(c_s.at[const_rows - 1], layout=col_vec)
            angles = pos.astype(_F32) * freqs
            cos = jnp.cos(angles).astype(dtype).astype(_F32)
            sin = jnp.sin(angles).astype(dtype).astype(_F32)
        for which, (buf, rows) in enumerate(((q_s, held["q"]), (k_s, held["k"]))):
            shape = (rows, piece)
            x = [plgpu.load(buf.at[j], layout=tile).astype(_F32) for j in range(pieces)]
            if normed:
                squares = functools.reduce(operator.add, [jnp.sum(p * p, axis=1) for p in x])
                inv = lax.rsqrt(squares * (1.0 / head_dim) + eps)
                inv = lax.broadcast_in_dim(inv, shape, [0])
                scale = [
                    plgpu.load(c_s.at[which * pieces + j], layout=col_vec) for j in range(pieces)
                ]
                if scale_offset:
                    scale = [scale_offset + part for part in scale]
                x = [
                    (p * inv * lax.broadcast_in_dim(part, shape, [1])).astype(dtype).astype(_F32)
                    for p, part in zip(x, scale, strict=True)
                ]
            if rotary:
                c, s = (lax.broadcast_in_dim(a, shape, [1]) for a in (cos, sin))
                first, second = x[0], x[1]
                x[0] = first * c - second * s
                x[1] = second * c + first * s
            for j in range(pieces):
                buf[j] = x[j].astype(dtype)
        plgpu.commit_smem()
        for j in range(pieces):
            cols = pl.ds(j * piece, piece)
            plgpu.copy_smem_to_gmem(q_s.at[j, pl.ds(0, heads)], out_ref.at[n, :, cols])
            plgpu.copy_smem_to_gmem(
                k_s.at[j, pl.ds(0, kv_heads)], k_pages_ref.at[page, offset, :, cols]
            )
        plgpu.copy_smem_to_gmem(v_s, v_pages_ref.at[page, offset])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((n_rows, heads, head_dim), dtype),
        grid=(n_rows,),
        grid_names=("n",),
        scratch_types=[
            plgpu.SMEM((pieces, held["q"], piece), dtype),
            plgpu.SMEM((pieces, held["k"], piece), dtype),
            plgpu.SMEM((kv_heads, head_dim), dtype),
            plgpu.SMEM((const_rows, piece), _F32),
            plgpu.Barrier(num_arrivals=2 * pieces + 1 + n_consts),
        ],
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=_REDUCTION_SCRATCH),
        interpret=interpret_params(interpret),
        kernel_name="attention_rows",
    )
    return kernel(q, k, v, *consts, page_table, positions, k_pages, v_pages)
