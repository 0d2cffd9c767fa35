"""Builds the Qwen3-Next parity fixtures with Hugging Face transformers (PyTorch on the CPU).

For each tiny configuration below: a randomly initialised ``Qwen3NextForCausalLM`` (every
weight random, norms included, so no term of the model is trivially zero or one), saved as a
sharded Hugging Face checkpoint folder (``config.json``, ``model-*.safetensors``,
``model.safetensors.index.json``), and ``reference.npz`` with the logits transformers computes:

  prompt          int32 [P]           prefill tokens
  prefill_logits  float32 [P, vocab]  logits of the prefill
  decode_tokens   int32 [N]           tokens fed one at a time after the prompt (with cache)
  decode_logits   float32 [N, vocab]  logits of each decode step
  prompt2, prefill2_logits            a second, shorter prompt prefilled on its own

The test suite reads these with numpy only; torch never enters it. Run in a separate
Python 3.11 environment (never the project's .venv):

  python3.11 -m venv tools/.venv-fixtures        # excluded from git via .git/info/exclude
  tools/.venv-fixtures/bin/pip install torch==2.13.0 transformers safetensors
  tools/.venv-fixtures/bin/python tools/make_qwen3_next_fixtures.py
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
import torch
import transformers
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "qwen3_next"

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

CONFIGS = {
    # GDN, attention, GDN, attention; MoE everywhere but layer 2; separate LM head.
    "moe": dict(
        COMMON,
        layer_types=["linear_attention", "full_attention"] * 2,
        mlp_only_layers=[2],
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        tie_word_embeddings=False,
    ),
    # Attention every third layer (from full_attention_interval), MoE on odd layers only,
    # top-k weights not renormalised, LM head tied to the embedding, half-rotary heads.
    "tied_sparse_step": dict(
        COMMON,
        full_attention_interval=3,
        decoder_sparse_step=2,
        norm_topk_prob=False,
        rope_parameters=dict(rope_type="default", rope_theta=1000.0, partial_rotary_factor=0.5),
        tie_word_embeddings=True,
    ),
}


def randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Every weight random: matrices ~ N(0, 1/fan_in), norm weights perturbed, dt_bias spread."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log") or "conv1d" in name:
                continue  # already random: log-uniform decay, uniform conv taps
            if name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5)
            elif p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5)


def write_reference(
    folder: pathlib.Path, model, vocab: int, seed: int, prompt_len: int, decode_steps: int
) -> None:
    """``reference.npz`` (random prompts of ids below ``vocab``: a prefill, decode steps with
    the cache, a second prompt on its own) and ``versions.json`` in ``folder``."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, prompt_len).astype(np.int64)
    decode_tokens = rng.integers(0, vocab, decode_steps).astype(np.int64)
    prompt2 = rng.integers(0, vocab, prompt_len // 2).astype(np.int64)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(prompt)[None], use_cache=True)
        prefill_logits = out.logits[0].numpy()
        cache = out.cache
        decode_logits = []
        for token in decode_tokens:
            out = model(input_ids=torch.tensor([[int(token)]]), cache=cache, use_cache=True)
            cache = out.cache
            decode_logits.append(out.logits[0, -1].numpy())
        prefill2_logits = model(input_ids=torch.from_numpy(prompt2)[None]).logits[0].numpy()
    np.savez(
        folder / "reference.npz",
        prompt=prompt.astype(np.int32),
        prefill_logits=prefill_logits.astype(np.float32),
        decode_tokens=decode_tokens.astype(np.int32),
        decode_logits=np.stack(decode_logits).astype(np.float32),
        prompt2=prompt2.astype(np.int32),
        prefill2_logits=prefill2_logits.astype(np.float32),
    )
    (folder / "versions.json").write_text(
        json.dumps({"torch": torch.__version__, "transformers": transformers.__version__}) + "\n"
    )


def build(name: str, kwargs: dict, seed: int, prompt_len: int, decode_steps: int) -> None:
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*"):
        old.unlink()
    torch.manual_seed(seed)
    config = Qwen3NextConfig(**kwargs)
    config._attn_implementation = "eager"
    model = Qwen3NextForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    randomize(model, generator)
    # Small shards, so the loader's index path is what the tests exercise.
    model.save_pretrained(folder, max_shard_size="200KB")
    (folder / "generation_config.json").unlink(missing_ok=True)

    write_reference(folder, model, config.vocab_size, seed, prompt_len, decode_steps)
    sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
    print(name, sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=11)
    parser.add_argument("--decode-steps", type=int, default=4)
    args = parser.parse_args()
    for i, (name, kwargs) in enumerate(CONFIGS.items()):
        build(name, kwargs, seed=1234 + i, prompt_len=args.prompt_len,
              decode_steps=args.decode_steps)  # fmt: skip


if __name__ == "__main__":
    main()
