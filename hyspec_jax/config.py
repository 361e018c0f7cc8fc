"""Frozen, hashable configs (usable as static jit arguments).

`TargetConfig` is parsed from a Hugging Face `config.json` of the Qwen3.5 (`qwen3_5`, `qwen3_5_text`,
`qwen3_5_moe[_text]`) or Qwen3-Next (`qwen3_next`) family; see `docs/reference/target_model.md` §2. `DrafterConfig`
is the DSpark / DFlash block drafter's (DeepSpec top-level keys, SpecForge's nested `dflash_config`); see
`docs/reference/drafters.md` §1.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

LINEAR = "linear_attention"
FULL = "full_attention"

# model_type -> (GDN projection layout, has MoE)
_FAMILIES = {
    "qwen3_5": ("split", False),
    "qwen3_5_text": ("split", False),
    "qwen3_5_moe": ("split", True),
    "qwen3_5_moe_text": ("split", True),
    "qwen3_next": ("interleaved", True),
}


# the config.json key holding the MTP head's layer count, per family
MTP_LAYERS_KEY = {t: ("num_nextn_predict_layers" if t == "qwen3_next" else "mtp_num_hidden_layers") for t in _FAMILIES}


DTYPES = ("auto", "float32", "bfloat16")   # --dtype of every command that loads or builds a model


def resolve_dtype(name: str):
    """A --dtype name -> the jnp dtype: "auto" is bfloat16 on a GPU (tensor cores), float32 on a CPU (no fast
    bf16 path there, and the CPU tests compare in fp32)."""
    import jax  # here, not at module level: configs are read by commands that never start JAX
    import jax.numpy as jnp

    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    try:
        return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: one of {', '.join(DTYPES)}") from None


class ConfigError(ValueError):
    """A config.json that this library cannot serve."""


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    # MoE (0 experts = dense everywhere)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    eos_token_id: tuple[int, ...] = ()
    # multi-token-prediction head shipped as `mtp.*` tensors (0 = none declared); Qwen3.5 configs say
    # mtp_num_hidden_layers, Qwen3-Next num_nextn_predict_layers (docs/reference/drafters.md §10)
    # not part of the target's identity (`spec.budget.model_id`): the head leaves the target's programs unchanged
    mtp_num_hidden_layers: int = dataclasses.field(default=0, metadata={"identity": False})

    def __post_init__(self):
        if self.model_type not in _FAMILIES:
            raise ConfigError(f"unsupported model_type {self.model_type!r}; expected one of {sorted(_FAMILIES)}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        bad = set(self.layer_types) - {LINEAR, FULL}
        if bad:
            raise ConfigError(f"unknown layer types {sorted(bad)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rotary_dim % 2:
            raise ConfigError(f"head_dim*partial_rotary_factor = {self.rotary_dim} must be even")
        if self.is_moe and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ConfigError("num_experts_per_tok must be in [1, num_experts]")

    # --- derived geometry -------------------------------------------------------------------------
    @property
    def projection_layout(self) -> str:
        return _FAMILIES[self.model_type][0]

    @property
    def is_moe(self) -> bool:
        return _FAMILIES[self.model_type][1] and self.num_experts > 0

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    def layer_slot(self, i: int) -> int:
        """Index of layer i among the layers of its own kind (row in the stacked state)."""
        return (self.gdn_layers if self.layer_types[i] == LINEAR else self.attn_layers).index(i)

    def is_sparse_layer(self, i: int) -> bool:
        return (self.is_moe and i not in self.mlp_only_layers
                and (i + 1) % max(self.decoder_sparse_step, 1) == 0)

    # --- HF config.json ---------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "TargetConfig":
        cfg = dict(raw)
        if "text_config" in cfg and isinstance(cfg["text_config"], dict):  # VLM wrapper (Qwen3_5ForConditionalGeneration)
            top_eos = cfg.get("eos_token_id")
            cfg = dict(cfg["text_config"])
            cfg.setdefault("eos_token_id", top_eos)
        model_type = cfg.get("model_type")
        if model_type not in _FAMILIES:
            raise ConfigError(f"unsupported model_type {model_type!r}; expected one of {sorted(_FAMILIES)}")
        required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim"]
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ConfigError(f"config.json lacks required keys: {', '.join(missing)}")
        n = int(cfg["num_hidden_layers"])
        layer_types = cfg.get("layer_types")
        if not layer_types:
            interval = int(cfg.get("full_attention_interval", 4))
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope", None):
            raise ConfigError(f"unsupported rope_type {rope_type!r} (only default/text-only mRoPE)")
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ConfigError(f"unsupported hidden_act {cfg.get('hidden_act')!r}")
        heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg.get("intermediate_size", 0)),
            layer_types=tuple(layer_types),
            linear_num_key_heads=int(cfg["linear_num_key_heads"]),
            linear_num_value_heads=int(cfg["linear_num_value_heads"]),
            linear_key_head_dim=int(cfg["linear_key_head_dim"]),
            linear_value_head_dim=int(cfg["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            attention_bias=bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=int(cfg.get("num_experts", 0) or 0) if _FAMILIES[model_type][1] else 0,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0) or 0),
            # Qwen3.5-MoE always renormalises the top-k; Qwen3-Next reads norm_topk_prob.
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if model_type == "qwen3_next" else True,
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(int(i) for i in (cfg.get("mlp_only_layers") or ())),
            eos_token_id=eos,
            mtp_num_hidden_layers=int(cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers", 0))
                                      or 0),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "TargetConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json (not a Hugging Face model directory)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON ({e})") from None
        return cls.from_hf_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers (and this library) read back to the same model."""
        out: dict[str, Any] = {
            # flat (text-only) configs: the VLM wrapper types would be read as their multimodal defaults
            "model_type": {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(self.model_type,
                                                                                           self.model_type),
            "architectures": ["Qwen3NextForCausalLM" if self.model_type == "qwen3_next" else
                              "Qwen3_5MoeForCausalLM" if self.is_moe else "Qwen3_5ForCausalLM"],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "layer_types": list(self.layer_types),
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim, "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "hidden_act": "silu", "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if _FAMILIES[self.model_type][1]:  # MoE families: write 0 experts too (else transformers defaults to 512)
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size,
                       shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                       norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                       mlp_only_layers=list(self.mlp_only_layers))
        if self.eos_token_id:
            out["eos_token_id"] = list(self.eos_token_id)
        if self.mtp_num_hidden_layers:   # each family's own key (what vLLM / SGLang read)
            out[MTP_LAYERS_KEY[self.model_type]] = self.mtp_num_hidden_layers
        return out


# ------------------------------------------------------------------------------------------------
# Drafter
# ------------------------------------------------------------------------------------------------
MARKOV_TYPES = ("none", "vanilla", "gated", "rnn")
DSPARK_ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel")
DFLASH_ARCHS = ("DFlashDraftModel",)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab / SGLang rule (docs/reference/drafters.md §1.1): n ids evenly spaced over [1, N−3]; N//2 when n == 1."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ConfigError(f"default tap rule needs a target of >= 4 layers, got {num_target_layers}; "
                          "pass target_layer_ids explicitly")
    span = end - start
    return tuple(int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 7
    logits_start: int = 0
    markov_head_type: str = "vanilla"
    markov_rank: int = 256
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    num_anchors: int = 512  # training metadata (anchors per sequence), kept for the config.json round trip

    def __post_init__(self):
        if self.logits_start not in (0, 1):
            raise ConfigError(f"logits_start must be 0 (DeepSpec anchor-first) or 1 (DFlash/speculators), "
                              f"got {self.logits_start}")
        if self.block_size <= self.logits_start:
            raise ConfigError(f"block_size {self.block_size} leaves no draft slot with logits_start "
                              f"{self.logits_start}")
        if self.markov_head_type not in MARKOV_TYPES:
            raise ConfigError(f"markov_head_type must be one of {MARKOV_TYPES}, got {self.markov_head_type!r}")
        if self.markov_rank < 0:
            raise ConfigError("markov_rank must be >= 0")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids is empty")
        bad = [i for i in self.target_layer_ids if not 0 <= i <= self.num_target_layers - 2]
        if bad:  # the last layer is returned after the final norm by HF: never a tap (DeepSpec asserts it)
            raise ConfigError(f"target_layer_ids {bad} outside [0, {self.num_target_layers - 2}]")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ConfigError("head_dim must be even (RoPE)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} outside the vocab [0, {self.vocab_size})")

    @property
    def num_draft_tokens(self) -> int:
        """γ: draft tokens per block."""
        return self.block_size - self.logits_start

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def has_markov(self) -> bool:
        return self.markov_rank > 0 and self.markov_head_type != "none"

    @property
    def confidence_dim(self) -> int:
        return self.hidden_size + (self.markov_rank if self.has_markov and self.confidence_head_with_markov else 0)

    @classmethod
    def from_target(cls, tcfg: TargetConfig, *, num_layers: int = 5, target_layer_ids: tuple[int, ...] | None = None,
                    mask_token_id: int | None = None, **overrides: Any) -> "DrafterConfig":
        """Draft config as a copy of the target's widths (DeepSpec practice) with n draft layers.

        mask_token_id defaults to the last vocab row (a reserved, untrained id for our own tokenizer).
        """
        ids = tuple(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(
            tcfg.num_hidden_layers, num_layers)
        kw: dict[str, Any] = dict(
            vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size, num_hidden_layers=num_layers,
            num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_key_value_heads,
            head_dim=tcfg.head_dim, intermediate_size=tcfg.intermediate_size,
            num_target_layers=tcfg.num_hidden_layers, target_layer_ids=ids,
            mask_token_id=tcfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
            rms_norm_eps=tcfg.rms_norm_eps, rope_theta=tcfg.rope_theta)
        kw.update(overrides)
        return cls(**kw)

    # --- config.json (DeepSpec top-level keys + SpecForge's nested dflash_config) -----------------
    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "attention_bias": self.attention_bias, "hidden_act": "silu", "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "num_target_layers": self.num_target_layers, "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size, "mask_token_id": self.mask_token_id, "num_anchors": self.num_anchors,
            "markov_rank": self.markov_rank, "markov_head_type": self.markov_head_type,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "logits_start": self.logits_start, "sample_from_anchor": self.logits_start == 0,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id},
        }

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, logits_start: int | None = None) -> "DrafterConfig":
        arch = (raw.get("architectures") or [""])[0]
        if arch.startswith("Gemma") or arch == "DFlash2DraftModel":
            raise ConfigError(f"drafter architecture {arch!r} is not supported")
        nested = raw.get("dflash_config") or {}
        get = lambda k, d=None: raw.get(k, nested.get(k, d))  # noqa: E731  top level wins, then dflash_config
        if logits_start is None:  # explicit flag first; never guess silently between conventions
            if "logits_start" in raw:
                logits_start = int(raw["logits_start"])
            elif "sample_from_anchor" in raw:
                logits_start = 0 if raw["sample_from_anchor"] else 1
            elif arch in DSPARK_ARCHS:
                logits_start = 0
            elif arch in DFLASH_ARCHS:
                logits_start = 1
            else:
                raise ConfigError(f"cannot tell the slot convention of architecture {arch!r}: pass logits_start")
        layer_types = raw.get("layer_types") or ["full_attention"] * int(raw["num_hidden_layers"])
        if any(t != "full_attention" for t in layer_types):
            raise ConfigError(f"only full_attention draft layers are supported, got {sorted(set(layer_types))}")
        if raw.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ConfigError(f"unsupported hidden_act {raw.get('hidden_act')!r}")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ConfigError("scaled RoPE is not supported for drafters")
        heads = int(raw["num_attention_heads"])
        n_target = int(get("num_target_layers"))
        n = int(raw["num_hidden_layers"])
        ids = get("target_layer_ids")
        ids = tuple(int(i) for i in ids) if ids is not None else default_target_layer_ids(n_target, n)
        if get("mask_token_id") is None:
            raise ConfigError("config.json has no mask_token_id (top level or dflash_config)")
        markov_type = str(get("markov_head_type", "vanilla"))
        return cls(
            vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]), num_hidden_layers=n,
            num_attention_heads=heads, num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            intermediate_size=int(raw["intermediate_size"]), num_target_layers=n_target, target_layer_ids=ids,
            mask_token_id=int(get("mask_token_id")), block_size=int(get("block_size", 7)),
            logits_start=logits_start, markov_head_type=markov_type,
            markov_rank=int(get("markov_rank", 0) or 0),
            enable_confidence_head=bool(get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(get("confidence_head_with_markov", True)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
            attention_bias=bool(raw.get("attention_bias", False)), num_anchors=int(get("num_anchors", 512)))
