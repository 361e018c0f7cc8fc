"""The engine with the Pallas kernels in its verify (GDN tree solve, tree attention) and commit, run in Pallas
interpret mode on the CPU: greedy outputs equal plain decoding (the losslessness oracle), with long and short
acceptances (a scripted drafter as in test_engine), for a chain and a tree bucket."""

from __future__ import annotations

import numpy as np
import pytest

from hyspec_jax.config import FULL, LINEAR, DrafterConfig, TargetConfig
from hyspec_jax.models import drafter as D
from hyspec_jax.models.target import create_model
from hyspec_jax.sampling import SamplingParams
from hyspec_jax.runtime.engine import Engine, SpecConfig
from hyspec_jax.tree import TreeExpansion
from tests.scripted_drafter import oracle_script, scripted

# GDN heads of 16 × 16: the smallest the kernels take (tl.dot needs every dimension ≥ 16)
TCFG = TargetConfig(
    model_type="qwen3_5_text", vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, intermediate_size=64, layer_types=(LINEAR, FULL, LINEAR),
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
GAMMA = 3


def test_kernel_engine_equals_autoregressive(monkeypatch):
    from hyspec_jax.pallas_kernels import gdn_commit, gdn_tree_solve, tree_attention
    traced = {"solve": 0, "commit": 0, "attention": 0}      # the kernels really are in the compiled rounds

    def counting(fn, key):
        def wrapped(*a, **kw):
            traced[key] += 1
            return fn(*a, **kw)
        return wrapped
    monkeypatch.setattr(gdn_tree_solve, "tree_solve_pallas", counting(gdn_tree_solve.tree_solve_pallas, "solve"))
    monkeypatch.setattr(gdn_commit, "path_commit_pallas", counting(gdn_commit.path_commit_pallas, "commit"))
    monkeypatch.setattr(tree_attention, "prefix_tree_attention",
                        counting(tree_attention.prefix_tree_attention, "attention"))
    target = create_model(TCFG, seed=3)
    dcfg = DrafterConfig.from_target(TCFG, num_layers=1, target_layer_ids=(0, 1), markov_rank=4,
                                       block_size=GAMMA)
    drafter = D.create_drafter(dcfg, None, seed=4)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, TCFG.vocab_size, n)] for n in (4, 9)]
    params = [SamplingParams(max_tokens=m) for m in (10, 7)]
    ref = [r.token_ids for r in Engine(target).generate(prompts, params)]

    oracle = scripted(drafter, oracle_script(prompts, ref, GAMMA, TCFG.vocab_size, 32))

    for spec in (SpecConfig(mode="chain", kernels="interpret"),
                 SpecConfig(mode="tree", tree=TreeExpansion(depth=GAMMA, top_k=2, beam=2), verify_nodes=5,
                            kernels="interpret")):
        eng = Engine(target, oracle, spec, slots=2, kv_len=32)
        out = eng.generate(prompts, params)
        assert [r.token_ids for r in out] == ref, spec.mode
        assert eng.last_stats.tau > 1.5, (spec.mode, eng.last_stats)
    assert traced["solve"] >= 2 * 2 and traced["commit"] >= 2 and traced["attention"] >= 2, traced  # 2 buckets


def test_unknown_kernel_setting_is_refused():
    with pytest.raises(ValueError, match="kernels"):
        SpecConfig(mode="chain", kernels="triton")
