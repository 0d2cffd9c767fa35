"""Whether XLA runs a product beside a GDN decode kernel when JAX puts it on a second stream
(``jax.experimental.compute_on``, ``gpu_stream:1``; XLA flag
``--xla_gpu_experimental_stream_annotation``), on the H200.

At 256 decoding rows a GDN layer's decode kernel is bound by the states it reads and writes,
and the layer's ``z`` product (the output gate's input, 4096 x 4096 at the 9B-like model) by
the tensor cores; the kernel does not need ``z``, so the two could run at once. One call runs
``LAYERS`` such pairs, each layer's input the last one's output; ``device_time`` gives the
summed kernel time and the span of a call. With overlap the span falls below the sum.

    python3 benchmarks/stream_overlap_probe.py            # both variants, in two processes
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ANNOTATION_FLAG = "--xla_gpu_experimental_stream_annotation=true"
ROWS, H, HV, K, V, HIDDEN, LAYERS = 256, 16, 32, 128, 128, 4096, 4


def run(on_second_stream: bool) -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental.compute_on import compute_on

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from device_time import device_time

    from pallas_kernels.gdn import decode_mgpu

    keys = iter(jax.random.split(jax.random.key(0), 16))

    def normal(shape, dtype=jnp.bfloat16, scale=1.0):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    slots = LAYERS * ROWS + 1
    pool = normal((slots, HV, K, V), jnp.float32, 0.1)
    x = normal((ROWS, HIDDEN))
    wq = normal((HIDDEN, 2 * H * K + HV * V), scale=HIDDEN**-0.5)
    wz = normal((HIDDEN, HV * V), scale=HIDDEN**-0.5)
    wo = normal((HV * V, HIDDEN), scale=(HV * V) ** -0.5)
    g = -jax.nn.softplus(normal((ROWS, 1, HV), jnp.float32))
    beta = jax.nn.sigmoid(normal((ROWS, 1, HV), jnp.float32))
    rows = jnp.arange(ROWS, dtype=jnp.int32)

    def z_product(h, w):
        return h @ w

    gate = (
        compute_on(compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)(
            z_product
        )
        if on_second_stream
        else z_product
    )

    def layers(pool, x):
        h = x
        for layer in range(LAYERS):
            qkv = (h @ wq).reshape(ROWS, 1, -1)
            q = qkv[..., : H * K].reshape(ROWS, 1, H, K)
            k = qkv[..., H * K : 2 * H * K].reshape(ROWS, 1, H, K)
            v = qkv[..., 2 * H * K :].reshape(ROWS, 1, HV, V)
            z = gate(h, wz)
            o, pool = decode_mgpu.fused_recurrent_gated_delta_rule(
                q, k, v, g, beta, pool, 1 + layer * ROWS + rows
            )
            h = ((o.reshape(ROWS, -1) * jax.nn.silu(z)) @ wo + h).astype(jnp.bfloat16)
        return pool, h

    compiled = jax.jit(layers, donate_argnums=0).lower(pool, x).compile()
    text = compiled.as_text()
    state = {"pool": pool}

    def call():
        state["pool"], h = compiled(state["pool"], x)
        return h

    t = device_time(call, calls=20)
    name = "z on stream 1" if on_second_stream else "one stream"
    async_ops = text.count("async-start") + text.count("call-start")
    print(
        f"{name:>14}: kernels {t.us:8.1f} us, span {t.span_us:8.1f} us a call of {LAYERS} "
        f"layers; async starts in the HLO: {async_ops}; {t.breakdown(4)}",
        flush=True,
    )


def main() -> None:
    if len(sys.argv) > 1:
        run(sys.argv[1] == "stream")
        return
    for variant in ("plain", "stream"):
        env = dict(os.environ)
        if variant == "stream":
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {ANNOTATION_FLAG}".strip()
        done = subprocess.run([sys.executable, __file__, variant], env=env, text=True,
                              capture_output=True)  # fmt: skip
        lines = (done.stdout + done.stderr).strip().splitlines()
        print("\n".join(lines[-3:]) if done.returncode else lines[-1], flush=True)


if __name__ == "__main__":
    main()
