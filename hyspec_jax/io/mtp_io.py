"""The `mtp.*` tensors of a Hugging Face Qwen3.5 / Qwen3-Next directory: the multi-token-prediction head.

Qwen3.5 checkpoints keep them at the top level (`mtp.fc.weight`) while the LM sits under `model.language_model.`;
Qwen3-Next under `mtp.` too. Names below `mtp.` are the `MTPHead` parameter paths: `fc.weight`,
`pre_fc_norm_embedding.weight`, `pre_fc_norm_hidden.weight`, `layers.{i}.…` (a decoder layer in the target's
names, its fused parameters mapped to and from the target's on-disk tensors by `hyspec_jax.io.layout`),
`norm.weight`. Only the shards that hold `mtp.` keys are opened (the index's weight map says which), and only
those keys are read. `save_mtp` adds a head (e.g. one trained by `hyspec train-mtp`) to a model directory in
the same layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from hyspec_jax.config import MTP_LAYERS_KEY, TargetConfig
from hyspec_jax.io import layout
from hyspec_jax.io.hf import CheckpointError, _weight_files, flat_params, hf_tensors, stream_params
from hyspec_jax.models.mtp import MTPHead, abstract_mtp

PREFIX = "mtp."


class NoMTPHead(CheckpointError):
    """An MTP mode was asked for and the model directory has no MTP head."""


def _mtp_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({model_dir / f for k, f in weight_map.items() if k.startswith(PREFIX)})
    return _weight_files(model_dir)


def has_mtp(model_dir: str | Path) -> bool:
    """Whether the directory declares an MTP head (config) and holds `mtp.*` tensors."""
    model_dir = Path(model_dir)
    try:
        cfg = TargetConfig.from_pretrained(model_dir)
        files = _mtp_files(model_dir)
    except (ValueError, OSError):
        return False
    if cfg.mtp_num_hidden_layers < 1:
        return False
    for path in files:
        with safe_open(str(path), framework="numpy") as f:
            if any(k.startswith(PREFIX) for k in f.keys()):
                return True
    return False


def _strip(key: str) -> str | None:
    return key[len(PREFIX):] if key.startswith(PREFIX) else None


def load_mtp(model_dir: str | Path, cfg: TargetConfig | None = None, dtype=jnp.float32) -> MTPHead:
    """The directory's MTP head in `dtype`. Raises `NoMTPHead` when its config declares no MTP layers or no
    `mtp.*` tensors are stored, `CheckpointError` when they do not match the config. Read by the target's
    streamed loader (`hf.stream_params`: shapes checked from the headers first, experts fused as they stream)."""
    model_dir = Path(model_dir)
    cfg = cfg or TargetConfig.from_pretrained(model_dir)
    if cfg.mtp_num_hidden_layers < 1:
        raise NoMTPHead(f"{model_dir}: no MTP head (config.json declares no mtp_num_hidden_layers / "
                        "num_nextn_predict_layers)")
    files = []
    for path in _mtp_files(model_dir):
        with safe_open(str(path), framework="numpy") as f:
            if any(k.startswith(PREFIX) for k in f.keys()):
                files.append(path)
    if not files:
        raise NoMTPHead(f"{model_dir}: no MTP head (no mtp.* tensors in its weights)")
    head = abstract_mtp(cfg, dtype)
    stream_params(flat_params(head), files, where=f"{model_dir} (mtp.*)", dtype=dtype, rename=_strip,
                  progress=False, fused=layout.fused_params(head))
    return head


MTP_FILE = "mtp.safetensors"


def save_mtp(head: MTPHead, model_dir: str | Path, dtype=None) -> Path:
    """Add the head to a Hugging Face model directory as `mtp.*` tensors, the layout real Qwen checkpoints use (so
    `load_mtp` reads both): its own shard `mtp.safetensors` (experts per expert, as the target's), the shard
    listed in model.safetensors.index.json (created from a single-file checkpoint; earlier mtp.* entries
    replaced), and the layer count under the family's config.json key. The target's tensors are not touched."""
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    raw = json.loads(cfg_path.read_text())
    files = _weight_files(model_dir)
    index = model_dir / "model.safetensors.index.json"
    weight_map: dict[str, str] = {}
    if index.is_file():
        weight_map = {k: f for k, f in json.loads(index.read_text()).get("weight_map", {}).items()
                      if not k.startswith(PREFIX)}
    else:
        for path in files:
            if path.name == MTP_FILE:
                continue
            with safe_open(str(path), framework="numpy") as f:
                weight_map.update({k: path.name for k in f.keys() if not k.startswith(PREFIX)})
    tensors = {PREFIX + k: np.ascontiguousarray(a) for k, a in hf_tensors(head, dtype).items()}
    save_file(tensors, str(model_dir / MTP_FILE), metadata={"format": "pt"})
    weight_map.update({k: MTP_FILE for k in tensors})
    index.write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    text[MTP_LAYERS_KEY[TargetConfig.from_hf_dict(raw).model_type]] = head.num_layers
    cfg_path.write_text(json.dumps(raw, indent=2) + "\n")
    return model_dir / MTP_FILE


__all__ = ["MTP_FILE", "NoMTPHead", "has_mtp", "load_mtp", "save_mtp"]
