"""Training: corpus split, tokenizer, target pretraining on a device mesh (1 vs 4 fake devices), exact resume,
loss decrease, and the exported checkpoint against `transformers` (CPU, fp32, a synthetic corpus: CI does not
have the Debian packages)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.train import common
from hyspec_jax.train.corpus import Document, assign_splits, build_corpus, load_shard, split_hash
from hyspec_jax.train.forward import train_forward
from hyspec_jax.train.target import TargetTrainConfig, TargetTrainer

WORDS = ("the of and to in is that for it as with was on be by at this are from or have an they which one you "
         "were her all she there would their we him been has when who will more no if out so said what up its "
         "about into than them can only other new some could time these two may then do first any my now such "
         "like our over man me even most made after also did many before must through back years where much "
         "def return class import self None True False print lambda yield").split()


def synthetic_docs(seed: int = 0, per_domain: int = 40) -> dict[str, list[Document]]:
    rng = random.Random(seed)
    out = {}
    for dom in ("prose", "verse", "code"):
        docs = []
        for i in range(per_domain):
            words = [rng.choice(WORDS) for _ in range(rng.randint(20, 80))]
            sep = "\n" if dom == "verse" else " "
            docs.append(Document(dom, f"{dom}/{i}", sep.join(words) + ".\n"))
        out[dom] = docs
    return out


FAST = {"xla_backend_optimization_level": 0}   # halves CPU compile time; same numerics path for 1 and 4 devices


def micro_config(vocab: int, eos: int) -> TargetConfig:
    return TargetConfig(
        model_type="qwen3_5_text", vocab_size=vocab, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, layer_types=(LINEAR, LINEAR, LINEAR, FULL),
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        tie_word_embeddings=True, eos_token_id=(eos,))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    manifest = build_corpus(out, docs=synthetic_docs(), vocab_size=400, val_fraction=0.15)
    return out, manifest


# ------------------------------------------------------------------------------------------------
# Corpus and tokenizer
# ------------------------------------------------------------------------------------------------
def test_split_is_deterministic_and_order_free():
    docs = [d for ds in synthetic_docs(per_domain=200).values() for d in ds]
    a = assign_splits(docs, 0.1)
    shuffled = docs[:]
    random.Random(1).shuffle(shuffled)
    assert assign_splits(shuffled, 0.1) == a
    assert a != assign_splits(docs, 0.1, salt="another salt")
    for dom in ("prose", "verse", "code"):
        frac = np.mean([a[(dom, d.doc_id)] == "validation" for d in docs if d.domain == dom])
        assert 0.03 < frac < 0.2, (dom, frac)
    # a document's split depends on its id alone: adding documents never moves existing ones
    more = docs + [Document("prose", f"extra/{i}", "x") for i in range(50)]
    b = assign_splits(more, 0.1)
    assert all(b[k] == v for k, v in a.items())
    assert split_hash("prose", "prose/0") == split_hash("prose", "prose/0")


def test_split_keeps_both_sides_per_domain():
    docs = [Document("tiny", f"d{i}", "text") for i in range(3)]
    s = assign_splits(docs, 0.01)
    assert sorted(s.values()) == ["train", "train", "validation"]
    s = assign_splits(docs, 0.99)
    assert sorted(s.values()) == ["train", "validation", "validation"]


def test_corpus_build_reproducible(corpus, tmp_path):
    out, manifest = corpus
    again = build_corpus(tmp_path / "again", docs=synthetic_docs(), vocab_size=400, val_fraction=0.15)
    assert (tmp_path / "again" / "documents.tsv").read_text() == (out / "documents.tsv").read_text()
    assert again["tokenizer_sha256"] == manifest["tokenizer_sha256"]
    for dom in ("prose", "verse", "code"):
        for split in ("train", "validation"):
            np.testing.assert_array_equal(load_shard(out, split, dom), load_shard(tmp_path / "again", split, dom))
    rows = [line.split("\t") for line in (out / "documents.tsv").read_text().splitlines()[1:]]
    val_docs = {r[1] for r in rows if r[2] == "validation"}
    assert manifest["totals"]["validation_docs"] == len(val_docs) > 0
    # shards hold exactly the documents of their split, each followed by <|endoftext|> (id 0)
    for dom in ("prose", "verse", "code"):
        n_val = sum(1 for r in rows if r[0] == dom and r[2] == "validation")
        assert int(np.sum(np.asarray(load_shard(out, "validation", dom)) == 0)) == n_val


def test_a_corpus_tokenized_with_another_tokenizer_finds_it_through_its_manifest(corpus, tmp_path, monkeypatch):
    """A corpus built with --tokenizer DIR has no tokenizer/ of its own (the embedded model's corpus): trainers use
    the one its manifest names, relative to the working directory, and refuse one whose bytes changed."""
    import shutil
    from hyspec_jax.train.corpus import CorpusError, corpus_tokenizer_dir
    out, _ = corpus
    assert corpus_tokenizer_dir(out) == out / "tokenizer"
    shutil.copytree(out / "tokenizer", tmp_path / "tok")
    monkeypatch.chdir(tmp_path)
    build_corpus(tmp_path / "c2", docs=synthetic_docs(), vocab_size=400, val_fraction=0.15, tokenizer_dir="tok")
    assert not (tmp_path / "c2" / "tokenizer").exists()
    assert corpus_tokenizer_dir(tmp_path / "c2") == Path("tok")
    p = tmp_path / "tok" / "tokenizer.json"
    p.write_text(p.read_text().replace('"<|mask|>"', '"<|masq|>"'))
    with pytest.raises(CorpusError, match="sha256"):
        corpus_tokenizer_dir(tmp_path / "c2")
    p.unlink()
    with pytest.raises(CorpusError, match="not there"):
        corpus_tokenizer_dir(tmp_path / "c2")


def test_tokenizer_specials_and_chat_template(corpus):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from hyspec_jax.train.tokenizer_train import apply_chat_template
    out, manifest = corpus
    tok = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    V = tok.get_vocab_size()
    assert manifest["vocab_size"] == V
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tok.token_to_id("<|mask|>") == V - 1
    text = "def f(x):\n    return x  # naïve\n"
    assert tok.decode(tok.encode(text).ids) == text
    hf = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello."}]
    rendered = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == apply_chat_template(msgs)
    ids = tok.encode(rendered).ids
    assert ids.count(1) == 3 and ids.count(2) == 2
    assert hf.eos_token_id == 0


# ------------------------------------------------------------------------------------------------
# Target training
# ------------------------------------------------------------------------------------------------
def make_trainer(corpus_dir, out, devices: int) -> TargetTrainer:
    from tokenizers import Tokenizer
    V = Tokenizer.from_file(str(corpus_dir / "tokenizer" / "tokenizer.json")).get_vocab_size()
    cfg = TargetTrainConfig(corpus=str(corpus_dir), out=str(out), seq_len=16, batch_size=8, steps=40, lr=1e-2,
                            warmup_steps=2, eval_every=0, ckpt_every=100, log_every=1, eval_windows=2, eval_batch=4,
                            dtype="float32", devices=devices, chunk=8, progress=False, compiler_options=FAST)
    return TargetTrainer(cfg, micro_config(V, 0))


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """Reference: 4 uninterrupted steps on 1 device; the same on 4 devices (FSDP); and 2 steps, a 'kill',
    then a fresh trainer resuming from the checkpoint for 2 more."""
    corpus_dir, _ = corpus
    ref = make_trainer(corpus_dir, tmp_path_factory.mktemp("ref"), 1)
    ref_losses = ref.run(stop_after=4)["losses"]
    mesh4 = make_trainer(corpus_dir, tmp_path_factory.mktemp("mesh4"), 4)
    mesh4_losses = mesh4.run(stop_after=4)["losses"]
    out = tmp_path_factory.mktemp("killed")
    first = make_trainer(corpus_dir, out, 1)
    first_losses = first.run(stop_after=2)["losses"]
    first.ckpt.close()
    del first
    resumed = make_trainer(corpus_dir, out, 1)
    start = resumed.start_step
    resumed_losses = resumed.run(stop_after=4)["losses"]
    return dict(ref=ref, ref_losses=ref_losses, mesh4=mesh4, mesh4_losses=mesh4_losses, first_losses=first_losses,
                resumed_start=start, resumed_losses=resumed_losses, killed_out=out)


def test_four_devices_same_losses_as_one(runs):
    ref, m4 = runs["ref_losses"], runs["mesh4_losses"]
    assert sorted(ref) == sorted(m4) == [0, 1, 2, 3]
    np.testing.assert_allclose([m4[i] for i in range(4)], [ref[i] for i in range(4)], rtol=2e-5)
    # the parameters really are sharded over the mesh (FSDP), not replicated
    leaves = jax.tree.leaves(runs["mesh4"].state["params"])
    sharded = [x for x in leaves if len({str(s.index) for s in x.addressable_shards}) == 4]
    assert len(sharded) >= 1, [x.sharding for x in leaves]   # the micro model's embedding (others < 4096)
    p1 = common.to_host(runs["ref"].state["params"])
    p4 = common.to_host(runs["mesh4"].state["params"])
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_resume_gives_the_same_next_losses(runs):
    assert runs["resumed_start"] == 2
    assert runs["first_losses"] == {0: runs["ref_losses"][0], 1: runs["ref_losses"][1]}
    assert sorted(runs["resumed_losses"]) == [2, 3]
    for s in (2, 3):
        assert runs["resumed_losses"][s] == pytest.approx(runs["ref_losses"][s], rel=1e-6)
    lines = common.read_metrics(runs["killed_out"] / "metrics.jsonl")
    assert [x["event"] for x in lines if "event" in x] == ["start", "resume"]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3, 4]


def test_loss_decreases_on_a_fixed_batch(runs):
    tr = runs["ref"]
    batch = tr.batch(123)
    state = jax.tree.map(jnp.copy, tr.state)
    losses = []
    for _ in range(12):
        state, m = tr.train_step(state, batch, 5)
        losses.append(float(m["loss"]))
    assert losses[-1] < 0.7 * losses[0], losses


def test_export_loads_in_transformers_with_same_logits(runs, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from hyspec_jax.io.hf import load_pretrained

    tr = runs["ref"]
    tr.cfg.export_dtype = "float32"
    tr.cfg.export_shard_mb = 0.02   # force several shards + index
    out = tr.export(tmp_path / "hf")
    assert (out / "model.safetensors.index.json").is_file()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [0, 2]
    cfg, model = load_pretrained(out)
    assert cfg == tr.model_cfg
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(tr.state["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = np.asarray(tr.batch(7))[:2, :16]
    ours = np.asarray(jax.jit(lambda t: train_forward(model, t, chunk=8)[0])(jnp.asarray(tokens)))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=1e-4)
    # validation per domain: finite losses on every validation domain
    val = tr.evaluate()
    assert sorted(val) == ["code", "prose", "verse"]
    assert all(np.isfinite(v["loss"]) and v["tokens"] > 0 for v in val.values())


def test_step_clock_fixes_total_steps_once_from_the_measured_rate_and_stops_past_the_budget(tmp_path, monkeypatch):
    """The time budget every recipe uses: the first flush (compilation) only marks the time; the first flush at least
    `calibrate_after` steps later fixes total steps from the measured s/step; 5% past the budget the run stops."""
    now = [100.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    log = common.MetricsLog(tmp_path / "m.jsonl", total=1000, progress=False)
    clock = common.StepClock(10.0, tokens_per_step=64, resumed=False, calibrate_after=10)
    now[0] = 105.0                                            # step 1 after 5 s of compilation
    assert clock.flush(1, 1000, 1000, log) == 1000 and clock.throughput is None
    now[0] = 106.0                                            # 10 more steps in 1 s: 0.1 s a step, 4 s left
    assert clock.flush(11, 1000, 1000, log) == 11 + 40
    assert clock.throughput == pytest.approx(640.0) and not clock.budget_hit
    now[0] = 108.0
    assert clock.flush(31, 51, 1000, log) == 51                # fixed once
    now[0] = 110.4
    clock.flush(51, 51, 1000, log)
    assert not clock.budget_hit                               # within the 5% grace
    now[0] = 110.6
    clock.flush(52, 51, 1000, log)
    assert clock.budget_hit
    log.close()
    events = [r for r in common.read_metrics(tmp_path / "m.jsonl") if r.get("event") == "total_steps"]
    assert [(e["step"], e["total_steps"]) for e in events] == [(11, 51)]
    now[0] = 200.0
    capped = common.StepClock(10.0, 64, resumed=False, calibrate_after=10)      # capped by --steps
    capped.flush(1, 30, 30, log := common.MetricsLog(tmp_path / "n.jsonl", total=30, progress=False))
    now[0] = 201.0
    assert capped.flush(11, 30, 30, log) == 30
    resumed = common.StepClock(10.0, 64, resumed=True)        # a resumed run keeps its total
    resumed.flush(1, 77, 1000, log)
    now[0] = 202.0
    assert resumed.flush(20, 77, 1000, log) == 77
    log.close()


def test_train_steps_logs_checkpoints_evaluates_and_stops_at_the_budget(tmp_path, monkeypatch):
    """The step loop both trainers share (common.train_steps), with a fake trainer and a fake clock: metrics read
    back at the flushes only (first step, every log_every, the last), checkpoints every ckpt_every and where it
    stops, evaluation every eval_every and once at the end; past the budget it checkpoints, evaluates once,
    logs the event and stops."""
    import dataclasses

    @dataclasses.dataclass
    class Cfg:
        steps: int = 12
        log_every: int = 4
        ckpt_every: int = 5
        eval_every: int = 6

    class Fake:
        def __init__(self, total):
            self.start_step, self.total_steps, self.saved, self.evals = 0, total, [], 0

        def save(self, step):
            self.saved.append(step)

        def evaluate(self):
            self.evals += 1
            return {"loss": float(self.evals)}

    now = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])

    def step_fn(step):
        now[0] += 1.0
        return 0.1 * step, {"loss": jnp.float32(10 - step)}

    def run(total, budget, stop=1 << 62, call_limit=0.0):
        fake, cfg = Fake(total), Cfg(steps=total)
        name = tmp_path / f"{total}_{budget}_{call_limit}.jsonl"
        log = common.MetricsLog(name, total=total, progress=False)
        clock = common.StepClock(budget, tokens_per_step=8, resumed=False, calibrate_after=100,
                                 call_limit_s=call_limit)
        losses, val, step = common.train_steps(fake, cfg, log, clock, stop, step_fn, lambda lr, m: {"lr": lr, **m})
        log.close()
        return fake, losses, val, step, common.read_metrics(name)

    fake, losses, val, step, rows = run(12, budget=0.0)
    assert step == 12 == fake.start_step and losses == {s: 10.0 - s for s in range(12)}
    assert fake.saved == [5, 10, 12] and fake.evals == 2 and val == {"loss": 2.0}      # eval at 6, then the end
    assert [r["step"] for r in rows if "lr" in r] == list(range(1, 13))
    assert [r["step"] for r in rows if "val" in r] == [6, 12]
    now[0] = 0.0
    fake, losses, val, step, rows = run(100, budget=7.0)         # 5% past 7 s: stops at the flush of step 8
    assert step == 8 and fake.saved == [5, 8] and fake.evals == 2 and max(losses) == 7
    assert [(r["step"], r["seconds"]) for r in rows if r.get("event") == "time_budget"] == [(8, 8.0)]
    now[0] = 0.0
    fake, losses, val, step, rows = run(12, budget=0.0, stop=3)  # stop_after: checkpoint there, no final eval
    assert step == 3 and fake.saved == [3] and fake.evals == 0
    now[0] = 0.0
    # the call limit (5 s): the flush of step 8 finds it spent — checkpoint, no evaluation, the run left to resume
    fake, losses, val, step, rows = run(12, budget=0.0, call_limit=5.0)
    assert step == 8 == fake.start_step and fake.saved == [5, 8] and fake.evals == 1     # the eval at 6 only
    assert [(r["step"], r["seconds"]) for r in rows if r.get("event") == "call_limit"] == [(8, 8.0)]
    now[0] = 0.0
    fake, losses, val, step, rows = run(8, budget=0.0, call_limit=5.0)   # the limit at the last step: it ends
    assert step == 8 and fake.saved == [5, 8] and fake.evals == 2
    assert not [r for r in rows if r.get("event") == "call_limit"]


def test_a_run_cut_by_its_call_limit_resumes_to_the_same_losses(corpus, runs, tmp_path):
    """--call-limit: the invocation stops with a checkpoint, not finished and not exported; the same command then
    resumes and reaches the uninterrupted run's losses."""
    import dataclasses
    from tokenizers import Tokenizer
    corpus_dir, _ = corpus
    V = Tokenizer.from_file(str(corpus_dir / "tokenizer" / "tokenizer.json")).get_vocab_size()
    ref = runs["ref"]
    cfg = dataclasses.replace(ref.cfg, out=str(tmp_path / "cut"), steps=4, call_limit_s=1e-9)
    first = TargetTrainer(cfg, micro_config(V, 0)).run()
    assert first["step"] == 1 and not first["finished"]                # stops at its first flush
    second = TargetTrainer(dataclasses.replace(cfg, call_limit_s=0.0), micro_config(V, 0))
    assert second.start_step == 1
    out = second.run()
    assert out["finished"] and out["step"] == 4
    for s_ in (1, 2, 3):
        assert out["losses"][s_] == pytest.approx(runs["ref_losses"][s_], rel=1e-6)


def test_model_flops_count_the_train_steps_matmuls(runs):
    """The MFU numerator: PaLM-convention model FLOPs of a trained token, against XLA's own count of the compiled
    train step (hardware FLOPs: also norms, activations, the optimizer and the chunked GDN's extra work), which
    must be at least the model count and not far above it."""
    from hyspec_jax.train.target import model_flops_utilization, train_flops_per_token
    tr = runs["ref"]
    fpt = train_flops_per_token(tr.model_cfg, tr.state["params"], tr.cfg.seq_len)
    tokens = tr.cfg.batch_size * tr.cfg.seq_len
    cost = tr._train_fn.lower(tr.state, tr.batch(0), jnp.float32(1e-3)).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert 1.0 <= cost["flops"] / (fpt * tokens) < 2.0, (cost["flops"], fpt * tokens)
    assert model_flops_utilization(1e6, fpt, 1, "NVIDIA H200", "float32") is None       # peak is bf16's
    assert model_flops_utilization(1e6, fpt, 1, "cpu", "bfloat16") is None               # unknown device
    assert model_flops_utilization(1e6, fpt, 2, "NVIDIA H100 80GB HBM3", "bfloat16") == pytest.approx(
        1e6 * fpt / (2 * 989.4e12))
