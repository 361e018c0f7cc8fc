"""Hugging Face checkpoint I/O: `config.json` + safetensors (single file or sharded with an index).

Parameter paths of `TargetModel` equal HF keys, so the mapping is only about prefixes and MoE expert form:
- `model.language_model.` (Qwen3.5 saved as ConditionalGeneration) → `model.`; `mtp.*`, `model.visual.*` ignored;
- routed experts on disk per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`) or fused
  (`mlp.experts.gate_up_proj` [E,2I,H], `mlp.experts.down_proj` [E,H,I]); saved per expert, as
  `save_pretrained` does.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from hyspec_jax.config import ConfigError, TargetConfig
from hyspec_jax.models.target import TargetModel, abstract_model

log = logging.getLogger(__name__)

_IGNORED = re.compile(r"^(mtp\.|model\.visual\.|visual\.)")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config (missing / misshapen tensors, no weight files)."""


def _canonical(key: str) -> str | None:
    if _IGNORED.match(key):
        return None
    if key.startswith("model.language_model."):
        key = "model." + key[len("model.language_model."):]
    elif key.startswith("language_model."):
        key = "model." + key[len("language_model."):]
    return key


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that do not exist: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no model.safetensors, no model.safetensors.index.json")
    return files


_Experts = dict[str, dict[int, dict[str, tuple[str, np.ndarray]]]]  # prefix -> expert -> proj -> (raw key, array)


def _read_tensors(model_dir: Path) -> tuple[dict[str, np.ndarray], _Experts]:
    """All tensors under canonical names, as numpy (bf16 via ml_dtypes); per-expert weights kept apart
    (with their on-disk names, for error messages) until `_fuse_experts` checks them against the config."""
    tensors: dict[str, np.ndarray] = {}
    experts: _Experts = {}
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="flax") as f:
            for raw_key in f.keys():
                key = _canonical(raw_key)
                if key is None:
                    continue
                m = _PER_EXPERT.match(key)
                arr = np.asarray(f.get_tensor(raw_key))
                if m:
                    experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = (raw_key, arr)
                else:
                    tensors[key] = arr
    return tensors, experts


def _fuse_experts(prefix: str, per: dict[int, dict[str, tuple[str, np.ndarray]]], gate_up_shape: tuple[int, ...],
                  down_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per-expert gate/up/down [I,H]/[I,H]/[H,I] -> fused gate_up [E,2I,H] (gate rows first), down [E,H,I]."""
    E, two_i, H = gate_up_shape
    want = {"gate_proj": (two_i // 2, H), "up_proj": (two_i // 2, H), "down_proj": tuple(down_shape[1:])}
    extra = sorted(set(per) - set(range(E)))
    if extra:
        raise CheckpointError(f"{prefix}: expert ids {extra} in the checkpoint, config.json has {E} experts")
    for e in range(E):
        for proj, shape in want.items():
            name = f"{prefix}.{e}.{proj}.weight"
            if proj not in per.get(e, {}):
                raise CheckpointError(f"missing tensor {name!r} (expected shape {shape})")
            raw_key, arr = per[e][proj]
            if tuple(arr.shape) != shape:
                raise CheckpointError(f"tensor {raw_key!r} has shape {tuple(arr.shape)} in the checkpoint, "
                                      f"expected {shape} from config.json")
    gate_up = np.stack([np.concatenate([per[e]["gate_proj"][1], per[e]["up_proj"][1]], axis=0) for e in range(E)])
    down = np.stack([per[e]["down_proj"][1] for e in range(E)])
    return gate_up, down


def flat_params(module: nnx.Module) -> dict[str, nnx.Variable]:
    """A module's parameters by dotted path (`layers.0.mlp.gate_proj.weight`): the checkpoint key names of the
    target (HF) and the drafter (DeepSpec) layouts."""
    return {".".join(map(str, path)): var for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def fill_params(expected: dict[str, nnx.Variable], tensors: dict[str, np.ndarray], where: str | Path, dtype) -> None:
    """Set each expected variable from its tensor (consumed from `tensors`), checking presence and shape;
    leftover tensors are logged, not loaded."""
    for name, var in expected.items():
        if name not in tensors:
            raise CheckpointError(f"missing tensor {name!r} (expected shape {tuple(var.shape)}) in {where}")
        arr = tensors.pop(name)
        if tuple(arr.shape) != tuple(var.shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(arr.shape)} in {where}, "
                                  f"expected {tuple(var.shape)} from the config")
        var.set_value(jnp.asarray(arr, dtype=dtype))
    if tensors:
        log.warning("%s: ignoring %d unexpected tensors, e.g. %s", where, len(tensors), sorted(tensors)[:3])


def load_pretrained(model_dir: str | Path, dtype=jnp.float32) -> tuple[TargetConfig, TargetModel]:
    """Read a HF model directory into a `TargetModel` with parameters in `dtype`."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: model directory does not exist")
    cfg = TargetConfig.from_pretrained(model_dir)
    tensors, experts = _read_tensors(model_dir)
    model = abstract_model(cfg, dtype)
    expected = flat_params(model)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for prefix, per in experts.items():
        gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        if gate_up not in expected or down not in expected:
            log.warning("ignoring per-expert tensors under %s (no routed experts there in config.json)", prefix)
            continue
        if gate_up in tensors or down in tensors:
            raise CheckpointError(f"{prefix}: both fused and per-expert expert tensors in the checkpoint")
        tensors[gate_up], tensors[down] = _fuse_experts(prefix, per, tuple(expected[gate_up].shape),
                                                        tuple(expected[down].shape))
    fill_params(expected, tensors, model_dir, dtype)
    return cfg, model


def save_pretrained(model: TargetModel, model_dir: str | Path, *, max_shard_bytes: int = 2 << 30,
                    dtype=None) -> None:
    """Write config.json + safetensors (sharded with an index when larger than max_shard_bytes)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg: TargetConfig = model.config
    out: dict[str, np.ndarray] = {}
    for name, var in flat_params(model).items():
        arr = np.asarray(var[...] if dtype is None else var[...].astype(dtype))
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            gate, up = np.split(arr, 2, axis=1)
            for e in range(arr.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}.{e}.up_proj.weight"] = up[e]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(arr.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = arr[e]
        else:
            out[name] = arr
    (model_dir / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(out):
        nbytes = out[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(out[name])
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(model_dir / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(a.nbytes for a in out.values())
    (model_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


__all__ = ["CheckpointError", "ConfigError", "load_pretrained", "save_pretrained"]
