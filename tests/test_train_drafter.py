"""Drafter training (CPU, fp32): the DSpark objective against a direct numpy evaluation, the ReaDy reader's
per-anchor states against the target's own `extend`, DSpark loss decrease, ReaDy stage 1 (reader only) and
stage 2 (reader + LoRA) updating only what they train, and exported drafters reproducing the trainer's loss."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyspec_jax.io.drafter_io import load_drafter
from hyspec_jax.io.hf import save_pretrained
from hyspec_jax.models.drafter import TrainOutputs
from hyspec_jax.models.target import create_model
from hyspec_jax.state import init_state
from hyspec_jax.train import common
from hyspec_jax.train.corpus import build_corpus
from hyspec_jax.train.drafter import DrafterTrainConfig, DrafterTrainer, drafter_loss
from hyspec_jax.train.forward import train_forward

try:
    from tests.test_train_target import FAST, micro_config, synthetic_docs
except ImportError:
    from test_train_target import FAST, micro_config, synthetic_docs


def test_drafter_loss_matches_numpy():
    rng = np.random.default_rng(0)
    B, A, G, V, T = 2, 3, 4, 11, 9
    logits = rng.normal(size=(B, A, G, V)).astype(np.float32)
    conf = rng.normal(size=(B, A, G)).astype(np.float32)
    labels = rng.integers(0, V, size=(B, A, G))
    anchors = np.array([[1, 4, 6], [0, 2, 7]])
    valid = (anchors[:, :, None] + np.arange(G) + 1) < T
    t_logits = rng.normal(size=(B, T, V)).astype(np.float32)
    out = TrainOutputs(logits=jnp.asarray(logits), base_logits=jnp.asarray(logits), confidence_logits=jnp.asarray(conf),
                       labels=jnp.asarray(labels), label_valid=jnp.asarray(valid))
    loss, m = jax.jit(lambda o, t, a: drafter_loss(o, t, a, ce=0.1, l1=0.9, conf=1.0, decay=4.0))(
        out, jnp.asarray(t_logits), jnp.asarray(anchors))

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    pd = softmax(logits.astype(np.float64))
    idx = np.clip(anchors[:, :, None] + np.arange(G), 0, T - 1)
    pt = softmax(np.take_along_axis(t_logits[:, None], idx[..., None], axis=2).astype(np.float64))
    w = np.exp(-np.arange(G) / 4.0) * valid
    ce = -np.log(np.take_along_axis(pd, labels[..., None], -1)[..., 0])
    l1 = np.abs(pd - pt).sum(-1)
    cstar = np.clip(1 - 0.5 * l1, 0, 1)
    sig = 1 / (1 + np.exp(-conf))
    bce = -(cstar * np.log(sig) + (1 - cstar) * np.log(1 - sig))
    want = (0.1 * (w * ce).sum() + 0.9 * (w * l1).sum() + (w * bce).sum()) / w.sum()
    assert float(loss) == pytest.approx(want, rel=1e-5)
    match = (logits.argmax(-1) == pt.argmax(-1)) & valid
    tau = 1 + np.cumprod(match, -1).sum() / valid[..., 0].sum()
    assert float(m["tau"]) == pytest.approx(tau, rel=1e-6)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter")
    build_corpus(root / "corpus", docs=synthetic_docs(), vocab_size=400, val_fraction=0.15)
    from tokenizers import Tokenizer
    V = Tokenizer.from_file(str(root / "corpus" / "tokenizer" / "tokenizer.json")).get_vocab_size()
    cfg = micro_config(V, 0)
    save_pretrained(create_model(cfg, seed=3), root / "target")
    return root, cfg


def make(root, stage, out, init=None, **kw):
    kw = {"ckpt_every": 100, "devices": 1, **kw}
    cfg = DrafterTrainConfig(target=str(root / "target"), corpus=str(root / "corpus"), out=str(root / out),
                             stage=stage, init=init, num_layers=1, block_size=4, markov_rank=8, seq_len=32,
                             batch_size=4, anchors=3, state_stride=8, steps=20, eval_every=0,
                             dtype="float32", progress=False, compiler_options=FAST,
                             source_layers=(0, 2), **kw)
    return DrafterTrainer(cfg)


def test_reader_states_are_the_committed_states_before_each_anchor(setup):
    root, cfg = setup
    from hyspec_jax.io.hf import load_pretrained
    _, target = load_pretrained(root / "target")
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, size=(2, 24)))
    states = jax.jit(lambda t: train_forward(target, t, chunk=8, state_slots=(0, 2))[3])(tokens)  # [2,3,B,...]
    # the target's serving path: extend over the first a tokens (a prefix mask; row 0 a = 8, row 1 a = 16)
    a = np.array([8, 16])
    ssm = jax.jit(lambda t, v: target.extend(init_state(cfg, 2, 24), t, v)[2].ssm)(
        tokens, jnp.asarray(np.arange(24)[None] < a[:, None]))
    for b in range(2):
        for i, slot in enumerate((0, 2)):
            np.testing.assert_allclose(states[i, a[b] // 8 - 1, b], ssm[slot, b], atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def dspark(setup):
    root, _ = setup
    tr = make(root, "dspark", "dspark")
    tokens = jax.device_put(tr.sampler.batch(0, 4), tr.batch_sh)
    anchors = jax.device_put(tr.anchors_for(0, 4), tr.batch_sh)
    losses = []
    for _ in range(10):
        tr.state, m = tr._train_fn(tr.state, tr.frozen, tokens, anchors, jnp.float32(3e-3))
        losses.append(float(m["loss"]))
    out = tr.export()
    return tr, losses, out


def test_dspark_loss_decreases_and_export_reproduces(dspark):
    tr, losses, out = dspark
    assert losses[-1] < 0.8 * losses[0], losses
    assert tr.cfg.ce_weight == 0.1 and tr.cfg.l1_weight == 0.9 and tr.cfg.conf_weight == 1.0
    loaded = load_drafter(out)
    assert loaded.config == tr.dcfg
    ours = common.to_host(tr.state["train"]["drafter"])
    theirs = common.to_host(nnx.state(loaded, nnx.Param))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_array_equal(a, b)


def test_evaluation_counts_every_window_once_whatever_the_batching(dspark):
    """Validation metrics do not depend on the evaluation batch: every window counts once (none repeated to fill
    a batch), and batches pool by their loss weights and block counts."""
    tr, _, _ = dspark
    sizes = {d: len(w) for d, w in tr.val.items()}
    assert sizes and max(sizes.values()) >= 3, sizes
    cfg = tr.cfg
    try:
        results = []
        for eb in (1, 2, 3):
            tr.cfg = dataclasses.replace(cfg, eval_batch=eb)
            results.append(tr.evaluate())
    finally:
        tr.cfg = cfg
    assert set(results[0]) == set(sizes)
    for d, ref in results[0].items():
        assert ref["windows"] == sizes[d]
        for r in results[1:]:
            assert r[d]["windows"] == sizes[d]
            for k in ("loss", "ce", "l1", "conf", "tau", "acc0"):
                assert r[d][k] == pytest.approx(ref[k], rel=1e-4, abs=2e-5), (d, k)


def test_ready_stages_train_only_reader_and_lora(setup, dspark):
    root, _ = setup
    _, _, dspark_dir = dspark
    s1 = make(root, "ready1", "ready1", init=str(dspark_dir))
    assert s1.cfg.lr == 1e-4 and (s1.cfg.ce_weight, s1.cfg.l1_weight, s1.cfg.conf_weight) == (1.0, 0.1, 0.0)
    assert set(s1.state["train"]) == {"reader"}
    tokens = jax.device_put(s1.sampler.batch(1, 4), s1.batch_sh)
    anchors = jax.device_put(s1.anchors_for(1, 4), s1.batch_sh)
    assert np.all(np.asarray(anchors) % 8 == 0)
    before = common.to_host(s1.state["train"])
    s1.state, m0 = s1._train_fn(s1.state, s1.frozen, tokens, anchors, jnp.float32(1e-2))
    for _ in range(3):
        s1.state, m = s1._train_fn(s1.state, s1.frozen, tokens, anchors, jnp.float32(1e-2))
    after = common.to_host(s1.state["train"])
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))]
    assert any(changed)
    assert float(m["loss"]) < float(m0["loss"])
    r1 = s1.export()
    assert (r1 / "reader" / "reader.safetensors").is_file()

    s2 = make(root, "ready2", "ready2", init=str(r1), lora_rank=2)
    assert set(s2.state["train"]) == {"reader", "lora"} and s2.cfg.lr == 5e-5
    frozen_before = common.to_host(s2.frozen["drafter"])
    for _ in range(3):
        s2.state, m = s2._train_fn(s2.state, s2.frozen, tokens, anchors, jnp.float32(1e-2))
    assert any(np.abs(x).max() > 0 for x in jax.tree.leaves(common.to_host(s2.state["train"]["lora"])))
    for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(common.to_host(s2.frozen["drafter"]))):
        np.testing.assert_array_equal(a, b)
    # the exported drafter = LoRA merged into the frozen weights (W + α/r · B A) + the trained reader, and
    # without the reader exactly the stage-1 weights (DSpark modes of the same directory)
    lora = common.to_host(s2.state["train"]["lora"])
    out2 = s2.export()
    exported = load_drafter(out2)
    assert exported.reader is not None and (out2 / "reader" / "lora.safetensors").is_file()
    plain = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(load_drafter(out2, with_reader=False),
                                                                                nnx.Param))}
    for name, v in nnx.to_flat_state(frozen_before):
        np.testing.assert_array_equal(np.asarray(plain["/".join(map(str, name))][...]), np.asarray(v[...]))
    got = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(exported, nnx.Param))}
    base = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(frozen_before)}
    for name, d in lora.items():
        want = np.asarray(base[name][...]) + (s2.cfg.lora_alpha / d["a"].shape[0]) * d["b"] @ d["a"]
        np.testing.assert_allclose(np.asarray(got[name][...]), want, rtol=1e-5, atol=1e-6)
    assert len(lora) >= 6 and "fc/weight" in lora
    reader = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(s2.state["train"]["reader"])}
    for name, v in reader.items():
        np.testing.assert_array_equal(np.asarray(got[name][...]), np.asarray(v[...]))
    # the control without state: LoRA only, no reader
    s3 = make(root, "ready2", "nostate", init=str(r1), no_state=True)
    assert set(s3.state["train"]) == {"lora"} and s3.rcfg is None


@pytest.fixture(scope="module")
def distill(setup):
    """One distillation set for the module: prompt pack (8 tokens, 2 per domain) + 32 greedy tokens each."""
    root, _ = setup
    from hyspec_jax.train.distill import generate_continuations, sample_prompts
    summary = sample_prompts(root / "corpus", root / "distill" / "prompts.npz", per_domain=2, prompt_len=8, seed=4)
    generate_continuations(root / "target", root / "distill" / "prompts.npz", root / "distill", gen_len=32,
                           batch_size=8, progress=False)
    return root / "distill", summary


def test_distillation_data_is_the_targets_greedy_continuation(setup, distill):
    root, cfg = setup
    from hyspec_jax.io.hf import load_pretrained
    from hyspec_jax.models.target import forward_full
    from hyspec_jax.train.distill import DistillSampler, load_prompts, sample_prompts

    ddir, a = distill
    first = load_prompts(ddir / "prompts.npz")
    sample_prompts(root / "corpus", root / "again.npz", per_domain=2, prompt_len=8, seed=4)
    np.testing.assert_array_equal(first[0], load_prompts(root / "again.npz")[0])      # deterministic
    assert a["prompts"] == 2 * len(a["domains"]) and first[0].shape == (a["prompts"], 8)
    manifest = json.loads((ddir / "manifest.json").read_text())
    seqs = np.load(ddir / "sequences.npy").astype(np.int32)
    assert seqs.shape == (a["prompts"], 40) and manifest["sequences"] == a["prompts"]
    np.testing.assert_array_equal(seqs[:, :8], first[0])
    # every generated token is the argmax of one no-cache forward over the sequence (an independent path)
    _, target = load_pretrained(root / "target")
    logits = forward_full(*nnx.split(target), jnp.asarray(seqs))
    np.testing.assert_array_equal(np.argmax(np.asarray(logits[:, 7:-1]), -1), seqs[:, 8:])
    s = DistillSampler(ddir, 12, seed=0)
    b = s.batch(3, 5)
    assert b.shape == (5, 12) and np.array_equal(b, s.batch(3, 5))
    assert all(any(np.array_equal(r, q[o:o + 12]) for q in seqs for o in range(29)) for r in b)


def test_a_prompt_pack_can_be_disjoint_from_another(setup, tmp_path):
    """--exclude-prompts: no window of the new pack overlaps one of the excluded pack (same seed, so without it
    the packs would be equal); every window is its shard's tokens at its start; a pack without starts is refused."""
    root, _ = setup
    from hyspec_jax.train.cli_train import main
    from hyspec_jax.train.corpus import load_shard
    from hyspec_jax.train.distill import sample_prompts

    a, b = tmp_path / "a" / "prompts.npz", tmp_path / "b" / "prompts.npz"
    sample_prompts(root / "corpus", a, per_domain=6, prompt_len=8, seed=4)
    assert main(["build-distill", "--corpus", str(root / "corpus"), "--out", str(b.parent), "--prompts-only",
                 "--per-domain", "6", "--prompt-len", "8", "--seed", "4", "--exclude-prompts", str(a)]) == 0
    za, zb = np.load(a), np.load(b)
    assert zb["tokens"].shape == za["tokens"].shape
    for di, d in enumerate(str(x) for x in zb["domains"]):
        shard = np.asarray(load_shard(root / "corpus", "train", d))
        old, new = za["starts"][za["domain"] == di], zb["starts"][zb["domain"] == di]
        assert all(abs(int(x) - int(e)) >= 8 for x in new for e in old)          # windows of 8 never overlap
        for x, row in zip(new, zb["tokens"][zb["domain"] == di]):
            np.testing.assert_array_equal(row, shard[x:x + 8])
    legacy = tmp_path / "legacy.npz"
    np.savez(legacy, tokens=za["tokens"], domain=za["domain"], domains=za["domains"])
    with pytest.raises(ValueError, match="no window starts"):
        sample_prompts(root / "corpus", tmp_path / "c.npz", per_domain=6, prompt_len=8, exclude=legacy)


def test_drafter_on_distill_data_resumes_exactly(setup, distill):
    """Steps 3-4 after a restart from the step-2 checkpoint equal steps 3-4 of the uninterrupted run."""
    root, _ = setup
    ddir, _ = distill
    import shutil
    first = make(root, "dspark", "resume", data=str(ddir), ckpt_every=2)
    first.run(stop_after=2)                                      # saves step 2 (synchronously)
    shutil.copytree(root / "resume", root / "killed")            # the run as it was when killed
    straight = first.run(stop_after=4)["losses"]                 # the same process carries on
    resumed = make(root, "dspark", "killed", data=str(ddir), ckpt_every=2)
    assert resumed.start_step == 2
    again = resumed.run(stop_after=4)["losses"]
    np.testing.assert_allclose([again[2], again[3]], [straight[2], straight[3]], rtol=1e-6)


def test_dspark_on_four_fake_devices_matches_one(setup):
    """Data parallel over the mesh (conftest forces 4 CPU devices): the same losses as one device."""
    root, _ = setup
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 (fake) devices")
    one = make(root, "dspark", "mesh1", devices=1).run(stop_after=3)["losses"]
    four = make(root, "dspark", "mesh4", devices=4).run(stop_after=3)["losses"]
    np.testing.assert_allclose([four[s] for s in range(3)], [one[s] for s in range(3)], rtol=2e-5)


def test_distillation_variants_fork_then_follow_the_target(setup, distill):
    """Variant 1 samples its first tokens, then every token is the target's argmax (no-cache forward); slices
    built apart and merged equal the set built at once."""
    root, _ = setup
    from hyspec_jax.io.hf import load_pretrained
    from hyspec_jax.models.target import forward_full
    from hyspec_jax.train.distill import generate_continuations, merge_distill

    ddir, _ = distill
    both = root / "variants"
    kw = dict(gen_len=16, batch_size=8, sample_prefix=3, progress=False)
    m = generate_continuations(root / "target", ddir / "prompts.npz", both, variants=2, **kw)
    seqs = np.load(both / "sequences.npy").astype(np.int32)
    n = seqs.shape[0] // 2
    assert m["variants"] == [0, 1] and seqs.shape == (2 * n, 24)
    np.testing.assert_array_equal(seqs[:n, :8], seqs[n:, :8])                        # same prompts
    plain = np.load(ddir / "sequences.npy").astype(np.int32)[:, :24]
    np.testing.assert_array_equal(seqs[:n], plain)                                  # variant 0 = plain greedy
    assert (seqs[n:, 8:11] != seqs[:n, 8:11]).any()                                 # the forks differ
    _, target = load_pretrained(root / "target")
    logits = np.asarray(forward_full(*nnx.split(target), jnp.asarray(seqs[n:])))
    np.testing.assert_array_equal(np.argmax(logits[:, 10:-1], -1), seqs[n:, 11:])    # greedy after the fork
    a = generate_continuations(root / "target", ddir / "prompts.npz", root / "v0", **kw)
    b = generate_continuations(root / "target", ddir / "prompts.npz", root / "v1", first_variant=1, **kw)
    assert a["variants"] == [0] and b["variants"] == [1]
    merged = merge_distill([root / "v0", root / "v1"], root / "merged")
    np.testing.assert_array_equal(np.load(root / "merged" / "sequences.npy"), seqs)
    np.testing.assert_array_equal(np.load(root / "merged" / "domains.npy"), np.load(both / "domains.npy"))
    assert merged["sequences"] == 2 * n and merged["variants"] == [0, 1]
    with pytest.raises(ValueError, match="variants repeat"):
        merge_distill([root / "v0", root / "v0"], root / "bad")
