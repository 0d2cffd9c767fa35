"""Builds the Nemotron-H parity fixtures with Hugging Face transformers (PyTorch on the CPU).

For each tiny configuration below: a randomly initialised ``NemotronHForCausalLM`` (every
weight random, norms, D, conv and projection biases and the router's correction bias
included, so no term of the model is trivially zero or one), saved as a Hugging Face checkpoint
folder, and ``reference.npz`` with the logits transformers computes in float32:

  prompt          int32 [P]           prefill tokens
  prefill_logits  float32 [P, vocab]  logits of the prefill
  decode_tokens   int32 [N]           tokens that follow the prompt
  decode_logits   float32 [N, vocab]  logits at each of them, from one uncached forward over
                                      prompt + decode_tokens (see below)
  prompt2, prefill2_logits            a second, shorter prompt prefilled on its own

transformers clips the Mamba2 time step at ``time_step_min`` on its chunked path but not on its
single-token decode path, so its cached decode drifts from its own prefill where the clip is
active. The decode references therefore come from the uncached forward (the chunked path,
which is what every mode here computes); for each configuration the script also runs the
cached decode and prints how far it is from them ("cached decode vs full").

The test suite reads these with numpy only; torch never enters it. Run in the separate
Python 3.11 environment of tools/make_qwen3_next_fixtures.py:

  tools/.venv-fixtures/bin/python tools/make_nemotron_h_fixtures.py
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
import torch
import transformers
from transformers import NemotronHConfig, NemotronHForCausalLM

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "nemotron_h"

COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    mamba_num_heads=4,
    mamba_head_dim=8,
    ssm_state_size=8,
    conv_kernel=4,
    chunk_size=4,  # several chunks per prompt: transformers' chunked scan is exercised
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24,
    layer_norm_epsilon=1e-5,
    max_position_embeddings=256,
)

CONFIGS = {
    # Every block type; two B/C groups; grouped routing (2 groups of 2, best group only),
    # scaled weights; the time-step floor is high enough to clip some steps.
    "hybrid": dict(
        COMMON,
        hybrid_override_pattern="M-M*ME",
        n_groups=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        time_step_min=0.05,
    ),
    # No conv bias, biases on the Mamba projections and the MLPs, one B/C group, MoE through a
    # latent width with unnormalised top-k weights, two attention layers.
    "biases_latent_moe": dict(
        COMMON,
        hybrid_override_pattern="*MEM*-",
        n_groups=1,
        use_conv_bias=False,
        use_bias=True,
        mlp_bias=True,
        moe_latent_size=16,
        norm_topk_prob=False,
        time_step_min=0.001,
    ),
}


def randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Every weight random: matrices ~ N(0, 1/fan_in), vectors perturbed or spread."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=generator) * 3.5 + 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=generator) * 4.0 - 3.0)
            elif name.endswith(".D") or name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))
            elif p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=generator))


def build(name: str, kwargs: dict, seed: int, prompt_len: int, decode_steps: int) -> None:
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*"):
        old.unlink()
    torch.manual_seed(seed)
    config = NemotronHConfig(**kwargs)
    config._attn_implementation = "eager"
    model = NemotronHForCausalLM(config).eval()
    randomize(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)

    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, config.vocab_size, prompt_len).astype(np.int64)
    decode_tokens = rng.integers(0, config.vocab_size, decode_steps).astype(np.int64)
    prompt2 = rng.integers(0, config.vocab_size, prompt_len // 2).astype(np.int64)
    full = np.concatenate([prompt, decode_tokens])
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(full)[None]).logits[0].numpy()
        prefill2_logits = model(input_ids=torch.from_numpy(prompt2)[None]).logits[0].numpy()
        out = model(input_ids=torch.from_numpy(prompt)[None], use_cache=True)
        cache, cached = out.cache, []
        for token in decode_tokens:
            out = model(input_ids=torch.tensor([[int(token)]]), cache=cache, use_cache=True)
            cache = out.cache
            cached.append(out.logits[0, -1].numpy())
    decode_logits = logits[prompt_len:]
    drift = np.linalg.norm(np.stack(cached) - decode_logits) / np.linalg.norm(decode_logits)
    np.savez(
        folder / "reference.npz",
        prompt=prompt.astype(np.int32),
        prefill_logits=logits[:prompt_len].astype(np.float32),
        decode_tokens=decode_tokens.astype(np.int32),
        decode_logits=decode_logits.astype(np.float32),
        prompt2=prompt2.astype(np.int32),
        prefill2_logits=prefill2_logits.astype(np.float32),
    )
    (folder / "versions.json").write_text(
        json.dumps({"torch": torch.__version__, "transformers": transformers.__version__}) + "\n"
    )
    sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
    print(name, sizes, f"cached decode vs full: {drift:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=11)
    parser.add_argument("--decode-steps", type=int, default=4)
    args = parser.parse_args()
    for i, (name, kwargs) in enumerate(CONFIGS.items()):
        build(name, kwargs, seed=4321 + i, prompt_len=args.prompt_len,
              decode_steps=args.decode_steps)  # fmt: skip


if __name__ == "__main__":
    main()
