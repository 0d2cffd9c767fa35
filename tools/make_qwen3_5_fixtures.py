"""Builds the Qwen3.5 parity fixtures with Hugging Face transformers (PyTorch on the CPU).

Four tiny random models, every weight random (norms included), saved as sharded Hugging Face
checkpoint folders with ``reference.npz`` holding the logits transformers computes (the same
arrays as ``make_qwen3_next_fixtures.py``: a prompt's prefill, decode steps with the cache,
a second prompt on its own):

  dense_vl      Qwen3_5ForConditionalGeneration (text under text_config, a tiny vision tower
                under model.visual.*), GDN value/key heads 2, untied, mtp.* tensors added
  moe_vl        Qwen3_5MoeForConditionalGeneration, ratio 2, untied, experts stored fused
                (as the released checkpoints), mtp.* tensors added
  moe_text      Qwen3_5MoeForCausalLM (text-only folder), ratio 1, tied embeddings
  dense_text_r3 Qwen3_5ForCausalLM (text-only folder), ratio 3, untied

All have key head dim != value head dim and attention head_dim != hidden / heads, and
multi-section rotary (``mrope_section``). transformers does not build the MTP head; its
``mtp.*`` tensors are random, shaped as the released checkpoints' (``mtp.fc``, the two
pre-fc norms, one full-attention decoder layer, ``mtp.norm``), for the speculative tests.

The test suite reads these with numpy only. Run in the fixtures environment (see
make_qwen3_next_fixtures.py)::

  tools/.venv-fixtures/bin/python tools/make_qwen3_5_fixtures.py
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
from make_qwen3_next_fixtures import randomize, write_reference  # tools/, the script's folder
from safetensors.torch import save_file
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "qwen3_5"

TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    layer_types=["linear_attention", "full_attention"] * 2,
    rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
        mrope_section=[2, 1, 1], mrope_interleaved=True,
    ),
)  # fmt: skip
MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
    shared_expert_intermediate_size=32,
)  # fmt: skip
# The vision placeholders inside the tiny vocabulary, so that the engine's refusal of them can
# be tested; prompts are drawn below them.
VISION_TOKENS = dict(
    image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253
)
TEXT_IDS = 250
VISION = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
    patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
)  # fmt: skip


def _dense_vl():
    text = dict(TEXT, tie_word_embeddings=False)
    config = Qwen3_5Config(
        text_config=text, vision_config=VISION, tie_word_embeddings=False, **VISION_TOKENS
    )
    return Qwen3_5ForConditionalGeneration, config, "model.language_model."


def _moe_vl():
    text = dict(TEXT, **MOE, tie_word_embeddings=False)
    config = Qwen3_5MoeConfig(
        text_config=text, vision_config=VISION, tie_word_embeddings=False, **VISION_TOKENS
    )
    return Qwen3_5MoeForConditionalGeneration, config, "model.language_model."


def _moe_text():
    kw = dict(TEXT, **MOE, linear_num_value_heads=2, tie_word_embeddings=True)
    return Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**kw), None


def _dense_text_r3():
    kw = dict(TEXT, linear_num_value_heads=6, tie_word_embeddings=False)
    return Qwen3_5ForCausalLM, Qwen3_5TextConfig(**kw), None


CONFIGS = {
    "dense_vl": _dense_vl,
    "moe_vl": _moe_vl,
    "moe_text": _moe_text,
    "dense_text_r3": _dense_text_r3,
}


def save_fused(folder: pathlib.Path, model) -> None:
    """The weights as the released MoE checkpoints store them: experts fused
    (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``, the in-memory
    layout transformers' ``save_pretrained`` splits per expert), in two shards and an index."""
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, value in state.items():
        first = name.startswith("model.language_model.layers.")
        shards["model-00001-of-00002.safetensors" if first else "model-00002-of-00002.safetensors"][
            name
        ] = value
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, folder / file)
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def add_mtp(folder: pathlib.Path, model, text_prefix: str, generator: torch.Generator) -> None:
    """Random ``mtp.*`` tensors in their own shard, listed in the index: the fc and norms,
    and one decoder layer shaped as the model's first full-attention layer."""
    state = model.state_dict()
    hidden = model.config.get_text_config().hidden_size
    layer_types = model.config.get_text_config().layer_types
    attention = f"{text_prefix}layers.{layer_types.index('full_attention')}."
    mtp = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=generator) / hidden**0.5}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = 0.1 * torch.randn(hidden, generator=generator)
    for name, value in state.items():
        if name.startswith(attention):
            scale = 0.1 if value.ndim == 1 else value.shape[-1] ** -0.5
            random = torch.randn(value.shape, generator=generator) * scale
            mtp["mtp.layers.0." + name[len(attention) :]] = random.to(value.dtype)
    save_file({k: v.contiguous() for k, v in mtp.items()}, folder / "mtp.safetensors")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "mtp.safetensors"))
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def build(name: str, seed: int, prompt_len: int, decode_steps: int) -> None:
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*"):
        old.unlink()
    torch.manual_seed(seed)
    cls, config, text_prefix = CONFIGS[name]()
    config._attn_implementation = "eager"
    model = cls(config).eval()
    generator = torch.Generator().manual_seed(seed)
    randomize(model, generator)
    # Small shards, so the loader's index path is what the tests exercise.
    model.save_pretrained(folder, max_shard_size="200KB")
    (folder / "generation_config.json").unlink(missing_ok=True)
    if name == "moe_vl":
        save_fused(folder, model)
    if text_prefix is not None:
        add_mtp(folder, model, text_prefix, generator)

    # Text ids only, below the vision placeholders.
    write_reference(folder, model, TEXT_IDS, seed, prompt_len, decode_steps)
    sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
    print(name, sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=11)
    parser.add_argument("--decode-steps", type=int, default=4)
    args = parser.parse_args()
    for i, name in enumerate(CONFIGS):
        build(name, seed=4321 + i, prompt_len=args.prompt_len, decode_steps=args.decode_steps)


if __name__ == "__main__":
    main()
