"""Scanned layers (`models.target.scan_layers`): the repeating block under `lax.scan` computes what the unrolled
stack computes — against transformers directly, and against the unrolled model for prefill, decode, tree verify,
drafter taps and the factorized commit; restacking round-trips; the compiled program does not grow with depth."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyspec_jax import tree as tree_lib
from hyspec_jax.config import TargetConfig
from hyspec_jax.io.hf import load_pretrained
from hyspec_jax.models.target import (create_model, extend_jit, scan_layers, scan_plan, unscan_layers, verify)
from hyspec_jax.spec.commit import commit
from hyspec_jax.state import init_state
from tests import hf_oracle

S_MAX = 40
LIN, FULL = "linear_attention", "full_attention"


def _cfg(layer_types) -> TargetConfig:
    return TargetConfig(model_type="qwen3_5_text", vocab_size=64, hidden_size=32, num_hidden_layers=len(layer_types),
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=48,
                        layer_types=tuple(layer_types), linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=8, linear_value_head_dim=4)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def checkpoint(request, tmp_path_factory):
    if request.param == "qwen3_5":       # period 4 (3 GDN + 1 attention), 2 blocks
        cfg = hf_oracle.qwen3_5_config(vocab=97, hidden=32, layers=8, hv=4, hk=2, dk=8, dv=4, head_dim=8,
                                       heads=2, kv_heads=1, layer_types=[LIN, LIN, LIN, FULL] * 2)
    else:                                # period 2 (GDN + attention, sparse MoE every layer), 3 blocks
        cfg = hf_oracle.qwen3_next_config(vocab=97, hidden=32, layers=6, num_experts=4, top_k=2,
                                          layer_types=[LIN, FULL] * 3)
    hf = hf_oracle.build(cfg, seed=5)
    return hf, hf_oracle.save(hf, tmp_path_factory.mktemp(request.param))


def test_plan_finds_the_block():
    plan = scan_plan(_cfg((LIN, LIN, LIN, FULL) * 3))
    assert (plan.period, plan.blocks, plan.rank) == (4, 3, (0, 1, 2, 0))
    assert scan_plan(_cfg((LIN, FULL, LIN, LIN, LIN))) is None      # does not repeat
    assert scan_plan(_cfg((LIN, LIN, LIN, FULL))) is None           # one block: nothing to scan


def test_scanned_matches_transformers(checkpoint):
    hf, path = checkpoint
    _, model = load_pretrained(path)
    scan_layers(model)
    assert model.is_scanned
    tokens = np.random.default_rng(0).integers(0, 97, (2, 11)).astype(np.int32)
    from hyspec_jax.models.target import forward_full
    graphdef, params = nnx.split(model)
    ours = np.asarray(forward_full(graphdef, params, jnp.asarray(tokens)))
    np.testing.assert_allclose(ours, hf_oracle.logits(hf, tokens), atol=2e-4, rtol=2e-4)


def test_scanned_equals_unrolled(checkpoint):
    _, path = checkpoint
    tcfg, unrolled = load_pretrained(path)
    _, scanned = load_pretrained(path)
    scan_layers(scanned)
    rng = np.random.default_rng(1)
    B, T = 2, 7
    toks = jnp.asarray(rng.integers(0, 97, (B, T)), jnp.int32)
    valid = jnp.asarray(np.arange(T)[None] < np.array([[T], [5]]))
    results = {}
    for name, model in (("unrolled", unrolled), ("scanned", scanned)):
        g, p = nnx.split(model)
        logits, state = extend_jit(g, p, init_state(tcfg, B, S_MAX), toks, valid)               # prefill
        step_logits, state = extend_jit(g, p, state, toks[:, :1], jnp.ones((B, 1), bool))      # decode
        tree = tree_lib.from_parents(np.array([[-1, 0, 0, 1, 2]] * B, np.int32))
        nodes = jnp.asarray(rng.integers(0, 97, (B, 5)), jnp.int32) if name == "unrolled" else results["nodes"]
        results["nodes"] = nodes
        model_ = nnx.merge(g, p)
        v_logits, taps, cache = model_.verify(state, tree, nodes, tap_layers=(0, 3, 5))
        committed = commit(state, cache, tree, jnp.array([3, 0], jnp.int32))
        results[name] = (logits, step_logits, state, v_logits, taps, cache, committed)
    for a, b in zip(jax.tree.leaves(results["unrolled"]), jax.tree.leaves(results["scanned"])):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5, rtol=1e-5)


def test_unscan_round_trips():
    cfg = _cfg((LIN, FULL) * 3)
    model = create_model(cfg, seed=2)
    before = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    unscan_layers(scan_layers(model))
    after = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])


def _decode_jaxpr_size(layers: int, scanned: bool) -> int:
    cfg = _cfg((LIN, LIN, LIN, FULL) * (layers // 4))
    model = create_model(cfg)
    if scanned:
        scan_layers(model)
    g, p = nnx.split(model)
    state = init_state(cfg, 1, 16)
    fn = lambda p, s, t: extend_jit.__wrapped__(g, p, s, t, jnp.ones((1, 1), bool))   # noqa: E731
    return str(jax.make_jaxpr(fn)(p, state, jnp.zeros((1, 1), jnp.int32))).count("\n")   # equations


def test_scanned_program_does_not_grow_with_depth():
    assert _decode_jaxpr_size(16, True) == _decode_jaxpr_size(8, True)
    assert _decode_jaxpr_size(16, False) > 1.5 * _decode_jaxpr_size(8, False)


def test_scanned_model_shards_like_its_layers():
    """A scanned parameter takes its layer's rule with the block axis replicated, and the sharded scanned decode
    equals the single-device one."""
    from hyspec_jax import sharding as shd
    cfg = _cfg((LIN, FULL) * 2)
    model = create_model(cfg, seed=3, scan=True)
    mesh = shd.make_mesh(1, 2)
    specs = {".".join(map(str, p)): s.get_value().spec
             for p, s in nnx.to_flat_state(shd.param_shardings(model, mesh))}
    assert specs["model.scanned.1.self_attn.q_proj.weight"] == jax.sharding.PartitionSpec(None, "model")
    assert specs["model.scanned.0.linear_attn.out_proj.weight"] == jax.sharding.PartitionSpec(None, None, "model")
    g, p = nnx.split(model)
    state = init_state(cfg, 2, 16)
    tokens, valid = jnp.ones((2, 3), jnp.int32), jnp.ones((2, 3), bool)
    want, _ = extend_jit(g, p, state, tokens, valid)
    got, _ = extend_jit(g, shd.shard_params(model, mesh), init_state(cfg, 2, 16), tokens, valid)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
