"""The speculative engine against plain autoregressive decoding (the losslessness oracle).

One tiny random target and one random drafter (with a ReaDy reader) per module; every mode runs in one fixed
bucket (4 slots, KV 64), so each compiles once. A random drafter rarely agrees with the target, so the greedy
tests also draft with a scripted drafter (tests/scripted_drafter.py): the drafter's base logits are pushed toward the
AR continuation with one wrong token at a varying position — long acceptances, partial acceptances and rejections all occur, and a
broken acceptance or commit would change the output.

Sampling: on a vocabulary-8 model the distribution of the first three generated tokens of many seeded
requests is compared with the exact AR distribution (enumerated from the target's logits) by a chi-square
goodness-of-fit test, p ≥ 1e-3 (fixed seeds: deterministic; a correct engine fails with probability 1e-3).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from hyspec_jax import cli
from hyspec_jax.config import FULL, LINEAR, DrafterConfig, TargetConfig
from hyspec_jax.io.drafter_io import save_drafter
from hyspec_jax.io.hf import save_pretrained
from hyspec_jax.models import drafter as D
from hyspec_jax.models.reader import ReaderConfig
from hyspec_jax.models.target import create_model, forward_full
from hyspec_jax.sampling import SamplingParams, warp
from hyspec_jax.runtime.engine import Engine, SpecConfig
from hyspec_jax.spec.budget import BudgetTable
from hyspec_jax.tree import TreeExpansion
from hyspec_jax.tokenizer import byte_level_tokenizer
from tests.scripted_drafter import oracle_script, scripted


def _tcfg(vocab: int) -> TargetConfig:
    return TargetConfig(
        model_type="qwen3_5_text", vocab_size=vocab, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, layer_types=(LINEAR, FULL, LINEAR),
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)


TCFG = _tcfg(300)   # ≥ the byte-level tokenizer's 257 ids: the CLI tests load the same model


SLOTS, KV = 4, 128
GAMMA = 4
TREE = TreeExpansion(depth=4, top_k=2, beam=4)
MAX_TOKENS = (12, 9, 16, 7, 13)
PROMPT_LENS = (3, 7, 11, 5, 9)


@pytest.fixture(scope="module")
def models():
    target = create_model(TCFG, seed=0)
    dcfg = DrafterConfig.from_target(TCFG, num_layers=1, target_layer_ids=(0, 1), markov_rank=8,
                                       block_size=GAMMA)
    drafter = D.create_drafter(dcfg, ReaderConfig.for_target(TCFG, rank=4, mlp_hidden=16), seed=1)
    # a trained reader is not zero-initialised at the output: make it act, so `ready` really differs
    w = drafter.reader.fc_out.weight
    w.set_value(0.5 * jax.random.normal(jax.random.key(5), w[...].shape))
    return target, drafter


@pytest.fixture(scope="module")
def reference(models):
    """Prompts, sampling params (one with a stop token met mid-way) and the AR outputs."""
    target, _ = models
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, TCFG.vocab_size, n)] for n in PROMPT_LENS]
    params = [SamplingParams(max_tokens=m) for m in MAX_TOKENS]
    gen = Engine(target)
    free = [r.token_ids for r in gen.generate(prompts, params)]
    stop = free[2][5]
    params[2] = SamplingParams(max_tokens=MAX_TOKENS[2], stop_token_ids=(stop,))
    res = gen.generate(prompts, params)
    assert res[2].finish_reason == "stop" and len(res[2].token_ids) <= 6
    return prompts, params, [r.token_ids for r in res]


def _oracle(drafter, prompts, ref, wrong: bool = True):
    """`drafter` scripted with the AR continuations `ref` of `prompts` (one wrong token a round with `wrong`)."""
    return scripted(drafter, oracle_script(prompts, ref, GAMMA, TCFG.vocab_size, KV, wrong))


def _spec(mode: str, **kw) -> SpecConfig:
    if mode in ("tree", "tree-ready"):
        kw.setdefault("tree", TREE)
        kw.setdefault("verify_nodes", 8)
    return SpecConfig(mode=mode, **kw)


@pytest.fixture(scope="module")
def engines(models):
    target, drafter = models
    cache = {}

    def get(mode):
        if mode not in cache:
            cache[mode] = Engine(target, drafter, _spec(mode), slots=SLOTS, kv_len=KV)
        return cache[mode]
    return get


@pytest.fixture(scope="module")
def oracle_engines(models, reference):
    """Engines drafting with the drafter scripted for the reference (`_oracle`), one per mode."""
    target, drafter = models
    prompts, _, ref = reference
    oracle = _oracle(drafter, prompts, ref)
    cache = {}

    def get(mode):
        if mode not in cache:
            cache[mode] = Engine(target, None if mode == "ar" else oracle, _spec(mode), slots=SLOTS, kv_len=KV)
        return cache[mode]
    return get


LOGPROBS = 3


@pytest.mark.parametrize("mode", ["ar", "chain", "tree", "widths"])
def test_emitted_logprobs_are_the_scorers(mode, models, reference):
    """Every emitted token's logprob and top-k alternatives come out of the program that emitted it — the prefill,
    the plain step, the width-1 step and the round (at the accepted path's nodes; "widths": rounds alternating
    with width-1 steps) — and equal the scorer's (a no-cache forward) over the finished sequence: greedy and
    sampled (the raw target distribution, not the warped one), penalized too. A request that asks none gets
    none."""
    from hyspec_jax.runtime.scheduler import EngineRequest, Scheduler
    from hyspec_jax.runtime.scoring import Scorer
    target, drafter = models
    prompts, params, ref = reference
    spec = _spec("chain" if mode == "widths" else mode)
    eng = Engine(target, None if mode == "ar" else _oracle(drafter, prompts, ref), spec, slots=SLOTS, kv_len=KV)
    if mode == "widths":
        be = eng.width_backend(SLOTS, KV, logprobs=LOGPROBS)
        assert 1 in be.widths
        be.force = [1, max(be.widths)]
    else:
        be = eng.backend(SLOTS, KV, logprobs=LOGPROBS)
    sched = Scheduler(be)
    got = {i: ([], []) for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        def sink(toks, reason, scores, i=i):
            got[i][0].extend(toks)
            got[i][1].append(scores)
        sched.submit(EngineRequest(prompt_ids=p, max_tokens=params[i].max_tokens, sink=sink,
                                   temperature=0.8 if i % 2 else 0.0, seed=i, presence_penalty=0.5 * (i == 3),
                                   logprobs=i != 4))
    sched.run_until_idle()
    scorer = Scorer(eng.tgraph, eng.tparams, max_len=KV, top_k=LOGPROBS)
    for i, p in enumerate(prompts):
        toks, scores = got[i]
        assert toks
        if i == 4:
            assert all(s is None for s in scores)
            continue
        scores = [s for s in scores if s is not None]
        have = sum(scores[1:], scores[0])
        want = scorer.score(p + toks, len(p))
        assert len(have) == len(toks)
        np.testing.assert_allclose(have.logprobs, want.logprobs, atol=1e-4)
        np.testing.assert_allclose(have.top_logprobs, want.top_logprobs, atol=1e-4)
        assert have.top_ids == want.top_ids
    if mode == "widths":
        assert set(be.width_counts) == set(be.force)


@pytest.mark.parametrize("mode", ["ar", "chain", "ready", "tree", "tree-ready"])
def test_greedy_equals_autoregressive(mode, oracle_engines, reference):
    prompts, params, ref = reference
    eng = oracle_engines(mode)
    # ragged batch of 5 requests in 4 slots: one is admitted when another finishes
    out = eng.generate(prompts, params)
    assert [r.token_ids for r in out] == ref
    assert out[2].finish_reason == "stop" and all(r.finish_reason == "length" for i, r in enumerate(out) if i != 2)
    assert [len(r.token_ids) for i, r in enumerate(out) if i != 2] == [m for i, m in enumerate(MAX_TOKENS) if i != 2]
    stats = eng.last_stats
    if mode != "ar":
        # the scripted drafts are right up to the wrong token: long and short acceptances both happen
        assert stats.tau > 2.0, stats
        apos = stats.accepted_per_position
        assert len(apos) == GAMMA and 0.6 < apos[0] < 1.0 and apos[2] > 0.0, stats
        assert all(sum(r.committed) >= len(r.token_ids) - 1 for r in out)
        # batch of one request (same bucket)
        one = eng.generate([prompts[3]], [params[3]])
        assert one[0].token_ids == ref[3]


def test_isolation_alone_and_cobatched(engines, reference):
    """The drafter's own proposals: a request's output does not depend on its neighbours."""
    prompts, params, ref = reference
    eng = engines("tree")
    batch = eng.generate(prompts, params)
    alone = [eng.generate([p], [q])[0].token_ids for p, q in zip(prompts[:2], params[:2])]
    assert [r.token_ids for r in batch[:2]] == alone
    assert [r.token_ids for r in batch] == ref


@pytest.mark.parametrize("mode", ["chain", "ready", "tree-ready"])
def test_pipelined_rounds_equal_autoregressive(mode, engines, reference):
    """The host dispatches the next round before reading the one in flight: a request that stops
    on a stop token in flight (request 2) and the request admitted into a freed slot (5 requests, 4 slots) still
    get exactly the AR tokens, and only the rounds a request really owned count in its statistics."""
    prompts, params, ref = reference
    eng = engines(mode)
    out = eng.generate(prompts, params)
    assert [r.token_ids for r in out] == ref
    assert out[2].finish_reason == "stop" and all(r.finish_reason == "length" for i, r in enumerate(out) if i != 2)
    for r in out:
        assert r.rounds == len(r.committed) == len(r.accepted)
        # tokens after the prefill's first: every owned round's, the last one's possibly cut (stop / max_tokens)
        assert sum(r.committed[:-1]) + 1 <= len(r.token_ids) - 1 <= sum(r.committed)
    assert eng.last_stats.rounds >= max(r.rounds for r in out)


def test_budget_floor_only_is_still_exact(models, reference):
    """Capacity 1 (below the floor): every request verifies its anchor and root child only."""
    target, drafter = models
    prompts, params, ref = reference
    eng = Engine(target, _oracle(drafter, prompts, ref), _spec("tree", capacity=1), slots=SLOTS, kv_len=KV)
    out = eng.generate(prompts, params)
    assert [r.token_ids for r in out] == ref
    assert max(c for r in out for c in r.committed) == 2          # one draft + the bonus at most
    assert eng.last_stats.accepted_per_position[0] > 0.5 and eng.last_stats.accepted_per_position[1] == 0.0


@pytest.mark.parametrize("mode", ["chain", "tree-ready"])
def test_packed_verify_under_a_batch_budget_is_exact(models, reference, mode):
    """A batch-wide budget C between the floor and slots · N: the round verifies the selection packed into C rows
    (Bole's packed forest, `budget.packed_rows`) and the output is still exactly AR; the budget shares the nodes
    across the batch (some round verifies more than C / slots drafts for one request)."""
    target, drafter = models
    prompts, params, ref = reference
    C = 13
    eng = Engine(target, _oracle(drafter, prompts, ref), _spec(mode, capacity=C), slots=SLOTS, kv_len=KV)
    be = eng.backend(SLOTS, KV)
    assert {s.packed_rows for s in be.round_shapes.values()} == {C}
    out = eng.generate(prompts, params)
    assert [r.token_ids for r in out] == ref
    assert max(c for r in out for c in r.committed) - 1 > C // SLOTS - 1


def test_packed_rows_follow_the_budget():
    from hyspec_jax.spec.budget import packed_rows
    assert packed_rows(None, 4, 8) == 0                     # no budget: the dense forest
    assert packed_rows(13, 4, 8) == 13
    assert packed_rows(3, 4, 8) == 8                        # never below the floor: anchor + root child a slot
    assert packed_rows(32, 4, 8) == 0 and packed_rows(40, 4, 8) == 0   # not below slots · N: nothing to pack
    assert packed_rows(13, 4, 1) == 0                       # plain decoding verifies nothing


def test_fewer_verified_nodes_than_draft_slots(models, reference):
    """A verify width N below the drafter's block (N − 1 < γ): the script still covers the whole block the round
    drafts, and the output is exactly AR with at most N − 1 drafts accepted a round."""
    target, drafter = models
    prompts, params, ref = reference
    eng = Engine(target, _oracle(drafter, prompts, ref), SpecConfig(mode="chain", verify_nodes=3), slots=SLOTS,
                 kv_len=KV)
    out = eng.generate(prompts, params)
    assert [r.token_ids for r in out] == ref
    assert max(c for r in out for c in r.committed) == 3


def test_confidence_scheduled_chain_is_exact(models, reference):
    """DSpark's confidence cut: with threshold 1 no survival passes, so every round verifies the floor of one
    draft (acceptance beyond the first position impossible) — and the output is still exactly AR."""
    target, drafter = models
    prompts, params, ref = reference
    eng = Engine(target, _oracle(drafter, prompts, ref), SpecConfig(mode="chain", confidence_threshold=1.0),
                 slots=SLOTS, kv_len=KV)
    out = eng.generate(prompts, params)
    assert [r.token_ids for r in out] == ref
    apos = eng.last_stats.accepted_per_position
    assert apos[0] > 0.5 and apos[1] == 0.0 and max(c for r in out for c in r.committed) == 2


# ------------------------------------------------------------------------------------------------
# Penalties: the target's penalized distribution in every round
# ------------------------------------------------------------------------------------------------
MIXED = dict(repetition_penalty=0.6, frequency_penalty=-0.5, presence_penalty=0.5)
PENALTIES = (dict(repetition_penalty=1.6, frequency_penalty=1.0), MIXED, {}, dict(presence_penalty=2.0), MIXED)


@pytest.fixture(scope="module")
def penalized_reference(models, reference):
    """The reference prompts with different penalties per request (one without), and their AR outputs."""
    target, _ = models
    prompts, plain_params, plain = reference
    params = [dataclasses.replace(p, **kw) for p, kw in zip(plain_params, PENALTIES)]
    out = [r.token_ids for r in Engine(target).generate(prompts, params)]
    # the penalties change every penalized request's output here (else the test below could not fail)
    assert [i for i in range(len(out)) if out[i] != plain[i]] == [0, 1, 3, 4], (out, plain)
    return prompts, params, out


@pytest.mark.parametrize("mode", ["chain", "ready", "tree", "tree-ready"])
def test_greedy_with_penalties_equals_autoregressive(mode, models, engines, penalized_reference):
    """Each node's target distribution is penalized with its own path's history: greedy speculative decoding with
    penalties is exactly AR decoding with the same penalties, in a ragged batch of different penalties."""
    target, drafter = models
    prompts, params, ref = penalized_reference
    eng = Engine(target, _oracle(drafter, prompts, ref), _spec(mode), slots=SLOTS, kv_len=KV)
    out = eng.generate(prompts, params)
    assert [r.token_ids for r in out] == ref
    assert eng.last_stats.tau > 2.0, eng.last_stats      # drafts were accepted under penalties
    # the drafter's own proposals
    assert [r.token_ids for r in engines(mode).generate(prompts, params)] == ref


def test_penalize_tree_equals_penalizing_each_path():
    """`penalize_tree` (base penalty + path correction) against penalizing each node with its path's full counts."""
    from hyspec_jax.sampling import PenaltyCounts, SlotPenalty, penalize, penalize_tree
    rng = np.random.default_rng(1)
    B, N, V, Dp = 2, 7, 6, 3
    parent = np.array([[-1, 0, 0, 1, 3, 2, 4], [-1, 0, 1, 2, 0, 4, 1]])
    tokens = rng.integers(0, V, (B, N)).astype(np.int32)
    tokens[0, 1:5] = [2, 4, 2, 2]              # a token repeated along a path
    logits = rng.normal(size=(B, N, V)).astype(np.float32)
    counts = rng.integers(0, 3, (B, V)).astype(np.int32)
    seen = counts > 0
    seen[:, 0] = True
    pen = SlotPenalty.of([0.5, -1.0], [1.25, 0.3], [1.7, 0.8])
    from hyspec_jax.tree import from_parents
    got = np.asarray(penalize_tree(jnp.asarray(logits), jnp.asarray(tokens), from_parents(jnp.asarray(parent),
                                                                                         max_depth=Dp + 1),
                                   PenaltyCounts(jnp.asarray(counts), jnp.asarray(seen)), pen))
    for b in range(B):
        for v in range(N):
            c, sn, a = counts[b].copy(), seen[b].copy(), v
            while parent[b, a] >= 0:
                c[tokens[b, a]] += 1
                sn[tokens[b, a]] = True
                a = parent[b, a]
            want = penalize(jnp.asarray(logits[b, v]), jnp.asarray(c), jnp.asarray(sn), pen.presence[b],
                            pen.frequency[b], pen.repetition[b])
            np.testing.assert_allclose(got[b, v], np.asarray(want), rtol=1e-6, err_msg=f"row {b} node {v}")


# ------------------------------------------------------------------------------------------------
# Sampling: distribution of the first three tokens vs exact AR
# ------------------------------------------------------------------------------------------------
SV = 8
SAMPLES = 3 * 1024
SETTINGS = (dict(temperature=1.0), dict(temperature=0.8, top_k=6, top_p=0.9))


@pytest.fixture(scope="module")
def small():
    cfg = _tcfg(SV)
    target = create_model(cfg, seed=3)
    # sharpen the target so the sequence distribution is far from uniform (more power)
    w = target.lm_head.weight
    w.set_value(w[...] * 4.0)
    dcfg = DrafterConfig.from_target(cfg, num_layers=1, target_layer_ids=(0, 1), markov_rank=4, block_size=GAMMA)
    drafter = D.create_drafter(dcfg, seed=4)
    prompt = [1, 5, 2, 7]
    graphdef, params = nnx.split(target)
    seqs = np.array([[a, b] for a in range(SV) for b in range(SV)], np.int32)
    toks = np.concatenate([np.broadcast_to(prompt, (len(seqs), len(prompt))), seqs], 1)
    logits = np.asarray(forward_full(graphdef, params, jnp.asarray(toks)), np.float64)
    P = len(prompt)
    rows = jnp.asarray(np.concatenate([logits[:1, P - 1], logits[::SV, P], logits[:, P + 1]]), jnp.float32)
    n = rows.shape[0]
    warp_jit = jax.jit(warp)
    exact = []
    for s in SETTINGS:
        full = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
        w = np.exp(np.asarray(warp_jit(rows, full(s.get("temperature", 1.0), jnp.float32),
                                       full(s.get("top_p", 1.0), jnp.float32), full(s.get("top_k", 0), jnp.int32))),
                   dtype=np.float64)
        p1, p2, p3 = w[0], w[1:1 + SV], w[1 + SV:].reshape(SV, SV, SV)       # [V], [t1, V], [t1, t2, V]
        exact.append(p1[:, None, None] * p2[:, :, None] * p3)
    t1 = int(np.argmax(logits[0, P - 1]))
    t2 = int(np.argmax(logits[t1 * SV, P]))
    greedy = [t1, t2, int(np.argmax(logits[t1 * SV + t2, P + 1]))]
    return target, drafter, prompt, exact, greedy


def _chisq_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    probs = probs.reshape(-1) / probs.sum()
    counts = np.bincount(samples, minlength=probs.size).astype(float)
    assert counts[probs == 0].sum() == 0, "a sequence outside the support was generated"
    exp = probs * counts.sum()
    small = exp < 5
    obs = np.append(counts[~small], counts[small].sum())
    e = np.append(exp[~small], exp[small].sum())
    keep = e > 0
    chi2 = float(np.sum((obs[keep] - e[keep]) ** 2 / e[keep]))
    return float(stats.chi2.sf(chi2, keep.sum() - 1))


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampling_matches_autoregressive_distribution(mode, small):
    target, drafter, prompt, exact, greedy = small
    spec = (SpecConfig(mode="tree", tree=TreeExpansion(depth=2, top_k=3, beam=3), verify_nodes=5) if mode == "tree"
            else SpecConfig(mode="chain", chain_length=2))
    eng = Engine(target, drafter, spec, slots=256, kv_len=128)
    # requests i % 3 == 0 are greedy (the greedy rows of a sampling batch), the others use SETTINGS
    params = [SamplingParams(max_tokens=3, seed=i, **(SETTINGS[i % 3 - 1] if i % 3 else {}))
              for i in range(SAMPLES)]
    out = eng.generate([prompt] * SAMPLES, params)
    seqs = np.array([r.token_ids for r in out])
    assert seqs.shape == (SAMPLES, 3)
    stats_ = eng.last_stats
    apos = stats_.accepted_per_position
    assert apos[0] > 0.05 and apos[-1] < 0.95, stats_              # acceptances and rejections both happen
    assert (seqs[0::3] == np.array(greedy)).all()
    for j in range(2):
        s = seqs[j + 1::3]
        code = s[:, 0] * SV * SV + s[:, 1] * SV + s[:, 2]
        assert _chisq_pvalue(code, exact[j]) > 1e-3, (mode, SETTINGS[j])


PEN = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.5)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampling_with_penalties_matches_autoregressive_distribution(mode, small):
    """Rejection sampling against the penalized, warped target: the first three tokens of seeded requests with
    penalties follow the exact penalized AR distribution (vLLM's formula in numpy over the target's logits of every
    prefix, then `warp`), by the chi-square test of the unpenalized case."""
    target, drafter, prompt, _, _ = small
    graphdef, params = nnx.split(target)
    seqs = np.array([[a, b] for a in range(SV) for b in range(SV)], np.int32)
    toks = np.concatenate([np.broadcast_to(prompt, (len(seqs), len(prompt))), seqs], 1)
    logits = np.asarray(forward_full(graphdef, params, jnp.asarray(toks)), np.float64)
    P = len(prompt)

    def penalized(x, out):       # vLLM's formula, written out
        seen = np.zeros(SV, bool)
        seen[list(prompt) + out] = True
        x = np.where(seen, np.where(x > 0, x / PEN["repetition_penalty"], x * PEN["repetition_penalty"]), x)
        c = np.bincount(np.asarray(out, np.int64), minlength=SV)
        return x - PEN["frequency_penalty"] * c - PEN["presence_penalty"] * (c > 0)

    def exact(setting, pen):     # [t1, t2, t3] probabilities
        rows = [pen(logits[0, P - 1], [])]
        rows += [pen(logits[a * SV, P], [a]) for a in range(SV)]
        rows += [pen(logits[a * SV + b, P + 1], [a, b]) for a in range(SV) for b in range(SV)]
        full = lambda v, dt: jnp.full((len(rows),), v, dt)  # noqa: E731
        w = np.exp(np.asarray(warp(jnp.asarray(np.array(rows), jnp.float32),
                                   full(setting.get("temperature", 1.0), jnp.float32),
                                   full(setting.get("top_p", 1.0), jnp.float32),
                                   full(setting.get("top_k", 0), jnp.int32))), dtype=np.float64)
        p1, p2, p3 = w[0], w[1:1 + SV], w[1 + SV:].reshape(SV, SV, SV)
        return p1[:, None, None] * p2[:, :, None] * p3

    for setting in SETTINGS:
        want = exact(setting, penalized)
        assert 0.5 * np.abs(want - exact(setting, lambda x, out: x)).sum() > 0.2     # the penalties matter
        spec = (SpecConfig(mode="tree", tree=TreeExpansion(depth=2, top_k=3, beam=3), verify_nodes=5)
                if mode == "tree" else SpecConfig(mode="chain", chain_length=2))
        eng = Engine(target, drafter, spec, slots=256, kv_len=128)
        half = SAMPLES // 2
        out = eng.generate([prompt] * half, [SamplingParams(max_tokens=3, seed=i, **setting, **PEN)
                                             for i in range(half)])
        s = np.array([r.token_ids for r in out])
        apos = eng.last_stats.accepted_per_position
        assert apos[0] > 0.05 and apos[-1] < 0.95, eng.last_stats
        assert _chisq_pvalue(s[:, 0] * SV * SV + s[:, 1] * SV + s[:, 2], want) > 1e-3, (mode, setting)


# ------------------------------------------------------------------------------------------------
# CLI: `hyspec generate --drafter … --spec-mode …` and `hyspec calibrate` (same model, same buckets)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dirs(models, tmp_path_factory):
    target, drafter = models
    root = tmp_path_factory.mktemp("spec_cli")
    save_pretrained(target, root / "target")
    byte_level_tokenizer().save(str(root / "target" / "tokenizer.json"))
    save_drafter(drafter, root / "drafter")
    prompts = root / "prompts.txt"
    prompts.write_text("Hi\nSpeculate!\nabc\nA longer one\nxyz\n")
    return root


def _cli(capsys, argv, stderr: list | None = None) -> list[dict]:
    assert cli.main(argv) == 0
    import json
    cap = capsys.readouterr()
    if stderr is not None:
        stderr.append(cap.err)
    return [json.loads(line) for line in cap.out.splitlines() if line.strip()]


def test_cli_generate_spec_modes_equal_ar(model_dirs, capsys):
    base = ["generate", "--model", str(model_dirs / "target"), "--prompts-file", str(model_dirs / "prompts.txt"),
            "--max-tokens", "10", "--json"]
    ar = _cli(capsys, base)
    assert all(r["stats"]["mode"] == "ar" and r["stats"]["tau"] == 1.0 for r in ar)
    drafter = ["--drafter", str(model_dirs / "drafter"), "--slots", str(SLOTS)]
    for mode, extra in (("chain", ["--stats"]), ("tree-ready", ["--verify-nodes", "8"])):
        err = []
        out = _cli(capsys, base + drafter + ["--spec-mode", mode] + extra, err)
        if "--stats" in extra:      # acceptance statistics on stderr, next to the JSON lines
            assert f"mode {mode}:" in err[0] and "accepted per position" in err[0]
            assert "compilations after start-up:" in err[0]
        assert [r["token_ids"] for r in out] == [r["token_ids"] for r in ar]
        for r in out:
            st = r["stats"]
            assert st["mode"] == mode and st["rounds"] >= 1 and st["new_tokens"] == len(r["token_ids"])
            assert len(st["accepted_per_position"]) == (GAMMA if mode == "chain" else TREE.depth)
            assert 1.0 <= st["tau"] <= 1 + GAMMA
            assert st["rounds"] >= (len(r["token_ids"]) - 1) / (1 + GAMMA)
    with pytest.raises(SystemExit):
        cli.main(base + ["--spec-mode", "chain"])                  # no drafter
    assert "needs --drafter" in capsys.readouterr().err


def test_cli_calibrate_writes_the_budget_table(model_dirs, capsys, models):
    out = model_dirs / "budget.json"
    argv = ["calibrate", "--model", str(model_dirs / "target"), "--batch", "1", "--kv-len", "64", "--nodes", "1,2",
            "--depth", "1", "--repeats", "2", "--eps", "0.5", "--out", str(out), "--json"]
    (entry,) = _cli(capsys, argv)[0]
    assert entry["batch"] == 1 and entry["kv_len"] == 64 and set(entry["t_ver_ms"]) == {"1", "2"}
    assert entry["t_dec_ms"] > 0 and entry["b_ver"] in (1, 2)
    ok = [int(n) for n, t in entry["t_ver_ms"].items() if t <= 1.5 * entry["t_dec_ms"]]
    assert entry["b_ver"] == (max(ok) if ok else 1)
    table = BudgetTable.load(out)
    assert len(table.entries) == 1
    # the engine takes its verify width from the table for that bucket (and its default elsewhere)
    target, drafter = models
    eng = Engine(target, drafter, SpecConfig(mode="chain"), budget_table=table, model_name=entry["model"])
    assert eng.nodes_for(1, 64) == entry["b_ver"] and eng.nodes_for(8, 64) == GAMMA + 1
