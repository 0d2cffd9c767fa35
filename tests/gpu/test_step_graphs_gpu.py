"""The whole step as CUDA graphs (``HYBRID_JAX_STEP_GRAPHS=1``: ``STEP_GRAPH_XLA_FLAGS``, XLA's
command buffers over the layer scan's while loop and everything else) on a Hopper GPU: a
Qwen3-Next model at kernel-sized dimensions gives the same greedy tokens and the same
log-probabilities, bit for bit, as the same model with no command buffers at all. The same
kernels run in the same order either way; only how the host launches them differs. XLA reads
its flags once per process, so each setting runs in a process of its own, both with
autotuning off: autotuning picks kernels by timing them, which two processes sharing a GPU
may decide differently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pallas_kernels._common import on_hopper_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not on_hopper_gpu(), reason="needs an sm_90 GPU"),
]

_GENERATE = """
import dataclasses, json, sys
import numpy as np
from flax import nnx
sys.path.insert(0, "tests")
from _kernel_sized import kernel_sized_qwen3_next_config
from hybrid_jax import Engine, EngineConfig
from hybrid_jax.engine.sampling import SamplingParams
from hybrid_jax.models.qwen3_next import Qwen3Next
from hybrid_jax.models.tokenizer import ByteTokenizer

block = ("linear_attention",) * 3 + ("full_attention",)
config = kernel_sized_qwen3_next_config(num_experts=64, num_experts_per_tok=8,
    num_hidden_layers=8, mlp_only_layers=(), layer_types=block * 2)
engine = Engine(Qwen3Next(config, rngs=nnx.Rngs(0)), ByteTokenizer(), EngineConfig(
    max_batch=8, max_tokens=64, max_context=256, batch_buckets=(8,), token_buckets=(64,),
    cache_dir=None), progress=False)
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 256, n).tolist() for n in (9, 12, 4, 7)]
results = engine.generate(prompts, SamplingParams(max_new_tokens=12, logprobs=0))
print(json.dumps([[r.token_ids, r.logprobs] for r in results]))
"""


def _start(flags: str, step_graphs: bool) -> subprocess.Popen:
    # Two processes share the GPU: neither takes JAX's default 75% of its memory.
    env = dict(
        os.environ, XLA_FLAGS=f"{flags} --xla_gpu_autotune_level=0",
        XLA_PYTHON_CLIENT_MEM_FRACTION="0.3", HYBRID_JAX_STEP_GRAPHS=str(int(step_graphs)),
    )  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    return subprocess.Popen([sys.executable, "-c", _GENERATE], env=env, cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _result(process: subprocess.Popen) -> list:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_step_graphs_give_the_tokens_and_logprobs_of_launches_one_by_one():
    # Both processes compile at once: the check is about bits, not time.
    graphs = _start("", step_graphs=True)
    one_by_one = _start("--xla_gpu_enable_command_buffer=", step_graphs=False)
    graphs, one_by_one = _result(graphs), _result(one_by_one)
    assert graphs == one_by_one
    assert all(len(tokens) == 12 for tokens, _ in graphs)
