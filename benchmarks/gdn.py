"""Gated DeltaNet on an H200: this project's kernels against FLA, jax-linear-attention and jnp.

Run on the GPU machine (see benchmarks/README.md)::

    python3 benchmarks/gdn.py [--out DIR] [--only decode,verify,prefill,conv]

Prints ONE table (every row measured in this run) and writes ``RESULTS.md`` to ``--out``
(default: this folder). Shapes: Qwen3-Next at TP1 (H=16, HV=32, K=V=128), bf16 activations,
a float32 ssm pool of 1024 slots; every step reads fresh random slots, so the state comes from
HBM, not L2.

How each side is timed:

* JAX (ours, jnp, jla), step time: R steps unrolled in ONE executable, the pool carried
  (donated) from step to step; per-step time = (t(R_hi) - t(R_lo)) / (R_hi - R_lo) from
  medians of wall times. The difference cancels the ~85 us of dispatch + sync of one call,
  but not the host work of each launch inside it (12-15 us per Mosaic GPU kernel), which
  sets a floor under small steps.
* JAX decode, verify and prefill, device time (``device_time.py``): one step per call, fresh
  slots every call, under the profiler; the GPU's own kernel durations of one call, median
  over calls (what ncu reports per kernel). Rates and ``vs FLA`` use it where it was measured.
* FLA (torch): token-path steps captured in a CUDA graph (R steps, each its own slots), the
  replays timed with CUDA events; prefill with ``triton.testing.do_bench`` (median, L2 flushed).

A row that fails prints its error in the table; the rest still runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from device_time import DeviceTime, device_time  # noqa: E402 (benchmarks/device_time.py)

from pallas_kernels.conv1d import prefill_mgpu, update_mgpu  # noqa: E402
from pallas_kernels.conv1d import reference as conv_reference  # noqa: E402
from pallas_kernels.gdn import chunk_mgpu, decode_mgpu, recurrent_mgpu  # noqa: E402
from pallas_kernels.gdn import reference as gdn_reference  # noqa: E402
from pallas_kernels.gdn.gating import gdn_gating  # noqa: E402

H, HV, K, V = 16, 32, 128, 128
SLOTS = 1024
STATE_BYTES = HV * K * V * 4
CONV_C, CONV_W = 2 * H * K + HV * V, 4
DECODE_BATCHES = (1, 16, 64, 256)
CONV_BATCHES = (1, 64, 256)
CONV_PREFILL = (("8x2048", 8, 2048),)
VERIFY = ((16, 4), (64, 4))
PREFILL = (("1x8192", 1, 8192), ("1x32768", 1, 32768), ("4x8192", 4, 8192),
           ("8x2048", 8, 2048), ("varlen 64x256", 64, 256))  # fmt: skip
DEVICE_CALLS = 20  # traced calls per device-time row (median over them)


@dataclasses.dataclass
class Row:
    group: str
    shape: str
    impl: str
    us: float | None = None
    device_us: float | None = None
    rate: str = ""
    note: str = ""

    @property
    def best_us(self) -> float | None:
        """The device time where measured, else the step time."""
        return self.device_us if self.device_us is not None else self.us


ROWS: list[Row] = []
DEADLINE = float("inf")  # time.monotonic() after which rows are skipped (--budget)
SMOKE = False  # --smoke: tiny shapes, kernels under the CPU interpreter (checks the script)


def _error(err: Exception) -> str:
    traceback.print_exc(limit=3)
    return f"ERROR {type(err).__name__}: {str(err).splitlines()[0][:110]}"


def _record(group: str, shape: str, impl: str, measure: Callable[..., float], rate, *args,
            device: Callable[[], DeviceTime] | None = None, **kwargs) -> None:  # fmt: skip
    """Runs ``measure(*args, **kwargs)`` (microseconds) and, if given, ``device()``; a failure
    becomes the row's note."""
    row = Row(group, shape, impl)
    if time.monotonic() > DEADLINE:
        row.note = "skipped: out of the run's time budget (--budget)"
        ROWS.append(row)
        return
    notes = []
    try:
        row.us = measure(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 (a failing row must not stop the table)
        notes.append(_error(err))
    if device is not None:
        try:
            timing = device()
            row.device_us = timing.us
            copies = f"; copies {timing.copy_us:.1f} us" if timing.copy_us else ""
            notes.append(f"device, per call: {timing.breakdown()}{copies}")
        except Exception as err:  # noqa: BLE001
            notes.append(f"device time: {_error(err)}")
    if row.best_us is not None:
        row.rate = rate(row.best_us)
    row.note = "; ".join(notes)
    ROWS.append(row)
    device_us = f"{row.device_us:8.1f}" if row.device_us is not None else "       -"
    print(f"  {group:8s} {shape:14s} {impl:34s} {row.us or float('nan'):10.1f} us, device "
          f"{device_us} us {row.rate} {row.note}", flush=True)  # fmt: skip


def _tbps(n_bytes: float) -> Callable[[float], str]:
    return lambda us: f"{n_bytes / us / 1e6:.2f} TB/s"


def _mtoks(tokens: int) -> Callable[[float], str]:
    return lambda us: f"{tokens / us:.1f} Mtok/s"


# ----------------------------------------------------------------------------- JAX timing


def jax_per_step_us(
    step, holder: Pool, xs_of, n_steps=8, calls=(1, 4), reps=5, operands=None
) -> float:
    """``step(pool, x) -> (pool, out)``; ``xs_of(R)`` gives a tuple of R per-step inputs (one
    argument each: no slicing op between steps). The pool is donated, so it is updated in place
    from step to step; ``holder`` keeps the live one. With ``operands`` (a pytree of arrays) the
    step is ``step(pool, x, operands)`` and they enter the executable as arguments: arrays a
    step closes over are constants, and XLA folds jnp work on them at compile time (minutes for
    the prefill references, and the folded work is then missing from the timing).

    One executable runs ``n_steps`` steps; the per-step time is the difference between
    ``calls[1]`` and ``calls[0]`` back-to-back calls (dispatch is asynchronous, so only the
    first call's dispatch and the last one's sync are not hidden, and they cancel).
    """
    if SMOKE:
        n_steps, reps = 1, 1

    def many(carry, xs, operands):
        outs = []
        for x in xs:
            carry, out = step(carry, x) if operands is None else step(carry, x, operands)
            outs.append(out)
        return carry, tuple(outs)

    fn = functools.partial(jax.jit(many, donate_argnums=0), operands=operands)
    xs = xs_of(n_steps)
    carry = holder.take()
    try:
        for _ in range(2):  # compile + warm-up
            carry, out = fn(carry, xs)
        jax.block_until_ready((carry, out))
        medians = []
        for n_calls in calls:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(n_calls):
                    carry, out = fn(carry, xs)
                jax.block_until_ready((carry, out))
                times.append(time.perf_counter() - t0)
            medians.append(statistics.median(times))
    finally:
        holder.put(carry)
    return (medians[1] - medians[0]) / ((calls[1] - calls[0]) * n_steps) * 1e6


def jax_device_time(step, holder: Pool, xs_of, operands=None) -> DeviceTime:
    """Device time of one ``step`` (as for ``jax_per_step_us``), one step per call: each call
    gets its own ``x`` (fresh slots: the state comes from HBM) and the donated pool of the
    call before."""
    calls, warmup = (2, 1) if SMOKE else (DEVICE_CALLS, 2)
    fn = jax.jit(step, donate_argnums=0)
    xs = iter(xs_of(calls + warmup))
    carry = holder.take()

    def call():
        nonlocal carry
        args = (carry, next(xs)) if operands is None else (carry, next(xs), operands)
        carry, out = fn(*args)
        return carry, out

    try:
        return device_time(call, calls=calls, warmup=warmup)
    finally:
        holder.put(carry)


# ----------------------------------------------------------------------------- inputs


def _rng(seed):
    return np.random.default_rng(seed)


def _slot_sets(rng, n_steps, n) -> np.ndarray:
    """``[n_steps, n]`` int32: per step, n distinct random real slots."""
    return np.stack([rng.permutation(np.arange(1, SLOTS))[:n] for _ in range(n_steps)]).astype(
        np.int32
    )


def _slots_of(rng, n) -> Callable[[int], tuple[jax.Array, ...]]:
    """For ``jax_per_step_us``: R device arrays of n distinct random slots."""
    return lambda n_steps: tuple(jnp.asarray(s) for s in _slot_sets(rng, n_steps, n))


def _token_inputs(rng, lead: tuple[int, ...]):
    """q, k, v (bf16), g, beta (fp32) with leading dims ``lead``."""
    bf16 = jnp.bfloat16
    return dict(
        q=jnp.asarray(rng.standard_normal((*lead, H, K)), bf16),
        k=jnp.asarray(rng.standard_normal((*lead, H, K)), bf16),
        v=jnp.asarray(rng.standard_normal((*lead, HV, V)), bf16),
        g=jnp.asarray(-np.logaddexp(0, rng.standard_normal((*lead, HV))), jnp.float32),
        beta=jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((*lead, HV)))), jnp.float32),
    )


def _gating_inputs(rng, inputs: dict) -> dict:
    """``inputs`` with ``gdn_gating``'s raw inputs (A_log, a, dt_bias [HV]; a, b like g) in
    place of g, beta: what the DECODE step's fused-gating op takes."""
    lead = inputs["g"].shape
    rest = {name: x for name, x in inputs.items() if name not in ("g", "beta")}
    return dict(
        rest,
        A_log=jnp.asarray(rng.uniform(-1.0, 1.0, HV), jnp.float32),
        a=jnp.asarray(rng.standard_normal(lead), jnp.bfloat16),
        dt_bias=jnp.asarray(rng.standard_normal(HV), jnp.float32),
        b=jnp.asarray(rng.standard_normal(lead), jnp.bfloat16),
    )


def _gating_then_decode(q, k, v, A_log, a, dt_bias, b, ssm_pool, state_indices):  # noqa: N803
    """The unfused DECODE step: ``gdn_gating`` in XLA, then our decode kernel."""
    lead = a.shape
    g, beta = gdn_gating(A_log, a.reshape(-1, HV), dt_bias, b.reshape(-1, HV), impl="reference")
    return decode_mgpu.fused_recurrent_gated_delta_rule(
        q, k, v, g.reshape(lead), beta.reshape(lead), ssm_pool, state_indices
    )


class Pool:
    """The live (donated-through) pool of a benchmark group; remade on the device when a
    failed row left it deleted."""

    def __init__(self, shape, dtype, seed):
        self.shape, self.dtype, self.key = shape, dtype, jax.random.key(seed)
        self.array = None

    def take(self) -> jax.Array:
        if self.array is None or self.array.is_deleted():
            self.key, sub = jax.random.split(self.key)
            self.array = (jax.random.normal(sub, self.shape) * 0.1).astype(self.dtype)
        array, self.array = self.array, None
        return array

    def put(self, array: jax.Array) -> None:
        self.array = array


def _ssm_pool(seed) -> Pool:
    return Pool((SLOTS, HV, K, V), jnp.float32, seed)


# ----------------------------------------------------------------------------- FLA (torch)


def _torch():
    import torch

    return torch


def _fla_graph_us(step, n_steps=16, replays=10) -> float:
    """``step(r)`` issues step r's kernels; all R are captured in one CUDA graph."""
    torch = _torch()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for r in range(n_steps):  # autotune / compile outside the graph
            step(r)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(n_steps):
            step(r)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (replays * n_steps))
    return statistics.median(samples)


def _torch_inputs(rng, lead):
    torch = _torch()
    dev = "cuda"
    return dict(
        q=torch.randn(*lead, H, K, device=dev, dtype=torch.bfloat16),
        k=torch.randn(*lead, H, K, device=dev, dtype=torch.bfloat16),
        v=torch.randn(*lead, HV, V, device=dev, dtype=torch.bfloat16),
        g=-torch.nn.functional.softplus(torch.randn(*lead, HV, device=dev)),
        beta=torch.sigmoid(torch.randn(*lead, HV, device=dev)),
    )


# ----------------------------------------------------------------------------- decode / verify


# Verify tilings (block_v, swizzle): the decision data for recurrent_mgpu.pick_config.
VERIFY_TILINGS = ((32, 0), (64, 0))


def _same_as_default(fn, inputs, n, config) -> str:
    """A non-default tiling is checked against the default one (which tests/gpu checks
    against the oracle) on a small pool of n + 1 slots: returns a note, empty when equal."""
    pool = jax.random.normal(jax.random.key(7), (n + 1, HV, K, V)) * 0.1
    idx = jnp.arange(1, n + 1, dtype=jnp.int32)
    got = jax.jit(functools.partial(fn, config=config))(**inputs, ssm_pool=pool, state_indices=idx)
    want = jax.jit(fn)(**inputs, ssm_pool=pool, state_indices=idx)
    errors = [float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(
        jnp.float32))) for a, b in zip(got, want, strict=True)]  # fmt: skip
    return "" if max(errors) < 1e-5 else f"MISMATCH vs default tiling: {errors}"


def _jax_row(group, shape, impl, step, pool, n, traffic, rng, inputs, **timing) -> None:
    """A JAX row: step time (``jax_per_step_us``, ``timing`` its options) and device time of
    ``step(pool, idx, inputs)``; ``inputs`` enter as arguments (as constants XLA would fold
    work on them at compile time)."""
    _record(group, shape, impl, jax_per_step_us, _tbps(traffic), step, pool, _slots_of(rng, n),
            operands=inputs, device=lambda: jax_device_time(step, pool, _slots_of(rng, n),
                                                            inputs), **timing)  # fmt: skip


def bench_decode(fla) -> None:
    rng = _rng(0)
    pool = _ssm_pool(seed=10)
    for n in DECODE_BATCHES:
        shape = f"batch {n}"
        traffic = 2 * n * STATE_BYTES
        inputs = _token_inputs(rng, (n, 1))
        gated = _gating_inputs(rng, inputs)
        ours = decode_mgpu.fused_recurrent_gated_delta_rule  # the public decode op's kernel
        impls = {
            f"ours (decode_mgpu {decode_mgpu.DEFAULT})": (ours, inputs),
            # The DECODE step's op (the gating in the kernel) and what it replaced.
            "ours, gating fused in (the DECODE step)": (
                decode_mgpu.fused_gating_recurrent_gated_delta_rule,
                gated,
            ),
            "ours, gdn_gating in XLA + decode": (_gating_then_decode, gated),
            "jnp reference": (gdn_reference.fused_recurrent_gated_delta_rule, inputs),
        }
        for impl, (fn, args) in impls.items():

            def step(pool, idx, args, fn=fn):
                o, pool = fn(**args, ssm_pool=pool, state_indices=idx)
                return pool, o

            _jax_row("decode", shape, impl, step, pool, n, traffic, rng, args)
        if fla is not None:
            _fla_decode(fla, n, traffic)


def _fla_decode(fla, n, traffic, d=1) -> None:
    torch = _torch()
    rng = _rng(1)
    pool = torch.randn(SLOTS, HV, K, V, device="cuda") * 0.1
    steps = 16
    idx = [torch.as_tensor(s, device="cuda", dtype=torch.long) for s in _slot_sets(rng, steps, n)]
    starts = rng.integers(1, SLOTS - n, size=steps)
    x = _torch_inputs(rng, (n, d))
    group, shape = ("decode", f"batch {n}") if d == 1 else ("verify", f"D={d} batch {n}")

    def pooled(r):
        h0 = pool.index_select(0, idx[r])
        _, ht = fla.fused_recurrent_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], beta=x["beta"], initial_state=h0,
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        pool.index_copy_(0, idx[r], ht)

    def kernel_only(r):
        h0 = pool[starts[r] : starts[r] + n]
        fla.fused_recurrent_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], beta=x["beta"], initial_state=h0,
            output_final_state=d == 1, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    if d == 1:
        _record(group, shape, "FLA + pool gather/scatter", lambda: _fla_graph_us(pooled),
                _tbps(traffic))  # fmt: skip
        _record(group, shape, "FLA kernel (contiguous slots)",
                lambda: _fla_graph_us(kernel_only), _tbps(traffic))  # fmt: skip
    else:
        _record(group, shape, "FLA kernel, outputs only", lambda: _fla_graph_us(kernel_only),
                _tbps(n * STATE_BYTES))  # fmt: skip


def bench_verify(fla) -> None:
    rng = _rng(2)
    pool = _ssm_pool(seed=12)
    fn = recurrent_mgpu.verify_gated_delta_rule
    for n, d in VERIFY:
        shape = f"D={d} batch {n}"
        traffic = (1 + d) * n * STATE_BYTES  # read the state, write D states
        inputs = _token_inputs(rng, (n, d))
        for block_v, swizzle in VERIFY_TILINGS:
            config = recurrent_mgpu.RecurrentConfig(block_v=block_v, swizzle=swizzle)

            def ours(pool, idx, inputs, config=config):
                return pool, fn(**inputs, ssm_pool=pool, state_indices=idx, config=config)

            label = f"ours bv={block_v}" + (f" swizzle={swizzle}" if swizzle else "")
            _jax_row("verify", shape, label, ours, pool, n, traffic, rng, inputs)
            if (block_v, swizzle) != (64, 0) and ROWS[-1].best_us is not None:
                try:
                    same = _same_as_default(fn, inputs, n, config)
                except Exception as err:  # noqa: BLE001
                    same = f"check failed: {type(err).__name__}"
                ROWS[-1].note = "; ".join(x for x in (same, ROWS[-1].note) if x)

        def ref_step(pool, idx, inputs):
            return pool, gdn_reference.verify_gated_delta_rule(
                **inputs, ssm_pool=pool, state_indices=idx
            )

        _jax_row("verify", shape, "jnp reference", ref_step, pool, n, traffic, rng, inputs,
                 n_steps=6)  # fmt: skip
        if fla is not None:
            _fla_decode(fla, n, traffic, d=d)


# ----------------------------------------------------------------------------- prefill


def bench_prefill(fla, jla) -> None:
    from pallas_kernels import gdn

    rng = _rng(3)
    pool = _ssm_pool(seed=10)
    for shape, n_seq, length in PREFILL:
        if time.monotonic() > DEADLINE:  # inputs of a skipped shape are not worth making
            for impl in ("ours (Mosaic GPU chunk)", "jnp reference (chunked)", "jla", "FLA"):
                _record("prefill", shape, impl, None, None)
            continue
        t_total = n_seq * length
        inputs = _token_inputs(rng, (t_total,))
        qsl = jnp.arange(0, t_total + 1, length, dtype=jnp.int32)
        has_init = jnp.ones((n_seq,), bool)

        def ours(fn, qsl=qsl, has_init=has_init):
            def step(pool, idx, tokens):
                o, pool = fn(**tokens, ssm_pool=pool, qsl=qsl, state_indices=idx,
                             has_initial_state=has_init)  # fmt: skip
                return pool, o

            return step

        reference = functools.partial(gdn.chunk_gated_delta_rule, impl="reference")
        impls = [
            ("ours (Mosaic GPU chunk)", chunk_mgpu.chunk_gated_delta_rule, 1),
            ("jnp reference (chunked)", reference, 1),
        ]
        for impl, fn, n_steps in impls:

            def measure(fn=fn, n_steps=n_steps, n_seq=n_seq, inputs=inputs):
                return jax_per_step_us(ours(fn), pool, _slots_of(rng, n_seq), n_steps=n_steps,
                                       calls=(1, 3), reps=3, operands=inputs)  # fmt: skip

            def device(fn=fn, n_seq=n_seq, inputs=inputs):
                return jax_device_time(ours(fn), pool, _slots_of(rng, n_seq), operands=inputs)

            _record("prefill", shape, impl, measure, _mtoks(t_total), device=device)
        if jla is not None:
            _jla_prefill(jla, rng, pool, shape, n_seq, length)
        if fla is not None:
            _fla_prefill(fla, shape, n_seq, length)


def _jla_prefill(jla, rng, pool, shape, n_seq, length) -> None:
    """Two rows: what a pooled server calls (the pool gather/scatter around jla's op) and jla's
    op alone from zero states (DESIGN.md's jla numbers were measured that way)."""
    dense = _token_inputs(rng, (n_seq, length))

    def attend(dense, initial_state):
        return jla.linear_attention(
            "gated_deltanet", dense["q"], dense["k"], dense["v"], g=dense["g"],
            beta=dense["beta"], impl="mosaic_gpu", initial_state=initial_state,
            output_final_state=True, use_qk_l2norm=True,
        )  # fmt: skip

    def pooled(pool, idx, dense):
        o, final = attend(dense, pool[idx])
        return pool.at[idx].set(final), o

    def alone(pool, idx, dense):
        return pool, attend(dense, None)

    for impl, step in (("jla 0.1.0 (+ pool gather/scatter)", pooled),
                       ("jla 0.1.0 (zero initial state, no pool)", alone)):  # fmt: skip
        _record("prefill", shape, impl,
                lambda step=step: jax_per_step_us(step, pool, _slots_of(rng, n_seq), n_steps=2,
                                                  calls=(1, 3), reps=3, operands=dense),
                _mtoks(n_seq * length),
                device=lambda step=step: jax_device_time(step, pool, _slots_of(rng, n_seq),
                                                         operands=dense))  # fmt: skip


def _fla_prefill(fla, shape, n_seq, length) -> None:
    torch = _torch()
    import triton.testing

    rng = _rng(4)
    t_total = n_seq * length
    x = _torch_inputs(rng, (1, t_total))
    pool = torch.randn(SLOTS, HV, K, V, device="cuda") * 0.1
    idx = torch.as_tensor(_slot_sets(rng, 1, n_seq)[0], device="cuda", dtype=torch.long)
    cu_cpu = torch.arange(0, t_total + 1, length, dtype=torch.long)
    cu = cu_cpu.cuda()

    def run():
        _, ht = fla.chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool.index_select(0, idx),
            output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
        )  # fmt: skip
        pool.index_copy_(0, idx, ht)

    _record("prefill", shape, "FLA chunk (+ pool gather/scatter)",
            lambda: triton.testing.do_bench(run, warmup=50, rep=200, return_mode="median") * 1e3,
            _mtoks(t_total))  # fmt: skip


# ----------------------------------------------------------------------------- conv1d


def bench_conv() -> None:
    rng = _rng(5)
    pool = Pool((SLOTS, CONV_C, CONV_W - 1), jnp.bfloat16, seed=11)
    weight = jnp.asarray(rng.standard_normal((CONV_C, CONV_W)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(CONV_C), jnp.bfloat16)
    for n in CONV_BATCHES:
        x = jnp.asarray(rng.standard_normal((n, 1, CONV_C)), jnp.bfloat16)
        traffic = n * CONV_C * 2 * (2 * (CONV_W - 1) + 2)
        # Rows a program of ours takes (update_mgpu.ROWS_PER_PROGRAM by default), side by side.
        ours = [("ours (Mosaic GPU)", update_mgpu.causal_conv1d_update)]
        ours += [
            (f"ours, {r} rows a program", functools.partial(update_mgpu.causal_conv1d_update,
                                                           rows_per_program=r))
            for r in (2, 4, 8) if r < n
        ]  # fmt: skip
        for impl, fn in (*ours, ("jnp reference", conv_reference.causal_conv1d_update)):

            def step(pool, idx, fn=fn, x=x):
                y, pool = fn(x, weight, bias, pool, idx)
                return pool, y

            def measure(step=step, n=n):
                return jax_per_step_us(step, pool, _slots_of(rng, n))

            _record("conv1d", f"update batch {n}", impl, measure, _tbps(traffic))
    for shape, n_seq, length in CONV_PREFILL:
        t_total = n_seq * length
        x = jnp.asarray(rng.standard_normal((t_total, CONV_C)), jnp.bfloat16)
        qsl = jnp.arange(0, t_total + 1, length, dtype=jnp.int32)
        has_init = jnp.ones((n_seq,), bool)
        traffic = 2 * t_total * CONV_C * 2  # read x, write y (the windows are negligible)
        reference = conv_reference.causal_conv1d_gathered
        for impl, fn in (("ours (Mosaic GPU)", prefill_mgpu.causal_conv1d),
                         ("jnp reference (gathered)", reference)):  # fmt: skip

            def step(pool, idx, fn=fn, x=x, qsl=qsl, has_init=has_init):
                y, pool = fn(x, weight, bias, pool, qsl, idx, has_init)
                return pool, y

            _record("conv1d", f"prefill {shape}", impl, jax_per_step_us, _tbps(traffic), step,
                    pool, _slots_of(rng, n_seq), n_steps=4)  # fmt: skip


# ----------------------------------------------------------------------------- report


def _optional(name: str):
    try:
        return importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 (a missing peer is a note, not a failure)
        print(f"{name}: not available ({type(err).__name__}: {err})", flush=True)
        return None


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "jax": jax.__version__}
    for name in ("jaxlib", "torch", "triton", "fla", "jla"):
        module = sys.modules.get(name) or _optional(name)
        out[name] = getattr(module, "__version__", "?") if module else "absent"
    return out


def _table() -> str:
    lines = ["| group | shape | implementation | step (us) | device (us) | rate | vs FLA | note |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    fla_us = {}
    for row in ROWS:
        if row.impl.startswith("FLA") and row.us and (row.group, row.shape) not in fla_us:
            fla_us[(row.group, row.shape)] = row.us
    for row in ROWS:
        base = fla_us.get((row.group, row.shape))
        ratio = f"{base / row.best_us:.2f}x" if base and row.best_us else ""
        us = f"{row.us:.1f}" if row.us is not None else "-"
        device_us = f"{row.device_us:.1f}" if row.device_us is not None else "-"
        lines.append(f"| {row.group} | {row.shape} | {row.impl} | {us} | {device_us} | "
                     f"{row.rate} | {ratio} | {row.note} |")  # fmt: skip
    return "\n".join(lines)


def _smoke_mode() -> None:
    """Tiny shapes and the kernels under the Mosaic GPU interpreter: runs the whole script
    on a CPU in a minute (no torch, no timing worth reading)."""
    global SMOKE, H, HV, K, V, SLOTS, STATE_BYTES, CONV_C
    global DECODE_BATCHES, VERIFY, PREFILL, CONV_BATCHES, CONV_PREFILL
    SMOKE = True
    H, HV, K, V, SLOTS, CONV_C = 1, 2, 64, 64, 8, 128
    STATE_BYTES = HV * K * V * 4
    DECODE_BATCHES, VERIFY, PREFILL = (1, 2), ((2, 2),), (("2x64", 2, 64),)
    CONV_BATCHES, CONV_PREFILL = (1, 2), (("2x20", 2, 20),)
    for module, name in ((decode_mgpu, "fused_recurrent_gated_delta_rule"),
                         (decode_mgpu, "fused_gating_recurrent_gated_delta_rule"),
                         (recurrent_mgpu, "verify_gated_delta_rule"),
                         (update_mgpu, "causal_conv1d_update"),
                         (prefill_mgpu, "causal_conv1d"),
                         (chunk_mgpu, "chunk_gated_delta_rule")):  # fmt: skip
        setattr(module, name, functools.partial(getattr(module, name), interpret=True))


def _write_report(out: Path, device_kind: str) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in _versions().items())
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    table = _table()
    report = (
        "# Gated DeltaNet benchmark results\n\n"
        f"Measured {stamp} on {device_kind} by `benchmarks/gdn.py` (one run, every row "
        f"measured in it).\n\nVersions: {versions}.\n\n"
        f"Shapes: Qwen3-Next TP1, H={H}, HV={HV}, K={K}, V={V}, bf16 activations, fp32 ssm pool "
        f"of {SLOTS} slots, fresh random slots every step; conv1d C={CONV_C}, W={CONV_W}, bf16. "
        "Decode/verify rates are state bytes moved (decode: read + write the state; verify: "
        "read it once and write D states; FLA verify writes no states) per second of device "
        "time where it was measured, else of step time; prefill rates are tokens per second "
        "(compute limit about 135 Mtok/s). `step` = JAX steps unrolled in one executable "
        "(host launch work included) or FLA's CUDA-graph replay per step; `device` = the "
        "kernels' own durations per call from a profiler trace (JAX rows). `vs FLA` "
        "= step time of the first FLA row of that shape (decode: FLA with the pool "
        "gather/scatter a pooled serving step needs; verify: FLA outputs only) over the row's "
        "device time (step time where there is none). Timing: see the docstring of "
        "`benchmarks/gdn.py`.\n\n"
        f"{table}\n"
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "RESULTS.md").write_text(report)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--only", default="decode,verify,prefill,conv")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--budget", type=float, default=0, help="seconds; later rows skipped")
    parser.add_argument("--prefill-shapes", default=None,
                        help="comma-separated names, e.g. '4x8192,varlen 64x256'")  # fmt: skip
    args = parser.parse_args()
    global DEADLINE, PREFILL
    if args.budget:
        DEADLINE = time.monotonic() + args.budget
    if args.prefill_shapes:
        wanted = args.prefill_shapes.split(",")
        unknown = sorted(set(wanted) - {name for name, _, _ in PREFILL})
        if unknown:
            parser.error(f"--prefill-shapes {unknown} not among {[n for n, _, _ in PREFILL]}")
        PREFILL = tuple(next(s for s in PREFILL if s[0] == name) for name in wanted)  # that order
    groups = args.only.split(",")
    if args.smoke:
        _smoke_mode()
    fla = _optional("fla.ops.gated_delta_rule")
    jla = _optional("jla.ops")
    device_kind = jax.devices()[0].device_kind
    print(f"device: {device_kind}", flush=True)
    runs = {
        "decode": lambda: bench_decode(fla),
        "verify": lambda: bench_verify(fla),
        "prefill": lambda: bench_prefill(fla, jla),
        "conv": bench_conv,
    }
    table = ""
    for group in groups:
        runs[group]()
        # Written after every group: a run cut short still leaves its rows.
        table = _write_report(Path(args.out), device_kind)
    print("\n" + table, flush=True)


if __name__ == "__main__":
    main()
