"""Tree verify through whole models (Qwen3-Next: GDN + gated attention; Nemotron-H: Mamba2 +
attention): every node of a tree sees exactly its root path, and committing an accepted node
continues like the plain run over that path.

The oracle of node i is a chain verify (a chain-only policy, i.e. the chain paths of every
kernel and the causal mask) of its root path, padded to D tokens with filler tokens that come
after it and so cannot change its logits.
"""

from __future__ import annotations

import collections
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.backend.commit import commit_tree_verified
from hybrid_jax.kv_cache import accepted_path, init_kv_cache
from hybrid_jax.metadata import BucketPolicy, RowSpec, build_metadata
from hybrid_jax.models.nemotron_h_loading import load_nemotron_h
from hybrid_jax.models.qwen3_next_loading import load_qwen3_next
from hybrid_jax.modes import ForwardMode
from hybrid_jax.state_pool import init_state_pool

M = ForwardMode
FIXTURES = pathlib.Path(__file__).parent / "fixtures"
D, PAGE, NUM_SLOTS, NUM_PAGES = 4, 4, 4, 16
CHAIN = BucketPolicy(
    batch_buckets=(2,), token_buckets=(16,), num_draft_tokens=D, page_size=PAGE, max_context=24
)
TREE = BucketPolicy(
    batch_buckets=(2,), token_buckets=(16,), num_draft_tokens=D, page_size=PAGE, max_context=24,
    tree_drafts=True,
)  # fmt: skip
TREES = ((-1, 0, 0, 2), (-1, 0, 1, 1))  # a branch at the root, a branch at node 1
SLOTS, PAGES = (1, 3), ((9, 2, 14, 5), (4, 11, 7, 1))
PROMPTS = ((5, 17, 3, 40, 8), (61, 2, 33))
REQUESTS = tuple(zip(SLOTS, PROMPTS, PAGES, strict=True))
TOL = 1e-5  # float32 relative error between two computations of the same logits


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


class Runner:
    """One model's jitted forward (reference ops, pools not donated)."""

    def __init__(self, model):
        self.model = model
        self.traces = collections.Counter()
        graphdef, self.params = nnx.split(model)

        def forward(params, tokens, pool, kv, meta):
            self.traces[meta.mode, meta.tree] += 1
            return nnx.merge(graphdef, params)(tokens, pool, kv, meta, impl="reference")

        self.forward = jax.jit(forward)
        self.commit = jax.jit(commit_tree_verified)

    def step(self, mode, rows, tokens, pool, kv, policy=CHAIN):
        meta = build_metadata(mode, rows, policy, num_slots=NUM_SLOTS, num_pages=NUM_PAGES)
        padded = np.zeros(meta.num_tokens, np.int32)
        padded[: len(tokens)] = tokens
        out = self.forward(self.params, jnp.asarray(padded), pool, kv, meta)
        return np.asarray(out.logits)[: len(tokens)], out, meta

    def prefilled(self):
        """Both requests' prompts in the pool and cache (random pool, NaN-poisoned cache)."""
        pool = init_state_pool(self.model.state_specs(), NUM_SLOTS)
        keys = iter(jax.random.split(jax.random.key(0), 64))
        pool = jax.tree.map(lambda a: jax.random.normal(next(keys), a.shape, a.dtype), pool)
        kv = init_kv_cache(self.model.kv_specs(), NUM_PAGES, PAGE)
        kv = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), kv)
        rows = [RowSpec(s, 0, len(p), pages) for s, p, pages in REQUESTS]
        _, out, _ = self.step(M.EXTEND, rows, np.concatenate(PROMPTS), pool, kv)
        return out.pool, out.kv


@pytest.fixture(scope="module", params=["qwen3_next", "nemotron_h"])
def run(request):
    load = {"qwen3_next": load_qwen3_next, "nemotron_h": load_nemotron_h}[request.param]
    name = {"qwen3_next": "moe", "nemotron_h": "hybrid"}[request.param]
    return Runner(load(FIXTURES / request.param / name))


def _path(parents, node):
    path = [node]
    while parents[path[0]] >= 0:
        path.insert(0, parents[path[0]])
    return path


def _drafts(seed):
    return np.random.default_rng(seed).integers(1, 64, (len(TREES), D)).astype(np.int32)


def _tree_step(run, pool, kv, drafts, trees=TREES):
    rows = [
        RowSpec(s, len(p), D, pages, parents=tree)
        for s, p, pages, tree in zip(SLOTS, PROMPTS, PAGES, trees, strict=True)
    ]
    return run.step(M.TARGET_VERIFY, rows, drafts.reshape(-1), pool, kv, TREE)


# Qwen3-Next only: Mamba2's tree verify is checked node by node at the op level
# (tests/kernels/test_tree_verify_kernels.py), and through Nemotron-H by the commit test below.
@pytest.mark.parametrize("run", ["qwen3_next"], indirect=True)
def test_every_tree_node_gets_the_logits_of_a_chain_over_its_root_path(run):
    pool, kv = run.prefilled()
    drafts = _drafts(1)
    logits, _, _ = _tree_step(run, pool, kv, drafts)
    logits = logits.reshape(len(TREES), D, -1)
    filler = np.full(D, 7, np.int32)
    for node in range(D):
        paths = [_path(tree, node) for tree in TREES]
        tokens = [np.concatenate([d[p], filler])[:D] for d, p in zip(drafts, paths, strict=True)]
        rows = [RowSpec(s, len(p), D, pages) for s, p, pages in REQUESTS]
        chain, _, _ = run.step(M.TARGET_VERIFY, rows, np.concatenate(tokens), pool, kv)
        chain = chain.reshape(len(TREES), D, -1)
        for r, path in enumerate(paths):
            err = _rel(logits[r, node], chain[r, len(path) - 1])
            assert err < TOL, f"row {r} node {node} (path {path}): relative error {err:.1e}"


def test_committing_a_tree_node_continues_like_the_plain_run_over_its_path(run):
    pool, kv = run.prefilled()
    drafts = _drafts(2)
    _, out, meta = _tree_step(run, pool, kv, drafts)
    accepted = np.array([3, 2], np.int32)  # paths 0-2-3 and 0-1-2: both off the chain
    paths = np.asarray(accepted_path(meta.parents[: len(TREES)], jnp.asarray(accepted)))
    assert paths.tolist() == [[0, 2, 3, -1], [0, 1, 2, -1]]
    spec_pool, spec_kv = run.commit(out.pool, out.kv, out.verify, meta, jnp.asarray(accepted))
    # Another topology in the same bucket runs the same executable.
    _tree_step(run, pool, kv, drafts, trees=((-1, 0, 0, 0), (-1, 0, 1, 2)))
    assert run.traces[M.TARGET_VERIFY, True] == 1

    # The plain run: the accepted path as an ordinary continuation of each prompt.
    kept = [drafts[r][p[p >= 0]] for r, p in enumerate(paths)]
    rows = [
        RowSpec(s, len(p), len(k), pages)
        for s, p, k, pages in zip(SLOTS, PROMPTS, kept, PAGES, strict=True)
    ]
    _, plain, _ = run.step(M.EXTEND, rows, np.concatenate(kept), pool, kv)
    for got, want in zip(jax.tree.leaves(spec_pool), jax.tree.leaves(plain.pool), strict=True):
        for slot in SLOTS:
            assert _rel(got[slot], want[slot]) < TOL, "committed state"

    # The next step (the bonus token) reads the moved keys and values.
    bonus = np.array([12, 30], np.int32)
    rows = [
        RowSpec(s, len(p) + len(k), 1, pages)
        for s, p, k, pages in zip(SLOTS, PROMPTS, kept, PAGES, strict=True)
    ]
    spec_logits, spec_next, _ = run.step(M.DECODE, rows, bonus, spec_pool, spec_kv)
    plain_logits, plain_next, _ = run.step(M.DECODE, rows, bonus, plain.pool, plain.kv)
    assert _rel(spec_logits, plain_logits) < TOL
    leaves = (jax.tree.leaves(spec_next.pool), jax.tree.leaves(plain_next.pool))
    for got, want in zip(*leaves, strict=True):
        for slot in SLOTS:
            assert _rel(got[slot], want[slot]) < TOL, "state after the next step"
