"""Tree verification in the full target against plain decoding of each root-to-node path (and transformers),
and the factorized commit against autoregressive decoding of the accepted tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from hyspec_jax import tree as tree_lib
from hyspec_jax.io.hf import load_pretrained
from hyspec_jax.models.target import extend_jit, verify
from hyspec_jax.spec.commit import commit
from hyspec_jax.state import init_state
from tests import hf_oracle

S_MAX = 48
verify_jit = jax.jit(verify, static_argnames=("graphdef", "method", "packed_rows"))
commit_jit = jax.jit(commit)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def target(request, tmp_path_factory):
    if request.param == "qwen3_5":
        cfg = hf_oracle.qwen3_5_config(vocab=97, hidden=32, layers=4, hv=6, hk=3, dk=8, dv=4, head_dim=8,
                                       heads=2, kv_heads=1,
                                       layer_types=["linear_attention", "full_attention", "linear_attention",
                                                    "linear_attention"])
    else:
        cfg = hf_oracle.qwen3_next_config(vocab=97, hidden=32, layers=4, num_experts=4, top_k=2)
    hf = hf_oracle.build(cfg, seed=3)
    path = hf_oracle.save(hf, tmp_path_factory.mktemp(request.param))
    tcfg, model = load_pretrained(path)
    graphdef, params = nnx.split(model)
    return hf, tcfg, graphdef, params


def _prefill(tcfg, graphdef, params, prompts: list[np.ndarray]):
    B = len(prompts)
    T = max(len(p) for p in prompts)
    toks = np.zeros((B, T), np.int32)
    valid = np.zeros((B, T), bool)
    for b, p in enumerate(prompts):
        toks[b, :len(p)], valid[b, :len(p)] = p, True
    _, state = extend_jit(graphdef, params, init_state(tcfg, B, S_MAX), jnp.asarray(toks), jnp.asarray(valid))
    return state


def _path(parent: np.ndarray, n: int) -> list[int]:
    out = []
    while n >= 0:
        out.append(n)
        n = int(parent[n])
    return out[::-1]


PLAIN_T = 24


def _plain(tcfg, graphdef, params, seq: np.ndarray):
    """Plain model on one sequence (right-padded to one shape: one compile): (logits [1,len,V], state)."""
    toks = np.zeros((1, PLAIN_T), np.int32)
    toks[0, :len(seq)] = seq
    valid = np.arange(PLAIN_T)[None] < len(seq)
    logits, state = extend_jit(graphdef, params, init_state(tcfg, 1, S_MAX), jnp.asarray(toks), jnp.asarray(valid))
    return logits[:, :len(seq)], state


ENVELOPE = tree_lib.TreeShape(max_nodes=14, max_depth=6)   # one bucket: one compile per method


@settings(max_examples=5)
@given(seed=st.integers(0, 2**31 - 1), depth=st.integers(1, 6), method=st.sampled_from(["squaring", "neumann", "solve"]))
def test_tree_logits_equal_plain_model_on_each_path(target, seed, depth, method):
    _, tcfg, graphdef, params = target
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 9, size=2)
    prompts = [rng.integers(0, tcfg.vocab_size, size=n) for n in lens]
    parents = [tree_lib.random_parents(rng, int(rng.integers(2, ENVELOPE.max_nodes + 1)), depth) for _ in prompts]
    tree = tree_lib.pack_forest(parents, ENVELOPE)
    nodes = ENVELOPE.max_nodes
    tokens = rng.integers(0, tcfg.vocab_size, size=(2, nodes)).astype(np.int32)
    state = _prefill(tcfg, graphdef, params, prompts)
    logits, _ = verify_jit(graphdef, params, state, tree, jnp.asarray(tokens), method=method)
    logits = np.asarray(logits)
    for b, par in enumerate(parents):
        for n in range(len(par)):
            seq = np.concatenate([prompts[b], tokens[b, _path(par, n)]])
            ref, _ = _plain(tcfg, graphdef, params, seq)
            np.testing.assert_allclose(logits[b, n], np.asarray(ref)[0, -1], atol=1e-4, rtol=1e-4)


def test_tree_logits_equal_transformers_on_paths(target):
    hf, tcfg, graphdef, params = target
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, tcfg.vocab_size, size=6)
    parent = np.asarray([-1, 0, 0, 1, 1, 2, 3, 6, 5])
    tree = tree_lib.pack_forest([parent], tree_lib.TreeShape(9, 4))
    tokens = rng.integers(0, tcfg.vocab_size, size=(1, 9)).astype(np.int32)
    logits, _ = verify_jit(graphdef, params, _prefill(tcfg, graphdef, params, [prompt]), tree, jnp.asarray(tokens))
    for leaf in (4, 7, 8):
        path = _path(parent, leaf)
        seq = np.concatenate([prompt, tokens[0, path]])
        ref = hf_oracle.logits(hf, seq[None])[0, len(prompt):]
        np.testing.assert_allclose(np.asarray(logits)[0, path], ref, atol=1e-4, rtol=1e-4)


@settings(max_examples=5)
@given(seed=st.integers(0, 2**31 - 1))
def test_commit_equals_autoregressive_decoding(target, seed):
    _, tcfg, graphdef, params = target
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, tcfg.vocab_size, size=n) for n in rng.integers(1, 9, size=3)]
    N, d = 10, 4
    parents = [tree_lib.random_parents(rng, N, d) for _ in prompts]
    tree = tree_lib.pack_forest(parents, tree_lib.TreeShape(N, d))
    tokens = rng.integers(0, tcfg.vocab_size, size=(3, N)).astype(np.int32)
    state = _prefill(tcfg, graphdef, params, prompts)
    _, cache = verify_jit(graphdef, params, state, tree, jnp.asarray(tokens))
    accepted = np.asarray([rng.integers(0, N), -1, rng.integers(0, N)], np.int32)
    new = commit_jit(state, cache, tree, jnp.asarray(accepted))
    for b in range(3):
        path = _path(parents[b], int(accepted[b])) if accepted[b] >= 0 else []
        seq = np.concatenate([prompts[b], tokens[b, path]]).astype(np.int32)
        _, ref = _plain(tcfg, graphdef, params, seq)
        L = len(seq)
        assert int(new.lengths[b]) == L
        np.testing.assert_allclose(np.asarray(new.ssm[:, b]), np.asarray(ref.ssm[:, 0]), atol=2e-5, rtol=1e-4)
        # the verify forward and plain decoding multiply the same rows in differently shaped products (other
        # summation orders): fp32 rounding, ~1e-5 relative, after the RMS norms of q/k. The attention layer's K/V
        # come after three GDN + MoE layers whose rounding they carry: 1.7e-5 seen on one element of keys whose
        # rows have scale ~1, so their bound is 3e-5 of that scale
        np.testing.assert_allclose(np.asarray(new.conv[:, b]), np.asarray(ref.conv[:, 0]), atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(new.keys[:, b, :L]), np.asarray(ref.keys[:, 0, :L]), atol=3e-5, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(new.values[:, b, :L]), np.asarray(ref.values[:, 0, :L]), atol=3e-5, rtol=1e-4)
        if accepted[b] < 0:  # nothing accepted: bit-identical state
            for a, r in ((new.ssm, state.ssm), (new.conv, state.conv), (new.keys, state.keys)):
                np.testing.assert_array_equal(np.asarray(a[:, b]), np.asarray(r[:, b]))
        # Continuing generation from the committed state matches plain decoding.
        nxt = np.asarray([[int(rng.integers(0, tcfg.vocab_size))]], np.int32)
        one = jax.tree.map(lambda x: x[:, b:b + 1] if x.ndim > 1 else x[b:b + 1], new)
        got, _ = extend_jit(graphdef, params, one, jnp.asarray(nxt), jnp.ones((1, 1), bool))
        want, _ = _plain(tcfg, graphdef, params, np.concatenate([seq, nxt[0]]))
        np.testing.assert_allclose(np.asarray(got)[0, 0], np.asarray(want)[0, -1], atol=1e-4, rtol=1e-4)


def test_chain_through_verify_equals_chunked_prefill(target):
    _, tcfg, graphdef, params = target
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, tcfg.vocab_size, size=5)
    state = _prefill(tcfg, graphdef, params, [prompt])
    chain = rng.integers(0, tcfg.vocab_size, size=(1, 11)).astype(np.int32)
    tree = tree_lib.chain(1, 11)
    logits, cache = verify_jit(graphdef, params, state, tree, jnp.asarray(chain))
    ref_logits, ref_state = extend_jit(graphdef, params, jax.tree.map(jnp.copy, state), jnp.asarray(chain),
                                       jnp.ones((1, 11), bool))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-4, rtol=1e-4)
    new = commit_jit(state, cache, tree, jnp.asarray([10], jnp.int32))
    np.testing.assert_allclose(np.asarray(new.ssm), np.asarray(ref_state.ssm), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(new.conv), np.asarray(ref_state.conv), atol=1e-5)


def test_grad_through_verify_matches_grad_through_prefill(target):
    """jax.grad flows through the verify forward (reference path); on a chain it equals the prefill grad."""
    _, tcfg, graphdef, params = target
    rng = np.random.default_rng(9)
    state = _prefill(tcfg, graphdef, params, [rng.integers(0, tcfg.vocab_size, size=4)])
    toks = jnp.asarray(rng.integers(0, tcfg.vocab_size, size=(1, 6)), jnp.int32)
    target_ids = jnp.asarray(rng.integers(0, tcfg.vocab_size, size=(1, 6)), jnp.int32)

    def nll(logits):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), target_ids[..., None], -1))

    def loss_verify(p):
        return nll(verify(graphdef, p, state, tree_lib.chain(1, 6), toks)[0])

    def loss_extend(p):
        from hyspec_jax.models.target import extend
        return nll(extend(graphdef, p, state, toks, jnp.ones((1, 6), bool))[0])

    gv = jax.grad(loss_verify)(params)
    ge = jax.grad(loss_extend)(params)
    flat_v, flat_e = jax.tree.leaves(gv), jax.tree.leaves(ge)
    assert all(np.isfinite(np.asarray(x)).all() for x in flat_v)
    assert max(float(jnp.abs(x).max()) for x in flat_v) > 0
    for a, b in zip(flat_v, flat_e):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("scan", [False, True])
def test_packed_rows_verify_equals_the_dense_forest(target, scan):
    """Bole's packed forest: the valid nodes of a [B, N] forest in C < B·N rows give the dense verify's logits, taps
    and commit factors at every valid node (the row-wise layers see the same rows; only the products' shapes
    differ), and a commit from either cache is the same state."""
    from hyspec_jax.models.target import scan_layers
    _, tcfg, graphdef, params = target
    model = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))     # scan_layers restacks in place
    if scan:
        scan_layers(model)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, tcfg.vocab_size, size=n) for n in (3, 7, 5)]
    N, d = 8, 3
    sizes = (8, 2, 5)                                      # 15 valid nodes of 24
    parents = [tree_lib.random_parents(rng, n, min(d, n - 1)) for n in sizes]
    tree = tree_lib.pack_forest(parents, tree_lib.TreeShape(N, d))
    tokens = jnp.asarray(rng.integers(0, tcfg.vocab_size, size=(3, N)), jnp.int32)
    state = _prefill(tcfg, graphdef, params, prompts)
    taps = (0, 2)
    dense = jax.jit(lambda s: model.verify(s, tree, tokens, tap_layers=taps))(state)
    packed = jax.jit(lambda s: model.verify(s, tree, tokens, tap_layers=taps, packed_rows=16))(state)
    valid = np.asarray(tree.valid)
    assert valid.sum() == 15
    np.testing.assert_allclose(np.asarray(packed[0])[valid], np.asarray(dense[0])[valid], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(packed[1])[:, valid], np.asarray(dense[1])[:, valid], atol=1e-5, rtol=1e-5)
    # of the 9 invalid nodes, 1 fills the 16th packed row; the 8 never packed are zero
    assert (~np.asarray(packed[0])[~valid].any(axis=-1)).sum() == 8
    accepted = jnp.asarray([5, 1, 0], jnp.int32)
    new_dense = commit_jit(state, dense[2], tree, accepted)
    new_packed = commit_jit(state, packed[2], tree, accepted)
    for a, b in zip(jax.tree.leaves(new_packed), jax.tree.leaves(new_dense)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_pack_nodes_orders_valid_nodes_first_and_round_trips():
    parents = [np.asarray([-1, 0, 0], np.int32), np.asarray([-1], np.int32), np.asarray([-1, 0], np.int32)]
    tree = tree_lib.pack_forest(parents, tree_lib.TreeShape(4, 2))
    p = tree_lib.pack_nodes(tree, 7)
    np.testing.assert_array_equal(np.asarray(p.index)[:6], [0, 1, 2, 4, 8, 9])   # valid, row-major
    x = jnp.arange(3 * 4 * 2, dtype=jnp.float32).reshape(3, 4, 2)
    back = np.asarray(p.unpack(p.pack(x)))
    valid = np.asarray(tree.valid)
    np.testing.assert_array_equal(back[valid], np.asarray(x)[valid])
    with pytest.raises(ValueError, match="packed rows"):
        tree_lib.pack_nodes(tree, 13)
