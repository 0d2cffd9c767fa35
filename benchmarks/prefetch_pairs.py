"""Launch pairs of a batch-1 decode step, with and without the first launch bringing what the
second reads into L2 (``pallas_kernels._prefetch``).

Each pair is two launches a Qwen3.5-35B-A3B-like step runs back to back, the first leaving
HBM mostly idle: the GDN decode kernel then the output projection's partial products
(``gdn``), the paged decode kernel then ``o_proj``'s (``attention``), the experts' hidden
rows then their down products (``experts``), the router's launch then the shared expert's
down product (``router``), the conv update then the GDN decode kernel (``conv``). Each call
takes the next of ``CYCLE`` weight copies, expert sets or slots, so what it reads comes from
HBM as in a step, where every layer reads its own; the bucket holds 8 rows, one real.

On the H200 (about a minute)::

    python3 benchmarks/prefetch_pairs.py [--pairs gdn,attention,experts,router,conv]

Prints per pair and setting the device us of each launch and of the call (median over the
traced calls), and checks that the prefetch changed no output bit. ``--smoke`` runs tiny
shapes in the CPU interpreter: the checks only, no timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from device_time import device_time  # noqa: E402

from pallas_kernels import conv1d, gdn, moe, projections  # noqa: E402
from pallas_kernels.attention import paged_decode  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
ROWS = 8  # the smallest decode bucket; row 0 is real


@dataclasses.dataclass(frozen=True)
class Dims:
    hidden: int = 2048
    key_heads: int = 16
    value_heads: int = 32
    head: int = 128  # GDN key and value head dim
    q_heads: int = 16
    kv_heads: int = 2
    attention_head: int = 256
    experts: int = 256
    top_k: int = 8
    expert_width: int = 512
    shared_width: int = 512
    positions: int = 32  # the real row's context
    cycle: int = 8  # weight copies, expert sets and slots a run cycles through

    @property
    def channels(self) -> int:
        return 2 * self.key_heads * self.head + self.value_heads * self.head


SMOKE = Dims(hidden=256, key_heads=1, value_heads=2, head=64, q_heads=2, kv_heads=1,
             attention_head=64, experts=64, top_k=2, expert_width=128, shared_width=128,
             positions=20, cycle=1)  # fmt: skip


def _normal(rng, shape, dtype=BF16, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _one_real_row(values: np.ndarray, pad) -> np.ndarray:
    out = np.full((ROWS, *values.shape), pad, values.dtype)
    out[0] = values
    return out


class Pair:
    """A pair's inputs for ``d.cycle`` calls and its jitted two launches; ``call(i,
    prefetch)`` runs call i's pair."""

    def __init__(self, run: Callable, inputs: list[tuple], donate: tuple[int, ...] = ()):
        self._run = {p: jax.jit(functools.partial(run, prefetch=p), donate_argnums=donate)
                     for p in (False, True)}  # fmt: skip
        self._inputs = inputs
        self._donate = donate
        self._carried: dict[int, jax.Array] = {}

    def call(self, i: int, prefetch: bool):
        args = list(self._inputs[i % len(self._inputs)])
        for k in self._donate:  # a donated pool goes from call to call
            args[k] = self._carried.get(k, args[k])
        out = self._run[prefetch](*args)
        for position, k in enumerate(self._donate):  # the run returns the pools first
            self._carried[k] = out[position]
        return out

    def check(self) -> None:
        """Raises when a call with the prefetch gives other bits than without (each run on
        its own copies of the inputs, which it may donate)."""
        for i, inputs in enumerate(self._inputs):
            outs = [self._run[p](*[jnp.copy(a) for a in inputs]) for p in (False, True)]
            for a, b in zip(*(jax.tree.leaves(o) for o in outs), strict=True):
                a, b = np.asarray(a), np.asarray(b)
                if not np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}")):
                    raise RuntimeError(f"call {i}: the prefetch changed an output")


def gdn_pair(d: Dims, rng, impl: str) -> Pair:
    slots = d.cycle + 1
    pool = _normal(rng, (slots, d.value_heads, d.head, d.head), F32, 0.1)
    gate_params = gdn.stack_gate_params(_normal(rng, d.value_heads, F32),
                                        _normal(rng, d.value_heads, F32))  # fmt: skip
    norm_weight = jnp.asarray(rng.uniform(0.5, 1.5, d.head), F32)
    inputs = []
    for i in range(d.cycle):
        qkv = _normal(rng, (ROWS, 1, d.channels))
        ba = _normal(rng, (ROWS, 1, 2 * d.value_heads))
        z = _normal(rng, (ROWS, 1, d.value_heads * d.head))
        idx = jnp.asarray(_one_real_row(np.array(i + 1, np.int32), 0))
        w_out = _normal(rng, (d.value_heads * d.head, d.hidden), scale=0.02)
        inputs.append((pool, qkv, ba, z, idx, w_out))

    def run(pool, qkv, ba, z, idx, w_out, *, prefetch):
        norm = gdn.OutputNorm(z, norm_weight, 1e-6)
        o, pool = gdn.packed_gating_recurrent_gated_delta_rule(
            qkv, ba, gate_params, pool, idx, output_norm=norm, impl=impl,
            prefetch=(w_out,) if prefetch else (),
        )  # fmt: skip
        (partials,) = projections.projection_partials(o.reshape(ROWS, -1), [w_out], impl=impl)
        return pool, o, partials

    return Pair(run, inputs, donate=(0,))


def attention_pair(d: Dims, rng, impl: str) -> Pair:
    page_size = 16
    pages_per_row = -(-d.positions // page_size)
    pages = d.cycle * pages_per_row + 1
    shape = (pages, page_size, d.kv_heads, d.attention_head)
    k_pages, v_pages = _normal(rng, shape), _normal(rng, shape)
    lens = jnp.asarray(_one_real_row(np.array(d.positions, np.int32), 0))
    inputs = []
    for i in range(d.cycle):
        q = _normal(rng, (ROWS, d.q_heads, d.attention_head))
        row = np.arange(pages_per_row, dtype=np.int32) + 1 + i * pages_per_row
        table = jnp.asarray(_one_real_row(row, 0))
        w_o = _normal(rng, (d.q_heads * d.attention_head, d.hidden), scale=0.02)
        inputs.append((q, table, w_o))

    def run(q, table, w_o, *, prefetch):
        out = paged_decode.paged_decode_attention(
            q, k_pages, v_pages, table, lens, scale=d.attention_head**-0.5, impl=impl,
            prefetch=(w_o,) if prefetch else (),
        )  # fmt: skip
        (partials,) = projections.projection_partials(out.reshape(ROWS, -1), [w_o], impl=impl)
        return out, partials

    return Pair(run, inputs)


def experts_pair(d: Dims, rng, impl: str) -> Pair:
    gate_up = moe.pair_halves(
        _normal(rng, (d.experts, d.hidden, 2 * d.expert_width), scale=d.hidden**-0.5)
    )
    down = _normal(rng, (d.experts, d.expert_width, d.hidden), scale=0.02)
    chosen = rng.permutation(d.experts)[: d.cycle * d.top_k].reshape(d.cycle, d.top_k)
    inputs = []
    for ids in chosen:
        ids = jnp.asarray(_one_real_row(ids.astype(np.int32), d.experts))
        inputs.append((_normal(rng, (ROWS, d.hidden)), ids))

    def run(x, ids, *, prefetch):
        hidden = moe.expert_hidden(
            x, gate_up, ids, tiles=True, impl=impl, prefetch_down=down if prefetch else None
        )
        out = moe.expert_matmul(hidden, down, ids.reshape(-1, 1), impl=impl)
        return hidden.tiles, out

    return Pair(run, inputs)


def router_pair(d: Dims, rng, impl: str) -> Pair:
    inputs = []
    for _ in range(d.cycle):
        router = _normal(rng, (d.hidden, d.experts), scale=d.hidden**-0.5)
        shared = moe.pair_halves(_normal(rng, (d.hidden, 2 * d.shared_width), scale=0.03))
        gate = _normal(rng, (d.hidden, 64), scale=d.hidden**-0.5)
        shared_down = _normal(rng, (d.shared_width, d.hidden), scale=0.02)
        inputs.append((_normal(rng, (ROWS, d.hidden)), router, shared, gate, shared_down))

    def run(x, router, shared, gate, shared_down, *, prefetch):
        logits, hidden, gate_logit = projections.projections(
            x, [router, shared, gate], paired=(False, True, False), impl=impl,
            prefetch=(shared_down,) if prefetch else (),
        )  # fmt: skip
        (partials,) = projections.projection_partials(hidden, [shared_down], impl=impl)
        return logits, gate_logit, partials

    return Pair(run, inputs)


def conv_pair(d: Dims, rng, impl: str) -> Pair:
    slots = d.cycle + 1
    states = _normal(rng, (slots, d.value_heads, d.head, d.head), F32, 0.1)
    conv_pool = _normal(rng, (slots, d.channels, 3))
    conv_weight = _normal(rng, (d.channels, 4), scale=0.5)
    gate_params = gdn.stack_gate_params(_normal(rng, d.value_heads, F32),
                                        _normal(rng, d.value_heads, F32))  # fmt: skip
    norm_weight = jnp.asarray(rng.uniform(0.5, 1.5, d.head), F32)
    inputs = []
    for i in range(d.cycle):
        idx = jnp.asarray(_one_real_row(np.array(i + 1, np.int32), 0))
        inputs.append((states, conv_pool, _normal(rng, (ROWS, 1, d.channels)),
                       _normal(rng, (ROWS, 1, 2 * d.value_heads)),
                       _normal(rng, (ROWS, 1, d.value_heads * d.head)), idx))  # fmt: skip

    def run(states, conv_pool, mixed, ba, z, idx, *, prefetch):
        qkv, conv_pool = conv1d.causal_conv1d_update(
            mixed, conv_weight, None, conv_pool, idx, impl=impl,
            prefetch_slots=(states,) if prefetch else (),
        )  # fmt: skip
        o, states = gdn.packed_gating_recurrent_gated_delta_rule(
            qkv, ba, gate_params, states, idx, output_norm=gdn.OutputNorm(z, norm_weight, 1e-6),
            impl=impl,
        )  # fmt: skip
        return states, conv_pool, o

    return Pair(run, inputs, donate=(0, 1))


PAIRS = {
    "gdn": gdn_pair,
    "attention": attention_pair,
    "experts": experts_pair,
    "router": router_pair,
    "conv": conv_pair,
}


def measure(pair: Pair, cycle: int, prefetch: bool) -> str:
    """One table row's cells: each launch's device us and the call's, its span."""
    counter = iter(range(10**9))
    timed = device_time(lambda: pair.call(next(counter) % cycle, prefetch), calls=4 * cycle)
    launches = "; ".join(f"{name[:40]} {us:.2f}" for name, us in timed.events.items())
    return f"{timed.us:.2f} | {timed.span_us:.2f} | {launches}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--pairs", default=",".join(PAIRS), help="comma-separated, of " + ", ".join(PAIRS)
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes, CPU interpreter, checks only"
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.pairs.split(",") if n.strip()]
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        parser.error(f"--pairs {args.pairs!r}: {unknown} are not pairs ({', '.join(PAIRS)})")
    d, impl = (SMOKE, "interpret") if args.smoke else (Dims(), "pallas")
    rng = np.random.default_rng(0)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; rows {ROWS} (1 real)")
    if not args.smoke:
        print("| pair | prefetch | device us a call | span us | launches (us) |")
        print("| --- | --- | ---: | ---: | --- |")
    for name in names:
        pair = PAIRS[name](d, rng, impl)
        pair.check()
        if args.smoke:
            print(f"{name}: the prefetch changed no output bit", flush=True)
            continue
        for prefetch in (False, True):
            cells = measure(pair, d.cycle, prefetch)
            print(f"| {name} | {'yes' if prefetch else 'no'} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
