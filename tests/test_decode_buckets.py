"""Decoding buckets (`Backend.step_rows`): a step or round over few decoding requests runs on the smallest compiled
row count that holds them — gathered from the slots and written back — and gives exactly the tokens of the step
over every slot: greedy equals plain decoding, sampled tokens are the same draws (a slot's randomness is its own
seed and step), with penalties, the deferred commit and the width changing per round.

The models, prompts and AR outputs are test_engine's (4 slots, 5 ragged requests: the live count falls from 4 to 1).
"""

from __future__ import annotations

import numpy as np
import pytest

from hyspec_jax.runtime.backend import check_decode_buckets, default_decode_buckets
from hyspec_jax.runtime.scheduler import run_batch
from hyspec_jax.sampling import SamplingParams
from hyspec_jax.runtime.engine import Engine
from tests.test_engine import KV, SLOTS, _spec, models, reference  # noqa: F401

BUCKETS = (1, 2)


def _recording(be):
    """Record the row count of every step the backend runs (SLOTS: all of them)."""
    seen, rows_of = [], be.step_rows

    def step_rows(active):
        rows = rows_of(active)
        if be._compile_rows is None:
            seen.append(SLOTS if rows is None else len(rows))
        return rows
    be.step_rows = step_rows
    return seen


def test_step_rows_pick_the_smallest_bucket_that_holds_the_active_slots(models):
    target, _ = models
    be = Engine(target).backend(SLOTS, KV, decode_buckets=(2, 1, 8))
    assert be.decode_buckets == (1, 2) and be.step_programs == 3
    assert be.step_rows(np.array([0, 0, 1, 0])).tolist() == [2]
    assert be.step_rows(np.array([1, 0, 1, 0])).tolist() == [0, 2]
    assert be.step_rows(np.array([0, 0, 0, 1])).tolist() == [3]
    assert be.step_rows(np.array([1, 0, 1, 1])) is None          # three: the full step
    assert be.step_rows(np.zeros(4)).tolist() == [4]              # nothing active: one padding row
    assert default_decode_buckets(64) == (1, 4, 16) and default_decode_buckets(4) == (1,)
    assert default_decode_buckets(1) == ()
    with pytest.raises(ValueError, match=">= 1"):
        check_decode_buckets((0, 2), 4)


@pytest.mark.parametrize("penalized", [False, True])
def test_plain_decoding_in_buckets_equals_every_slot(penalized, models, reference):
    target, _ = models
    prompts, params, ref = reference
    gen = Engine(target)
    if penalized:
        params = [SamplingParams(max_tokens=p.max_tokens, stop_token_ids=p.stop_token_ids, temperature=0.9, seed=i,
                                 repetition_penalty=1.3, presence_penalty=0.4) for i, p in enumerate(params)]
        _, ref, _ = run_batch(gen.backend(SLOTS, KV), prompts, params)
    be = gen.backend(SLOTS, KV, decode_buckets=BUCKETS)
    seen = _recording(be)
    _, out, _ = run_batch(be, prompts, params)
    assert out == ref
    assert {1, 2, SLOTS} <= set(seen), seen


@pytest.mark.parametrize("mode,kw", [("tree-ready", {}), ("chain", {}), ("tree", {"deferred_rows": 12}),
                                     ("tree-ready", {"adaptive": True})])
def test_rounds_in_buckets_equal_plain_decoding(mode, kw, models, reference):
    target, drafter = models
    prompts, params, ref = reference
    adaptive = kw.pop("adaptive", False)
    eng = Engine(target, drafter, _spec(mode, **kw), slots=SLOTS, kv_len=KV)
    if adaptive:
        be = eng.width_backend(SLOTS, KV, decode_buckets=BUCKETS)
        be.force = [8, 1, 2, 4]
    else:
        be = eng.backend(SLOTS, KV, decode_buckets=BUCKETS)
    seen = _recording(be)
    _, out, _ = run_batch(be, prompts, params)
    assert out == ref
    assert set(seen) & set(BUCKETS) and SLOTS in seen, seen


def test_sampled_rounds_in_buckets_draw_the_same_tokens(models, reference):
    """Sampling (and penalties): the same seeds give the same tokens with and without buckets."""
    target, drafter = models
    prompts, params, _ = reference
    params = [SamplingParams(max_tokens=p.max_tokens, temperature=1.0, top_k=8, seed=7 + i,
                             frequency_penalty=0.5 if i % 2 else 0.0) for i, p in enumerate(params)]
    eng = Engine(target, drafter, _spec("tree-ready"), slots=SLOTS, kv_len=KV)
    _, full, _ = run_batch(eng.backend(SLOTS, KV), prompts, params)
    be = eng.backend(SLOTS, KV, decode_buckets=BUCKETS)
    seen = _recording(be)
    _, out, _ = run_batch(be, prompts, params)
    assert out == full
    assert {1, 2} <= set(seen), seen

