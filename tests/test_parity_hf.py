"""Logit parity with `transformers` (torch, CPU, fp32) on tiny random models with every parameter perturbed.

Geometries are deliberately untuned: GVA ratios 1/2/3, head_dim 16/32, dk != dv, different layer_types
patterns, Qwen3.5 split and Qwen3-Next interleaved projections, dense and MoE (mlp_only_layers,
decoder_sparse_step, norm_topk_prob off), untied embeddings.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file

from hyspec_jax.io.hf import load_pretrained
from hyspec_jax.models.target import extend_jit
from hyspec_jax.state import init_state

try:  # tests/ as a package (tests/__init__.py) or as a plain directory on sys.path
    from tests import hf_oracle as ho
except ImportError:
    import hf_oracle as ho

TOL = 1e-4
LIN, FULL = "linear_attention", "full_attention"
P = 13          # prompt length (prefill bucket)
MAX_LEN = 24    # KV bucket
DECODE = 8
PIECES = [(5, 3, 1, 4), (4, 1, 3, 5)]   # per-row prefill pieces (sum P), fed through the prefill bucket (width P)

GEOMETRIES = {
    # Qwen3.5 dense, HV/HK = 1, head_dim 16, dk != dv, attention in the middle
    "qwen3_5-r1": lambda: ho.qwen3_5_config(hk=2, hv=2, dk=8, dv=16, head_dim=16, heads=4, kv_heads=2,
                                            layer_types=[LIN, FULL, LIN]),
    # Qwen3-Next MoE, HV/HK = 2, head_dim 32, attention first and last, a dense layer via mlp_only_layers,
    # no top-k renormalisation
    "qwen3_next-moe-r2": lambda: ho.qwen3_next_config(hk=2, hv=4, dk=16, dv=8, head_dim=32, heads=2, kv_heads=1,
                                                      layer_types=[FULL, LIN, LIN, FULL], mlp_only_layers=[1],
                                                      norm_topk_prob=False, num_experts=5, top_k=2),
    # Qwen3-Next MoE on every other layer (decoder_sparse_step 2), HV/HK = 3, default interval schedule
    "qwen3_next-step2-r3": lambda: ho.qwen3_next_config(hk=1, hv=3, dk=8, dv=8, head_dim=16, heads=4, kv_heads=1,
                                                        layers=4, decoder_sparse_step=2, num_experts=3, top_k=2,
                                                        rope_theta=500.0),
    # Qwen3-Next without experts (num_experts = 0: dense everywhere), HV/HK = 2, more value than key width
    "qwen3_next-dense-r2": lambda: ho.qwen3_next_config(hk=1, hv=2, dk=8, dv=16, head_dim=16, heads=2, kv_heads=2,
                                                        num_experts=0, layer_types=[LIN, LIN, FULL]),
}


class Geo:
    """One geometry: the torch oracle, our loaded model, and shared prompts / reference runs."""

    def __init__(self, name, path):
        self.name = name
        self.hf_config = GEOMETRIES[name]()
        self.torch_model = ho.build(self.hf_config, seed=len(name))
        ho.save(self.torch_model, path)
        self.path = path
        self.cfg, model = load_pretrained(path)
        self.graphdef, self.params = nnx.split(model)
        rng = np.random.default_rng(len(name))
        self.prompts = rng.integers(0, self.hf_config.vocab_size, size=(2, P))
        self.hf_prefill, self.hf_steps, self.fed = ho.cached_decode(self.torch_model, self.prompts, DECODE)
        # our prefill at once, then 8 cached decode steps
        state = init_state(self.cfg, 2, MAX_LEN)
        logits, state = extend_jit(self.graphdef, self.params, state, jnp.asarray(self.prompts, jnp.int32),
                                   jnp.ones((2, P), bool))
        self.prefill = np.asarray(logits)
        self.prefill_state = jax.tree.map(np.asarray, state)
        self.steps = []
        for t in range(DECODE):
            logits, state = extend_jit(self.graphdef, self.params, state, jnp.asarray(self.fed[:, t:t + 1], jnp.int32),
                                       jnp.ones((2, 1), bool))
            self.steps.append(np.asarray(logits[:, 0]))
        self.decoded_state = state

    def extend(self, state, tokens, valid):
        return extend_jit(self.graphdef, self.params, state, jnp.asarray(tokens, jnp.int32), jnp.asarray(valid))


_BUILT: dict[str, Geo] = {}


def get_geo(name, tmp_path_factory) -> Geo:
    if name not in _BUILT:
        _BUILT[name] = Geo(name, tmp_path_factory.mktemp(name))
    return _BUILT[name]


@pytest.fixture(scope="module", params=list(GEOMETRIES))
def geo(request, tmp_path_factory):
    return get_geo(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_5_geo(tmp_path_factory):
    return get_geo("qwen3_5-r1", tmp_path_factory)


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def test_config_parsed_as_transformers_sees_it(geo):
    hf, cfg = geo.hf_config, geo.cfg
    assert cfg.layer_types == tuple(hf.layer_types)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (hf.linear_num_key_heads,
                                                                      hf.linear_num_value_heads)
    assert cfg.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    sparse = [i for i in range(hf.num_hidden_layers)
              if type(geo.torch_model.model.layers[i].mlp).__name__.endswith("SparseMoeBlock")]
    assert [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_layer(i)] == sparse


def test_prefill_logits_match_transformers(geo):
    ref = ho.logits(geo.torch_model, geo.prompts)
    assert geo.prefill.shape == ref.shape
    assert max_diff(geo.prefill, ref) < TOL
    assert max_diff(geo.hf_prefill, ref) < 1e-5          # the oracle's own cached prefill agrees


def test_cached_decode_steps_match_transformers(geo):
    for t in range(DECODE):
        assert max_diff(geo.steps[t], geo.hf_steps[t]) < TOL, t
    assert np.array_equal(np.asarray(geo.decoded_state.lengths), [P + DECODE] * 2)
    # the greedy continuation we would produce is the one transformers produced
    ours = np.stack([s.argmax(-1) for s in geo.steps[:-1]], 1)
    np.testing.assert_array_equal(ours, geo.fed[:, 1:])


def test_ragged_batch_equals_each_prompt_alone(geo):
    lens = [P, 8]
    tokens = geo.prompts.copy()
    tokens[1, lens[1]:] = 0                                   # right padding
    valid = np.arange(P)[None] < np.array(lens)[:, None]
    state = init_state(geo.cfg, 2, MAX_LEN)
    logits, state = geo.extend(state, tokens, valid)
    logits = np.asarray(logits)
    np.testing.assert_array_equal(np.asarray(state.lengths), lens)
    nxt = np.array([[7], [11]])
    step, state = geo.extend(state, nxt, np.ones((2, 1), bool))
    for b, n in enumerate(lens):
        alone = ho.logits(geo.torch_model, np.concatenate([tokens[b:b + 1, :n], nxt[b:b + 1]], 1))[0]
        assert max_diff(logits[b, :n], alone[:n]) < TOL, b
        assert max_diff(step[b, 0], alone[n]) < TOL, b        # and the decode step that follows it


def test_prefill_in_pieces_equals_prefill_at_once(geo):
    """Each row's prompt arrives in pieces of different sizes through one bucket (valid prefix masks), as the
    engine feeds it: the rows of a batch are at different lengths after every piece."""
    state = init_state(geo.cfg, 2, MAX_LEN)
    got = np.zeros_like(geo.prefill)
    starts = [0, 0]
    for k in range(len(PIECES[0])):
        tokens = np.full((2, P), 3, np.int64)
        valid = np.zeros((2, P), bool)
        for b in range(2):
            n = PIECES[b][k]
            tokens[b, :n] = geo.prompts[b, starts[b]:starts[b] + n]
            valid[b, :n] = True
        logits, state = geo.extend(state, tokens, valid)
        for b in range(2):
            n = PIECES[b][k]
            got[b, starts[b]:starts[b] + n] = np.asarray(logits[b, :n])
            starts[b] += n
    assert max_diff(got, geo.prefill) < TOL
    ref = geo.prefill_state
    np.testing.assert_array_equal(np.asarray(state.lengths), ref.lengths)
    assert max_diff(state.ssm, ref.ssm) < 1e-5
    assert max_diff(state.conv, ref.conv) < 1e-5
    assert max_diff(state.keys, ref.keys) < 1e-5 and max_diff(state.values, ref.values) < 1e-5
    assert not np.any(np.asarray(state.keys)[:, :, P:])      # padding never wrote the KV cache


def test_prefill_in_exact_pieces_equals_prefill_at_once(qwen3_5_geo):
    """6 + 1 + 6 tokens through extend at their own lengths (the T == 1 piece takes the decode path).
    One geometry: every other length is one more compiled program."""
    geo = qwen3_5_geo
    state = init_state(geo.cfg, 2, MAX_LEN)
    outs, start = [], 0
    for n in (6, 1, 6):
        logits, state = geo.extend(state, geo.prompts[:, start:start + n], np.ones((2, n), bool))
        outs.append(np.asarray(logits))
        start += n
    assert max_diff(np.concatenate(outs, 1), geo.prefill) < TOL
    assert max_diff(state.ssm, geo.prefill_state.ssm) < 1e-5
    assert max_diff(state.conv, geo.prefill_state.conv) < 1e-5


# ------------------------------------------------------------------------------------------------
# Qwen3.5 saved as ConditionalGeneration (model.language_model.*, plus mtp.* and model.visual.*)
# ------------------------------------------------------------------------------------------------
def test_conditional_generation_checkpoint_loads_identically(qwen3_5_geo, tmp_path):
    import transformers
    geo = qwen3_5_geo
    tensors = load_file(str(geo.path / "model.safetensors"))
    rng = np.random.default_rng(0)
    H = geo.hf_config.hidden_size
    out = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
           for k, v in tensors.items()}
    out.update({
        "mtp.fc.weight": rng.normal(size=(H, 2 * H)).astype(np.float32),
        "mtp.norm.weight": rng.normal(size=(H,)).astype(np.float32),
        "mtp.layers.0.self_attn.q_proj.weight": rng.normal(size=(8, H)).astype(np.float32),
        "model.visual.patch_embed.proj.weight": rng.normal(size=(16, 3, 2, 4, 4)).astype(np.float32),
        "model.visual.blocks.0.attn.qkv.weight": rng.normal(size=(48, 16)).astype(np.float32),
    })
    # split in two shards with an index, as the real checkpoints are
    names = sorted(out)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, keys in shards.items():
        save_file({k: out[k] for k in keys}, str(tmp_path / fname), metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=H, patch_size=4)
    top = transformers.Qwen3_5Config(text_config=geo.hf_config.to_dict(), vision_config=vision,
                                     architectures=["Qwen3_5ForConditionalGeneration"])
    top.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5" and raw["text_config"]["model_type"] == "qwen3_5_text"
    assert any(k.startswith("model.language_model.layers.") for k in out)

    cfg, model = load_pretrained(tmp_path)
    assert cfg == geo.cfg
    ours = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    ref = dict(nnx.to_flat_state(geo.params))
    assert ours.keys() == ref.keys()
    for key in ref:
        np.testing.assert_array_equal(np.asarray(ours[key][...]), np.asarray(ref[key][...]), err_msg=str(key))

    # the rewritten directory really is what transformers reads as this model
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        np.testing.assert_allclose(ho.logits(hf, geo.prompts), ho.logits(geo.torch_model, geo.prompts),
                                   rtol=0, atol=1e-6)
