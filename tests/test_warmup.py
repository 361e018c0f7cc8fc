"""Start-up compilation: `warmup` / `compile_buckets` compile every program of a bucket, after which requests in
that bucket compile nothing (`compilations_after_startup` stays 0) and a request needing a new bucket counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from hyspec_jax import compilation
from hyspec_jax.config import FULL, LINEAR, DrafterConfig, TargetConfig
from hyspec_jax.runtime.backend import prompt_buckets
from hyspec_jax.models import drafter as D
from hyspec_jax.models.target import create_model
from hyspec_jax.sampling import SamplingParams
from hyspec_jax.runtime.engine import Engine, SpecConfig

CFG = TargetConfig(
    model_type="qwen3_5_text", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, intermediate_size=64, layer_types=(LINEAR, FULL),
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)


@pytest.fixture(scope="module")
def models():
    target = create_model(CFG, seed=0)
    dcfg = DrafterConfig.from_target(CFG, num_layers=1, target_layer_ids=(0,), markov_rank=4, block_size=3)
    return target, D.create_drafter(dcfg, seed=1)


def test_prompt_buckets():
    assert prompt_buckets(0) == []
    assert prompt_buckets(1) == prompt_buckets(16) == [16]
    assert prompt_buckets(17) == [16, 32]
    assert prompt_buckets(57) == [16, 32, 64]


def test_spec_engine_warmup_then_no_compilations(models):
    target, drafter = models
    eng = Engine(target, drafter, SpecConfig(mode="chain"), slots=2, kv_len=64)
    n = eng.compile_buckets([(2, 64)], prompt_lengths=[16], stochastic=(False,), progress=False, cache=False)
    assert n > 0 and eng.compilations_after_startup == 0
    eng.generate([[1, 2, 3], [4, 5, 6, 7, 8], [9] * 16], SamplingParams(max_tokens=6))   # admitted as slots free
    assert eng.compilations_after_startup == 0
    assert eng.last_stats.compilations_after_startup == 0
    assert eng.last_stats.to_dict()["compilations_after_startup"] == 0
    eng.generate([list(range(1, 21))], SamplingParams(max_tokens=4))     # 20 tokens: prompt bucket 32, not compiled
    assert eng.compilations_after_startup > 0
    assert eng.last_stats.compilations_after_startup == eng.compilations_after_startup


def test_generator_warmup_then_no_compilations(models):
    target, _ = models
    gen = Engine(target)
    assert gen.warmup(batch=1, kv_len=128, progress=False, cache=False) > 0
    gen.generate([[1, 2, 3]], SamplingParams(max_tokens=5))
    gen.generate([[5] * 40], SamplingParams(max_tokens=5, temperature=0.8, seed=3))   # prompt bucket 64, KV 128
    assert gen.compilations_after_startup == 0
    gen.generate([[1, 2, 3]], SamplingParams(max_tokens=200))                          # KV 256: a new bucket
    assert gen.compilations_after_startup > 0


def test_ar_engine_warmup_delegates(models):
    target, _ = models
    eng = Engine(target, None, SpecConfig(mode="ar"), slots=1, kv_len=128)
    eng.compile_buckets([(1, 128)], prompt_lengths=[3], progress=False, cache=False)
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    assert eng.last_stats.compilations_after_startup == 0


def test_compile_counter_and_persistent_cache(tmp_path, monkeypatch):
    prev = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv(compilation.CACHE_ENV, str(tmp_path / "jax"))
    assert compilation.compilation_cache_dir() == tmp_path / "jax"
    seen = []
    remove = compilation.on_compile(seen.append)
    try:
        assert compilation.enable_compilation_cache() == tmp_path / "jax"
        x = jnp.arange(7.0)
        watch = compilation.CompileWatch()
        jax.jit(lambda x: x * 3 + 1)(x).block_until_ready()
        assert watch.since == 1 and seen[-1] == "jit(<lambda>)"
        assert any((tmp_path / "jax").iterdir())       # small programs are cached too
    finally:
        remove()
        jax.config.update("jax_compilation_cache_dir", prev)
        from jax.experimental.compilation_cache import compilation_cache as cc
        cc.reset_cache()
