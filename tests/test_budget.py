"""spec.budget (Bole's batch-shared selection, DSpark confidence length, calibration table) and the tree
candidates of spec.select."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyspec_jax import tree as T
from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.sampling import SlotSampling
from hyspec_jax.spec.budget import (BudgetTable, b_ver, confident_length, model_id, root_floor, select_nodes)
from hyspec_jax.spec.select import tree_candidates
from hyspec_jax.tree import TreeExpansion
from tests.tiny_drafter import tiny_draft_block
from tests.tree_reference import tree_from_block

B, M = 6, 12


@jax.jit
def _select(score, parent, depth, valid, active, capacity):
    forced = root_floor(score, parent, valid & active[:, None], active)
    sel = select_nodes(score, parent, depth, valid & active[:, None], forced, 5, capacity)
    return forced, sel


def _forest(rng, batch: int = B, nodes: int = M, max_depth: int = 4, tie_rate: float = 0.25):
    """Random candidate forests (anchor = node 0, topological order) with path-monotone scores; a share
    `tie_rate` of the steps adds nothing (ties on purpose; 0: distinct scores, one optimum)."""
    parent = np.full((batch, nodes), -1, np.int32)
    valid = np.zeros((batch, nodes), bool)
    score = np.full((batch, nodes), -np.inf, np.float32)
    for b in range(batch):
        n = int(rng.integers(1, nodes + 1))
        p = T.random_parents(rng, n, max_depth=max_depth, roots=1)
        parent[b, :n], valid[b, :n] = p, True
        score[b, 0] = 0.0
        for i in range(1, n):
            step = 0.0 if rng.random() < tie_rate else np.log(rng.uniform(0.05, 1.0))
            score[b, i] = score[b, p[i]] + step
    depth = np.stack([T.parent_depths(np.where(v, p, -1)) for p, v in zip(parent, valid)])
    return score, parent, depth, valid


def _order_key(score, depth, forced, b, i):
    return (not forced[b, i], -score[b, i], depth[b, i], b, i)


@pytest.mark.parametrize("seed", range(6))
def test_selection_floor_prefix_capacity_and_best_scores(seed):
    rng = np.random.default_rng(seed)
    score, parent, depth, valid = _forest(rng)
    active = rng.random(B) < 0.8
    active[0] = True
    C = int(rng.integers(1, 3 * B))
    forced, sel = _select(*map(jnp.asarray, (score, parent, depth, valid, active)), jnp.int32(C))
    forced, kept = np.asarray(forced), np.asarray(sel.kept)
    valid = valid & active[:, None]
    # floor: anchor and best root child of every active row
    for b in range(B):
        if not active[b]:
            assert not kept[b].any() and not forced[b].any()
            continue
        kids = [i for i in range(M) if valid[b, i] and parent[b, i] == 0]
        assert kept[b, 0] and forced[b, 0]
        if kids:
            best = max(kids, key=lambda i: (score[b, i], -i))
            assert kept[b, best] and forced[b, best]
    # prefix-connected, row capacity 5, batch capacity max(C, floor)
    for b in range(B):
        for i in np.flatnonzero(kept[b]):
            assert valid[b, i]
            assert parent[b, i] < 0 or kept[b, parent[b, i]]
    assert (kept.sum(1) <= 5).all()
    assert kept.sum() <= max(C, forced.sum())
    # best scores: no dropped candidate that could have been added (parent kept, row not full) beats a kept
    # non-forced node in the order (score desc, depth asc, slot, index)
    full = kept.sum(1) >= 5
    worst_kept = max((_order_key(score, depth, forced, b, i) for b, i in zip(*np.nonzero(kept & ~forced))),
                     default=None)
    for b, i in zip(*np.nonzero(valid & ~kept)):
        if full[b] or not kept[b, parent[b, i]]:
            continue
        if worst_kept is not None:
            assert _order_key(score, depth, forced, b, i) > worst_kept
        assert kept.sum() >= max(C, forced.sum())        # only the capacity can have stopped it
    # compaction: the [B, 5] forest is the kept candidates in order, parents renumbered
    idx, sv, sp, sd = (np.asarray(x) for x in (sel.index, sel.valid, sel.parent, sel.depth))
    for b in range(B):
        ks = np.flatnonzero(kept[b])
        assert sv[b].sum() == len(ks) and (idx[b, :len(ks)] == ks).all()
        for j, i in enumerate(ks):
            assert sd[b, j] == depth[b, i]
            assert (sp[b, j] == -1) if parent[b, i] < 0 else (ks[sp[b, j]] == parent[b, i])


@pytest.mark.parametrize("seed,row_capacity", [(0, 5), (1, 3), (2, 16), (3, 1)])
def test_a_capacity_that_cannot_bind_selects_per_row_alike(seed, row_capacity):
    """With capacity ≥ B · N (every backend without a user budget C) the per-row ranking of
    batch_capacity=False keeps, compacts and renumbers exactly what the batch-wide sort does: ties in score and
    depth, inactive rows, forced nodes, a row capacity above the candidates (padding)."""
    rng = np.random.default_rng(seed)
    score, parent, depth, valid = _forest(rng, tie_rate=0.5)
    active = rng.random(B) < 0.8
    active[0] = True
    args = [jnp.asarray(x) for x in (score, parent, depth, valid & active[:, None])]
    forced = root_floor(args[0], args[1], args[3], jnp.asarray(active))
    whole = select_nodes(*args, forced, row_capacity, B * row_capacity)
    per_row = select_nodes(*args, forced, row_capacity, B * row_capacity, batch_capacity=False)
    for name in ("index", "valid", "parent", "depth", "kept"):
        np.testing.assert_array_equal(np.asarray(getattr(per_row, name)), np.asarray(getattr(whole, name)),
                                      err_msg=name)


def test_selection_shares_capacity_across_the_batch():
    """Two rows, capacity 5: the confident row gets the spare nodes, the other keeps its floor."""
    score = np.array([[0, -0.1, -0.2, -0.3, -0.4, -0.5], [0, -3.0, -4.0, -5.0, -6.0, -7.0]], np.float32)
    parent = np.array([[-1, 0, 1, 2, 3, 4]] * 2, np.int32)
    depth = np.array([[0, 1, 2, 3, 4, 5]] * 2, np.int32)
    valid = np.ones((2, 6), bool)
    @jax.jit
    def run(capacity):
        forced = root_floor(jnp.asarray(score), jnp.asarray(parent), jnp.asarray(valid), jnp.ones(2, bool))
        return select_nodes(jnp.asarray(score), jnp.asarray(parent), jnp.asarray(depth), jnp.asarray(valid),
                            forced, 6, capacity).kept
    assert np.asarray(run(5)).sum(1).tolist() == [3, 2]
    assert np.asarray(run(9)).sum(1).tolist() == [6, 3]


def test_confident_length():
    c = jnp.array([[0.9, 0.9, 0.5, 0.9], [0.2, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert confident_length(c, 0.7).tolist() == [2, 1, 4]        # survival .9 .81 .405 …; floor of 1
    assert confident_length(c, 0.0).tolist() == [4, 4, 4]


def test_b_ver_and_table_round_trip(tmp_path):
    t = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.3, 16: 2.0}
    assert b_ver(t, 1.0, 0.1) == (4, True)
    assert b_ver(t, 1.0, 0.5) == (8, True)
    assert b_ver({4: 2.0, 8: 3.0}, 1.0, 0.1) == (4, False)
    table = BudgetTable()
    mid = model_id({"a": 1}, "tiny")
    for batch, S, n in ((1, 1024, 16), (4, 1024, 8), (4, 4096, 4)):
        table.add(dict(device_kind="cpu", model=mid, batch=batch, kv_len=S, max_depth=4, b_ver=n, eps=0.1,
                       t_dec_ms=1.0, t_ver_ms={"4": 1.0}))
    path = tmp_path / "budget.json"
    table.save(path)
    raw = json.loads(path.read_text())
    assert raw["version"] == 1 and len(raw["entries"]) == 3
    back = BudgetTable.load(path)
    assert back.lookup("cpu", mid, 1, 1024)["b_ver"] == 16
    table.add(dict(device_kind="cpu", model=mid, batch=1, kv_len=1024, max_depth=8, b_ver=32))
    assert table.lookup("cpu", mid, 1, 1024, depth=8)["b_ver"] == 32       # the matching depth first
    assert table.lookup("cpu", mid, 1, 1024, depth=4)["b_ver"] == 16
    assert back.lookup("cpu", mid, 3, 2000)["b_ver"] == 4            # smallest covering bucket
    assert back.lookup("cpu", mid, 8, 1024) is None
    assert back.lookup("gpu", mid, 1, 1024) is None
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ValueError, match="entries"):
        BudgetTable.load(tmp_path / "bad.json")


# ------------------------------------------------------------------------------------------------
# Tree candidates
# ------------------------------------------------------------------------------------------------
TCFG = TargetConfig(
    model_type="qwen3_5_text", vocab_size=48, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, intermediate_size=64, layer_types=(LINEAR, FULL, LINEAR),
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)


@pytest.fixture(scope="module")
def block():
    return tiny_draft_block(TCFG, seed=2)


def test_greedy_tree_candidates_agree_with_propose_tree(block):
    """Greedy rows: the beam expansion keeps the same top nodes (tokens on the same paths, same ρ) as
    the ρ-ranked reference (tests/tree_reference.py) when the beam holds every node of the full k-ary tree."""
    model, graphdef, params, blk, anchor = block
    spec = TreeExpansion(depth=3, top_k=2, beam=8)
    full = TreeExpansion(depth=3, top_k=2, beam=14)
    cand = jax.jit(lambda p, b, a: tree_candidates(nnx.merge(graphdef, p), b, a, spec))(params, blk, anchor)
    prop = jax.jit(lambda p, b, a: tree_from_block(nnx.merge(graphdef, p), b, a, full))(params, blk, anchor)
    for b in range(2):
        def paths(tok, par, ok, base):
            out = {}
            for i in np.flatnonzero(ok):
                seq, j = [], i
                while j >= base:
                    seq.append(int(tok[j]))
                    j = int(par[j])
                out[tuple(seq[::-1])] = i
            return out
        mine = paths(np.asarray(cand.token[b]), np.asarray(cand.parent[b]), np.asarray(cand.valid[b]) &
                     (np.arange(cand.token.shape[1]) > 0), 1)
        theirs = paths(np.asarray(prop.token[b]), np.asarray(prop.parent[b]), np.asarray(prop.valid[b]), 0)
        assert set(mine) == set(theirs)
        for path, i in mine.items():
            np.testing.assert_allclose(np.exp(float(cand.score[b, i])), float(prop.rho[b, theirs[path]]), rtol=1e-5)


def test_sampled_tree_scores_are_pre_draw_and_monotone(block):
    """Sampling rows: scores never increase down a path, siblings come in draw order with non-increasing
    pre-draw scores, and the first child of every node scores exactly its parent's ρ (mass 1 left)."""
    model, graphdef, params, blk, anchor = block
    spec = TreeExpansion(depth=3, top_k=3, beam=5)
    samp = SlotSampling(temperature=jnp.array([1.0, 0.7]), top_p=jnp.array([1.0, 0.9]),
                        top_k=jnp.array([0, 10], jnp.int32), seed=jnp.array([1, 2], jnp.uint32))
    keys = jax.random.split(jax.random.key(0), 2)
    cand = jax.jit(lambda p, b, a, s, k: tree_candidates(nnx.merge(graphdef, p), b, a, spec, s, k))(
        params, blk, anchor, samp, keys)
    tok, par, ok, sc, q = (np.asarray(x) for x in (cand.token, cand.parent, cand.valid, cand.score, cand.child_q))
    assert ok[:, 1:].sum() > 4
    for b in range(2):
        rho = {0: 0.0}
        for i in np.flatnonzero(ok[b])[1:]:
            p = par[b, i]
            assert sc[b, i] <= sc[b, p] + 1e-6
            rho[i] = rho[p] + np.log(q[b, p, tok[b, i]])
            sibs = [j for j in np.flatnonzero(ok[b]) if par[b, j] == p and j < i]
            mass = 1.0 - sum(q[b, p, tok[b, j]] for j in sibs)
            np.testing.assert_allclose(sc[b, i], min(rho[p] + np.log(mass), sc[b, p]), atol=1e-5)
            assert q[b, p, tok[b, i]] > 0

