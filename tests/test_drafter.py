"""DSpark drafter + ReaDy reader: shapes, attention masking, context cache, reader math, heads, checkpoints."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from hyspec_jax.config import FULL, LINEAR, ConfigError, DrafterConfig, TargetConfig, default_target_layer_ids
from hyspec_jax.io.drafter_io import load_drafter, load_drafter_config, save_drafter
from hyspec_jax.models import drafter as D
from hyspec_jax.models.reader import Reader, ReaderConfig, default_source_layers, select_states
from hyspec_jax.models.target import create_model
from hyspec_jax.state import DrafterState, init_drafter_state, init_state

TCFG = TargetConfig(
    model_type="qwen3_5_text", vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, intermediate_size=128, layer_types=(LINEAR, LINEAR, LINEAR, FULL),
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
B, S = 2, 16


def dcfg(**kw) -> DrafterConfig:
    base = dict(num_layers=2, target_layer_ids=(0, 2), markov_rank=8, block_size=5)
    base.update(kw)
    return DrafterConfig.from_target(TCFG, **base)


def rcfg(**kw) -> ReaderConfig:
    return ReaderConfig.for_target(TCFG, mlp_hidden=32, **kw)


def rand(seed: int, shape, scale=1.0) -> np.ndarray:
    # numpy, not jax.random: every new shape would compile a threefry kernel (seconds on CPU)
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


@pytest.fixture(scope="module")
def target():
    return create_model(TCFG, seed=1)


@pytest.fixture(scope="module")
def heads(target) -> D.TargetHeads:
    return D.target_heads(target)


def ssm_like(seed: int) -> jax.Array:
    return rand(seed, (len(TCFG.gdn_layers), B, 4, 16, 16), 0.3)


draft_jit = D.draft_block_jit        # the library's compiled entry points (shared with test_propose)
append_jit = D.append_context_jit


def filled_state(graphdef, params, cfg, num_new, seed=3, T=8) -> tuple[DrafterState, jax.Array]:
    taps = jnp.asarray(rand(seed, (cfg.num_taps, B, T, TCFG.hidden_size)))
    st = init_drafter_state(cfg, B, S)
    return append_jit(graphdef, params, st, taps, jnp.asarray(num_new, jnp.int32)), taps


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------
def test_default_tap_rule_and_config_checks():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(40, 5) == (1, 10, 19, 28, 37)
    assert default_target_layer_ids(64, 5) == (1, 16, 31, 46, 61)
    assert default_target_layer_ids(36, 1) == (18,)
    cfg = dcfg()
    assert cfg.num_draft_tokens == 5 and dcfg(logits_start=1).num_draft_tokens == 4
    assert DrafterConfig.from_target(TCFG.__class__(**{**TCFG.__dict__, "num_hidden_layers": 36,
                                                         "layer_types": (LINEAR,) * 36})).target_layer_ids \
        == (1, 9, 17, 25, 33)
    with pytest.raises(ConfigError, match="logits_start"):
        dcfg(logits_start=2)
    with pytest.raises(ConfigError, match="outside"):
        dcfg(target_layer_ids=(0, 3))        # the last target layer is never a tap
    with pytest.raises(ConfigError, match="markov_head_type"):
        dcfg(markov_head_type="lstm")
    assert DrafterConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    # reader defaults: paper's layers 30 and 62 on a 64-layer 3:1 stack
    big = TargetConfig(**{**TCFG.__dict__, "num_hidden_layers": 64,
                          "layer_types": tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(64))})
    assert default_source_layers(big) == (30, 62)
    assert rcfg().source_layers == (1, 2) and rcfg().source_slots == (1, 2)
    with pytest.raises(ConfigError, match="not GDN"):
        rcfg(source_layers=(3,))
    with pytest.raises(ConfigError, match="rank"):
        rcfg(rank=17)
    assert rcfg(rank=16).value_rank == 16    # full rank allowed


# ------------------------------------------------------------------------------------------------
# Masking: bidirectional block, context strictly before the anchor, blocks isolated
# ------------------------------------------------------------------------------------------------
def test_block_attention_mask():
    cfg = dcfg()
    model = D.create_drafter(cfg)
    graphdef, params = nnx.split(model)
    A, G, d = 2, cfg.block_size, TCFG.hidden_size

    @jax.jit
    def run(params, x, start, ck, cv, ctx_len):
        return nnx.merge(graphdef, params).block_hidden(x, start, ck, cv, ctx_len)

    x = rand(0, (B, A, G, d))
    start = jnp.array([[3, 6], [4, 9]], jnp.int32)
    ctx_len = jnp.array([10, 7], jnp.int32)
    kv_shape = (cfg.num_hidden_layers, B, 12, cfg.num_key_value_heads, cfg.head_dim)
    ck, cv = rand(1, kv_shape), rand(2, kv_shape)
    h = np.asarray(run(params, x, start, ck, cv, ctx_len))
    assert h.shape == (B, A, G, d) and np.isfinite(h).all()

    # bidirectional: the last slot changes slot 0 of its own block
    x2 = x.copy()
    x2[:, :, -1] += 1.0
    h2 = np.asarray(run(params, x2, start, ck, cv, ctx_len))
    assert np.all(np.abs(h2[:, :, 0] - h[:, :, 0]).max(-1) > 1e-4)
    # blocks are isolated from each other
    x3 = x.copy()
    x3[:, 1] += 1.0
    h3 = np.asarray(run(params, x3, start, ck, cv, ctx_len))
    np.testing.assert_array_equal(h3[:, 0], h[:, 0])
    assert np.abs(h3[:, 1] - h[:, 1]).max() > 1e-4
    # context keys/values at positions >= anchor (or >= ctx_len) are invisible, position anchor-1 is seen
    for b, a in [(0, 0), (1, 0), (0, 1), (1, 1)]:
        first_hidden = int(min(start[b, a], ctx_len[b]))
        ck2, cv2, cv3 = ck.copy(), cv.copy(), cv.copy()
        ck2[:, b, first_hidden:], cv2[:, b, first_hidden:] = 100.0, -100.0
        np.testing.assert_array_equal(np.asarray(run(params, x, start, ck2, cv2, ctx_len))[b, a], h[b, a])
        cv3[:, b, first_hidden - 1] += 5.0
        assert np.abs(np.asarray(run(params, x, start, ck, cv3, ctx_len))[b, a] - h[b, a]).max() > 1e-4


def test_draft_block_context_strictly_before_anchor(heads):
    cfg = dcfg()
    graphdef, params = nnx.split(D.create_drafter(cfg))
    st, _ = filled_state(graphdef, params, cfg, [7, 4])
    np.testing.assert_array_equal(np.asarray(st.lengths), [7, 4])
    anchor = jnp.array([5, 9], jnp.int32)
    blk = draft_jit(graphdef, params, st, anchor, heads)
    assert blk.hidden.shape == (B, 5, TCFG.hidden_size) and blk.logits.shape == (B, 5, TCFG.vocab_size)
    assert blk.logits.dtype == jnp.float32
    # garbage in the cache at positions >= the anchor position is invisible
    junk = np.arange(S)[None, :, None, None] >= np.asarray(st.lengths)[:, None, None, None]
    st2 = st.replace(keys=jnp.asarray(np.where(junk, 50.0, st.keys), jnp.float32),
                     values=jnp.asarray(np.where(junk, -50.0, st.values), jnp.float32))
    blk2 = draft_jit(graphdef, params, st2, anchor, heads)
    np.testing.assert_array_equal(np.asarray(blk2.logits), np.asarray(blk.logits))
    # the last committed token (anchor − 1) is visible
    v3 = np.array(st.values)
    v3[:, 1, 3] += 3.0
    st3 = st.replace(values=jnp.asarray(v3))
    blk3 = draft_jit(graphdef, params, st3, anchor, heads)
    np.testing.assert_array_equal(np.asarray(blk3.logits[0]), np.asarray(blk.logits[0]))
    assert np.abs(np.asarray(blk3.logits[1] - blk.logits[1])).max() > 1e-5


def test_logits_start_selects_slots(heads):
    cfg0, cfg1 = dcfg(), dcfg(logits_start=1)
    m0, m1 = D.create_drafter(cfg0), D.create_drafter(cfg1)   # same seed: same weights
    g0, p0 = nnx.split(m0)
    g1, p1 = nnx.split(m1)
    st, _ = filled_state(g0, p0, cfg0, [6, 6])
    anchor = jnp.array([1, 2], jnp.int32)
    b0, b1 = draft_jit(g0, p0, st, anchor, heads), draft_jit(g1, p1, st, anchor, heads)
    assert b1.logits.shape[1] == 4
    np.testing.assert_allclose(np.asarray(b1.logits), np.asarray(b0.logits[:, 1:]), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Context cache
# ------------------------------------------------------------------------------------------------
def test_context_cache_equals_recompute(heads):
    cfg = dcfg()
    graphdef, params = nnx.split(D.create_drafter(cfg))
    T = 12
    taps = rand(5, (cfg.num_taps, B, T, TCFG.hidden_size))
    first, second = [3, 8], [6, 2]                   # ragged commits per slot
    st = init_drafter_state(cfg, B, S)
    chunk1, chunk2 = np.zeros((cfg.num_taps, B, 8, 64), np.float32), np.zeros((cfg.num_taps, B, 8, 64), np.float32)
    for b in range(B):
        chunk1[:, b, :first[b]] = taps[:, b, :first[b]]
        chunk2[:, b, :second[b]] = taps[:, b, first[b]:first[b] + second[b]]
    for b in range(B):
        chunk1[:, b, first[b]:] = 77.0                # rows beyond num_new must be dropped
    st = append_jit(graphdef, params, st, jnp.asarray(chunk1), jnp.asarray(first, jnp.int32))
    st = append_jit(graphdef, params, st, jnp.asarray(chunk2), jnp.asarray(second, jnp.int32))
    total = np.add(first, second)
    np.testing.assert_array_equal(np.asarray(st.lengths), total)
    positions = jnp.asarray(np.broadcast_to(np.arange(T), (B, T)), jnp.int32)
    k_ref, v_ref = jax.jit(D.context_kv, static_argnums=0)(graphdef, params, jnp.asarray(taps), positions)
    for b in range(B):
        n = total[b]
        np.testing.assert_allclose(np.asarray(st.keys[:, b, :n]), np.asarray(k_ref[:, b, :n]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(st.values[:, b, :n]), np.asarray(v_ref[:, b, :n]), rtol=1e-5, atol=1e-6)
        assert not np.asarray(st.keys[:, b, n:]).any()     # nothing written past the committed length
    # drafting from the incremental cache == from a cache filled in one go
    one = init_drafter_state(cfg, B, S)
    full = np.zeros((cfg.num_taps, B, T, 64), np.float32)
    for b in range(B):
        full[:, b, :total[b]] = taps[:, b, :total[b]]
    one = append_jit(graphdef, params, one, jnp.asarray(full), jnp.asarray(total, jnp.int32))
    anchor = jnp.array([7, 8], jnp.int32)
    np.testing.assert_allclose(np.asarray(draft_jit(graphdef, params, st, anchor, heads).logits),
                               np.asarray(draft_jit(graphdef, params, one, anchor, heads).logits),
                               rtol=1e-5, atol=1e-5)


def test_target_taps_train_and_inference_paths_agree(target, heads):
    """Target taps -> append_context -> draft_block == forward_train's block at the same anchor (with reader)."""
    tgd, tparams = nnx.split(target)
    cfg = dcfg()
    rc = rcfg()
    model = D.create_drafter(cfg, rc)
    model.reader.fc_out.weight.set_value(jnp.asarray(rand(9, model.reader.fc_out.weight.shape, 0.05)))  # a live reader
    graphdef, params = nnx.split(model)
    T = 10
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 120, (B, T)), jnp.int32)

    @jax.jit
    def taps_of(tparams, tokens):
        m = nnx.merge(tgd, tparams)
        _, taps, state = m.extend(init_state(TCFG, B, T), tokens, jnp.ones((B, T), bool),
                                  tap_layers=cfg.target_layer_ids)
        return taps, state.ssm

    taps, ssm = taps_of(tparams, tokens)
    assert taps.shape == (2, B, T, 64)
    anchors = jnp.array([[6], [5]], jnp.int32)
    train = jax.jit(D.forward_train, static_argnums=0)(
        graphdef, params, heads, taps, tokens, anchors, None, select_states(rc, ssm)[:, None])
    st = append_jit(graphdef, params, init_drafter_state(cfg, B, S), taps, anchors[:, 0])
    anchor_tok = tokens[jnp.arange(B), anchors[:, 0]]
    blk = draft_jit(graphdef, params, st, anchor_tok, heads, ssm)
    np.testing.assert_allclose(np.asarray(train.base_logits[:, 0]), np.asarray(blk.logits), rtol=1e-4, atol=1e-5)
    # teacher-forced Markov bias: slot 0 uses the anchor, slot k the label of slot k-1
    w1 = np.asarray(model.markov_head.markov_w1.weight[...])
    w2 = np.asarray(model.markov_head.markov_w2.weight[...])
    tok = np.asarray(tokens)
    for b in range(B):
        a = int(anchors[b, 0])
        for k in range(min(cfg.num_draft_tokens, T - a)):
            bias = w2 @ w1[tok[b, a + k]]
            np.testing.assert_allclose(np.asarray(train.logits[b, 0, k]), np.asarray(blk.logits[b, k]) + bias,
                                       rtol=1e-4, atol=1e-5)
            if a + k + 1 < T:
                assert int(train.labels[b, 0, k]) == tok[b, a + k + 1] and bool(train.label_valid[b, 0, k])
            else:
                assert not bool(train.label_valid[b, 0, k])
    assert train.confidence_logits.shape == (B, 1, cfg.num_draft_tokens)


# ------------------------------------------------------------------------------------------------
# Reader
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reader_kw", [dict(), dict(position="before_attention", injection_layer=0)])
def test_zero_initialised_reader_is_exactly_dspark(heads, reader_kw):
    cfg = dcfg()
    plain = D.create_drafter(cfg, seed=7)
    with_reader = D.create_drafter(cfg, rcfg(**reader_kw), seed=7)
    gp, pp = nnx.split(plain)
    gr, pr = nnx.split(with_reader)
    # the DSpark parameters are identical (the reader is created last)
    flat_r = dict(nnx.to_flat_state(pr))
    for path, var in nnx.to_flat_state(pp):
        np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(flat_r[path][...]))
    st, _ = filled_state(gp, pp, cfg, [7, 5])
    anchor = jnp.array([3, 4], jnp.int32)
    ssm = ssm_like(11)
    ref = draft_jit(gp, pp, st, anchor, heads)
    got = draft_jit(gr, pr, st, anchor, heads, ssm)
    np.testing.assert_array_equal(np.asarray(got.hidden), np.asarray(ref.hidden))
    np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(ref.logits))
    # and the reader is live once its output projection is trained
    with_reader.reader.fc_out.weight.set_value(jnp.asarray(rand(8, with_reader.reader.fc_out.weight.shape, 0.1)))
    gr, pr = nnx.split(with_reader)
    moved = np.asarray(draft_jit(gr, pr, st, anchor, heads, ssm).logits)
    assert np.abs(moved - np.asarray(ref.logits)).max() > 1e-4
    other = draft_jit(gr, pr, st, anchor, heads, ssm_like(12))  # ... and depends on the committed state
    assert np.abs(np.asarray(other.logits) - moved).max() > 1e-5
    with pytest.raises(ValueError, match="reader"):
        D.draft_block(gr, pr, st, anchor, heads)


def _rms_np(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1.0 + w)


def test_reader_readout_matches_numpy():
    rc = rcfg(rank=8, value_rank=4)   # distinct query and value ranks
    reader = Reader(rc, rngs=nnx.Rngs(0))
    reader.fc_out.weight.set_value(jnp.asarray(rand(1, reader.fc_out.weight.shape, 0.1)))
    reader.norm.weight.set_value(jnp.asarray(rand(2, reader.norm.weight.shape, 0.1)))
    graphdef, params = nnx.split(reader)

    @jax.jit
    def run(params, h, ssm):
        r = nnx.merge(graphdef, params)
        states = select_states(rc, ssm)[:, None]
        T, log_rms = r.state_summary(states)
        return states, r.readout(h, T), log_rms, r(h, states)

    A, G, M, dk, dv = 1, 3, rc.num_reads, rc.key_dim, rc.value_dim
    ssm = ssm_like(3)
    h = rand(4, (B, A, G, rc.hidden_size))
    states, u, log_rms, dh = (np.asarray(x) for x in run(params, h, ssm))
    # select_states: (layer, head) flattened, layers in source order
    for b in range(B):
        for li, slot in enumerate(rc.source_slots):
            for hh in range(rc.num_heads):
                np.testing.assert_array_equal(np.asarray(states[b, 0, li * rc.num_heads + hh]),
                                              np.asarray(ssm[slot, b, hh]))

    W_q, U, V = (np.asarray(p[...]) for p in (reader.w_q, reader.u, reader.v))
    S_np, h_np = np.asarray(states, np.float64), np.asarray(h, np.float64)
    hn = _rms_np(h_np, np.asarray(reader.norm.weight[...]), rc.eps)
    u_ref = np.zeros((B, A, G, M, rc.value_rank))
    lr_ref = np.zeros((B, A, M))
    for b in range(B):
        for m in range(M):
            S_hf = S_np[b, 0, m]                                   # [dk, dv], o = Sᵀq
            rms = np.sqrt(np.mean(S_hf ** 2) + rc.eps)
            S_bar = (S_hf / rms).T                                 # the paper's S̄ ∈ R^{dv×dk}
            lr_ref[b, 0, m] = np.log(rms)
            T_m = V[m].T @ S_bar                                   # [r_v, dk]
            for j in range(G):
                q = U[m].T @ (W_q[m] @ hn[b, 0, j])                # [dk]
                u_ref[b, 0, j, m] = T_m @ q / np.sqrt(dk)
    np.testing.assert_allclose(u, u_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(log_rms, lr_ref, rtol=1e-5, atol=1e-6)
    f = np.concatenate([u_ref.reshape(B, A, G, -1), np.broadcast_to(lr_ref[:, :, None], (B, A, G, M))], -1)
    pre = f @ np.asarray(reader.fc_in.weight[...]).T + np.asarray(reader.fc_in.bias[...])
    dh_ref = (pre / (1 + np.exp(-pre))) @ np.asarray(reader.fc_out.weight[...]).T
    np.testing.assert_allclose(dh, dh_ref, rtol=1e-4, atol=1e-5)
    assert dv == 16 and dh.shape == (B, A, G, rc.hidden_size)


# ------------------------------------------------------------------------------------------------
# Markov and confidence heads
# ------------------------------------------------------------------------------------------------
def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_markov_heads_match_formulas(kind):
    cfg = dcfg(markov_head_type=kind)
    model = D.create_drafter(cfg)
    mh = model.markov_head
    for lin in (mh.gate_proj, mh.joint_proj):
        if lin is not None:
            lin.bias.set_value(jnp.asarray(rand(3, lin.bias.shape, 0.5)))
    G = cfg.num_draft_tokens
    prev = np.random.default_rng(0).integers(0, 128, (B, G))
    h = rand(1, (B, G, 64))
    graphdef, params = nnx.split(model)

    @jax.jit
    def heads_of(params, prev, h):
        m = nnx.merge(graphdef, params)
        bias, e = m.markov_teacher(prev, h)
        return bias, e, m.confidence_logit(h, e)

    bias, e, logit = heads_of(params, prev, h)
    W1, W2 = np.asarray(mh.markov_w1.weight[...]), np.asarray(mh.markov_w2.weight[...])
    r = cfg.markov_rank
    for b in range(B):
        s = np.zeros(r)
        for k in range(G):
            ek = W1[int(prev[b, k])]
            hk = np.asarray(h[b, k])
            if kind == "vanilla":
                z = ek
            elif kind == "gated":
                z = _sig(np.asarray(mh.gate_proj.weight[...]) @ np.concatenate([hk, ek])
                         + np.asarray(mh.gate_proj.bias[...])) * ek
            else:
                pre = (np.asarray(mh.joint_proj.weight[...]) @ np.concatenate([s, ek, hk])
                       + np.asarray(mh.joint_proj.bias[...]))
                g, c, o = np.split(pre, 3)
                s = _sig(g) * s + (1 - _sig(g)) * np.tanh(c)
                z = np.tanh(o)
            np.testing.assert_allclose(np.asarray(bias[b, k]), W2 @ z, rtol=1e-4, atol=1e-6)
            np.testing.assert_array_equal(np.asarray(e[b, k]), ek)
    # confidence head: sigmoid(w·[h; W1[prev]] + b)
    logit = np.asarray(logit)
    w, cb = np.asarray(model.confidence_head.proj.weight[...])[0], float(model.confidence_head.proj.bias[...][0])
    ref = np.concatenate([np.asarray(h), np.asarray(e)], -1) @ w + cb
    np.testing.assert_allclose(logit, ref, rtol=1e-5, atol=1e-6)


def test_no_markov_head_and_plain_confidence():
    model = D.create_drafter(dcfg(markov_rank=0, confidence_head_with_markov=True))
    assert model.markov_head is None and model.confidence_head.proj.weight.shape == (1, 64)
    bias, e = model.markov_teacher(jnp.zeros((B, 5), jnp.int32), rand(0, (B, 5, 64)))
    assert float(jnp.abs(bias).max()) == 0.0 and e.shape == (B, 5, 0)


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------
def test_checkpoint_round_trip(tmp_path, heads):
    cfg = dcfg(markov_head_type="gated")
    rc = rcfg(position="before_attention", injection_layer=0)
    model = D.create_drafter(cfg, rc, seed=3)
    model.reader.fc_out.weight.set_value(jnp.asarray(rand(1, model.reader.fc_out.weight.shape, 0.1)))
    save_drafter(model, tmp_path / "d", heads=heads)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["logits_start"] == 0
    assert raw["target_layer_ids"] == [0, 2] and raw["dflash_config"]["mask_token_id"] == 127
    for key in ("block_size", "num_target_layers", "markov_rank", "markov_head_type", "enable_confidence_head",
                "confidence_head_with_markov", "num_anchors", "layer_types"):
        assert key in raw
    with safe_open(str(tmp_path / "d" / "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
    for key in ("fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight", "lm_head.weight",
                "layers.1.self_attn.q_proj.weight", "layers.0.self_attn.k_norm.weight",
                "layers.0.mlp.down_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
                "layers.1.post_attention_layernorm.weight",
                "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "markov_head.gate_proj.bias",
                "confidence_head.proj.weight", "confidence_head.proj.bias"):
        assert key in keys, key
    assert not any(k.startswith("reader") for k in keys)
    assert (tmp_path / "d" / "reader" / "reader.safetensors").is_file()
    assert set(json.loads((tmp_path / "d" / "SHA256.json").read_text())) == {
        "config.json", "model.safetensors", "reader/reader.safetensors", "reader/reader_config.json"}

    loaded = load_drafter(tmp_path / "d")
    assert loaded.config == cfg and loaded.reader_config == rc
    want = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    got = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    assert set(got) == set(want)
    for path in want:
        np.testing.assert_array_equal(np.asarray(got[path][...]), np.asarray(want[path][...]))
    assert load_drafter(tmp_path / "d", with_reader=False).reader is None

    # DFlash-style config: the slot convention follows the architecture unless stated
    raw2 = {k: v for k, v in raw.items() if k not in ("logits_start", "sample_from_anchor")}
    assert DrafterConfig.from_hf_dict({**raw2, "architectures": ["DFlashDraftModel"]}).logits_start == 1
    assert DrafterConfig.from_hf_dict({**raw2, "sample_from_anchor": False}).logits_start == 1
    with pytest.raises(ConfigError, match="slot convention"):
        DrafterConfig.from_hf_dict({**raw2, "architectures": ["SomethingElse"]})
    (tmp_path / "d" / "config.json").write_text(json.dumps({**raw2, "architectures": ["DSparkDraftModel"]}))
    assert load_drafter_config(tmp_path / "d")[0].logits_start == 0
    assert load_drafter_config(tmp_path / "d", logits_start=1)[0].logits_start == 1
