"""The labelled random-weight demo model, created on the fly when no trained model is available.

Its output is meaningless text: it exists so that the whole path (tokenizer → prefill → decode → streaming)
runs on a fresh machine. The embedded trained model replaces it as the default once shipped.
"""

from __future__ import annotations

from pathlib import Path

from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.paths import cache_dir

RANDOM_LABEL = "random-weight demo model (untrained: the text it writes is meaningless)"


def demo_config(vocab_size: int = 257) -> TargetConfig:
    layers = 8
    return TargetConfig(
        model_type="qwen3_5_text", vocab_size=vocab_size, hidden_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=768,
        layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        rope_theta=10000.0, eos_token_id=(vocab_size - 1,))


def random_demo_model_dir(seed: int = 0) -> Path:
    """Write (once) a random-weight model + byte-level tokenizer in the HF layout; return its directory."""
    from hyspec_jax.io.hf import save_pretrained
    from hyspec_jax.models.target import create_model
    from hyspec_jax.tokenizer import byte_level_tokenizer

    out = cache_dir() / f"random-demo-seed{seed}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    tok = byte_level_tokenizer()
    cfg = demo_config(tok.get_vocab_size())
    save_pretrained(create_model(cfg, seed=seed), out)
    tok.save(str(out / "tokenizer.json"))
    (out / "README.md").write_text(f"# {RANDOM_LABEL}\n\nSeed {seed}. Created by `hyspec generate` when no model is given.\n")
    return out
