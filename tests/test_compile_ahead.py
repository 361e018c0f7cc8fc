"""Start-up programs compiled by several threads at once (`compilation.compile_ahead`): every program a backend
or scorer runs at start-up is in `program_calls`, compiled there, so that running them afterwards compiles
nothing more — plain decoding, a speculative round, every width of a width backend, the scorer's buckets —
and the server's start-up (`serve.server.compile_start_up`) leaves nothing to compile while serving. With one
worker, or with the program cache on, it does nothing.

The models are test_engine's (one tiny random target and drafter).
"""

from __future__ import annotations

import numpy as np
import pytest

from hyspec_jax import compilation as C
from hyspec_jax.generate import Generator
from hyspec_jax.runtime.scoring import Scorer
from hyspec_jax.spec.engine import SpecEngine
from tests.test_engine import KV, SLOTS, _spec, models  # noqa: F401

pytestmark = pytest.mark.usefixtures("quick_compiles")


def _backend(kind, models):
    target, drafter = models
    if kind == "ar":
        return Generator.from_model(target).backend(SLOTS, KV)
    if kind == "chain-widths":          # a width backend: one round per width
        return SpecEngine(target, drafter, _spec("chain"), slots=SLOTS, kv_len=KV).width_backend(SLOTS, KV, None)
    return SpecEngine(target, drafter, _spec(kind), slots=SLOTS, kv_len=KV).backend(SLOTS, KV)


@pytest.mark.parametrize("kind", ["ar", "tree-ready", "chain-widths"])
def test_programs_compiled_ahead_are_the_ones_the_start_up_runs(kind, models):
    be = _backend(kind, models)
    calls = be.program_calls()
    labels = [label for label, _, _ in calls]
    assert len(labels) == len(set(labels)) == len(be.shapes) + 2 * (len(be.widths) if kind == "chain-widths" else 1)
    done = []
    watch = C.CompileWatch()
    assert C.compile_ahead(calls, 2, done.append) == len(calls)
    assert sorted(d.rsplit(" ", 1)[0] for d in done) == sorted(labels)     # each reported once, with its time
    assert watch.since == len(calls)
    watch = C.CompileWatch()
    be.compile()                        # runs every program: each finds its executable
    assert watch.since == 0


def test_scorer_buckets_compiled_ahead(models):
    target, _ = models
    be = Generator.from_model(target).backend(SLOTS, KV)
    scorer = Scorer(be.graphdef, be.params, KV, 3)
    assert C.compile_ahead(scorer.program_calls(), 2) == len(scorer.buckets)
    watch = C.CompileWatch()
    scorer.compile()
    assert watch.since == 0
    ids = list(np.arange(1, 20) % 7)
    assert scorer.score(ids).logprobs == pytest.approx(Scorer(be.graphdef, be.params, KV, 3).score(ids).logprobs)


def test_server_start_up_with_threads_leaves_nothing_to_compile(models):
    from hyspec_jax.serve.server import compile_start_up
    be = _backend("tree-ready", models)
    scorer = Scorer(be.graphdef, be.params, KV, 2)
    compile_start_up(be, scorer, 2, None)
    watch = C.CompileWatch()
    be.compile()
    scorer.compile()
    assert watch.since == 0


def test_one_worker_or_the_program_cache_compiles_nothing_ahead(models, tmp_path, monkeypatch):
    be = _backend("ar", models)
    assert C.compile_ahead(be.program_calls(), 1) == 0
    monkeypatch.setenv(C.CACHE_ENV, str(tmp_path / "xla"))
    monkeypatch.delenv(C.PROGRAM_CACHE_ENV, raising=False)
    with C.program_cache() as on:
        if not on:
            pytest.skip("program cache unavailable here")
        assert C.compile_ahead(be.program_calls(), 2) == 0
