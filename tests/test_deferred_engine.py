"""Deferred GDN commit inside the engine (`SpecConfig.deferred_rows`, `TargetState.pending`) against plain
autoregressive decoding (the losslessness oracle), with ring capacities small enough that folds happen several
times inside every generation and slots sit at different fold phases.

The models, prompts, scripted drafter and the sampling oracle are test_engine's (one tiny random target and drafter).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyspec_jax.sampling import SamplingParams
from hyspec_jax.runtime.engine import Engine, SpecConfig
from hyspec_jax.state import fold_pending, init_state
from hyspec_jax.tree import TreeExpansion
from tests.test_engine import (GAMMA, SAMPLES, SETTINGS, SLOTS, KV, SV, _chisq_pvalue, _oracle, _spec,  # noqa: F401
                               models, reference, small)

ROWS = 8     # depth 4: a round appends ≤ 5 rows, so the ring folds about every second round


_committed = jax.jit(lambda st: fold_pending(st).ssm)


def _recording(eng, log: list, states: list | None = None):
    """Wrap the backends `eng.backend` makes (an `Engine`'s) to record, before every step, each slot's pending row count and whether it is active (and into `states`
    the committed GDN states: checkpoints folded with their rows)."""
    make = eng.backend

    def backend(*a, **kw):
        be = make(*a, **kw)
        dispatch = be.dispatch

        def recorded(active, *args, **kws):
            count = np.zeros(be.slots, np.int32) if be.state.pending is None else be.state.pending.count[0]
            log.append((np.asarray(count).copy(), np.asarray(active, bool).copy()))
            if states is not None:
                states.append(np.asarray(_committed(be.state)))
            return dispatch(active, *args, **kws)
        be.dispatch = recorded
        return be
    eng.backend = backend
    return eng


def _drops(log) -> int:
    """Rounds after which a slot active in both had fewer rows: folds (or a freed slot's next request)."""
    return sum(bool(np.any((c1 < c0) & a0 & a1)) for (c0, a0), (c1, a1) in zip(log, log[1:]))


@pytest.mark.parametrize("mode", ["chain", "ready", "tree", "tree-ready"])
@pytest.mark.parametrize("scripted", [True, False])
def test_deferred_greedy_equals_autoregressive(mode, scripted, models, reference):
    target, drafter = models
    prompts, params, ref = reference
    if scripted:
        drafter = _oracle(drafter, prompts, ref)
    log, states, eager_log, eager_states = [], [], [], []
    eng = _recording(Engine(target, drafter, _spec(mode, deferred_rows=ROWS), slots=SLOTS, kv_len=KV), log,
                     states)
    out = eng.generate(prompts, params)
    assert [r.token_ids for r in out] == ref
    assert out[2].finish_reason == "stop"
    # the same rounds with every commit written: the committed states agree before every round
    eager = _recording(Engine(target, drafter, _spec(mode), slots=SLOTS, kv_len=KV), eager_log, eager_states)
    assert [r.token_ids for r in eager.generate(prompts, params)] == ref
    assert [a.tolist() for _, a in log] == [a.tolist() for _, a in eager_log]
    for s, e in zip(states, eager_states):
        np.testing.assert_allclose(s, e, rtol=1e-5, atol=1e-6)
    counts = np.array([c for c, _ in log])
    assert counts.max() > 0                                           # verifies read pending rows
    if scripted:                                                        # long acceptances: folds inside generations
        assert _drops(log) >= 3, log
        # slots at different fold phases in one round
        assert any(len(set(c[a].tolist())) > 1 for c, a in log), log


def test_deferred_plain_decoding_equals_autoregressive(models, reference):
    """`ar` with a 4-row ring: each step appends one row per GDN layer, the batch folds every ~4 steps, and the
    committed states equal the eager decoder's before every step (state oracle: the model-level test below)."""
    target, _ = models
    prompts, params, ref = reference
    log, states, eager_log, eager_states = [], [], [], []
    eng = Engine(target, None, SpecConfig(mode="ar", deferred_rows=4), slots=SLOTS, kv_len=KV)
    _recording(eng, log, states)
    assert [r.token_ids for r in eng.generate(prompts, params)] == ref
    eager = Engine(target, None, SpecConfig(mode="ar"), slots=SLOTS, kv_len=KV)
    _recording(eager, eager_log, eager_states)
    eager.generate(prompts, params)
    assert len(states) == len(eager_states) and _drops(log) >= 3 and max(c.max() for c, _ in log) == 4
    for s, e in zip(states, eager_states):
        np.testing.assert_allclose(s, e, rtol=1e-5, atol=1e-6)


def test_slot_reused_after_a_request_ends_mid_ring(models, reference):
    """One slot, three requests in turn, a ring no generation fills: each request ends with rows pending, and
    the next one, prefilled into the same slot, must not inherit them."""
    target, drafter = models
    prompts, params, ref = reference
    log, states, eager_log, eager_states = [], [], [], []
    pick = (0, 1, 3)
    args = ([prompts[i] for i in pick], [params[i] for i in pick])
    drafter = _oracle(drafter, *args[:1], [ref[i] for i in pick])
    eng = _recording(Engine(target, drafter, _spec("tree", deferred_rows=64), slots=1, kv_len=KV), log, states)
    out = eng.generate(*args)
    assert [r.token_ids for r in out] == [ref[i] for i in pick]
    eager = _recording(Engine(target, drafter, _spec("tree"), slots=1, kv_len=KV), eager_log, eager_states)
    eager.generate(*args)
    assert len(states) == len(eager_states)
    for s, e in zip(states, eager_states):   # tight: the prompt's decay shrinks a leaked ring to ~1e-6 here
        np.testing.assert_allclose(s, e, rtol=0, atol=1e-7)
    counts = [int(c[0]) for c, _ in log]
    reuses = [(a, b) for a, b in zip(counts, counts[1:]) if b < a]
    assert len(reuses) == 2 and all(a > 0 and b == 0 for a, b in reuses), counts   # no fold, two mid-ring ends


def test_prefill_gather_empties_the_rings_of_reset_rows():
    """A request's first chunk starts from an empty ring whatever the slot held; a continued chunk keeps its rows
    (the extend folds them)."""
    from hyspec_jax.runtime.programs import gather_target
    from tests.test_engine import TCFG
    st = init_state(TCFG, 3, 16, deferred_rows=4)
    st = st.replace(pending=jax.tree.map(lambda x: x + 1, st.pending))
    sub = gather_target(st, jnp.asarray([2, 0, 3]), jnp.asarray([True, False, False]))   # row 3: padding
    for x in jax.tree.leaves(sub.pending):
        assert (np.asarray(x[:, 0]) == 0).all() and (np.asarray(x[:, 1:]) == 1).all()


def test_ring_must_hold_a_round(models):
    target, drafter = models
    with pytest.raises(ValueError, match="deferred_rows"):
        Engine(target, drafter, _spec("chain", deferred_rows=GAMMA), slots=SLOTS, kv_len=KV).backend(SLOTS, KV)
    with pytest.raises(ValueError, match="deferred_rows"):
        SpecConfig(deferred_rows=-1)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_deferred_sampling_matches_autoregressive_distribution(mode, small):
    """test_engine's chi-square test with a 4-row ring (a round appends ≤ 3): the second round of a request
    verifies from checkpoint + rows or right after a fold; 256 slots reused by 3072 requests."""
    target, drafter, prompt, exact, greedy = small
    spec = (SpecConfig(mode="tree", tree=TreeExpansion(depth=2, top_k=3, beam=3), verify_nodes=5, deferred_rows=4)
            if mode == "tree" else SpecConfig(mode="chain", chain_length=2, deferred_rows=4))
    log = []
    eng = _recording(Engine(target, drafter, spec, slots=256, kv_len=128), log)
    params = [SamplingParams(max_tokens=3, seed=i, **(SETTINGS[i % 3 - 1] if i % 3 else {}))
              for i in range(SAMPLES)]
    out = eng.generate([prompt] * SAMPLES, params)
    seqs = np.array([r.token_ids for r in out])
    assert seqs.shape == (SAMPLES, 3)
    assert any(np.any(c[a] > 0) for c, a in log)                     # some verify read pending rows
    assert (seqs[0::3] == np.array(greedy)).all()
    for j in range(2):
        s = seqs[j + 1::3]
        code = s[:, 0] * SV * SV + s[:, 1] * SV + s[:, 2]
        assert _chisq_pvalue(code, exact[j]) > 1e-3, (mode, SETTINGS[j])


# ------------------------------------------------------------------------------------------------
# The target's programs with deferred rows, unrolled and scanned, against the eager state
# ------------------------------------------------------------------------------------------------
def test_target_programs_with_rings_equal_eager_unrolled_and_scanned():
    """Prefill, plain decoding steps (each appends a row), two verify + commit rounds (the second verifies from
    checkpoint + rows), an 8-row ring that folds both in a step and in a commit: logits and committed states equal
    the eager state's, for the unrolled and the scanned stack."""
    from flax import nnx

    from hyspec_jax import tree as tree_lib
    from hyspec_jax.config import FULL, LINEAR, TargetConfig
    from hyspec_jax.models.target import create_model, extend_jit
    from hyspec_jax.spec.commit import commit
    cfg = TargetConfig(model_type="qwen3_5_text", vocab_size=64, hidden_size=32, num_hidden_layers=8,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=48,
                       layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 2, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=4)
    rng = np.random.default_rng(0)
    B, T, S = 2, 7, 40
    prompt = jnp.asarray(rng.integers(0, 64, (B, T)), jnp.int32)
    valid = jnp.asarray(np.arange(T)[None] < np.array([[T], [5]]))
    steps = [jnp.asarray(rng.integers(0, 64, (B, 1)), jnp.int32) for _ in range(9)]
    tree = tree_lib.from_parents(np.array([[-1, 0, 0, 1, 2]] * B, np.int32))
    rounds = [(jnp.asarray(rng.integers(0, 64, (B, 5)), jnp.int32), jnp.array(n, jnp.int32))
              for n in ([3, 0], [4, 2])]
    verify = jax.jit(lambda g, p, st, toks: nnx.merge(g, p).verify(st, tree, toks)[::2], static_argnums=0)
    commit_jit = jax.jit(lambda st, cache, node: commit(st, cache, tree, node))

    def run(scan: bool, rows: int):
        g, p = nnx.split(create_model(cfg, seed=3, scan=scan))
        out = []
        logits, st = extend_jit(g, p, init_state(cfg, B, S, deferred_rows=rows), prompt, valid)
        out.append(logits)
        for i, tok in enumerate(steps):
            logits, st = extend_jit(g, p, st, tok, jnp.asarray([[True], [i != 1]]))   # slot 1 idles once
            out += [logits, _committed(st)]
        counts = [] if rows == 0 else [np.asarray(st.pending.count[0])]
        for toks, node in rounds:
            logits, cache = verify(g, p, st, toks)
            st = commit_jit(st, cache, node)
            out += [logits, _committed(st)]
            counts += [] if rows == 0 else [np.asarray(st.pending.count[0])]
        return out, counts

    eager, _ = run(False, 0)
    for scan in (False, True):
        got, counts = run(scan, 8)
        # the 9th step finds slot 0's ring full: both fold, then 1 row each; round 1 appends its paths (3 / 1
        # rows: a path may take 5, 1 + 5 ≤ 8); round 2 folds first (4 + 5 > 8), then 3 / 2
        assert [c.tolist() for c in counts] == [[1, 1], [4, 2], [3, 2]]
        for a, b in zip(got, eager):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# The verify's kernel path: the tree-solve kernel merges the rows into its state tile (Pallas interpret mode)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key_heads", [2, 4])      # q/k at key heads (the kernel maps them) or already expanded
def test_tree_solve_kernel_merges_pending_rows(key_heads):
    from hyspec_jax import gdn, kernels
    from tests.test_deferred_commit import expand, random_round, rel
    B, N, HV, dk, dv, depth, P = 2, 16, 4, 16, 16, 4, 16
    S_base = jnp.asarray(np.random.default_rng(1).standard_normal((B, HV, dk, dv)) * 0.5, jnp.float32)
    pend = gdn.deferred_empty(B, HV, P, dk, dv)
    rng = np.random.default_rng(2)
    for rnd in range(2):          # round 2 verifies from S_base + round 1's rows (5 and 1 of 16)
        par, mask, (q, k, v, g, beta) = random_round(30 + rnd, B, N, key_heads, HV, dk, dv, depth)
        o_ref, fac_ref = gdn.masked_solve(gdn.deferred_fold(S_base, pend), expand(q, HV), expand(k, HV), v, g, beta,
                                          mask)
        o, fac = kernels.tree_solve(S_base, q, k, v, g, beta, mask, depth, impl="interpret", method="inverse",
                                    deferred=pend)
        assert rel(o, o_ref) < 1e-4 and rel(fac.corrected, fac_ref.corrected) < 1e-4
        from hyspec_jax.pallas_kernels import trees
        path, length = trees.paths_to(par, np.array([int(rng.integers(1, N)), 0]), depth - 1)
        pend = gdn.deferred_append(pend, fac_ref, jnp.asarray(path), jnp.asarray(length))
    assert int(pend.count[0]) > 1


def test_rings_shard_like_the_state():
    """sharding.STATE_RULES covers the rings: slots over "data", GDN value heads over "model", as `ssm`."""
    from hyspec_jax import sharding
    from tests.test_engine import TCFG
    mesh = sharding.make_mesh(2, 2)
    sh = sharding.state_shardings(TCFG, jax.eval_shape(lambda: init_state(TCFG, 4, 16, deferred_rows=8)), mesh)
    assert tuple(sh.pending.keys.spec)[:3] == tuple(sh.ssm.spec)[:3] == (None, "data", "model")
    assert tuple(sh.pending.count.spec) == (None, "data")
