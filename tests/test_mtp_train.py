"""`hyspec train-mtp`: the head learns the next-next token on a frozen target, resumes exactly from its orbax
checkpoint, and is written as `mtp.*` tensors that the MTP loader and the `mtp` mode read back.

Corpus: a word-level tokenizer of 24 words; every document follows one fixed successor permutation (with a random
jump one time in ten), so the token after next is mostly the successor of the next — learnable by the head from
(t_{p+1}, h_p), and the same rule holds on the validation documents."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

from hyspec_jax import cli
from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.io.hf import flat_params, load_pretrained, save_pretrained
from hyspec_jax.io.mtp_io import load_mtp
from hyspec_jax.models.target import create_model
from hyspec_jax.sampling import SamplingParams
from hyspec_jax.runtime.engine import Engine, SpecConfig
from hyspec_jax.train.corpus import Document, build_corpus
from hyspec_jax.train.mtp import MTPTrainConfig, MTPTrainer
from hyspec_jax.train.tokenizer_train import EOS

WORDS = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_train")
    vocab = {f"w{i}": i for i in range(WORDS)} | {EOS: WORDS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    rng = np.random.default_rng(0)
    succ = rng.permutation(WORDS)
    docs = {}
    for d in ("a", "b"):
        docs[d] = []
        for j in range(40):
            w = [int(rng.integers(WORDS))]
            for _ in range(40):     # the successor rule, with a random jump one time in ten
                w.append(int(rng.integers(WORDS)) if rng.random() < 0.1 else int(succ[w[-1]]))
            docs[d].append(Document(d, f"{d}{j}", " ".join(f"w{i}" for i in w)))
    build_corpus(root / "corpus", docs=docs, val_fraction=0.15, tokenizer_dir=root / "tok")
    cfg = TargetConfig(model_type="qwen3_5_text", vocab_size=32, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=48,
                       layer_types=(LINEAR, FULL), linear_num_key_heads=1, linear_num_value_heads=2,
                       linear_key_head_dim=8, linear_value_head_dim=8)
    target = create_model(cfg, seed=3)
    # a trained LM head's logits span several nats; the random init's (std 0.02) barely one
    target.lm_head.weight.set_value(30.0 * target.lm_head.weight[...])
    save_pretrained(target, root / "target")
    tok.save(str(root / "target" / "tokenizer.json"))
    return root


def _cfg(root, out, **kw) -> MTPTrainConfig:
    base = dict(target=str(root / "target"), corpus=str(root / "corpus"), out=str(root / out), seq_len=32,
                batch_size=8, steps=40, lr=1e-2, warmup_frac=0.1, eval_every=0, eval_windows=4, ckpt_every=20,
                log_every=5, dtype="float32", progress=False)
    return MTPTrainConfig(**(base | kw))


@pytest.fixture(scope="module")
def trained(setup):
    tr = MTPTrainer(_cfg(setup, "run", eval_every=40))
    summary = tr.run()
    return tr, summary


def test_loss_decreases_and_the_head_learns_the_next_next_token(trained):
    tr, summary = trained
    losses = [summary["losses"][s] for s in sorted(summary["losses"])]
    assert len(losses) == 40
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses
    val = summary["val"]
    assert val and all(v["acc"] > 0.4 for v in val.values()), val          # chance is 1/24
    first = json.loads((tr.out / "metrics.jsonl").read_text().splitlines()[1])   # step-0 evaluation
    assert all(val[d]["loss"] < first["val"][d]["loss"] for d in val)


def test_resume_gives_the_same_next_losses(setup, trained):
    tr, summary = trained
    part = MTPTrainer(_cfg(setup, "resume"))
    part.run(stop_after=20)
    part.ckpt.close()
    again = MTPTrainer(_cfg(setup, "resume"))
    assert again.start_step == 20
    rest = again.run()
    for s in range(20, 40):
        np.testing.assert_allclose(rest["losses"][s], summary["losses"][s], rtol=1e-5, err_msg=str(s))


def test_export_is_read_by_the_mtp_loader_and_mode(setup, trained):
    tr, _ = trained
    model_dir = tr.export()
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == 1
    head = load_mtp(model_dir)
    want = flat_params(tr.head())
    for k, v in flat_params(head).items():
        np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(want[k][...]), err_msg=k)
    tcfg, target = load_pretrained(model_dir)            # the target itself unchanged
    _, orig = load_pretrained(setup / "target")
    for (k, a), (_, b) in zip(nnx.to_flat_state(nnx.state(target, nnx.Param)),
                              nnx.to_flat_state(nnx.state(orig, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 9, 5, 9]]
    params = [SamplingParams(max_tokens=12)] * 2
    ref = [r.token_ids for r in Engine(target).generate(prompts, params)]
    eng = Engine(target, head, SpecConfig(mode="mtp", chain_length=2), slots=2, kv_len=64)
    assert [r.token_ids for r in eng.generate(prompts, params)] == ref


def test_cli_help_and_bad_target(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["train-mtp", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "usage: hyspec train-mtp" in out and "--install-into" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["train-mtp", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert e.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]


def test_teacher_forced_steps_equal_the_drafting_path(setup, trained):
    """Every recursive step `teacher_forced` trains is what drafting computes: at pair p, the cache of the
    committed pairs (`append` of t_0 .. t_p), then `step` at depths 0, 1, 2 fed t_{p+1}, t_{p+2}, t_{p+3} and the
    previous step's g, with the earlier steps' K/V as the node's ancestors."""
    import jax.numpy as jnp
    from hyspec_jax.models.drafter import target_heads
    from hyspec_jax.models.mtp import init_mtp_state
    from hyspec_jax.train.forward import train_forward

    tr, _ = trained
    head = tr.head()
    _, target = load_pretrained(setup / "target")
    embed = target_heads(target).embed
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, WORDS, (2, 12)), jnp.int32)
    _, hidden, _, _ = train_forward(target, tokens, chunk=12)
    steps = 3
    g_tf = head.teacher_forced(embed, tokens, hidden, steps=steps)
    assert g_tf.shape == (steps, 2, 11, hidden.shape[-1])
    for p in (0, 4, 8):
        state = init_mtp_state(head.config, 2, 16)
        state = head.append(state, embed, tokens[:, :p + 1], hidden[:, :p + 1], jnp.full((2,), p + 1, jnp.int32))
        fed = state.hidden[:, None]
        ks, vs = [], []
        for d in range(steps):
            local_k = jnp.concatenate(ks, axis=1) if ks else jnp.zeros((2, 0, *state.keys.shape[3:]))
            local_v = jnp.concatenate(vs, axis=1) if vs else local_k
            g, k, v = head.step(state, embed, tokens[:, p + 1 + d][:, None], fed, d, local_k, local_v,
                                jnp.ones((2, 1, d), bool))
            np.testing.assert_allclose(np.asarray(g[:, 0]), np.asarray(g_tf[d, :, p]), atol=2e-5, err_msg=f"{p} {d}")
            ks.append(k), vs.append(v)
            fed = g


def test_multi_step_distilled_training_runs_and_reports_each_step(setup):
    tr = MTPTrainer(_cfg(setup, "multi", steps=6, draft_steps=3, distill=0.5, step_decay=0.7, eval_every=6, ckpt_every=100))
    summary = tr.run()
    tr.ckpt.close()
    assert all(np.isfinite(v) for v in summary["losses"].values())
    for v in summary["val"].values():
        assert {"loss", "acc", "agree", "agree_1", "agree_2"} <= set(v)
    with pytest.raises(ValueError, match="draft_steps"):
        MTPTrainer(_cfg(setup, "bad", draft_steps=0))
