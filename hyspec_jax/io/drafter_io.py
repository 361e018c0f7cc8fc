"""Drafter checkpoints: DeepSpec / SpecForge DSpark layout (docs/reference/drafters.md §5) + ReaDy reader.

    <dir>/config.json                 DeepSpec keys (`Qwen3DSparkModel`, block_size, mask_token_id,
                                      target_layer_ids, markov_*, confidence_*), SpecForge's nested
                                      `dflash_config`, and the explicit slot convention `logits_start`
    <dir>/model.safetensors           fc, hidden_norm, layers.{i}.…, norm, markov_head.*, confidence_head.*
                                      (+ optional frozen copies embed_tokens / lm_head, ignored on load:
                                      the target's are used)
    <dir>/reader/reader.safetensors   norm.weight, w_q [M,r,d], u [M,r,dk], v [M,dv,r_v], fc_in.*, fc_out.weight
    <dir>/reader/reader_config.json   ReaderConfig (source layers and their state rows, ranks, injection point)
    <dir>/reader/lora.safetensors     optional ReaDy stage-2 LoRA of the drafter's linear layers: `{name}.lora_a`
                                      [r, in], `{name}.lora_b` [out, r], metadata `alpha`; merged (W + α/r·B·A)
                                      only when the reader is loaded, so one directory serves DSpark (chain,
                                      tree: the stage-1 weights) and ReaDy (ready, tree-ready: LoRA + reader)
    <dir>/SHA256.json                 digests of the files above

Parameter paths of `Drafter` equal the checkpoint keys (plus `reader.`), its fused MLP gate/up aside:
`hyspec_jax.io.layout` maps it to and from `gate_proj` / `up_proj` (the weights and a LoRA's factors alike).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from hyspec_jax.config import ConfigError, DrafterConfig
from hyspec_jax.io import layout
from hyspec_jax.io.hf import CheckpointError, flat_params, stream_params
from hyspec_jax.models.drafter import Drafter, TargetHeads, abstract_drafter
from hyspec_jax.models.reader import ReaderConfig

_FROZEN_COPIES = ("embed_tokens.weight", "lm_head.weight")  # DeepSpec saves them; the target's are used
READER_DIR = "reader"
LORA_FILE = "lora.safetensors"


def _read(path: Path) -> dict[str, np.ndarray]:
    with safe_open(str(path), framework="numpy") as f:
        return {k: np.asarray(f.get_tensor(k)) for k in f.keys()}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_drafter(model: Drafter, out_dir: str | Path, *, heads: TargetHeads | None = None, dtype=None,
                 lora: dict[str, dict[str, np.ndarray]] | None = None, lora_alpha: float = 16.0) -> None:
    """Write the DSpark checkpoint (+ reader/ when the drafter has a reader). With `heads`, frozen copies of the
    target's embedding and LM head are included as DeepSpec does (readers that bind the target's skip them).
    `lora` ({param name ('.' or '/' separated): {"a": [r,in], "b": [out,r]}}) is kept unmerged in reader/, next
    to the reader it was trained with."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cast = lambda a: np.ascontiguousarray(np.asarray(a if dtype is None else a.astype(dtype)))  # noqa: E731
    main, reader = {}, {}
    arrays = {name: cast(var[...]) for name, var in flat_params(model).items()}
    for name, arr in layout.disk_tensors(model, arrays):
        if name.startswith("reader."):
            reader[name[len("reader."):]] = arr
        else:
            main[name] = np.ascontiguousarray(arr)
    if heads is not None:
        main["embed_tokens.weight"], main["lm_head.weight"] = cast(heads.embed), cast(heads.lm_head)
    (out_dir / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    save_file(main, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    files = ["config.json", "model.safetensors"]
    if model.reader is not None:
        rdir = out_dir / READER_DIR
        rdir.mkdir(exist_ok=True)
        save_file(reader, str(rdir / "reader.safetensors"), metadata={"format": "pt"})
        (rdir / "reader_config.json").write_text(json.dumps(model.reader_config.to_dict(), indent=2) + "\n")
        files += [f"{READER_DIR}/reader.safetensors", f"{READER_DIR}/reader_config.json"]
        if lora:
            names, fused = set(flat_params(model)), layout.fused_params(model)
            tensors = {}
            for name, d in lora.items():
                key = name.replace("/", ".")
                if key not in names:
                    raise CheckpointError(f"LoRA for {name!r}: no such drafter parameter")
                a, b = cast(np.asarray(d["a"])), cast(np.asarray(d["b"]))
                if key in fused:        # W + B·A of a fused weight is its parts' W_p + B_p·A, B_p their rows of B
                    for part in fused[key].parts:
                        tensors[f"{part.key}.lora_a"], tensors[f"{part.key}.lora_b"] = a, layout.gather(part, b)
                else:
                    tensors[f"{key}.lora_a"], tensors[f"{key}.lora_b"] = a, b
            save_file(tensors, str(rdir / LORA_FILE), metadata={"format": "pt", "alpha": repr(float(lora_alpha))})
            files.append(f"{READER_DIR}/{LORA_FILE}")
    elif lora:
        raise CheckpointError("a LoRA is stored with its reader: this drafter has none (merge it instead)")
    (out_dir / "SHA256.json").write_text(json.dumps({f: _sha256(out_dir / f) for f in files}, indent=2) + "\n")


def load_drafter_config(model_dir: str | Path, *, logits_start: int | None = None
                        ) -> tuple[DrafterConfig, ReaderConfig | None]:
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json")
    try:
        cfg = DrafterConfig.from_hf_dict(json.loads(path.read_text()), logits_start=logits_start)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: not a DSpark/DFlash drafter config ({e})") from None
    rpath = model_dir / READER_DIR / "reader_config.json"
    rcfg = ReaderConfig.from_dict(json.loads(rpath.read_text())) if rpath.is_file() else None
    return cfg, rcfg


def load_drafter(model_dir: str | Path, *, dtype=jnp.float32, with_reader: bool = True,
                 logits_start: int | None = None) -> Drafter:
    """Read a drafter directory (reader included when present and with_reader). logits_start overrides the
    slot convention for checkpoints whose config does not state it."""
    model_dir = Path(model_dir)
    cfg, rcfg = load_drafter_config(model_dir, logits_start=logits_start)
    rcfg = rcfg if with_reader else None
    weights = model_dir / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{model_dir}: no model.safetensors")
    model = abstract_drafter(cfg, rcfg, dtype)
    params = flat_params(model)
    # streamed like the target (hf.stream_params): each tensor placed as it is read
    stream_params({k: v for k, v in params.items() if not k.startswith("reader.")}, [weights], where=weights,
                  dtype=dtype, rename=lambda k: None if k in _FROZEN_COPIES else k, fused=layout.fused_params(model))
    if model.reader is not None:
        rweights = model_dir / READER_DIR / "reader.safetensors"
        if not rweights.is_file():
            raise CheckpointError(f"{model_dir}: reader_config.json without reader.safetensors")
        stream_params(flat_params(model.reader), [rweights], where=rweights, dtype=dtype)
        _merge_lora(model, model_dir / READER_DIR / LORA_FILE, dtype)
    return model


def _merge_lora(model: Drafter, path: Path, dtype) -> None:
    """W += α/r · B·A (fp32) for every LoRA pair in `path` (by on-disk weight name: a part of a fused weight
    adds to its rows), if the file exists."""
    if not path.is_file():
        return
    with safe_open(str(path), framework="flax") as f:
        alpha = float((f.metadata() or {}).get("alpha", "nan"))
    if not np.isfinite(alpha):
        raise CheckpointError(f"{path}: no 'alpha' in the metadata")
    tensors = _read(path)
    params = flat_params(model)
    parts = {p.key: (f.name, p) for f in layout.fused_params(model).values() for p in f.parts}
    for key in sorted(k[:-len(".lora_a")] for k in tensors if k.endswith(".lora_a")):
        a, b = tensors[f"{key}.lora_a"].astype(np.float32), tensors.get(f"{key}.lora_b")
        name, part = parts.get(key, (key, None))
        var = params.get(name)
        shape = part.shape if part is not None else None if var is None else tuple(var.shape)
        if b is None or shape != (b.shape[0], a.shape[1]) or b.shape[1] != a.shape[0]:
            raise CheckpointError(f"{path}: LoRA pair {key!r} does not fit the drafter")
        w, delta = np.array(var[...], np.float32), (alpha / a.shape[0]) * (b.astype(np.float32) @ a)
        if part is None:
            w += delta
        else:
            layout.scatter(part, delta, w, add=True)
        var.set_value(jnp.asarray(w, dtype=dtype))


__all__ = ["save_drafter", "load_drafter", "load_drafter_config"]
