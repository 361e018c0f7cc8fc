"""Training across hosts on JAX's own runtime, on one machine: `hyspec train-target`, `train-drafter` and
`train-mtp` as one process of four fake CPU devices and as two processes of two devices each (`jax.distributed`
over loopback, gloo collectives; each process reads only its rows of every global batch). The per-step losses
and the final validation are one process's, the exported weights too; process 0 alone prints and logs; the
two-process checkpoint restores in a second two-process run (it resumes at its last step and evaluates the same).

All nine processes of the first wave start at once (and the three resumes of the second), so the module costs
about as much wall time as its CPU time over the cores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from hyspec_jax.io.hf import save_pretrained
from hyspec_jax.models.target import create_model
from hyspec_jax.train.common import read_metrics
from hyspec_jax.train.corpus import build_corpus
from hyspec_jax.train.distill import DistillSampler
from hyspec_jax.train.target import WindowSampler

try:
    from tests.multihost_runs import launch
    from tests.test_train_target import micro_config, synthetic_docs
except ImportError:
    from multihost_runs import launch
    from test_train_target import micro_config, synthetic_docs

pytestmark = pytest.mark.slow_module   # scheduled first by bin/test (tests/conftest.py)

STEPS = 3
COMMON = ["--steps", str(STEPS), "--batch-size", "4", "--dtype", "float32", "--eval-every", "0", "--eval-windows", "4"]
TRAINERS = {   # tiny sizes; {root} is the module's directory
    "target": ["train-target", "--corpus", "{root}/corpus", "--preset", "tiny", "--seq-len", "16", "--warmup", "0",
               "--log-every", "1", "--chunk", "8", "--export-dtype", "float32"],
    "drafter": ["train-drafter", "--target", "{root}/target", "--corpus", "{root}/corpus", "--layers", "1",
                "--block-size", "4", "--markov-rank", "8", "--seq-len", "16", "--anchors", "3", "--eval-batch", "4"],
    "mtp": ["train-mtp", "--target", "{root}/target", "--corpus", "{root}/corpus", "--seq-len", "16"],
}
ENV = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}   # tiny programs: XLA's passes cost more than they save


def _args(name: str, root: Path, out: str) -> list[str]:
    return [a.format(root=root) for a in TRAINERS[name]] + COMMON + ["--out", str(root / out)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost_train")
    build_corpus(root / "corpus", docs=synthetic_docs(), vocab_size=400, val_fraction=0.15)
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(str(root / "corpus" / "tokenizer" / "tokenizer.json")).get_vocab_size()
    save_pretrained(create_model(micro_config(vocab, 0), seed=3), root / "target")
    first = {}
    for name in TRAINERS:
        first[name, 1] = launch(_args(name, root, f"{name}-1"), processes=1, devices=4, env=ENV)
        first[name, 2] = launch(_args(name, root, f"{name}-2"), processes=2, devices=2, env=ENV)
    stdout = {key: run.wait() for key, run in first.items()}
    before = {name: read_metrics(root / f"{name}-2" / "metrics.jsonl") for name in TRAINERS}
    # the same two-process commands again: each resumes from its checkpoint at the last step and evaluates
    again = {name: launch(_args(name, root, f"{name}-2"), processes=2, devices=2, env=ENV) for name in TRAINERS}
    for run in again.values():
        run.wait()
    return root, stdout, before


def _losses(metrics: list[dict]) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics if "loss" in m}


def _val(metrics: list[dict]) -> list[dict]:
    return [m["val"] for m in metrics if "val" in m]


def _json_lines(out: str) -> list[str]:
    return [x for x in out.splitlines() if x.startswith("{")]     # gloo logs its connections on stdout too


@pytest.mark.parametrize("name", list(TRAINERS))
def test_two_processes_train_like_one(runs, name):
    root, stdout, before = runs
    one = read_metrics(root / f"{name}-1" / "metrics.jsonl")
    two = before[name]
    want, got = _losses(one), _losses(two)
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=0, atol=1e-5)
    assert len(set(want.values())) > 1                         # the curve moves: the steps did train
    (v1,), (v2,) = _val(one), _val(two)
    assert v1.keys() == v2.keys() and v1
    for domain in v1:
        for k, x in v1[domain].items():
            assert v2[domain][k] == pytest.approx(x, rel=1e-5, abs=1e-5), (domain, k)
    # process 0 prints the summary, process 1 nothing; the exported weights are one process's
    assert _json_lines(stdout[name, 2][1]) == []
    export = Path(json.loads((root / f"{name}-2" / "summary.json").read_text())["export"])
    files = sorted(p.relative_to(export) for p in export.rglob("*.safetensors"))
    assert files
    for f in files:
        a, b = load_file(root / f"{name}-1" / export.name / f), load_file(export / f)
        assert a.keys() == b.keys()
        for k in a:
            # the all-reduces sum in another order across processes, and Adam's g / sqrt(v) turns that into
            # update differences up to a few % of a step where a gradient is near zero (the fused gate/up GEMM
            # sums its shards in another order: 1.02e-4 seen once in 8,192): 2e-4 is 7% of one step (lr 3e-3 at
            # most); misplaced rows or shards would differ by whole steps (1e-3 .. 1e-2)
            np.testing.assert_allclose(b[k], a[k], rtol=0, atol=2e-4, err_msg=f"{f}:{k}")


@pytest.mark.parametrize("name", list(TRAINERS))
def test_two_process_checkpoint_restores(runs, name):
    root, _, before = runs
    after = read_metrics(root / f"{name}-2" / "metrics.jsonl")[len(before[name]):]
    assert [m.get("event") for m in after if "event" in m] == ["resume"]
    assert after[0]["step"] == STEPS
    assert _losses(after) == {}                                  # nothing left to train
    assert _val(after) == _val(before[name])                     # the restored state evaluates as the saved one


def test_process_shares_tile_the_batch(tmp_path):
    """What each process reads (rows [lo, hi) of a batch) are the rows of the batch one process reads."""
    build_corpus(tmp_path / "corpus", docs=synthetic_docs(per_domain=8), vocab_size=300, val_fraction=0.15)
    np.save(tmp_path / "sequences.npy", np.arange(20 * 12, dtype=np.uint16).reshape(20, 12))
    for sampler in (WindowSampler(tmp_path / "corpus", 8, seed=1), DistillSampler(tmp_path, 8, seed=1)):
        full = sampler.batch(5, 6)
        parts = [sampler.batch(5, 6, slice(lo, lo + 2)) for lo in (0, 2, 4)]
        np.testing.assert_array_equal(np.concatenate(parts), full)
        assert not np.array_equal(sampler.batch(6, 6), full)
