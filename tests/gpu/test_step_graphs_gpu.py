"""Decode steps as whole CUDA graphs (``xla_flags.STEP_GRAPH_OPTIONS``, a decode executable's
compile options: XLA's command buffers over the layer scan's while loop and everything else) on
a Hopper GPU: a Qwen3-Next model at kernel-sized dimensions gives the same greedy tokens and
the same log-probabilities, bit for bit, as the same model whose steps compile as XLA chooses.
The same kernels run in the same order either way; only how the host launches them differs.
Both engines run in one process with autotuning off: autotuning picks kernels by timing them,
which two compiles may decide differently.
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
import json, sys
import numpy as np
from flax import nnx
sys.path.insert(0, "tests")
from _kernel_sized import kernel_sized_qwen3_next_config
from hybrid_jax import Engine, EngineConfig, xla_flags
from hybrid_jax.engine.sampling import SamplingParams
from hybrid_jax.models.qwen3_next import Qwen3Next
from hybrid_jax.models.tokenizer import ByteTokenizer

block = ("linear_attention",) * 3 + ("full_attention",)
config = kernel_sized_qwen3_next_config(num_experts=64, num_experts_per_tok=8,
    num_hidden_layers=8, mlp_only_layers=(), layer_types=block * 2)
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 256, n).tolist() for n in (9, 12, 4, 7)]
results = {}
for graphs in (True, False):
    xla_flags.STEP_GRAPHS = graphs  # read when the engine compiles its steps
    engine = Engine(Qwen3Next(config, rngs=nnx.Rngs(0)), ByteTokenizer(), EngineConfig(
        max_batch=8, max_tokens=64, max_context=256, batch_buckets=(8,), token_buckets=(64,),
        cache_dir=None), progress=False)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=12, logprobs=0))
    results[str(graphs)] = [[r.token_ids, r.logprobs] for r in out]
    del engine
print(json.dumps(results))
"""


def test_step_graphs_give_the_tokens_and_logprobs_of_xlas_own_launches():
    env = dict(os.environ, XLA_FLAGS="--xla_gpu_autotune_level=0")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _GENERATE], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    graphs, xla_chooses = results["True"], results["False"]
    assert graphs == xla_chooses
    assert all(len(tokens) == 12 for tokens, _ in graphs)
