"""Engine runs shared by the speculative-decoding tests (n-gram, MTP chain and MTP tree drafts).

A plain module, not a test module: pytest's default import mode puts ``tests/`` (it has no
``__init__.py``) on ``sys.path`` before importing a test module there, so the test modules
import this one by its bare name. The fixtures stay in the test modules, where their scopes
read next to the tests that share them; they call the builders here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from hybrid_jax import Engine, EngineConfig
from hybrid_jax.cli import main
from hybrid_jax.engine.sampling import SamplingParams
from hybrid_jax.engine.scheduler import Request
from hybrid_jax.kv_cache import init_kv_cache
from hybrid_jax.metadata import BucketPolicy, RowSpec, build_metadata
from hybrid_jax.models.qwen3_next import Qwen3Next, tiny_qwen3_next_config
from hybrid_jax.models.tokenizer import ByteTokenizer
from hybrid_jax.modes import ForwardMode
from hybrid_jax.state_pool import init_state_pool

__all__ = [
    "CHI2_4_999",
    "GREEDY",
    "PROMPTS",
    "FromScratch",
    "OracleDrafter",
    "agreeing_model",
    "assert_same_states",
    "check_agreeing_drafts_are_accepted",
    "chi_square",
    "engine_pair",
    "generate_tokens",
    "repeating_model",
    "restored_cache_options",
    "run_bench",
    "run_joining_and_leaving",
    "seeded_runs",
    "slot_states",
    "speculative_fixtures",
    "states_by_position",
]

M = ForwardMode
GREEDY = SamplingParams(max_new_tokens=10)
# The MTP modules' prompts (chain and tree drafts); the n-gram module has its own.
PROMPTS = [
    list(b"abcabcabcabc"),
    np.random.default_rng(1).integers(0, 256, 9).tolist(),
    [7, 7, 7, 7, 7],
    list(b"the cat the cat the cat"),  # longer than a step: prefilled in two chunks
]

# ---------------------------------------------------------------- JAX's persistent cache, the CLI

_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


@contextlib.contextmanager
def restored_cache_options() -> Iterator[None]:
    """JAX's persistent-cache options as they were before, and the cache reset, on exit: an
    engine or the CLI sets them process-wide, and later modules must not use a folder of ours."""
    saved = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}
    try:
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


_BENCH_ARGV = (
    "bench", "--num-prompts", "2", "--prompt-len", "6", "--new-tokens", "5", "--plot", "",
    "--max-batch", "2", "--max-tokens", "16", "--max-context", "32", "--impl", "reference",
)  # fmt: skip


def run_bench(cache_dir: Path, *flags: str) -> int | str | None:
    """``hybrid-jax bench`` on two short prompts of the tiny model, ``flags`` added (the
    speculative source and its options); returns its exit status."""
    with restored_cache_options(), pytest.raises(SystemExit) as exit_info:
        main([*_BENCH_ARGV, "--cache-dir", str(cache_dir), *flags])
    return exit_info.value.code


# ---------------------------------------------------------------- engines and runs


def engine_pair(
    config: EngineConfig, cache_dir: str, model: Callable[[], Qwen3Next] | None = None
) -> tuple[Engine, Engine]:
    """(speculative, plain) engines of ``config`` on one model (``model()`` each, or the tiny
    preset's). The plain one's context holds the speculative one's lookahead page, so its page
    tables, and so its EXTEND executables and samplers, are the same programs, shared through
    the cache in ``cache_dir``."""
    spec_config = dataclasses.replace(config, cache_dir=cache_dir)
    context = spec_config.policy(tiny_qwen3_next_config().max_position_embeddings).max_context
    plain_config = dataclasses.replace(spec_config, speculative=None, max_context=context)
    configs = (spec_config, plain_config)
    if model is None:
        pair = tuple(Engine.from_preset("tiny", c, progress=False) for c in configs)
    else:
        pair = tuple(Engine(model(), ByteTokenizer(), c, progress=False) for c in configs)
    assert pair[0].policy.max_pages == pair[1].policy.max_pages
    return pair


def speculative_fixtures(config: EngineConfig, prompts: Sequence[list[int]]):
    """A speculative module's module-scoped fixtures: ``engines`` (the ``engine_pair`` of
    ``config``, in the suite's ``cache_dir``) and ``plain_tokens`` (the plain engine's greedy
    tokens for ``prompts``). A test module binds them by name."""

    @pytest.fixture(scope="module")
    def engines(cache_dir):
        """(speculative, plain) engines of the tiny preset."""
        return engine_pair(config, cache_dir)

    @pytest.fixture(scope="module")
    def plain_tokens(engines):
        return generate_tokens(engines[1], prompts, GREEDY)

    return engines, plain_tokens


def check_agreeing_drafts_are_accepted(
    config: EngineConfig, cache_dir: str, model: Callable[[], Qwen3Next],
    prompts: Sequence[list[int]],
) -> tuple[Engine, Engine]:  # fmt: skip
    """Drafts of a model that repeats its last prompt token (``repeating_model``, or an MTP
    head that agrees with it) are accepted, and change no token. Run after the module's
    ``engines``: every program is in the cache, so the pair only loads. Returns it."""
    spec, plain = engine_pair(config, cache_dir, model)
    want = generate_tokens(plain, prompts, GREEDY)
    assert want[1] == [prompts[1][-1]] * GREEDY.max_new_tokens  # it does repeat
    assert generate_tokens(spec, prompts, GREEDY) == want
    stats = spec.speculative_stats
    draft = config.speculative.num_draft_tokens
    assert stats.acceptance_rate > 0.9 and stats.mean_accepted_length > draft - 0.5
    assert spec.retraces == 0
    return spec, plain


def generate_tokens(
    engine: Engine, prompts: Sequence[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Each prompt's generated token ids."""
    return [r.token_ids for r in engine.generate(prompts, params)]


def run_joining_and_leaving(
    engine: Engine, prompts: Sequence[list[int]], params: SamplingParams
) -> list[list[int]]:
    """Tokens of three requests served together: ``prompts[0]`` from the start, ``prompts[1]``
    joining after two steps (while 0 verifies) and leaving after 3 tokens, ``prompts[3]``
    joining once 1 has left; in that order (two lists if 3 never joined)."""
    short = dataclasses.replace(params, max_new_tokens=3)
    tokens: dict[int, list[int]] = {}
    ids = [engine.add_request(prompts[0], params)]
    for event in engine.step() + engine.step():
        tokens.setdefault(event.request_id, []).append(event.token_id)
    ids.append(engine.add_request(prompts[1], short))
    joined_late = False
    while engine.has_work:
        for event in engine.step():
            tokens.setdefault(event.request_id, []).append(event.token_id)
        if not joined_late and ids[1] not in {r.request_id for r in engine.scheduler.running}:
            ids.append(engine.add_request(prompts[3], params))
            joined_late = True
    return [tokens[i] for i in ids]


def seeded_runs(
    engine: Engine, prompts: Sequence[list[int]], greedy: SamplingParams
) -> tuple[list[int], list[int], list[int]]:
    """``prompts[0]`` sampled with seed 7: alone, next to a greedy ``prompts[2]``, and alone
    with seed 8; the three token lists."""
    params = SamplingParams(max_new_tokens=8, temperature=1.2, top_k=50, seed=7)
    (solo,) = engine.generate([prompts[0]], params)
    mixed = engine.generate([prompts[0], prompts[2]], [params, greedy])
    (other,) = engine.generate([prompts[0]], dataclasses.replace(params, seed=8))
    return solo.token_ids, mixed[0].token_ids, other.token_ids


class OracleDrafter:
    """Drafts from the known greedy continuations, one draft wrong at a position that cycles
    with the history's length, so every acceptance length 0..num_drafts occurs."""

    def __init__(self, sequences: Sequence[list[int]], num_drafts: int):
        self.sequences, self.num_drafts = sequences, num_drafts

    def propose(self, history: Sequence[int]) -> tuple[int, ...]:
        n = len(history)
        # A history off every known sequence (the engine went wrong) gets plain padding, so
        # the test fails on the tokens, not in here.
        seq = next((s for s in self.sequences if s[:n] == list(history)), [])
        out = (seq[n : n + self.num_drafts] + [0] * self.num_drafts)[: self.num_drafts]
        wrong = n % (self.num_drafts + 1)
        if wrong < self.num_drafts:
            out[wrong] = (out[wrong] + 1) % 256
        return tuple(out)


# ---------------------------------------------------------------- state after each step

ReadState = Callable[[Engine, Request], dict[str, list[np.ndarray]]]


def slot_states(engine: Engine, req: Request) -> dict[str, list[np.ndarray]]:
    """{"state": every linear layer's state in the request's slot}."""
    pool = engine.state.pool
    return {"state": [np.asarray(a[req.slot]) for a in (*pool.conv, *pool.ssm)]}


def states_by_position(
    engine: Engine,
    prompt: list[int],
    params: SamplingParams,
    read: ReadState = slot_states,
    check: Callable[[Request], None] | None = None,
) -> dict[int, dict[str, list[np.ndarray]]]:
    """{tokens folded into the slot: ``read(engine, req)``} after each step of one request
    served alone; ``check(req)`` runs after each step while the request decodes."""
    engine.add_request(prompt, params)
    states = {}
    while engine.has_work:
        engine.step()
        if engine.scheduler.running:
            req = engine.scheduler.running[0]
            states[req.num_computed] = read(engine, req)
            if check is not None and req.is_decoding:
                check(req)
    return states


def assert_same_states(
    got: dict[int, dict[str, list[np.ndarray]]],
    want: dict[int, dict[str, list[np.ndarray]]],
    prompt_len: int,
) -> None:
    """At every position reached by a verify step (two at least, each also reached by the
    plain run) every part ``read`` returned equals the plain run's, layer by layer."""
    verified = sorted(n for n in got if n > prompt_len)
    assert len(verified) >= 2 and set(verified) <= set(want)
    for n in verified:
        for name, arrays in got[n].items():
            for layer, (a, b) in enumerate(zip(arrays, want[n][name], strict=True)):
                np.testing.assert_allclose(
                    a, b, rtol=2e-5, atol=2e-5, err_msg=f"{name} {n=} {layer=}"
                )
    # The check can fail: the states of neighbouring positions differ.
    a, b = got[verified[0]]["state"][-1], want[verified[1]]["state"][-1]
    assert not np.allclose(a, b, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------- rigged models, the MTP head


def repeating_model() -> Qwen3Next:
    """The tiny model made to repeat the token it is fed: embeddings scaled up dominate the
    residual stream, and the LM head is the embedding itself, so the argmax is the input."""
    model = Qwen3Next(tiny_qwen3_next_config(), rngs=nnx.Rngs(0))
    embedding = model.embed_tokens.embedding.get_value()
    model.embed_tokens.embedding.set_value(embedding * 30)
    model.lm_head.kernel.set_value(embedding.T)
    return model


def agreeing_model() -> Qwen3Next:
    """``repeating_model`` with an MTP head made to agree: its ``fc`` passes the next token's
    normed embedding through, scaled to dominate too, so it guesses that the token after next
    repeats the next one, as the target does."""
    model = repeating_model()
    embedding = model.embed_tokens.embedding.get_value()
    h = embedding.shape[1]
    fc = jnp.concatenate([30 * jnp.eye(h), jnp.zeros((h, h))], axis=0)
    model.mtp.fc.kernel.set_value(fc.astype(embedding.dtype))
    return model


class FromScratch:
    """The head's cache entries and chain drafts for a history (root last) computed afresh:
    the target prefills all but the root, the head extends over those positions, then drafts.
    Jitted on one token bucket (64: longer than any history here), so every history reuses
    one executable per step."""

    def __init__(self, engine: Engine):
        policy: BucketPolicy = dataclasses.replace(
            engine.policy, token_buckets=(64,), batch_buckets=(1,)
        )
        self.policy = policy
        self.pages = tuple(range(1, policy.max_pages + 1))
        graphdef, self.params = nnx.split(engine.model)
        num_pages = policy.max_pages + 1

        @jax.jit
        def extend(params, tokens, following, meta):
            m = nnx.merge(graphdef, params)
            pool = init_state_pool(m.state_specs(), 2)
            kv = init_kv_cache(m.kv_specs(), num_pages, policy.page_size)
            mtp_kv = init_kv_cache(m.mtp_kv_specs(), num_pages, policy.page_size)
            hidden, *_ = m.hidden_states(tokens, pool, kv, meta, impl="reference")
            out, mtp_kv = m.mtp_hidden_states(following, hidden, mtp_kv, meta)
            return out, jnp.argmax(m.logits(out), axis=-1).astype(jnp.int32), mtp_kv

        @jax.jit
        def decode(params, token, hidden, mtp_kv, meta):
            m = nnx.merge(graphdef, params)
            out, mtp_kv = m.mtp_hidden_states(token, hidden, mtp_kv, meta)
            return out, jnp.argmax(m.logits(out), axis=-1).astype(jnp.int32), mtp_kv

        self.extend, self.decode = extend, decode

    def __call__(self, history: list[int]) -> tuple[np.ndarray, tuple[int, ...]]:
        """(cache entries ``[positions, KVH, head_dim]`` from position 0, D-1 drafts)."""
        n, policy = len(history) - 1, self.policy
        meta = build_metadata(M.EXTEND, [RowSpec(1, 0, n, self.pages)], policy, num_slots=2)
        tokens = np.zeros(meta.num_tokens, np.int32)
        following = np.zeros(meta.num_tokens, np.int32)
        tokens[:n], following[:n] = history[:n], history[1:]
        out, guesses, mtp_kv = self.extend(
            self.params, jnp.asarray(tokens), jnp.asarray(following), meta
        )
        kv = np.asarray(mtp_kv.k[0]).reshape(-1, *mtp_kv.k[0].shape[2:])[policy.page_size :]
        hidden, drafts = out[n - 1 : n], [guesses[n - 1 : n]]
        for k in range(policy.num_draft_tokens - 2):
            meta = build_metadata(M.DECODE, [RowSpec(1, n + k, 1, self.pages)], policy,
                                  num_slots=2)  # fmt: skip
            hidden, guess, mtp_kv = self.decode(self.params, drafts[-1], hidden, mtp_kv, meta)
            drafts.append(guess)
        return kv, tuple(int(d[0]) for d in drafts)

    def assert_head_cache(self, engine: Engine, req: Request) -> tuple[int, ...]:
        """Asserts that the engine's head cache at the request's computed positions equals a
        fresh computation's; returns the fresh drafts."""
        want_kv, want_drafts = self(req.token_ids)
        n = req.num_computed
        got = np.asarray(engine.mtp.kv.k[0])[list(req.pages)].reshape(-1, *want_kv.shape[1:])
        np.testing.assert_allclose(got[:n], want_kv[:n], rtol=1e-4, atol=1e-4)
        return want_drafts


# ---------------------------------------------------------------- sampling statistics

# chi-square 99.9% quantile at 4 degrees of freedom (5 tokens): with a fixed seed a test is
# deterministic, and a wrong rule lands far above it (each test checks one).
CHI2_4_999 = 18.47


def chi_square(tokens: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's statistic of the token counts against ``probs``; a token of probability 0
    fails at once."""
    counts = np.bincount(tokens, minlength=len(probs))
    expected = probs * len(tokens)
    real = expected > 0
    assert counts[~real].sum() == 0, "a token of probability 0 was emitted"
    return float((((counts - expected) ** 2)[real] / expected[real]).sum())
