"""The logprobs scorer (`runtime.scoring.Scorer`): its start-up compile covers every prompt bucket, so scoring a
sequence of any length up to the context compiles nothing while serving (it once warmed the 16-token bucket
only, whatever its log said); the scores equal a direct forward's log-softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyspec_jax.compilation import CompileWatch
from hyspec_jax.runtime.engine import Engine
from hyspec_jax.models.target import create_model, forward_full
from hyspec_jax.runtime.scoring import Scorer
from tests.test_engine import _tcfg

pytestmark = pytest.mark.slow_module   # scheduled first by bin/test (tests/conftest.py)


def test_buckets_are_powers_of_four_then_the_contexts():
    from hyspec_jax.runtime.scoring import score_buckets
    assert score_buckets(1) == [16]
    assert score_buckets(64) == [16, 64]
    assert score_buckets(2048) == [16, 64, 256, 1024, 2048]
    assert score_buckets(4096) == [16, 64, 256, 1024, 4096]
    assert score_buckets(3000) == [16, 64, 256, 1024, 4096]


def test_compile_covers_every_bucket_and_scores_equal_a_forward():
    gen = Engine(create_model(_tcfg(64), seed=3))
    scorer = Scorer(gen.tgraph, gen.tparams, max_len=64, top_k=2)
    assert scorer.buckets == [16, 64]
    scorer.compile()
    watch = CompileWatch()
    rng = np.random.default_rng(0)
    seqs = [[int(t) for t in rng.integers(0, 64, n)] for n in (5, 16, 17, 40, 64)]     # both buckets, each at its edges
    scores = [scorer.score(ids, 1) for ids in seqs]
    assert watch.since == 0, f"{watch.since} compilations while scoring"
    for ids, got in zip(seqs, scores):
        logits = forward_full(gen.tgraph, gen.tparams, jnp.asarray([ids], jnp.int32))
        lp = np.asarray(jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1))
        np.testing.assert_allclose(got.logprobs, [lp[j - 1, t] for j, t in enumerate(ids) if j >= 1], atol=1e-4)
