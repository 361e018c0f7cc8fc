"""Tiny random `transformers` models used as oracles (torch, CPU, float32).

Random init leaves every zero-centred norm at 0 and the gated norm at 1, so `build` perturbs EVERY
parameter; otherwise the (1 + w) / plain-w conventions would never be exercised.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("USE_HUB_KERNELS", "NO")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()


def qwen3_5_config(*, hidden=48, layers=4, heads=4, kv_heads=2, head_dim=16, hk=2, hv=4, dk=8, dv=8,
                   inter=80, vocab=101, layer_types=None, tie=False, rope_theta=10000.0, partial=0.25,
                   conv_kernel=4, **extra):
    rotary = int(head_dim * partial)
    layers = len(layer_types) if layer_types else layers
    return transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk, linear_value_head_dim=dv,
        linear_conv_kernel_dim=conv_kernel, rms_norm_eps=1e-6, layer_types=layer_types,
        tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": partial,
                         "mrope_section": [rotary // 2, 0, 0], "mrope_interleaved": True},
        **extra)


def qwen3_next_config(*, hidden=48, layers=4, heads=4, kv_heads=2, head_dim=16, hk=2, hv=4, dk=8, dv=8,
                      inter=80, vocab=101, layer_types=None, tie=False, rope_theta=10000.0, partial=0.25,
                      num_experts=4, top_k=2, moe_inter=24, shared_inter=40, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=(), conv_kernel=4, **extra):
    layers = len(layer_types) if layer_types else layers
    return transformers.Qwen3NextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk, linear_value_head_dim=dv,
        linear_conv_kernel_dim=conv_kernel, rms_norm_eps=1e-6, layer_types=layer_types,
        tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": partial},
        num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=shared_inter, norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=decoder_sparse_step, mlp_only_layers=list(mlp_only_layers), **extra)


def model_class(config):
    return {"qwen3_5_text": transformers.Qwen3_5ForCausalLM,
            "qwen3_next": transformers.Qwen3NextForCausalLM,
            "qwen3_5_moe_text": transformers.Qwen3_5MoeForCausalLM}[config.model_type]


def perturb_(model: torch.nn.Module, seed: int, scale: float = 0.1) -> None:
    """Add noise to every parameter (norm weights included) so no identity shortcut hides a bug."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 3.0 + 0.05))   # decays of all sizes
            elif name.endswith("dt_bias"):
                p.add_(noise)
            elif "norm" in name:
                p.add_(0.3 * noise)
            elif name.endswith("conv1d.weight"):
                p.add_(0.2 * noise)
            else:
                p.add_(scale * noise)


def build(config, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = model_class(config)(config).to(torch.float32).eval()
    perturb_(model, seed + 1)
    return model


def save(model: torch.nn.Module, path: str | Path) -> Path:
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


@torch.no_grad()
def logits(model: torch.nn.Module, tokens: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    kw = {} if attention_mask is None else {"attention_mask": torch.as_tensor(attention_mask, dtype=torch.long)}
    out = model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long), use_cache=False, **kw)
    return out.logits.float().numpy()


@torch.no_grad()
def cached_decode(model: torch.nn.Module, prompt: np.ndarray, steps: int) -> tuple[np.ndarray, list[np.ndarray],
                                                                                      np.ndarray]:
    """Greedy cached generation: prefill `prompt` [B,T], then `steps` one-token forwards with past_key_values.

    Returns (prefill logits [B,T,V], per-step logits [B,V] (for the token fed at that step),
    fed tokens [B, steps]).
    """
    ids = torch.as_tensor(np.asarray(prompt), dtype=torch.long)
    out = model(input_ids=ids, use_cache=True)
    pre = out.logits.float().numpy()
    past = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    step_logits, fed = [], []
    for _ in range(steps):
        fed.append(nxt[:, 0].numpy())
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
        step_logits.append(out.logits[:, -1].float().numpy())
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return pre, step_logits, np.stack(fed, axis=1)
