"""The MTP head and its `mtp.*` loader against an independent torch re-implementation of the head's formula.

The oracle shares no code with the library: the pre-fc norms, the concatenation and fc are written here in
torch; the decoder layer and the head's final norm are a one-layer `transformers` model of the target's family
whose `model.layers.0` / `model.norm` ARE the checkpoint's `mtp.layers.0` / `mtp.norm`; the target hidden is
transformers' final-norm `last_hidden_state`.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from hyspec_jax.config import TargetConfig
from hyspec_jax.io.hf import CheckpointError, load_pretrained
from hyspec_jax.io.mtp_io import NoMTPHead, has_mtp, load_mtp
from hyspec_jax.models.mtp import init_mtp_state
from hyspec_jax.state import init_state

try:
    from tests import hf_oracle as ho
except ImportError:
    import hf_oracle as ho

LIN, FULL = "linear_attention", "full_attention"
EPS = 1e-6


def _files(path):
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def _mtp_tensors(make_config, family_kw, hidden, seed) -> tuple[dict[str, np.ndarray], torch.nn.Module]:
    """Random mtp.* tensors: layer 0 and the final norm from a one-full-attention-layer transformers model of the
    family (saved by transformers, so its on-disk expert form), fc and the pre-fc norms random."""
    import tempfile
    from pathlib import Path
    one = ho.build(make_config(layer_types=[FULL], **family_kw), seed=seed)
    with tempfile.TemporaryDirectory() as d:
        ho.save(one, d)
        disk = {}
        for f in _files(Path(d)):
            disk.update(load_file(str(Path(d) / f)))
    out = {}
    for k, v in disk.items():
        if k.startswith("model.layers.0."):
            out["mtp.layers.0." + k[len("model.layers.0."):]] = v
        elif k == "model.norm.weight":
            out["mtp.norm.weight"] = v
    rng = np.random.default_rng(seed)
    out["mtp.fc.weight"] = (0.1 * rng.standard_normal((hidden, 2 * hidden))).astype(np.float32)
    out["mtp.pre_fc_norm_embedding.weight"] = (0.3 * rng.standard_normal(hidden)).astype(np.float32)
    out["mtp.pre_fc_norm_hidden.weight"] = (0.3 * rng.standard_normal(hidden)).astype(np.float32)
    return out, one


def _write_checkpoint(path, target, mtp: dict[str, np.ndarray] | None, *, vlm: bool = False, layers_key: str):
    """transformers' checkpoint of `target`, resharded: one shard per tensor group, the mtp tensors in their own
    shard, an index; vlm: the LM under model.language_model. and the config wrapped as Qwen3.5's VLM config."""
    ho.save(target, path)
    tensors = {}
    for f in _files(path):
        tensors.update(load_file(str(path / f)))
        (path / f).unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    if vlm:
        tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                   for k, v in tensors.items()}
    shards = {"model-00001-of-00003.safetensors": {k: v for k, v in tensors.items() if "layers" not in k},
              "model-00002-of-00003.safetensors": {k: v for k, v in tensors.items() if "layers" in k},
              "model-00003-of-00003.safetensors": dict(mtp or {})}
    weight_map = {}
    for name, shard in shards.items():
        if shard:
            save_file({k: np.ascontiguousarray(v) for k, v in shard.items()}, str(path / name),
                      metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = json.loads((path / "config.json").read_text())
    if mtp is not None:
        cfg[layers_key] = 1
    if vlm:
        cfg = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": cfg}
    (path / "config.json").write_text(json.dumps(cfg))


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + w)


@torch.no_grad()
def oracle_logits(target, one, mtp, tokens: np.ndarray, extra: list[int] = ()) -> np.ndarray:
    """Logits of the head at every position p = 0 .. T−2 of tokens [1, T] (pair (t_{p+1}, h_p)), then one
    recursive step per `extra` token d (pair (d, g_prev) with g_prev the head's previous output)."""
    t = lambda k: torch.as_tensor(mtp[k])  # noqa: E731
    ids = torch.as_tensor(tokens, dtype=torch.long)
    h = target.model(input_ids=ids).last_hidden_state                      # final-norm hidden [1,T,H]
    embed = target.model.embed_tokens.weight
    lm = target.lm_head.weight
    fuse = lambda e, hh: torch.cat([_rms(e, t("mtp.pre_fc_norm_embedding.weight")),  # noqa: E731
                                    _rms(hh, t("mtp.pre_fc_norm_hidden.weight"))], -1) @ t("mtp.fc.weight").T
    x = fuse(embed[ids[:, 1:]], h[:, :-1])
    out = None
    for d in [None] + list(extra):
        if d is not None:
            x = torch.cat([x, fuse(embed[torch.tensor([[d]])], out[:, -1:])], 1)
        pos = torch.arange(x.shape[1])[None]
        out = one.model(inputs_embeds=x, position_ids=pos).last_hidden_state
    return (out @ lm.T).numpy()


FAMILIES = {
    "qwen3_5_tied": (ho.qwen3_5_config, dict(tie=True), "mtp_num_hidden_layers", False),
    "qwen3_5_vlm": (ho.qwen3_5_config, dict(), "mtp_num_hidden_layers", True),
    "qwen3_next_moe": (ho.qwen3_next_config, dict(num_experts=3, top_k=2), "num_nextn_predict_layers", False),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ckpt(request, tmp_path_factory):
    make, kw, key, vlm = FAMILIES[request.param]
    target = ho.build(make(layer_types=[LIN, FULL, LIN], **kw), seed=3)
    mtp, one = _mtp_tensors(make, kw, target.config.hidden_size, seed=11)
    path = tmp_path_factory.mktemp(request.param)
    _write_checkpoint(path, target, mtp, vlm=vlm, layers_key=key)
    return path, target, one, mtp


def _library_logits(path, tokens: np.ndarray, chunks: list[int], extra: list[int]):
    """The library's head: the target prefilled chunk by chunk, its final-norm hiddens appended to the MTP cache,
    then the draft steps from the anchor (depth 0) and the extra tokens (depth 1..)."""
    cfg, target = load_pretrained(path)
    head = load_mtp(path, cfg)
    B, T = tokens.shape
    state = init_state(cfg, B, 32)
    mstate = init_mtp_state(cfg, B, 32)
    embed = target.model.embed_tokens.weight[...]
    last = cfg.num_hidden_layers - 1
    start = 0
    for n in chunks:      # tokens t_0 .. t_{T-2} through the target; t_{T-1} is the anchor
        part = jnp.asarray(tokens[:, start:start + n])
        _, taps, state = target.extend(state, part, jnp.ones(part.shape, bool), tap_layers=(last,))
        mstate = head.append(mstate, embed, part, target.model.norm(taps[0]), jnp.full((B,), n, jnp.int32))
        start += n
    assert start == T - 1
    H = cfg.hidden_size
    kv = (0, cfg.num_key_value_heads, cfg.head_dim)
    lk, lv = jnp.zeros((B,) + kv), jnp.zeros((B,) + kv)
    hid, tok = mstate.hidden[:, None], jnp.asarray(tokens[:, -1:])
    out = []
    for depth, nxt in enumerate([None] + list(extra)):
        if nxt is not None:
            tok = jnp.full((B, 1), nxt, jnp.int32)
        g, k, v = head.step(mstate, embed, tok, hid, depth, lk, lv, jnp.ones((B, 1, lk.shape[1]), bool))
        out.append(np.asarray(target.logits(g))[:, 0])
        lk, lv, hid = jnp.concatenate([lk, k], 1), jnp.concatenate([lv, v], 1), g
        assert g.shape == (B, 1, H)
    return out


def test_head_matches_an_independent_torch_oracle(ckpt):
    path, target, one, mtp = ckpt
    rng = np.random.default_rng(0)
    V = target.config.vocab_size
    tokens = rng.integers(0, V, (1, 9))
    extra = [int(rng.integers(V)), int(rng.integers(V))]
    got = _library_logits(path, tokens, [3, 5], extra)            # two prefill chunks: the pending hidden carries
    for i in range(len(extra) + 1):
        want = oracle_logits(target, one, mtp, tokens, extra[:i])[0, -1]
        np.testing.assert_allclose(got[i][0], want, rtol=2e-4, atol=2e-4, err_msg=f"draft step {i}")


def test_head_logits_are_not_the_target_s(ckpt):
    """The head predicts the token after next: its logits differ from the target's at the same position."""
    path, target, one, mtp = ckpt
    tokens = np.arange(1, 8)[None] % target.config.vocab_size
    got = _library_logits(path, tokens, [6], [])[0]
    plain = ho.logits(target, tokens)[0, -1]
    assert np.abs(got[0] - plain).max() > 1e-2


def test_config_reads_both_layer_count_keys(ckpt):
    path = ckpt[0]
    cfg = TargetConfig.from_pretrained(path)
    assert cfg.mtp_num_hidden_layers == 1
    raw = cfg.to_hf_dict()
    assert TargetConfig.from_hf_dict(raw) == cfg      # the family's own key is written back
    assert ("num_nextn_predict_layers" in raw) == (cfg.model_type == "qwen3_next")


def test_checkpoint_without_mtp_raises_the_typed_error(tmp_path):
    target = ho.build(ho.qwen3_5_config(layer_types=[LIN, FULL]), seed=1)
    _write_checkpoint(tmp_path, target, None, layers_key="mtp_num_hidden_layers")
    assert not has_mtp(tmp_path)
    with pytest.raises(NoMTPHead, match="no MTP head"):
        load_mtp(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())           # declared, but no tensors
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    with pytest.raises(NoMTPHead, match="no mtp"):
        load_mtp(tmp_path)


def test_missing_mtp_tensor_is_named(ckpt, tmp_path):
    path, target, one, mtp = ckpt
    partial = {k: v for k, v in mtp.items() if k != "mtp.pre_fc_norm_hidden.weight"}
    layers_key = "num_nextn_predict_layers" if target.config.model_type == "qwen3_next" else "mtp_num_hidden_layers"
    _write_checkpoint(tmp_path, target, partial, layers_key=layers_key)
    with pytest.raises(CheckpointError, match="pre_fc_norm_hidden"):
        load_mtp(tmp_path)
