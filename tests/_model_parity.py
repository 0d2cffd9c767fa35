"""Logit parity with transformers, shared by the model tests (Qwen3-Next, Nemotron-H).

A plain module, not a test module: pytest's default import mode puts ``tests/`` on
``sys.path``, so the test modules import it by its bare name. It holds the jitted runner, the
reference files' reader and the checks every hybrid model must pass in each forward mode; the
test functions (and their fixtures) stay in the model's test module, named there, and call
these checks with that model's runner and references.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Collection, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.backend.commit import commit_verified
from hybrid_jax.kv_cache import init_kv_cache
from hybrid_jax.metadata import BucketPolicy, RowSpec, build_metadata, example_metadata
from hybrid_jax.modes import ForwardMode, LayerKind, UnsupportedForwardModeError
from hybrid_jax.state_pool import init_state_pool

M = ForwardMode
D = 4
PAGE = 4
NUM_SLOTS, NUM_PAGES = 4, 16
# One bucket per mode, so each mode compiles once per model.
POLICY = BucketPolicy(
    batch_buckets=(2,), token_buckets=(16,), num_draft_tokens=D, page_size=PAGE, max_context=24
)
TOL = 1e-4  # float32 relative error, |ours - ref| / |ref| over a step's logits


class Runner:
    """The model's forward, jitted (one trace per (mode, bucket)); pools are not donated."""

    def __init__(self, model):
        self.model = model
        graphdef, self.params = nnx.split(model)

        def forward(params, tokens, pool, kv, meta):
            return nnx.merge(graphdef, params)(tokens, pool, kv, meta, impl="reference")

        self.forward = jax.jit(forward)

    def fresh(self, seed=0):
        """A pool of random states (rows without initial state must ignore them) and a KV
        cache poisoned with NaN (a read of an unwritten entry would show)."""
        pool = init_state_pool(self.model.state_specs(), NUM_SLOTS)
        keys = iter(jax.random.split(jax.random.key(seed), 64))
        pool = jax.tree.map(lambda a: jax.random.normal(next(keys), a.shape, a.dtype), pool)
        kv = init_kv_cache(self.model.kv_specs(), NUM_PAGES, PAGE)
        kv = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), kv)
        return pool, kv

    def step(self, mode, rows, tokens, pool, kv):
        """Logits of the real tokens ``[n, vocab]`` and the model output."""
        meta = build_metadata(mode, rows, POLICY, num_slots=NUM_SLOTS, num_pages=NUM_PAGES)
        n = sum(row.num_tokens for row in rows)
        padded = np.zeros(meta.num_tokens, np.int32)
        padded[:n] = tokens
        out = self.forward(self.params, jnp.asarray(padded), pool, kv, meta)
        return np.asarray(out.logits)[:n], out


def greedy_tokens(run: Runner, prompt: list[int], pages: tuple[int, ...], n: int) -> list[int]:
    """The ``n`` greedy tokens after ``prompt``, step by step: EXTEND over the prompt in slot
    1 on ``pages``, then DECODE of each argmax."""
    pool, kv = run.fresh()
    logits, out = run.step(M.EXTEND, [RowSpec(1, 0, len(prompt), pages)], prompt, pool, kv)
    tokens = [int(np.argmax(logits[-1]))]
    for i in range(n - 1):
        row = RowSpec(1, len(prompt) + i, 1, pages)
        logits, out = run.step(M.DECODE, [row], tokens[-1:], out.pool, out.kv)
        tokens.append(int(np.argmax(logits[0])))
    return tokens


def references(fixtures: pathlib.Path, names: Iterable[str]) -> dict[str, dict[str, np.ndarray]]:
    """Each fixture's ``reference.npz`` (transformers' tokens and logits), by fixture name."""
    return {name: dict(np.load(fixtures / name / "reference.npz")) for name in names}


def family_fixtures(load: Callable[[pathlib.Path], nnx.Module], fixtures: pathlib.Path,
                    names: tuple[str, ...]):  # fmt: skip
    """A model family's module-scoped ``runners`` and ``refs`` fixtures: a ``Runner`` of
    ``load(fixtures / name)`` and the reference of each fixture ``name``. A test module binds
    them by name (``runners, refs = family_fixtures(...)``)."""

    @pytest.fixture(scope="module")
    def runners():
        return {name: Runner(load(fixtures / name)) for name in names}

    @pytest.fixture(scope="module")
    def refs():
        return references(fixtures, names)

    return runners, refs


def rel_err(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def assert_close(got, want, what):
    assert got.shape == want.shape, what
    assert rel_err(got, want) < TOL, f"{what}: relative error {rel_err(got, want):.2e}"


def params_of(model):
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))}


def check_prefill_then_decode(run: Runner, ref: dict) -> None:
    """EXTEND over the prompt, then DECODE token by token, on scattered pages; the pages the
    request does not own stay NaN."""
    prompt, tokens = ref["prompt"], ref["decode_tokens"]
    p = len(prompt)
    pages = (9, 2, 14, 5)  # scattered on purpose
    pool, kv = run.fresh()
    logits, out = run.step(M.EXTEND, [RowSpec(3, 0, p, pages)], prompt, pool, kv)
    assert_close(logits, ref["prefill_logits"], "prefill")
    for i, token in enumerate(tokens):
        row = RowSpec(3, p + i, 1, pages)
        logits, out = run.step(M.DECODE, [row], [token], out.pool, out.kv)
        assert_close(logits[0], ref["decode_logits"][i], f"decode step {i}")
    others = sorted(set(range(1, NUM_PAGES)) - set(pages))
    for k, v in zip(out.kv.k, out.kv.v, strict=True):
        assert np.isnan(np.asarray(k)[others]).all() and np.isnan(np.asarray(v)[others]).all()


def check_verify_then_commit(run: Runner, ref: dict) -> None:
    """TARGET_VERIFY of D drafts leaves the pool untouched and gives one verify state per
    linear layer; committing two accepted drafts then decoding continues like transformers."""
    prompt, tokens = ref["prompt"], ref["decode_tokens"]
    p, pages = len(prompt), (4, 1, 7, 12)
    pool, kv = run.fresh(1)
    _, out = run.step(M.EXTEND, [RowSpec(2, 0, p, pages)], prompt, pool, kv)
    before = jax.tree.map(np.asarray, out.pool)
    logits, out = run.step(M.TARGET_VERIFY, [RowSpec(2, p, D, pages)], tokens, out.pool, out.kv)
    for i in range(D):
        assert_close(logits[i], ref["decode_logits"][i], f"verify token {i}")
    for got, want in zip(jax.tree.leaves(out.pool), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)  # verify never writes the pool
    assert sorted(i for v in out.verify for i in v.layers) == list(
        range(len(run.model.state_specs()))
    )
    # Accept the first two drafts (step index 1); the rejected drafts' keys stay in the pages
    # and must be overwritten, never read.
    slots = jnp.asarray([2, 0], jnp.int32)
    pool = commit_verified(out.pool, out.verify, slots, jnp.asarray([1, -1], jnp.int32))
    kv = out.kv
    for i in (2, 3):
        logits, out = run.step(M.DECODE, [RowSpec(2, p + i, 1, pages)], [tokens[i]], pool, kv)
        pool, kv = out.pool, out.kv
        assert_close(logits[0], ref["decode_logits"][i], f"decode after commit, token {i}")


def check_chunked_prefill_mixed_and_draft_extend(run: Runner, ref: dict) -> None:
    """A prompt in three chunks: EXTEND, then MIXED beside a fresh request, then the last two
    tokens in DRAFT_EXTEND; every chunk's logits match the one-shot prefill's."""
    prompt, prompt2 = ref["prompt"], ref["prompt2"]
    a, b = (3, 8, 10), (6, 11)
    pool, kv = run.fresh(2)
    logits, out = run.step(M.EXTEND, [RowSpec(1, 0, 5, a)], prompt[:5], pool, kv)
    assert_close(logits, ref["prefill_logits"][:5], "first chunk")
    # MIXED: the first request's second chunk beside a fresh request.
    rows = [RowSpec(1, 5, 4, a), RowSpec(2, 0, len(prompt2), b)]
    x = np.concatenate([prompt[5:9], prompt2])
    logits, out = run.step(M.MIXED, rows, x, out.pool, out.kv)
    assert_close(logits[:4], ref["prefill_logits"][5:9], "second chunk in MIXED")
    assert_close(logits[4:], ref["prefill2_logits"], "fresh request in MIXED")
    # DRAFT_EXTEND: the last two prompt tokens on the fixed bs x D token layout.
    logits, out = run.step(M.DRAFT_EXTEND, [RowSpec(1, 9, 2, a)], prompt[9:], out.pool, out.kv)
    assert_close(logits, ref["prefill_logits"][9:], "DRAFT_EXTEND")


def check_idle_step_changes_nothing(run: Runner) -> None:
    """IDLE gives ``[0, vocab]`` logits and returns the pool and cache bit for bit."""
    pool, kv = jax.tree.map(np.asarray, run.fresh(3))
    _, out = run.step(M.IDLE, [], [], pool, kv)
    assert out.logits.shape == (0, run.model.config.vocab_size)
    for got, want in zip(jax.tree.leaves((out.pool, out.kv)), jax.tree.leaves((pool, kv)),
                         strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got), want)


def check_unsupported_mode_fails_while_tracing(run: Runner, kinds: Collection[LayerKind]) -> None:
    """A mode no layer supports raises while tracing, naming the mode and one of ``kinds``."""
    pool, kv = run.fresh()
    meta = dataclasses.replace(example_metadata(M.DECODE, 2, 2, POLICY), mode=M.DLLM_EXTEND)
    with pytest.raises(UnsupportedForwardModeError, match="DLLM_EXTEND") as err:
        jax.eval_shape(run.forward, run.params, jnp.zeros(2, jnp.int32), pool, kv, meta)
    assert err.value.layer_kind in kinds


def check_layout_is_refused(run: Runner, pool, kv, match: str) -> None:
    """A pool or cache of another layout than the model's raises ``match`` while tracing."""
    meta = example_metadata(M.DECODE, 2, 2, POLICY)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(run.forward, run.params, jnp.zeros(2, jnp.int32), pool, kv, meta)
