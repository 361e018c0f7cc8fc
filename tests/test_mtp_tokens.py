"""Token storage beyond 65,536 ids (what a real Qwen3.5 target needs, ~248k ids): corpus shards and distillation
data choose a wide enough integer type and read back either, checked with a synthetic 248k-id vocabulary."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from hyspec_jax.config import TargetConfig
from hyspec_jax.runtime.engine import Engine
from hyspec_jax.io.hf import save_pretrained
from hyspec_jax.models.target import create_model
from hyspec_jax.sampling import SamplingParams
from hyspec_jax.train.corpus import Document, build_corpus, load_shard, token_dtype
from hyspec_jax.train.distill import DistillSampler, generate_continuations, load_prompts, sample_prompts
from hyspec_jax.train.tokenizer_train import EOS

V = 248_320      # Qwen3.5's vocabulary size
HIGH = [70_000, 131_071, 248_000, 65_536, 65_535]      # ids a uint16 store would wrap


def test_token_dtype_boundaries():
    assert token_dtype(8192) == np.uint16 and token_dtype(65_536) == np.uint16
    assert token_dtype(65_537) == np.uint32 and token_dtype(V) == np.uint32
    with pytest.raises(ValueError):
        token_dtype(1 << 33)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A corpus over a word-level tokenizer of V ids (word `w{i}` is id i, EOS the last id), words drawn so that
    every document holds ids above 65,535."""
    root = tmp_path_factory.mktemp("wide")
    vocab = {f"w{i}": i for i in range(V - 1)} | {EOS: V - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    rng = np.random.default_rng(0)
    docs = {}
    for d in ("alpha", "beta"):
        docs[d] = [Document(d, f"{d}{j}", " ".join(f"w{i}" for i in list(rng.integers(0, V - 1, 40)) + HIGH))
                   for j in range(30)]
    manifest = build_corpus(root / "corpus", docs=docs, val_fraction=0.1, tokenizer_dir=root / "tok")
    return root, docs, manifest


def test_corpus_shards_keep_ids_beyond_uint16(corpus):
    root, docs, manifest = corpus
    assert manifest["dtype"] == "uint32" and manifest["vocab_size"] == V
    shard = load_shard(root / "corpus", "train", "alpha")
    assert shard.dtype == np.uint32
    ids = np.asarray(shard)
    assert ids.max() == V - 1                                     # EOS, the last id
    for h in HIGH:
        assert np.sum(ids == h) > 0
    # the first train document comes back exactly, then EOS
    train_docs = [d for d in docs["alpha"]]
    first = [int(w[1:]) for w in train_docs[0].text.split()]
    starts = [0] + list(np.flatnonzero(ids == V - 1) + 1)
    assert any(list(ids[s:s + len(first)]) == first for s in starts[:-1])


def test_a_narrow_corpus_still_reads_as_uint16(tmp_path):
    """Corpora written before (uint16, manifest "dtype" uint16 or no manifest) read back unchanged."""
    (tmp_path / "tokens" / "train").mkdir(parents=True)
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "tokens" / "train" / "x.bin")
    assert load_shard(tmp_path, "train", "x").dtype == np.uint16
    (tmp_path / "manifest.json").write_text(json.dumps({"dtype": "uint16"}))
    np.testing.assert_array_equal(load_shard(tmp_path, "train", "x"), np.arange(10))


def test_distillation_data_keeps_ids_beyond_uint16(corpus, tmp_path):
    root, _, _ = corpus
    summary = sample_prompts(root / "corpus", tmp_path / "prompts.npz", per_domain=2, prompt_len=6, seed=1)
    assert summary["prompts"] == 4
    raw = np.load(tmp_path / "prompts.npz")["tokens"]
    assert raw.dtype == np.uint32
    tokens, _, _ = load_prompts(tmp_path / "prompts.npz")
    tokens[0, -1] = 200_000            # make sure a prompt reaches past uint16 whatever the windows drew
    np.savez_compressed(tmp_path / "prompts.npz", tokens=tokens.astype(np.uint32),
                        domain=np.load(tmp_path / "prompts.npz")["domain"], domains=np.asarray(["alpha", "beta"]))
    cfg = TargetConfig(model_type="qwen3_5_text", vocab_size=V, hidden_size=16, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=24,
                       layer_types=("linear_attention", "full_attention"), linear_num_key_heads=1,
                       linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    model = create_model(cfg, seed=2)
    save_pretrained(model, tmp_path / "target")
    generate_continuations(tmp_path / "target", tmp_path / "prompts.npz", tmp_path / "distill", gen_len=4,
                           batch_size=4, progress=False)
    seqs = np.load(tmp_path / "distill" / "sequences.npy")
    assert seqs.dtype == np.uint32
    np.testing.assert_array_equal(seqs[:, :6], tokens)
    want = Engine(model).generate([list(map(int, tokens[0]))], [SamplingParams(max_tokens=4)])
    assert list(seqs[0, 6:]) == want[0].token_ids
    batch = DistillSampler(tmp_path / "distill", 10, seed=0).batch(0, 3)
    assert batch.dtype == np.int32 and batch.max() < V
    assert np.isin(batch, seqs).all()


def test_held_out_packs_come_from_the_validation_split(tmp_path):
    """`hyspec build-distill --prompts-only --split validation` (the long held-out evaluation packs) draws every
    window from the validation shard; the default stays the train split."""
    from hyspec_jax.train import cli_train
    for split, lo in (("train", 0), ("validation", 1000)):
        (tmp_path / "tokens" / split).mkdir(parents=True)
        np.arange(lo, lo + 200, dtype=np.uint16).tofile(tmp_path / "tokens" / split / "x.bin")
    for split, lo in (("validation", 1000), (None, 0)):
        out = tmp_path / f"pack_{split}"
        argv = ["build-distill", "--prompts-only", "--corpus", str(tmp_path), "--out", str(out), "--per-domain", "3",
                "--prompt-len", "16"] + (["--split", split] if split else [])
        assert cli_train.main(argv) == 0
        tokens, _, _ = load_prompts(out / "prompts.npz")
        assert tokens.shape == (3, 16)
        assert (tokens >= lo).all() and (tokens < lo + 200).all()
        assert (np.diff(tokens, axis=1) == 1).all()          # contiguous windows of the shard
