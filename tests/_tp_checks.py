"""Tensor parallelism measured on four host CPU devices: run by tests/test_tensor_parallel.py
in a process of its own (the device count is fixed when JAX starts), it prints one JSON object
of what it saw and the test module asserts on it. With ``lowering`` (run by
tests/test_gpu_lowering.py) it lowers the GPU tests' models' steps cut over two devices for
the GPU instead, with their kernels, and prints the kernels each step holds.

    python tests/_tp_checks.py [lowering]  # XLA_FLAGS: --xla_force_host_platform_device_count=4
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from traceback import format_exception  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from hybrid_jax import Engine, EngineConfig, SamplingParams, parallel  # noqa: E402
from hybrid_jax.engine.speculative import SpeculativeConfig  # noqa: E402
from hybrid_jax.kv_cache import init_kv_cache  # noqa: E402
from hybrid_jax.metadata import BucketPolicy, RowSpec, build_metadata  # noqa: E402
from hybrid_jax.models.auto import load_checkpoint  # noqa: E402
from hybrid_jax.models.layer_scan import fold_scanned_norms, scan_layers  # noqa: E402
from hybrid_jax.models.nemotron_h import NemotronH, NemotronHConfig  # noqa: E402
from hybrid_jax.models.qwen3_next import Qwen3Next, tiny_qwen3_next_config  # noqa: E402
from hybrid_jax.models.tokenizer import ByteTokenizer  # noqa: E402
from hybrid_jax.modes import ForwardMode  # noqa: E402
from hybrid_jax.state_pool import init_state_pool  # noqa: E402

M = ForwardMode
SLOTS, PAGES, PAGE = 4, 20, 8
POLICY = BucketPolicy(batch_buckets=(2,), token_buckets=(16,), max_context=64, page_size=PAGE)

# Every cut is real at tp=4: GDN 4 key / 8 value heads, attention 8 query / 4 KV heads, 8
# experts of width 32 (a dense MLP of 128 in layer 2), vocabulary 256.
QWEN = dataclasses.replace(
    tiny_qwen3_next_config(), num_attention_heads=8, num_key_value_heads=4,
    linear_num_key_heads=4, linear_num_value_heads=8, num_experts=8, num_nextn_predict_layers=0,
)  # fmt: skip
QWEN_MTP = dataclasses.replace(QWEN, num_nextn_predict_layers=1)
# Two repeats of a block of MoE layers: scanned, and folded (``fold_scanned_norms``).
QWEN_REPEATED = dataclasses.replace(
    QWEN, num_hidden_layers=8, mlp_only_layers=(),
    layer_types=("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3
    + ("full_attention",),
)  # fmt: skip
# Mamba2 4 heads in 4 groups, attention 4 query / 4 KV heads, a latent MoE of 4 experts with a
# shared expert, biases on every projection that has one (the row-cut ones are added once).
NEMOTRON = NemotronHConfig(
    vocab_size=128, hidden_size=32, layers_block_type=(
        "full_attention", "linear_attention", "moe", "linear_attention", "mlp",
    ), num_attention_heads=4, num_key_value_heads=4, head_dim=8, intermediate_size=48,
    mamba_num_heads=4, mamba_head_dim=8, n_groups=4, ssm_state_size=8, use_bias=True,
    mlp_bias=True, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24, moe_latent_size=16,
)  # fmt: skip


def _randomised(model: nnx.Module, seed: int) -> nnx.Module:
    """Every parameter drawn afresh (biases and norms away from their initial zeros and ones)."""
    rng = np.random.default_rng(seed)
    for _, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = param.get_value()
        scale = 0.3 if value.ndim > 1 else 0.1
        param.set_value(jnp.asarray(rng.standard_normal(value.shape) * scale, value.dtype))
    return model


def _steps(
    model: nnx.Module, tp: int, fold: bool = False
) -> tuple[list[np.ndarray], np.ndarray, str]:
    """Logits of an EXTEND step (two prompts) then a DECODE step, the states after them and
    the compiled DECODE step's HLO, with the model cut over ``tp`` devices (its scanned
    layers' norm weights folded into their products with ``fold``)."""
    mesh = parallel.make_mesh(tp)
    sharded = parallel.shard_model(model, mesh) if tp > 1 else model
    sharded = scan_layers(sharded)
    if fold:
        fold_scanned_norms(sharded)
    pool = init_state_pool(sharded.state_specs(), SLOTS)
    kv = init_kv_cache(sharded.kv_specs(), PAGES, PAGE)
    if tp > 1:
        pool, kv = parallel.shard_pool(pool, mesh), parallel.shard_kv_cache(kv, mesh)
    graphdef, params = nnx.split(sharded)

    @jax.jit
    def forward(params, tokens, pool, kv, meta):
        return nnx.merge(graphdef, params)(tokens, pool, kv, meta, impl="reference")

    with parallel.on_mesh(mesh):
        rows = [RowSpec(1, 0, 7, (1,)), RowSpec(2, 0, 5, (2,))]
        meta = build_metadata(M.EXTEND, rows, POLICY, num_slots=SLOTS, num_pages=PAGES)
        tokens = np.zeros(meta.num_tokens, np.int32)
        tokens[:12] = np.arange(12) * 7 % 101
        out = forward(params, jnp.asarray(tokens), pool, kv, meta)
        rows = [RowSpec(1, 7, 1, (1,)), RowSpec(2, 5, 1, (2,))]
        meta = build_metadata(M.DECODE, rows, POLICY, num_slots=SLOTS, num_pages=PAGES)
        args = (params, jnp.asarray([3, 4], jnp.int32), out.pool, out.kv, meta)
        decode = forward.lower(*args).compile()
        hlo, out2 = decode.as_text(), decode(*args)
    logits = [np.asarray(out.logits)[:12], np.asarray(out2.logits)[:2]]
    return logits, np.asarray(out2.pool.ssm), hlo


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _collectives(hlo: str) -> dict:
    """How many all-reduces the HLO has, and the result shapes of its all-gathers."""
    gathers = re.findall(r"= (\w+\[[\d,]*\])[^=]*? all-gather\(", hlo)
    return {"all_reduce": hlo.count(" all-reduce("), "all_gather_shapes": gathers}


def forward_checks() -> dict:
    result = {}
    for name, model, fold in (
        ("qwen", _randomised(Qwen3Next(QWEN, rngs=nnx.Rngs(0)), 1), False),
        ("nemotron", _randomised(NemotronH(NEMOTRON, rngs=nnx.Rngs(0)), 2), False),
        ("qwen_folded", _randomised(Qwen3Next(QWEN_REPEATED, rngs=nnx.Rngs(0)), 3), True),
    ):
        want, states, _ = _steps(model, 1, fold)
        for tp in (2, 4):
            got, got_states, hlo = _steps(model, tp, fold)
            result[f"{name}_tp{tp}"] = {
                "logits_rel": [_rel(g, w) for g, w in zip(got, want, strict=True)],
                "states_rel": _rel(got_states, states),
                **_collectives(hlo),
            }
    return result


def engine_checks() -> dict:
    prompts = [list(b"abcabcabcabc"), list(b"hello")]
    greedy = SamplingParams(max_new_tokens=8)
    mtp = SpeculativeConfig("mtp", num_draft_tokens=3)
    mtp_tree = SpeculativeConfig("mtp", num_draft_tokens=4, tree=True, tree_parents=(-1, 0, 0, 1))
    result = {}
    for name, tp, spec in (
        ("tp1", 1, None), ("tp4", 4, None), ("tp2_ngram", 2, SpeculativeConfig(num_draft_tokens=3)),
        ("tp2_mtp", 2, mtp), ("tp2_mtp_tree", 2, mtp_tree),
    ):  # fmt: skip
        config = EngineConfig(
            max_batch=2, max_tokens=16, max_context=64, batch_buckets=(2,), token_buckets=(16,),
            impl="reference", cache_dir=None, tensor_parallel=tp, speculative=spec,
        )  # fmt: skip
        # The same weights with an MTP head: the target's forward does not read the head.
        model_config = QWEN if spec is None or spec.source != "mtp" else QWEN_MTP
        model = Qwen3Next(model_config, rngs=nnx.Rngs(0))
        engine = Engine(model, ByteTokenizer(), config, progress=False)
        tokens = [r.token_ids for r in engine.generate(prompts, greedy)]
        pool = engine.state.pool
        result[name] = {
            "tokens": tokens,
            "retraces": engine.retraces,
            "pool_devices": len(pool.ssm.sharding.device_set),
            "verify_steps": engine.speculative_stats.steps,
            "head_kv_devices": engine.mtp and len(engine.mtp.kv.k.sharding.device_set),
        }
    return result


def _greedy(model: nnx.Module, prompt: list[int], n: int) -> list[int]:
    """The ``n`` greedy tokens after ``prompt`` on one device, step by step (no engine)."""
    graphdef, params = nnx.split(model)
    forward = jax.jit(
        lambda params, tokens, pool, kv, meta: nnx.merge(graphdef, params)(
            tokens, pool, kv, meta, impl="reference"
        )
    )
    pool = init_state_pool(model.state_specs(), SLOTS)
    kv = init_kv_cache(model.kv_specs(), PAGES, PAGE)
    pages, tokens = (1, 2), list(prompt)
    for _ in range(n):
        done = len(tokens) - len(prompt)
        start, length = (0, len(prompt)) if not done else (len(tokens) - 1, 1)
        mode = M.EXTEND if not done else M.DECODE
        meta = build_metadata(
            mode, [RowSpec(1, start, length, pages)], POLICY, num_slots=SLOTS, num_pages=PAGES
        )
        padded = np.zeros(meta.num_tokens, np.int32)
        padded[:length] = tokens[start:]
        out = forward(params, jnp.asarray(padded), pool, kv, meta)
        pool, kv = out.pool, out.kv
        tokens.append(int(np.argmax(np.asarray(out.logits)[length - 1])))
    return tokens[len(prompt) :]


def checkpoint_checks() -> dict:
    """A checkpoint loaded straight onto two devices: no weight whole on one device, and an
    engine over it serves the greedy tokens of the model on one device."""
    folder = pathlib.Path(__file__).parent / "fixtures" / "qwen3_next" / "moe"
    mesh = parallel.make_mesh(2)
    model = load_checkpoint(folder, mesh=mesh)
    kernel = model.layers[0].linear_attn.in_proj_qkv.kernel.get_value()
    prompt = list(b"abcabc")
    want = _greedy(load_checkpoint(folder), prompt, 6)
    config = EngineConfig(
        max_batch=2, max_tokens=16, max_context=64, batch_buckets=(2,), token_buckets=(16,),
        impl="reference", cache_dir=None, tensor_parallel=2,
    )  # fmt: skip
    engine = Engine.from_checkpoint(folder, config, tokenizer=ByteTokenizer(), progress=False)
    got = engine.generate([prompt], SamplingParams(max_new_tokens=6))[0].token_ids
    return {
        "checkpoint": {
            "placed": parallel.is_placed(model, mesh),
            "shard_sizes": [s.data.size for s in kernel.addressable_shards],
            "size": kernel.size,
            "tokens": got,
            "want": want,
        }
    }


def lowering_checks() -> dict:
    """For each GPU-test model cut over two devices, and each of its DECODE and EXTEND steps
    lowered for the GPU with ``impl="auto"`` deciding as on an H200: the Pallas kernels the
    step holds, or the error that stopped it."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from _kernel_sized import (  # noqa: PLC0415
        kernel_sized_nemotron_h_config,
        repeated_moe_qwen3_next_config,
        with_zero_weights,
    )

    from pallas_kernels import _common  # noqa: PLC0415

    _common.on_hopper_gpu = lambda: True
    builds = {
        "qwen": lambda: Qwen3Next(repeated_moe_qwen3_next_config(), rngs=nnx.Rngs(0)),
        "nemotron": lambda: NemotronH(kernel_sized_nemotron_h_config(), rngs=nnx.Rngs(0)),
    }
    policy = BucketPolicy(batch_buckets=(8,), token_buckets=(64,), max_context=256, page_size=16)
    slots, pages = 9, 64
    result = {}
    for name, build in builds.items():
        mesh = parallel.make_mesh(2)
        model = scan_layers(parallel.shard_model(with_zero_weights(build), mesh))
        pool = parallel.shard_pool(init_state_pool(model.state_specs(), slots), mesh)
        kv = parallel.shard_kv_cache(init_kv_cache(model.kv_specs(), pages, 16), mesh)
        graphdef, params = nnx.split(model)

        @jax.jit
        def forward(params, tokens, pool, kv, meta, graphdef=graphdef):
            return nnx.merge(graphdef, params)(tokens, pool, kv, meta, impl="auto")

        steps = ((M.DECODE, RowSpec(1, 7, 1, (1,))), (M.EXTEND, RowSpec(1, 0, 40, (1, 2, 3))))
        for mode, row in steps:
            with parallel.on_mesh(mesh):
                meta = build_metadata(mode, [row], policy, num_slots=slots, num_pages=pages)
                tokens = jnp.zeros((meta.num_tokens,), jnp.int32)
                try:
                    traced = forward.trace(params, tokens, pool, kv, meta)
                    text = traced.lower(lowering_platforms=("cuda",)).as_text()
                except Exception as error:  # the test shows what stopped the step
                    result[f"{name}_{mode.name}"] = "".join(format_exception(error))[-3000:]
                    continue
            # A kernel's module names its function ``\00<kernel>_mosaic_gpu\00``.
            found = re.findall(r"\\00([a-z0-9_]+?)_mosaic_gpu\\00", text)
            result[f"{name}_{mode.name}"] = sorted(set(found))
    return result


if __name__ == "__main__":
    if sys.argv[1:] == ["lowering"]:
        checks = lowering_checks()
    elif sys.argv[1:] == ["engines"]:
        checks = engine_checks()
    else:
        checks = {**forward_checks(), **checkpoint_checks()}
    print(json.dumps({"devices": jax.device_count(), **checks}))
