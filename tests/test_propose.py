"""Chain and tree proposals from a DSpark block, against direct numpy re-computations."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyspec_jax.config import FULL, LINEAR, DrafterConfig, TargetConfig
from hyspec_jax.models import drafter as D
from hyspec_jax.models.target import create_model
from hyspec_jax.sampling import SlotSampling, slot_keys
from hyspec_jax.spec import propose as P
from hyspec_jax.state import init_drafter_state
from hyspec_jax.tree import TreeExpansion
from tests import tree_reference as TR

TCFG = TargetConfig(
    model_type="qwen3_5_text", vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, intermediate_size=128, layer_types=(LINEAR, LINEAR, LINEAR, FULL),
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
B, S, G = 2, 16, 5


class Setup:
    def __init__(self, kind: str = "vanilla"):
        self.cfg = DrafterConfig.from_target(TCFG, num_layers=2, target_layer_ids=(0, 2), markov_rank=8,
                                               block_size=G, markov_head_type=kind)
        self.model = D.create_drafter(self.cfg, seed=2)
        if self.model.markov_head.kind == "vanilla":  # sharpen the bias so the Markov term decides some argmaxes
            w2 = self.model.markov_head.markov_w2.weight
            w2.set_value(w2[...] * 50.0)
        self.graphdef, self.params = nnx.split(self.model)
        taps = jnp.asarray(2.0 * np.random.default_rng(0).standard_normal((2, B, 8, TCFG.hidden_size)), jnp.float32)
        st = init_drafter_state(self.cfg, B, S)
        self.dstate = D.append_context_jit(self.graphdef, self.params, st, taps, jnp.array([8, 5], jnp.int32))
        self.anchor = jnp.array([17, 93], jnp.int32)


@pytest.fixture(scope="module")
def heads() -> D.TargetHeads:
    return D.target_heads(create_model(TCFG, seed=1))


@pytest.fixture(scope="module")
def setup(heads) -> Setup:
    s = Setup()
    s.block = D.draft_block_jit(s.graphdef, s.params, s.dstate, s.anchor, heads)
    return s


chain_jit = jax.jit(P.propose_chain, static_argnums=0)
tree_jit = jax.jit(TR.propose_tree, static_argnums=(0, 5), static_argnames=("return_probs",))


def _softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def np_logits(s: Setup, b: int, depth: int, prev: int) -> np.ndarray:
    """Vanilla DSpark draft logits at a depth (1 = child of the anchor) after token prev."""
    W1 = np.asarray(s.model.markov_head.markov_w1.weight[...], np.float64)
    W2 = np.asarray(s.model.markov_head.markov_w2.weight[...], np.float64)
    return np.asarray(s.block.logits[b, depth - 1], np.float64) + W2 @ W1[prev]


def test_chain_greedy_is_argmax_of_block_logits_plus_markov_bias(setup, heads):
    s = setup
    prop = chain_jit(s.graphdef, s.params, s.dstate, s.anchor, heads)
    assert prop.tokens.shape == (B, G) and prop.probs.shape == (B, G, TCFG.vocab_size)
    W1 = np.asarray(s.model.markov_head.markov_w1.weight[...], np.float64)
    w = np.asarray(s.model.confidence_head.proj.weight[...], np.float64)[0]
    cb = float(s.model.confidence_head.proj.bias[...][0])
    flips = 0
    for b in range(B):
        prev = int(s.anchor[b])
        for k in range(G):
            logits = np_logits(s, b, k + 1, prev)
            tok = int(np.argmax(logits))
            flips += tok != int(np.argmax(np.asarray(s.block.logits[b, k])))
            assert int(prop.tokens[b, k]) == tok
            np.testing.assert_allclose(np.asarray(prop.logits[b, k]), logits, rtol=1e-4, atol=1e-4)
            conf = 1 / (1 + np.exp(-(np.concatenate([np.asarray(s.block.hidden[b, k]), W1[prev]]) @ w + cb)))
            np.testing.assert_allclose(float(prop.confidence[b, k]), conf, rtol=1e-5)
            prev = tok
    assert flips > 0  # the Markov bias actually changed some choices
    np.testing.assert_array_equal(np.asarray(prop.probs).argmax(-1), np.asarray(prop.tokens))
    np.testing.assert_array_equal(np.asarray(prop.probs).max(-1), 1.0)
    np.testing.assert_array_equal(np.asarray(prop.token_probs), 1.0)


def test_chain_sampling_distributions(setup, heads):
    s = setup
    sampling = SlotSampling(temperature=jnp.array([0.0, 0.7]), top_p=jnp.array([1.0, 1.0]),
                            top_k=jnp.array([0, 5], jnp.int32), seed=jnp.array([1, 2], jnp.uint32))
    keys = slot_keys(sampling.seed, jnp.int32(0))
    prop = chain_jit(s.graphdef, s.params, s.dstate, s.anchor, heads, sampling=sampling, keys=keys)
    greedy = chain_jit(s.graphdef, s.params, s.dstate, s.anchor, heads)
    np.testing.assert_array_equal(np.asarray(prop.tokens[0]), np.asarray(greedy.tokens[0]))   # greedy row
    prev = int(s.anchor[1])
    for k in range(G):
        logits = np_logits(s, 1, k + 1, prev)
        keep = np.argsort(-logits)[:5]
        ref = np.zeros_like(logits)
        ref[keep] = _softmax(logits[keep] / 0.7)
        np.testing.assert_allclose(np.asarray(prop.probs[1, k]), ref, rtol=1e-4, atol=1e-6)
        tok = int(prop.tokens[1, k])
        assert tok in keep
        np.testing.assert_allclose(float(prop.token_probs[1, k]), ref[tok], rtol=1e-4)
        prev = tok
    again = chain_jit(s.graphdef, s.params, s.dstate, s.anchor, heads, sampling=sampling, keys=keys)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(prop.tokens))


def _paths(prop: TR.TreeProposal, b: int) -> dict[int, tuple[int, ...]]:
    """node -> token path from the anchor (checks topological order and depths on the way)."""
    parent, token, depth, valid = (np.asarray(x[b]) for x in (prop.parent, prop.token, prop.depth, prop.valid))
    out: dict[int, tuple[int, ...]] = {}
    for i in range(len(parent)):
        if not valid[i]:
            assert parent[i] == -1 and depth[i] == 0
            continue
        p = int(parent[i])
        assert -1 <= p < i, "topological order"
        if p >= 0:
            assert valid[p] and depth[i] == depth[p] + 1
            out[i] = out[p] + (int(token[i]),)
        else:
            assert depth[i] == 1
            out[i] = (int(token[i]),)
    return out


def _rho(s: Setup, b: int, path: tuple[int, ...]) -> float:
    prev, rho = int(s.anchor[b]), 1.0
    for d, tok in enumerate(path, start=1):
        rho *= _softmax(np_logits(s, b, d, prev))[tok]
        prev = tok
    return rho


def test_tree_full_envelope_children_are_top_k(setup, heads):
    s = setup
    env = TreeExpansion(depth=3, top_k=2, beam=2 + 4 + 8)
    prop = tree_jit(s.graphdef, s.params, s.dstate, s.anchor, heads, env)
    assert prop.parent.shape == (B, 14) and bool(prop.valid.all())
    for b in range(B):
        paths = _paths(prop, b)
        assert len(paths) == 14 and len(set(paths.values())) == 14
        for i, path in paths.items():
            np.testing.assert_allclose(float(prop.rho[b, i]), _rho(s, b, path), rtol=1e-4)
        # the children of every node of depth < 3 (and of the anchor) are exactly its top-2 tokens
        internal = [()] + [p for p in paths.values() if len(p) < 3]
        for path in internal:
            prev = path[-1] if path else int(s.anchor[b])
            top = set(np.argsort(-np_logits(s, b, len(path) + 1, prev))[:2].tolist())
            children = {p[-1] for p in paths.values() if len(p) == len(path) + 1 and p[:-1] == path}
            assert children == top


def test_tree_budget_keeps_global_top_rho(setup, heads):
    s = setup
    env = TreeExpansion(depth=3, top_k=3, beam=6)
    prop = tree_jit(s.graphdef, s.params, s.dstate, s.anchor, heads, env)
    for b in range(B):
        paths = _paths(prop, b)
        assert len(paths) == 6
        # brute force over the full 3-ary tree of depth 3
        every: dict[tuple[int, ...], float] = {}
        frontier = [()]
        for d in range(1, 4):
            nxt = []
            for path in frontier:
                prev = path[-1] if path else int(s.anchor[b])
                for tok in np.argsort(-np_logits(s, b, d, prev))[:3].tolist():
                    every[path + (tok,)] = _rho(s, b, path + (tok,))
                    nxt.append(path + (tok,))
            frontier = nxt
        best = sorted(every, key=every.get, reverse=True)[:6]
        assert set(paths.values()) == set(best)
        for i, path in paths.items():
            np.testing.assert_allclose(float(prop.rho[b, i]), every[path], rtol=1e-4)
        rho = np.asarray(prop.rho[b])
        for i in paths:   # rho never grows along a path
            p = int(prop.parent[b, i])
            assert p < 0 or rho[p] >= rho[i]


def test_tree_with_k1_is_the_rnn_greedy_chain(setup):
    """k = 1 turns the tree into the chain; with the RNN head this checks the per-node RNN state threading."""
    s = Setup("rnn")
    env = TreeExpansion(depth=G, top_k=1, beam=G)

    @jax.jit
    def both(params, block, anchor):  # the sequential stages alone, on the fixture's block
        m = nnx.merge(s.graphdef, params)
        return TR.tree_from_block(m, block, anchor, env), P.chain_from_block(m, block, anchor)

    prop, chain = both(s.params, setup.block, s.anchor)
    np.testing.assert_array_equal(np.asarray(prop.token), np.asarray(chain.tokens))
    np.testing.assert_array_equal(np.asarray(prop.parent), np.arange(G)[None].repeat(B, 0) - 1)
    np.testing.assert_array_equal(np.asarray(prop.depth), np.arange(1, G + 1)[None].repeat(B, 0))
    ptok = np.take_along_axis(_softmax(np.asarray(chain.logits, np.float64)), np.asarray(chain.tokens)[..., None],
                              -1)[..., 0]
    np.testing.assert_allclose(np.asarray(prop.rho), np.cumprod(np.asarray(ptok), axis=1), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(prop.confidence), np.asarray(chain.confidence), rtol=1e-5)


def test_tree_sampling_and_anchor_convention(setup, heads):
    s = setup
    env = TreeExpansion(depth=3, top_k=3, beam=6)
    sampling = SlotSampling(temperature=jnp.array([0.0, 1.2]), top_p=jnp.array([1.0, 0.95]),
                            top_k=jnp.array([0, 0], jnp.int32), seed=jnp.array([0, 5], jnp.uint32))
    keys = slot_keys(sampling.seed, jnp.int32(3))
    prop = tree_jit(s.graphdef, s.params, s.dstate, s.anchor, heads, env, sampling=sampling, keys=keys,
                    return_probs=True)
    greedy = tree_jit(s.graphdef, s.params, s.dstate, s.anchor, heads, env)
    for f in ("parent", "token", "depth", "valid", "rho"):       # greedy rows ignore the sampler
        np.testing.assert_allclose(np.asarray(getattr(prop, f)[0]), np.asarray(getattr(greedy, f)[0]), rtol=1e-6)
    q = np.asarray(prop.draft_probs)
    assert q.shape == (B, 6, TCFG.vocab_size)
    paths = _paths(prop, 1)
    for i, path in paths.items():
        np.testing.assert_allclose(q[1, i].sum(), 1.0, rtol=1e-5)
        assert q[1, i, path[-1]] > 0                                 # drawn from its own q
        # rho = product of the draft probabilities along the path
        rho, j = 1.0, i
        while j >= 0:
            rho *= q[1, j, int(prop.token[1, j])]
            j = int(prop.parent[1, j])
        np.testing.assert_allclose(float(prop.rho[1, i]), rho, rtol=1e-4)
    for key, grp in itertools.groupby(sorted(paths.values(), key=lambda p: p[:-1]), key=lambda p: p[:-1]):
        toks = [p[-1] for p in grp]
        assert len(toks) == len(set(toks))                          # siblings are distinct (no replacement)

    parent, valid, depth, token = jax.jit(TR.with_anchor)(prop, s.anchor)
    assert parent.shape == (B, 7)
    assert int(parent[1, 0]) == -1 and int(depth[1, 0]) == 0 and int(token[1, 0]) == int(s.anchor[1])
    for i in range(6):
        if bool(prop.valid[1, i]):
            assert int(parent[1, i + 1]) == max(int(prop.parent[1, i]), -1) + 1
            assert int(depth[1, i + 1]) == int(prop.depth[1, i])
