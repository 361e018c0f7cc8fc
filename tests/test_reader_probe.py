"""`hyspec bench reader-probe` (bench/reader_probe.py) on a tiny random target + drafter with a non-zero reader (CPU):
the ridge fit against a known linear map, the clustered standard error, prefix binning, the swapped-state control,
the state / query assembly against the target's own GDN recurrence, and τ̂ against the trainer's evaluation."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyspec_jax import gdn
from hyspec_jax.bench import reader_probe as R
from hyspec_jax.config import DrafterConfig
from hyspec_jax.io.drafter_io import save_drafter
from hyspec_jax.io.hf import save_pretrained
from hyspec_jax.models.drafter import create_drafter, forward_train
from hyspec_jax.models.reader import ReaderConfig
from hyspec_jax.models.target import create_model
from hyspec_jax.train import common
from hyspec_jax.train.corpus import build_corpus
from hyspec_jax.train.forward import train_forward

try:
    from tests.test_train_target import FAST, micro_config, synthetic_docs
except ImportError:
    from test_train_target import FAST, micro_config, synthetic_docs

pytestmark = pytest.mark.usefixtures("quick_compiles")
T, STRIDE = 32, 8


# ------------------------------------------------------------------------------------------------
# Statistics and binning (no model)
# ------------------------------------------------------------------------------------------------
def test_ridge_recovers_a_known_linear_map():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3000, 12)).astype(np.float32) * rng.uniform(0.1, 5, 12).astype(np.float32) + 3
    w = rng.normal(size=(12, 5)).astype(np.float32)
    y = x @ w + np.float32(1.5) + 0.01 * rng.normal(size=(3000, 5)).astype(np.float32)
    held = np.arange(3000) % 4 == 0
    r = R.ridge_select(x, y, held, (1e-6, 1e-1, 10.0))
    assert r.lam == 1e-6                        # almost noise-free: the least penalty wins on the held-out rows
    xt = rng.normal(size=(200, 12)).astype(np.float32) * 2 + 3
    np.testing.assert_allclose(r.predict(xt), xt @ w + 1.5, atol=0.02)
    # a strong penalty shrinks towards the mean
    big = R.ridge_fit(x, y, 100.0)
    assert np.abs(big.predict(xt) - y.mean(0)).max() < np.abs(r.predict(xt) - y.mean(0)).max()


def test_clustered_standard_error():
    rng = np.random.default_rng(1)
    v = rng.normal(size=50)
    m, se = R.cluster_mean(v, np.arange(50))          # one value a cluster: the textbook SE
    assert m == pytest.approx(v.mean()) and se == pytest.approx(v.std(ddof=1) / np.sqrt(50))
    # every value twice in its own cluster: the same mean and (independent units = clusters) the same SE
    m2, se2 = R.cluster_mean(np.repeat(v, 2), np.repeat(np.arange(50), 2))
    assert m2 == pytest.approx(m) and se2 == pytest.approx(se)
    assert np.isnan(R.cluster_mean(v, np.zeros(50))[1])


def test_binning_counts_every_anchor_once():
    bins = (32, 128, 256, 448)
    anchors = R.anchors_for(512, 8)
    assert anchors[0] == 8 and anchors[-1] == 504 and np.all(anchors % 8 == 0)
    b = R.bin_of(anchors, bins)
    labels = R.bin_labels(bins)
    assert labels == ["<32", "32-127", "128-255", "256-447", "448+"]
    edges = (0, *bins, 10**9)
    for a, i in zip(anchors, b):
        assert edges[i] <= a < edges[i + 1]
    assert np.bincount(b, minlength=5).tolist() == [3, 12, 16, 24, 8]
    # the τ̂ table: each block in exactly one bin, "all" their sum
    W = 3
    rng = np.random.default_rng(2)
    data = {f"{k}_{v}": rng.uniform(1, 3, (W, anchors.size)) for k in ("tau", "acc0") for v in R.VARIANTS}
    data.update(anchors=anchors, domain=np.array(["a", "a", "b"]))
    rep = R.tau_report(data, bins)
    for d, n_w in (("a", 2), ("b", 1), ("pooled", 3)):
        per = rep[d]
        assert sum(per[lab]["blocks"] for lab in labels) == per["all"]["blocks"] == n_w * anchors.size
    assert rep["pooled"]["all"]["dspark"] == pytest.approx(data["tau_dspark"].mean(), abs=1e-5)


# ------------------------------------------------------------------------------------------------
# A tiny target + drafter with a non-zero reader
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("reader_probe")
    build_corpus(root / "corpus", docs=synthetic_docs(), vocab_size=400, val_fraction=0.15)
    from tokenizers import Tokenizer
    V = Tokenizer.from_file(str(root / "corpus" / "tokenizer" / "tokenizer.json")).get_vocab_size()
    tcfg = micro_config(V, 0)                                       # layers: GDN 0, 1, 2, attention 3
    save_pretrained(create_model(tcfg, seed=3), root / "target")
    dcfg = DrafterConfig.from_target(tcfg, num_layers=1, block_size=4, markov_rank=8, target_layer_ids=(0, 2))
    rcfg = ReaderConfig.for_target(tcfg, hidden_size=dcfg.hidden_size, source_layers=(1, 2), rank=4)
    drafter = create_drafter(dcfg, rcfg, seed=5)
    w = drafter.reader.fc_out.weight                                # untrained readers are exactly DSpark
    w.set_value(jax.random.normal(jax.random.key(7), w[...].shape) * 0.5)
    save_drafter(drafter, root / "drafter")
    m = R.load_models(root / "target", root / "drafter")
    assert m.probe_layers == (1, 2)                                  # sources 1, 2; untapped GDN layer 1
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, V, size=(3, T)), jnp.int32)
    anchors = jnp.asarray(np.broadcast_to(R.anchors_for(T, STRIDE), (3, 3)))
    return root, m, tokens, anchors


def _target(m):
    from flax import nnx
    return nnx.merge(m.t_graphdef, m.t_params)


def test_swapped_states_are_another_windows_and_change_the_drafts(tiny):
    _, m, tokens, anchors = tiny
    target = _target(m)
    taps, states = train_forward(target, tokens, tap_layers=m.dcfg.target_layer_ids, chunk=STRIDE,
                                 state_slots=m.rcfg.source_slots)[2:]
    own = R.states_before(states, anchors, STRIDE)
    swapped = R.states_before(states, anchors, STRIDE, roll=1)
    for b in range(3):
        np.testing.assert_array_equal(np.asarray(swapped[b]), np.asarray(own[(b - 1) % 3]))
        for i, a in enumerate(np.asarray(anchors[b])):           # the state after tokens 0 .. a − 1, per layer
            for s in range(len(m.rcfg.source_slots)):
                hv = m.rcfg.num_heads
                np.testing.assert_array_equal(np.asarray(own[b, i, s * hv:(s + 1) * hv]),
                                              np.asarray(states[s, a // STRIDE - 1, b]))
    assert not np.allclose(np.asarray(own), np.asarray(swapped))
    # the drafter's hidden the ridge reads is the one forward_train turns into its base logits
    gd, pd = m.dspark
    h = R.dspark_hidden(gd, pd, m.heads, taps, tokens, anchors)
    np.testing.assert_allclose(np.asarray(m.heads.logits(h)), np.asarray(
        forward_train(gd, pd, m.heads, taps, tokens, anchors).base_logits), atol=1e-5)
    g, p = m.ready
    run = lambda st: forward_train(g, p, m.heads, taps, tokens, anchors, reader_states=st).logits
    assert np.abs(np.asarray(run(own)) - np.asarray(run(swapped))).max() > 1e-3


def test_query_and_state_readout_are_the_targets_own(tiny):
    """The (q, k, v, g, β) the probe extracts step the committed state at one chunk boundary to the next one
    `train_forward` returns; each Sᵀq feature is that state after a − 1 read by the true query at a − 1 + j
    (the swapped one: another window's state, the same query)."""
    _, m, tokens, anchors = tiny
    target = _target(m)
    slots = tuple(m.tcfg.layer_slot(L) for L in m.probe_layers)
    taps_l = tuple(L - 1 for L in m.probe_layers)
    _, _, taps, states = train_forward(target, tokens, tap_layers=taps_l, chunk=STRIDE, state_slots=slots)
    fn = R.make_pass(m, STRIDE, 2)
    out = jax.device_get(fn(m.t_params, m.dspark[1], m.ready[1], m.heads, tokens, anchors))
    assert out["sq"].shape == (len(m.probe_layers), 2, 3, 3, 2, m.tcfg.linear_num_value_heads *
                               m.tcfg.linear_value_head_dim)
    for p, L in enumerate(m.probe_layers):
        q, k, v, g, beta = R.gdn_inputs(target, L, taps[p], jnp.ones(tokens.shape, bool))
        c = 1                                                    # chunk 1 -> chunk 2 by the serial recurrence
        sl = slice((c + 1) * STRIDE, (c + 2) * STRIDE)
        _, S = gdn.serial_recurrence(states[p, c], q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl])
        np.testing.assert_allclose(np.asarray(S), np.asarray(states[p, c + 1]), atol=2e-5, rtol=1e-4)
        q0, _, _, g0, b0 = R.gdn_inputs(target, L, taps[p], jnp.zeros(tokens.shape, bool))
        assert not np.any(np.asarray(g0)) and not np.any(np.asarray(b0))
        np.testing.assert_array_equal(np.asarray(q0), np.asarray(q))
        for b in range(3):
            for i, a in enumerate(np.asarray(anchors[b])):
                for j in (1, 2):
                    for swap in (0, 1):
                        S_a = np.asarray(states[p, a // STRIDE - 1, (b - swap) % 3], np.float64)
                        want = np.einsum("hkv,hk->hv", S_a, np.asarray(q[b, a - 1 + j], np.float64)).reshape(-1)
                        np.testing.assert_allclose(out["sq"][p, swap, b, i, j - 1], want, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(out["q"][p], np.asarray(q[np.arange(3)[:, None, None], np.asarray(
            anchors)[:, :, None] - 1 + np.arange(1, 3)]).reshape(3, 3, 2, -1), atol=1e-6)
    # the second pass's readout with the true queries is the first pass's
    qs = jnp.asarray(out["q"]).reshape(out["q"].shape[:4] + (m.tcfg.linear_num_value_heads, -1))
    again = R.make_readout(m, STRIDE, m.probe_layers)(m.t_params, tokens, anchors, qs)
    np.testing.assert_allclose(np.asarray(again), out["sq"], atol=1e-6, rtol=1e-5)
    # the targets: the final-norm hidden and the argmax at a − 1 + j
    logits, hidden = train_forward(target, tokens)[:2]
    a0 = int(anchors[0, 0])
    np.testing.assert_allclose(out["y_hidden"][0, 0, 1], np.asarray(hidden[0, a0 + 1]), atol=1e-5)
    assert out["y_top"][0, 0, 0] == int(jnp.argmax(logits[0, a0]))


def test_own_state_tau_is_the_trainers_evaluation(tiny):
    from hyspec_jax.train.drafter import DrafterTrainConfig, DrafterTrainer
    root, m, tokens, anchors = tiny
    fn = R.make_pass(m, STRIDE, 1)
    out = jax.device_get(fn(m.t_params, m.dspark[1], m.ready[1], m.heads, tokens, anchors))
    for no_state, key in ((False, "tau_ready"), (True, "tau_dspark")):
        tr = DrafterTrainer(DrafterTrainConfig(
            target=str(root / "target"), corpus=str(root / "corpus"), out=str(root / f"tr{int(no_state)}"),
            stage="ready2", init=str(root / "drafter"), no_state=no_state, seq_len=T, state_stride=STRIDE,
            batch_size=3, devices=1, dtype="float32", progress=False, compiler_options=FAST))
        mt = tr._eval_fn(tr.state["train"], tr.frozen, common.batch_from_host(np.asarray(tokens), tr.batch_sh),
                         common.batch_from_host(np.asarray(anchors), tr.batch_sh))
        assert float(mt["tau"]) == pytest.approx(float(np.mean(out[key])), abs=1e-5)


def test_command_writes_its_json_and_table(tiny, tmp_path, capsys):
    root, *_ = tiny
    out = tmp_path / "probe.json"
    rc = R.main(["--json", str(out), "--model", str(root / "target"), "--drafter", str(root / "drafter"),
                 "--corpus", str(root / "corpus"), "--seq-len", str(T), "--windows", "4", "--batch", "2",
                 "--bins", "16", "--horizons", "2", "--lambdas", "0.1", "1", "--quiet"])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["tau"]["pooled"]["all"]["blocks"] == sum(rep["windows"].values()) * 3
    assert set(rep["tau"]["pooled"]) == {"<16", "16+", "all"}
    assert set(rep["ridge"]["horizons"]) == {"1", "2"}
    sets = rep["ridge"]["horizons"]["1"]
    assert {"taps", "draft", "taps +Sq[1,2]", "draft +Sq[1,2] swapped", "draft +Sq[1]",
            "draft +Sq[2] swapped", "draft +Sq̂[1,2]", "draft +Sq̂[1,2] swapped"} <= set(sets)
    assert all(0 <= r["bins"]["all"]["top1"] <= 1 for r in sets.values())
    own = sets["draft +Sq[1]"]["bins"]["all"]
    assert "gain_vs_base" in own and "gain_vs_swapped" in own and "gain_vs_base" not in sets["draft"]["bins"]["all"]
    assert out.with_suffix(".md").read_text().startswith("# ReaDy reader probe")
    # other base taps: the states also read by a query predicted from those taps, each probed layer alone too
    assert R.main(["--json", str(out), "--model", str(root / "target"), "--drafter", str(root / "drafter"),
                   "--corpus", str(root / "corpus"), "--seq-len", str(T), "--windows", "4", "--batch", "2",
                   "--bins", "16", "--horizons", "1", "--lambdas", "1", "--base-taps", "0", "1", "--quiet"]) == 0
    sets = json.loads(out.read_text())["ridge"]["horizons"]["1"]
    assert {"taps +Sq[2]", "taps +Sq̂[1,2]", "taps +Sq̂[2]", "taps +Sq̂[1] swapped"} <= set(sets)
    assert "gain_vs_swapped" in sets["taps +Sq̂[2]"]["bins"]["all"]
    capsys.readouterr()
    assert R.main(["--json", str(out), "--model", str(root / "nope")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")


def test_base_taps_choose_the_layers_of_the_taps_features(tiny):
    """--base-taps (the positive control's geometry: taps that leave a GDN layer untapped): the `taps` features are
    those layers' outputs at t = a − 1 and token a's embedding, and each probed layer is also read alone on them."""
    import dataclasses
    root, m, tokens, anchors = tiny
    m2 = dataclasses.replace(m, base_taps=(0, 1))
    out = jax.device_get(R.make_pass(m2, STRIDE, 1)(m2.t_params, m2.dspark[1], m2.ready[1], m2.heads, tokens,
                                                     anchors))
    taps = train_forward(_target(m2), tokens, tap_layers=(0, 1), chunk=STRIDE)[2]
    for b in range(3):
        for i, a in enumerate(np.asarray(anchors[b])):
            want = np.concatenate([np.asarray(taps[0, b, a - 1]), np.asarray(taps[1, b, a - 1]),
                                   np.asarray(m2.heads.embed_tokens(tokens[b, a]))])
            np.testing.assert_allclose(out["base"][b, i], want, atol=1e-6)
    assert {"taps +Sq[1]", "taps +Sq[2] swapped", "taps +Sq̂[1,2]", "taps +Sq̂[2] swapped"} <= set(R.feature_sets(m2))
    assert "taps +Sq[1]" not in R.feature_sets(m)                  # the drafter's own taps: as before
    assert R.load_models(root / "target", root / "drafter", base_taps=(0, 1)).base_taps == (0, 1)
    with pytest.raises(ValueError, match="base taps"):
        R.load_models(root / "target", root / "drafter", base_taps=(9,))
