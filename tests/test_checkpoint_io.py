"""Checkpoint I/O: our save_pretrained / load_pretrained against the Hugging Face layout and transformers itself."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from hyspec_jax.config import ConfigError, TargetConfig
from hyspec_jax.io.hf import CheckpointError, hf_tensors, load_pretrained, save_pretrained
from hyspec_jax.models.target import abstract_model, extend_jit
from hyspec_jax.state import init_state

try:  # tests/ as a package (tests/__init__.py) or as a plain directory on sys.path
    from tests import hf_oracle as ho
except ImportError:
    import hf_oracle as ho

LIN, FULL = "linear_attention", "full_attention"


def flat(model_or_state) -> dict[str, np.ndarray]:
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, nnx.Param)
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(state)}


def assert_same_params(a, b):
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype, k
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def disk_tensors(path) -> dict[str, np.ndarray]:
    index = path / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    out = {}
    for f in files:
        out.update(load_file(str(path / f)))
    return out


@pytest.fixture(scope="module")
def next_moe(tmp_path_factory):
    """A Qwen3-Next MoE checkpoint written by transformers (per-expert tensors on disk)."""
    cfg = ho.qwen3_next_config(hk=1, hv=2, layer_types=[LIN, FULL, LIN], mlp_only_layers=[2], num_experts=3,
                               norm_topk_prob=False)
    model = ho.build(cfg, seed=5)
    path = ho.save(model, tmp_path_factory.mktemp("next_moe"))
    return model, path


@pytest.fixture(scope="module")
def next_moe_loaded(next_moe):
    return load_pretrained(next_moe[1])


# ------------------------------------------------------------------------------------------------
# Round trips
# ------------------------------------------------------------------------------------------------
def test_save_load_round_trip_single_file(next_moe, next_moe_loaded, tmp_path):
    _, hf_path = next_moe
    cfg, model = next_moe_loaded
    save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    # the same tensor names, shapes and values as transformers' own save_pretrained (per-expert on disk)
    ours, theirs = disk_tensors(tmp_path), disk_tensors(hf_path)
    assert ours.keys() == theirs.keys()
    assert any(re.search(r"mlp\.experts\.2\.up_proj\.weight$", k) for k in ours)
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"}
    cfg2, model2 = load_pretrained(tmp_path)
    assert cfg2 == cfg
    assert_same_params(model2, model)


@pytest.mark.parametrize("make_config", [
    lambda: ho.qwen3_5_config(hk=2, hv=6, layer_types=[LIN, FULL, LIN]),
    lambda: ho.qwen3_next_config(hk=2, hv=6, layer_types=[LIN, FULL, LIN], num_experts=3)],
    ids=["split", "interleaved"])
def test_load_save_round_trip_is_byte_identical(make_config, tmp_path):
    """Both GDN projection layouts (and the MLPs' gate/up) are fused on load and split back on save: every tensor
    of transformers' bf16 checkpoint comes back under its name with the same bytes."""
    ho.save(ho.build(make_config(), seed=4).to(torch.bfloat16), tmp_path / "hf")
    _, model = load_pretrained(tmp_path / "hf", dtype=jnp.bfloat16)
    assert "model.layers.0.linear_attn.in_proj.weight" in flat(model)
    save_pretrained(model, tmp_path / "ours")
    theirs, ours = disk_tensors(tmp_path / "hf"), disk_tensors(tmp_path / "ours")
    assert ours.keys() == theirs.keys()
    assert any(k.endswith(("in_proj_qkv.weight", "in_proj_qkvz.weight")) for k in ours)
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape, k
        assert ours[k].tobytes() == theirs[k].tobytes(), k


def test_save_load_round_trip_sharded(next_moe_loaded, tmp_path):
    cfg, model = next_moe_loaded
    save_pretrained(model, tmp_path, max_shard_bytes=16 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == shards
    tensors = disk_tensors(tmp_path)
    assert tensors.keys() == index["weight_map"].keys()
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    for fname in shards:                                      # every shard respects the limit (or holds one tensor)
        shard = load_file(str(tmp_path / fname))
        assert len(shard) == 1 or sum(a.nbytes for a in shard.values()) <= 16 * 1024
    cfg2, model2 = load_pretrained(tmp_path)
    assert cfg2 == cfg
    assert_same_params(model2, model)


def test_fused_and_per_expert_checkpoints_load_identically(next_moe, next_moe_loaded, tmp_path):
    torch_model, hf_path = next_moe
    cfg, model = next_moe_loaded
    tensors = disk_tensors(hf_path)
    fused, per = {}, re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for k, v in tensors.items():
        m = per.match(k)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
        else:
            fused[k] = v
    assert groups, "the transformers checkpoint should hold per-expert tensors"
    for prefix, ex in groups.items():
        E = len(ex)
        fused[f"{prefix}.gate_up_proj"] = np.stack([np.concatenate([ex[e]["gate_proj"], ex[e]["up_proj"]])
                                                    for e in range(E)])
        fused[f"{prefix}.down_proj"] = np.stack([ex[e]["down_proj"] for e in range(E)])
    save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(hf_path / "config.json", tmp_path / "config.json")
    _, model2 = load_pretrained(tmp_path)
    assert_same_params(model2, model)
    # and both equal transformers' in-memory fused experts (gate rows first)
    for i, layer in enumerate(torch_model.model.layers):
        if hasattr(layer.mlp, "experts"):
            ours = model.model.layers[i].mlp.experts
            np.testing.assert_array_equal(np.asarray(ours.gate_up_proj[...]),
                                          layer.mlp.experts.gate_up_proj.detach().numpy())
            np.testing.assert_array_equal(np.asarray(ours.down_proj[...]),
                                          layer.mlp.experts.down_proj.detach().numpy())


def test_checkpoint_with_an_expert_the_config_lacks_fails_in_one_line(next_moe, tmp_path):
    """transformers' checkpoint of 3 experts a layer plus a 4th expert's tensors config.json does not have: a clear
    CheckpointError naming the stray tensor, before any data is read (not silently skipped)."""
    _, hf_path = next_moe
    tensors = disk_tensors(hf_path)
    layer = next(k for k in tensors if ".mlp.experts.0.gate_proj.weight" in k).split(".experts.")[0]
    for proj in ("gate_proj", "up_proj", "down_proj"):
        tensors[f"{layer}.experts.3.{proj}.weight"] = tensors[f"{layer}.experts.0.{proj}.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(hf_path / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"experts\.3\..*is not one of config.json's 3 experts"):
        load_pretrained(tmp_path)


def test_bf16_checkpoint_loads_in_the_requested_dtype(tmp_path):
    cfg = ho.qwen3_5_config(layer_types=[LIN, FULL], hk=1, hv=1)
    model = ho.build(cfg, seed=3).to(torch.bfloat16)
    ho.save(model, tmp_path)
    _, ours32 = load_pretrained(tmp_path, dtype=jnp.float32)
    _, ours16 = load_pretrained(tmp_path, dtype=jnp.bfloat16)
    f32, f16 = hf_tensors(ours32), hf_tensors(ours16)      # in the checkpoint's names
    for name, p in model.named_parameters():
        assert f32[name].dtype == np.float32 and f16[name].dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(f32[name], p.detach().float().numpy(), err_msg=name)
        np.testing.assert_array_equal(f16[name].astype(np.float32), p.detach().float().numpy(), err_msg=name)


# ------------------------------------------------------------------------------------------------
# transformers reads what we write
# ------------------------------------------------------------------------------------------------
def _hf_load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


TORCH_CHAIN = {
    "qwen3_5-tied": lambda: ho.qwen3_5_config(tie=True, hk=1, hv=3, layer_types=[FULL, LIN, LIN]),
    "qwen3_next-moe": lambda: ho.qwen3_next_config(decoder_sparse_step=2, mlp_only_layers=[3], num_experts=4,
                                                   top_k=3, layers=4),
    "qwen3_next-dense": lambda: ho.qwen3_next_config(num_experts=0, layer_types=[LIN, FULL]),
}


@pytest.mark.parametrize("make_config", list(TORCH_CHAIN.values()), ids=list(TORCH_CHAIN))
def test_transformers_loads_what_we_save(make_config, tmp_path):
    """transformers model → HF checkpoint → load_pretrained → save_pretrained (sharded) → transformers: same logits."""
    hf_cfg = make_config()
    model = ho.build(hf_cfg, seed=9)
    ho.save(model, tmp_path / "hf")
    _, ours = load_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "ours", max_shard_bytes=32 * 1024)
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    reloaded = _hf_load(tmp_path / "ours")
    assert type(reloaded) is type(model)
    theirs = dict(model.state_dict())
    again = dict(reloaded.state_dict())
    assert again.keys() == theirs.keys()
    for k in theirs:
        np.testing.assert_array_equal(again[k].numpy(), theirs[k].numpy(), err_msg=k)
    tokens = np.random.default_rng(0).integers(0, hf_cfg.vocab_size, size=(2, 9))
    np.testing.assert_array_equal(ho.logits(reloaded, tokens), ho.logits(model, tokens))


def _target_config(model_type, **kw):
    base = dict(vocab_size=64, hidden_size=24, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, intermediate_size=40, layer_types=(LIN, LIN, FULL), linear_num_key_heads=1,
                linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=4, rope_theta=5e5,
                partial_rotary_factor=0.5)
    return TargetConfig(model_type=model_type, **{**base, **kw})


CONFIGS = [
    pytest.param(_target_config("qwen3_5_text"), id="qwen3_5_text"),
    pytest.param(_target_config("qwen3_5_text", tie_word_embeddings=True), id="qwen3_5_text-tied"),
    pytest.param(_target_config("qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                shared_expert_intermediate_size=8), id="qwen3_5_moe_text"),
    pytest.param(_target_config("qwen3_next", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                shared_expert_intermediate_size=8, norm_topk_prob=False, decoder_sparse_step=2,
                                mlp_only_layers=(1,)), id="qwen3_next-moe"),
    pytest.param(_target_config("qwen3_next"), id="qwen3_next-dense"),
    pytest.param(_target_config("qwen3_5"), id="qwen3_5-wrapper-type"),
    pytest.param(_target_config("qwen3_5_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                shared_expert_intermediate_size=8), id="qwen3_5_moe-wrapper-type"),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_config_json_we_write_is_the_model_transformers_builds(cfg, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert TargetConfig.from_pretrained(tmp_path) == dataclasses.replace(
        cfg, model_type={"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(cfg.model_type,
                                                                                          cfg.model_type))
    text = transformers.AutoConfig.from_pretrained(tmp_path).get_text_config()
    assert text.model_type.endswith("_text") or text.model_type == "qwen3_next"
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(text, key) == getattr(cfg, key), key
    assert tuple(text.layer_types) == cfg.layer_types
    assert text.rope_parameters["rope_theta"] == cfg.rope_theta
    assert text.rope_parameters["partial_rotary_factor"] == cfg.partial_rotary_factor
    if not cfg.is_moe:
        assert getattr(text, "num_experts", 0) == 0
    else:
        assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size,
                text.shared_expert_intermediate_size) == (cfg.num_experts, cfg.num_experts_per_tok,
                                                          cfg.moe_intermediate_size,
                                                          cfg.shared_expert_intermediate_size)
    if cfg.model_type == "qwen3_next":
        assert (text.norm_topk_prob, text.decoder_sparse_step, tuple(text.mlp_only_layers)) == (
            cfg.norm_topk_prob, cfg.decoder_sparse_step, cfg.mlp_only_layers)


def test_our_model_saved_is_read_by_transformers_with_the_same_logits(tmp_path):
    """A Qwen3.5-MoE target created here (not by transformers), every parameter randomised, saved sharded:
    transformers' forward of that checkpoint equals our forward."""
    cfg = TargetConfig(
        model_type="qwen3_5_moe_text", vocab_size=97, hidden_size=40, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=24, intermediate_size=0, layer_types=(LIN, FULL, LIN),
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=4,
        partial_rotary_factor=0.25, rope_theta=1000.0, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=12, shared_expert_intermediate_size=20)
    # every parameter random (numpy fills the abstract model: eager jax.random would compile per shape)
    rng = np.random.default_rng(1)
    graphdef, abstract = nnx.split(abstract_model(cfg))
    params = jax.tree.map(lambda p: jnp.asarray(0.3 * rng.normal(size=p.shape), p.dtype), abstract)
    model = nnx.merge(graphdef, params)
    save_pretrained(model, tmp_path, max_shard_bytes=8 * 1024)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_moe_text"
    hf = _hf_load(tmp_path)
    assert type(hf).__name__ == "Qwen3_5MoeForCausalLM"
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 11))
    ref = ho.logits(hf, tokens)
    logits, _ = extend_jit(graphdef, params, init_state(cfg, 2, 11), jnp.asarray(tokens, jnp.int32),
                           jnp.ones((2, 11), bool))
    # fp32, relative to the logit scale (docs/design.md §6: fp32 << 1e-3 relative): every parameter is 0.3·N(0, 1), so
    # logits reach ~6 and summation-order differences (XLA's dot, the native CPU kernel, torch) grow with them
    err = np.max(np.abs(np.asarray(logits) - ref)) / np.max(np.abs(ref))
    assert err < 1e-4, err
    assert TargetConfig.from_pretrained(tmp_path) == cfg


# ------------------------------------------------------------------------------------------------
# Errors name what is wrong
# ------------------------------------------------------------------------------------------------
def _rewrite(src, dst, edit):
    dst.mkdir(exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = disk_tensors(src)
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_missing_tensor_is_named(next_moe, tmp_path):
    key = "model.layers.0.linear_attn.dt_bias"
    path = _rewrite(next_moe[1], tmp_path, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=re.escape(repr(key))):
        load_pretrained(path)


def test_misshapen_tensor_names_both_shapes(next_moe, tmp_path):
    key = "model.layers.1.self_attn.k_proj.weight"

    def edit(t):
        assert t[key].shape == (32, 48)
        t[key] = np.zeros((32, 47), np.float32)
    with pytest.raises(CheckpointError, match=re.escape(repr(key))) as err:
        load_pretrained(_rewrite(next_moe[1], tmp_path, edit))
    assert "(32, 47)" in str(err.value) and "(32, 48)" in str(err.value)


def test_missing_expert_tensor_is_named(next_moe, tmp_path):
    key = "model.layers.1.mlp.experts.2.up_proj.weight"
    with pytest.raises(CheckpointError, match=re.escape(repr(key))):
        load_pretrained(_rewrite(next_moe[1], tmp_path, lambda t: t.pop(key)))


def test_misshapen_expert_tensor_names_both_shapes(next_moe, tmp_path):
    key = "model.layers.0.mlp.experts.1.down_proj.weight"

    def edit(t):
        assert t[key].shape == (48, 24)
        t[key] = np.zeros((48, 25), np.float32)
    with pytest.raises(CheckpointError, match=re.escape(repr(key))) as err:
        load_pretrained(_rewrite(next_moe[1], tmp_path, edit))
    assert "(48, 25)" in str(err.value) and "(48, 24)" in str(err.value)


def test_directory_without_config_json_raises_config_error(next_moe, tmp_path):
    shutil.copy(next_moe[1] / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match="config.json"):
        load_pretrained(tmp_path)


def test_other_unreadable_directories(next_moe, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    shutil.copy(next_moe[1] / "config.json", tmp_path / "empty" / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_pretrained(tmp_path / "empty")
    idx = tmp_path / "lost_shard"
    idx.mkdir()
    shutil.copy(next_moe[1] / "config.json", idx / "config.json")
    (idx / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="gone.safetensors"):
        load_pretrained(idx)
    bad = tmp_path / "llama"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="llama"):
        load_pretrained(bad)


# ------------------------------------------------------------------------------------------------
# Streamed loading: shard by shard, each tensor placed as read, onto one device or a mesh
# ------------------------------------------------------------------------------------------------
from jax.sharding import NamedSharding  # noqa: E402

from hyspec_jax import sharding as shd  # noqa: E402
from hyspec_jax.io import hf  # noqa: E402


@pytest.fixture(scope="module")
def sharded_moe(tmp_path_factory):
    """A Qwen3-Next MoE checkpoint written by transformers in many shards with an index (experts per expert);
    head, value-head and expert counts even, so a model axis of 2 or 4 splits them."""
    cfg = ho.qwen3_next_config(heads=4, kv_heads=2, hk=2, hv=4, layer_types=[LIN, FULL, LIN, LIN], num_experts=4,
                               mlp_only_layers=[2])
    model = ho.build(cfg, seed=11)
    path = tmp_path_factory.mktemp("sharded_moe")
    model.save_pretrained(path, max_shard_size="20KB")
    return model, path


@pytest.fixture(scope="module")
def sharded_moe_loaded(sharded_moe):
    stats = hf.LoadStats()
    cfg, model = load_pretrained(sharded_moe[1], stats=stats)
    return cfg, model, stats


def test_sharded_checkpoint_streams_onto_one_device(sharded_moe, sharded_moe_loaded):
    torch_model, path = sharded_moe
    cfg, model, stats = sharded_moe_loaded
    files = sorted(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(files) >= 5 and stats.files == len(files)
    assert any(k.endswith("experts.gate_up_proj") for k in flat(model))
    # transformers' in-memory parameters (routed experts fused, gate rows first, as ours; the rest in our
    # on-disk names)
    ours = {**hf_tensors(model), **{k: v for k, v in flat(model).items() if ".experts." in k}}
    theirs = {k: v.detach().numpy() for k, v in torch_model.state_dict().items()}
    assert theirs.keys() <= ours.keys()
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    # host memory: never more than one file's tensors plus one MoE layer's fused experts (the old loader held
    # every tensor of the checkpoint at once)
    total = sum(a.nbytes for a in disk_tensors(path).values())
    assert stats.bytes_read == total and stats.held_bytes == 0
    layer = max(ours[k].nbytes + ours[k.replace("gate_up_proj", "down_proj")].nbytes
                for k in ours if k.endswith("gate_up_proj"))
    assert 0 < stats.peak_host_bytes <= stats.largest_file_bytes + layer < total / 2


@pytest.mark.parametrize("mesh_shape", [(1, 4), (2, 2)], ids=["model4", "data2-model2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_sharded_checkpoint_streams_onto_a_mesh(sharded_moe, sharded_moe_loaded, mesh_shape, dtype):
    """Each parameter lands in sharding.param_spec's layout, with the values of the single-device load."""
    _, path = sharded_moe
    cfg, single, _ = sharded_moe_loaded
    if dtype != jnp.float32:
        single = load_pretrained(path, dtype=dtype)[1]
    mesh = shd.make_mesh(*mesh_shape)
    cfg2, model = load_pretrained(path, dtype=dtype, mesh=mesh)
    assert cfg2 == cfg
    split = 0
    for name, var in hf.flat_params(model).items():
        arr = var[...]
        spec = shd.param_spec(name, arr.shape, cfg, mesh)
        assert arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim), name
        assert arr.dtype == dtype, name
        split += any(s is not None for s in spec)
    assert split >= 10                                    # attention, GDN value heads, MLPs, experts, vocab
    assert_same_params(model, single)


class _ReadLog:
    """hf._ShardReader, recording which files are open at once, every read of tensor data, and the bytes of the
    arrays those reads returned that are still alive (weak references), at their most."""

    def __init__(self, monkeypatch):
        self.open, self.max_open, self.reads = 0, 0, []
        self.live, self.peak_live = {}, 0
        log = self

        class Logged(hf._ShardReader):
            def __init__(self, path):
                super().__init__(path)
                log.open += 1
                log.max_open = max(log.max_open, log.open)

            def close(self):
                log.open -= 1
                super().close()

            def read(self, t, index):
                return log._read(self.path, t.raw_key, super().read(t, index))
        monkeypatch.setattr(hf, "_ShardReader", Logged)

    def _read(self, path, key, arr):
        self.reads.append((path, key))
        n = len(self.reads)
        self.live[n] = arr.nbytes
        weakref.finalize(arr, self.live.pop, n, None)
        self.peak_live = max(self.peak_live, sum(self.live.values()))
        return arr


def test_row_ranges_are_read_directly_other_slices_lazily():
    shape = (6, 4, 2)
    assert hf._row_range(None, shape) == (0, 6)
    assert hf._row_range((slice(None),) * 3, shape) == (0, 6)
    assert hf._row_range((slice(2, 4),), shape) == (2, 4)
    assert hf._row_range((slice(2, 4), slice(0, 4), slice(None)), shape) == (2, 4)
    assert hf._row_range((slice(None), slice(0, 2)), shape) is None
    assert hf._row_range((slice(0, 6, 2),), shape) is None
    assert hf._row_range(None, ()) == (0, 1) and hf._row_range((), ()) == (0, 1)


def test_shards_are_read_one_at_a_time(sharded_moe, monkeypatch):
    reads = _ReadLog(monkeypatch)
    load_pretrained(sharded_moe[1], mesh=shd.make_mesh(1, 2))
    assert reads.max_open == 1 and reads.open == 0
    order = [p for p, _ in reads.reads]
    assert len(set(order)) >= 5
    # each file's data is read in one stretch, never returned to
    stretches = [p for i, p in enumerate(order) if i == 0 or order[i - 1] != p]
    assert len(stretches) == len(set(order))


def test_a_missing_tensor_fails_before_any_data_is_read(sharded_moe, tmp_path, monkeypatch):
    key = "model.layers.3.linear_attn.out_proj.weight"
    path = _rewrite(sharded_moe[1], tmp_path, lambda t: t.pop(key))
    reads = _ReadLog(monkeypatch)
    with pytest.raises(CheckpointError, match=re.escape(repr(key))):
        load_pretrained(path)
    assert reads.reads == []


@pytest.mark.parametrize("mesh_shape", [None, (1, 2)], ids=["one-device", "mesh"])
def test_host_memory_stays_within_a_shard(tmp_path_factory, mesh_shape, monkeypatch):
    """Every array the reader hands out is released once placed (weak references to them): at no read are
    more than one file's tensors alive; a loader that kept what it read would reach the checkpoint's size.
    A bf16 checkpoint loaded in fp32, so that every read array is converted: on CPU, XLA adopts a 64-byte
    aligned numpy buffer as the device buffer without a copy, and such an array would rightly outlive the load
    as the model's own storage."""
    path = tmp_path_factory.getbasetemp() / "dense_bf16"
    if not path.exists():
        cfg = ho.qwen3_5_config(hidden=128, inter=512, vocab=256, layer_types=[LIN, LIN, LIN, FULL] * 2)
        ho.build(cfg, seed=2).to(torch.bfloat16).save_pretrained(path, max_shard_size="350KB")
    total = sum(a.nbytes for a in disk_tensors(path).values())
    mesh = None if mesh_shape is None else shd.make_mesh(*mesh_shape)
    reads = _ReadLog(monkeypatch)
    stats = hf.LoadStats()
    _, model = load_pretrained(path, mesh=mesh, stats=stats)
    assert stats.files >= 8 and stats.largest_file_bytes < total / 8 and len(reads.reads) >= stats.tensors
    assert 0 < reads.peak_live <= stats.largest_file_bytes and reads.live == {}
    # a bf16 read + its fp32 copy, plus the fp32 buffer of one fused parameter being assembled (an MLP's gate/up)
    fused = max(a.nbytes for k, a in flat(model).items() if k.endswith(("gate_up_proj.weight", "in_proj.weight")))
    assert 0 < stats.peak_host_bytes <= 2 * stats.largest_file_bytes + fused


def test_conditional_generation_prefixes_and_unexpected_tensors_in_shards(sharded_moe, sharded_moe_loaded,
                                                                          tmp_path, caplog):
    """Qwen3.5 saved as ConditionalGeneration (model.language_model.*, model.visual.*, mtp.*) in several shards,
    plus one stray tensor: the same parameters, the stray one logged."""
    _, src = sharded_moe
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map = {}
    for fname in sorted(set(index["weight_map"].values())):
        tensors = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
                   for k, v in load_file(str(src / fname)).items()}
        if not weight_map:
            tensors.update({"mtp.fc.weight": np.zeros((2, 2), np.float32),
                            "model.visual.patch_embed.weight": np.zeros((3,), np.float32),
                            "stray.weight": np.zeros((4,), np.float32)})
        save_file(tensors, str(tmp_path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    with caplog.at_level("WARNING", logger="hyspec_jax.io.hf"):
        _, model = load_pretrained(tmp_path)
    assert_same_params(model, sharded_moe_loaded[1])
    assert "ignoring 1 unexpected tensors" in caplog.text and "stray.weight" in caplog.text


def test_progress_bar_only_when_asked_or_large(sharded_moe, capsys):
    load_pretrained(sharded_moe[1])
    assert capsys.readouterr().err == ""                  # small checkpoint, stderr not a terminal
    load_pretrained(sharded_moe[1], progress=True)
    assert "loading" in capsys.readouterr().err
