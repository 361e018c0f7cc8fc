"""Engine statistics: the round split into draft / verify / commit (`hyspec_jax.bench.phases.phase_times`,
`hyspec generate --phase-times`) and ReaDy's censored prefix survival in `SpecStats` / `--stats` / `--json`."""

from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyspec_jax import cli
from hyspec_jax.config import FULL, LINEAR, DrafterConfig, TargetConfig
from hyspec_jax.io.drafter_io import save_drafter
from hyspec_jax.io.hf import save_pretrained
from hyspec_jax.models import drafter as D
from hyspec_jax.models.reader import ReaderConfig
from hyspec_jax.models.target import create_model
from hyspec_jax.sampling import SamplingParams
from hyspec_jax.bench.phases import format_phase_times, phase_times, round_inputs, round_kernels
from hyspec_jax.cli import request_stats
from hyspec_jax.runtime.engine import Engine, SpecConfig, SpecStats
from hyspec_jax.tree import TreeExpansion
from hyspec_jax.spec.stats import prefix_survival
from hyspec_jax.tokenizer import byte_level_tokenizer

TCFG = TargetConfig(
    model_type="qwen3_5_text", vocab_size=300, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, intermediate_size=64, layer_types=(LINEAR, FULL, LINEAR),
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
GAMMA, SLOTS, KV = 4, 2, 64


@pytest.fixture(scope="module")
def models():
    target = create_model(TCFG, seed=0)
    dcfg = DrafterConfig.from_target(TCFG, num_layers=1, target_layer_ids=(0, 1), markov_rank=8,
                                       block_size=GAMMA)
    drafter = D.create_drafter(dcfg, ReaderConfig.for_target(TCFG, rank=4, mlp_hidden=16), seed=1)
    return target, drafter


PROMPTS = [[5, 9, 17, 3, 44, 2], [7, 1, 250]]


@pytest.mark.parametrize("mode,spec_kw,temperature", [
    ("chain", {}, 0.0),
    ("tree-ready", dict(tree=TreeExpansion(depth=3, top_k=2, beam=3), verify_nodes=6), 1.0),   # sampling: child q
])
def test_phase_times_split_round_equals_fused(models, mode, spec_kw, temperature):
    target, drafter = models
    eng = Engine(target, drafter, SpecConfig(mode=mode, **spec_kw), slots=SLOTS, kv_len=KV)
    params = [SamplingParams(max_tokens=8, temperature=temperature, seed=i) for i in range(len(PROMPTS))]
    pt = phase_times(eng, PROMPTS, params, repeats=2)
    assert pt["identical"] and pt["state_identical"], pt   # the three jitted phases = the fused round
    for k in ("draft_ms", "verify_ms", "commit_ms", "round_ms"):
        assert pt[k] > 0, pt
    assert pt["sum_ms"] == pytest.approx(pt["draft_ms"] + pt["verify_ms"] + pt["commit_ms"], abs=1e-3)
    assert pt["sum_over_round"] > 0 and pt["batch"] == SLOTS and pt["kv_len"] == KV and pt["active"] == 2
    assert pt["verify_nodes"] == (6 if mode == "tree-ready" else GAMMA + 1)
    k = pt["kernels"]
    assert all(isinstance(k[n], int) and k[n] > 0 for n in ("draft", "verify", "commit", "round", "ar_step")), k
    assert k["round"] > k["ar_step"], k          # a round does more than one decoding step
    text = format_phase_times(pt)
    assert all(w in text for w in ("draft", "verify", "commit", "fused round", "identical", "kernels"))
    # the engine still generates normally afterwards (same bucket, same compiled round)
    assert len(eng.generate(PROMPTS, params)[0].token_ids) == 8


def test_round_kernels_by_named_scope(models):
    """The fused round's kernels split by the phases' named scopes add up to `kernel_count` of the same program,
    the tree build counts apart from the drafter's forward, and ar is refused."""
    from hyspec_jax.compilation import kernel_count
    from hyspec_jax.runtime.programs import spec_round_io_jit
    target, drafter = models
    eng = Engine(target, drafter, SpecConfig(mode="tree-ready", tree=TreeExpansion(depth=3, top_k=2, beam=3),
                                                 verify_nodes=6), slots=SLOTS, kv_len=KV)
    params = SamplingParams(max_tokens=8)
    rk = round_kernels(eng, PROMPTS, params)
    for scope in ("draft/drafter_forward", "draft/tree_build", "verify", "commit"):
        assert rk["round"].get(scope, 0) > 0, rk
    assert rk["round_total"] == sum(rk["round"].values()) and rk["ar_step"] > 0
    x = round_inputs(eng, PROMPTS, params, "test")
    lowered = spec_round_io_jit.lower(eng.tgraph, eng.tparams, eng.dgraph, eng.dparams, x["slots"], x["anchor"],
                                      x["inputs"], shape=x["shape"])     # as the backend launches it
    assert rk["round_total"] == kernel_count(lowered)
    # no run-time branch in the greedy round (a GPU would read its predicate back to the host every round)
    assert not re.search(r"\bconditional\(", lowered.compile().as_text())
    with pytest.raises(ValueError, match="speculative mode"):
        round_kernels(Engine(target, None, SpecConfig(mode="ar")), PROMPTS, params)


def test_phase_times_rejects_ar(models):
    target, _ = models
    with pytest.raises(ValueError, match="speculative mode"):
        phase_times(Engine(target, None, SpecConfig(mode="ar")), PROMPTS, SamplingParams(max_tokens=4))


def test_prefix_survival_in_spec_stats(models):
    target, drafter = models
    eng = Engine(target, drafter, SpecConfig(mode="chain"), slots=SLOTS, kv_len=KV)
    prompts = PROMPTS + [[3, 3, 3]]
    res = eng.generate(prompts, [SamplingParams(max_tokens=m) for m in (12, 9, 7)])
    st = eng.last_stats
    assert st.prefix_survival == prefix_survival([r.accepted for r in res], eng.depth)
    assert len(st.prefix_survival) == eng.depth == GAMMA
    # censored: the last round of each request never counts as a rejection
    uncensored = [a for r in res for a in r.accepted[:-1]]
    if uncensored and not math.isnan(st.prefix_survival[0]):
        hits0 = sum(a >= 1 for r in res for a in r.accepted)
        assert st.prefix_survival[0] == pytest.approx(hits0 / (len(uncensored) + sum(r.accepted[-1] >= 1 for r in res)))
    d = st.to_dict()
    assert len(d["prefix_survival"]) == GAMMA and all(x is None or 0 <= x <= 1 for x in d["prefix_survival"])
    json.dumps(d, allow_nan=False)                     # NaN (no round counts) is written as null
    rs = request_stats(eng, res[0])
    assert rs["prefix_survival"] == [None if math.isnan(x) else round(x, 4) for x in res[0].prefix_survival(GAMMA)]


def test_spec_stats_to_dict_nan_is_null():
    st = SpecStats(mode="chain", rounds=1, tau=1.0, accepted_per_position=[0.0, 0.0],
                   prefix_survival=prefix_survival([[0]], 2))
    assert st.to_dict()["prefix_survival"] == [None, None]


def test_format_stats_prefix_survival():
    st = {"prompts": 1, "new_tokens": 10, "seconds": 1.0, "tokens_per_second": 10.0, "prefill_seconds": 0.1,
          "decode_steps_per_second": 5.0, "mode": "chain", "rounds": 4, "tau": 2.5,
          "accepted_per_position": [0.75, 0.5], "prefix_survival": [0.8, None], "verify_nodes": 3,
          "compilations_after_startup": 0}
    text = cli.format_stats(st)
    assert "prefix survival" in text and "1: 0.80  2: n/a" in text


def test_cli_stats_and_phase_times(models, tmp_path, capsys):
    target, drafter = models
    save_pretrained(target, tmp_path / "target")
    byte_level_tokenizer().save(str(tmp_path / "target" / "tokenizer.json"))
    save_drafter(drafter, tmp_path / "drafter")
    base = ["generate", "--model", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
            "--spec-mode", "chain", "--slots", str(SLOTS), "--max-tokens", "6", "--json", "--stats",
            "--phase-times", "Hi"]
    assert cli.main(base) == 0
    cap = capsys.readouterr()
    [res] = [json.loads(line) for line in cap.out.splitlines() if line.strip()]
    assert len(res["stats"]["prefix_survival"]) == GAMMA
    assert "prefix survival" in cap.err and "round phases (chain" in cap.err
    for phase in ("draft", "verify", "commit"):
        assert any(line.split()[1:2] == [phase] and line.rstrip().endswith("ms") for line in cap.err.splitlines())
    assert "identical" in cap.err
    # streamed text, no --stats: the one-line summary stays, the phase lines follow it
    assert cli.main([a for a in base if a not in ("--json", "--stats")]) == 0
    err = capsys.readouterr().err
    assert "tok/s incl. compile" in err and "round phases (chain" in err and "prefix survival" not in err


def test_kernel_count_by_scope_longest_prefix():
    """Each kernel counts under the longest named scope its op name starts with, unscoped ones under "(other)",
    and the split adds up to kernel_count."""
    from hyspec_jax.compilation import kernel_count, kernel_count_by_scope

    def f(x):
        with jax.named_scope("a"):
            y = jnp.sin(x) @ x
        with jax.named_scope("b"):
            with jax.named_scope("c"):
                z = jnp.sort(y, axis=0)
        return z + 1
    low = jax.jit(f).lower(jnp.ones((8, 8)))
    split = kernel_count_by_scope(low, ("a", "b", "b/c"))
    assert split["b/c"] >= 1 and split["a"] >= 1 and "b" not in split
    assert sum(split.values()) == kernel_count(low) == sum(kernel_count_by_scope(low, ("b",)).values())
    assert kernel_count_by_scope(low, ()) == {"": kernel_count(low)}
