"""Incremental detokenisation: the streamed pieces add up to the whole decode, partial
characters are held back, and each token decodes only a short window."""

from __future__ import annotations

import random

import pytest

from hybrid_jax.models.tokenizer import ByteTokenizer, HFTokenizer, TextStream

PIECES = ["a", "é", "漢字", "🙂", " ", "x\n", "hello", " world"]


def _texts(seed: int, n: int):
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def _streamed(tokenizer, ids, rng):
    stream, pieces, i = TextStream(tokenizer), [], 0
    while i < len(ids):
        n = rng.randint(1, 3)  # speculative steps land several tokens at once
        pieces.append(stream.extend(ids[i : i + n], final=i + n >= len(ids)))
        i += n
    return pieces


def test_byte_stream_adds_up_to_the_decode_and_holds_partial_characters_back():
    tok = ByteTokenizer()
    for seed, text in enumerate(_texts(0, 100)):
        rng = random.Random(seed)
        ids = tok.encode(text) + ([0xE6] if seed % 3 == 0 else [])  # a dangling lead byte
        pieces = _streamed(tok, ids, rng)
        assert "".join(pieces) == tok.decode(ids)
        assert not any("\ufffd" in p for p in pieces[:-1])


def test_byte_level_bpe_stream_matches_its_decode():
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    model.train_from_iterator(_texts(1, 50), trainer)
    tok = HFTokenizer(model)
    for seed, text in enumerate(_texts(2, 50)):
        ids = tok.encode(text)
        assert "".join(_streamed(tok, ids, random.Random(seed))) == tok.decode(ids)


def test_each_token_decodes_a_short_window():
    calls = []

    class Counting(ByteTokenizer):
        def decode(self, ids):
            calls.append(len(ids))
            return super().decode(ids)

    stream = TextStream(Counting())
    for token in ByteTokenizer().encode("abc" * 2000):
        stream.extend([token])
    assert max(calls) <= 2
