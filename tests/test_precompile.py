"""`Backend.precompile`: the step programs of a one-shot generation load on a background thread while its prompts
prefill. The program it prepares is the one the first step runs (the step then compiles nothing), for plain
decoding, a speculative round and every width of a width backend; off (no program cache: a server, a benchmark)
it runs nothing; and `run_batch`, which starts it, still returns plain decoding's tokens.

The models and prompts are test_engine's (one tiny random target and drafter).
"""

from __future__ import annotations

import numpy as np
import pytest

from hyspec_jax import compilation as C
from hyspec_jax.generate import Generator
from hyspec_jax.runtime.scheduler import run_batch
from hyspec_jax.spec.engine import SpecEngine
from tests.test_engine import KV, SLOTS, _spec, models, reference  # noqa: F401

pytestmark = pytest.mark.usefixtures("quick_compiles")


@pytest.fixture
def program_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(C.CACHE_ENV, str(tmp_path / "xla"))
    monkeypatch.delenv(C.PROGRAM_CACHE_ENV, raising=False)
    with C.program_cache() as on:
        if not on:
            pytest.skip("program cache unavailable (flatbuffers missing?)")
        yield tmp_path / "programs"


def _backend(kind, models, slots=SLOTS):
    target, drafter = models
    if kind == "ar":
        return Generator.from_model(target).backend(slots, KV)
    eng = SpecEngine(target, drafter, _spec(kind), slots=slots, kv_len=KV)
    if kind == "chain":                    # a width backend: one round per width
        return eng.width_backend(slots, KV, None)
    return eng.backend(slots, KV)


def _prefill_one(be):
    rows, t = be.shapes[0]
    z = np.zeros(rows, np.float32)
    slots = np.full(rows, be.slots, np.int32)
    slots[0] = 0
    be.prefill(slots, np.ones((rows, t), np.int32), np.ones((rows, t), bool), np.ones(rows, bool),
               be.sampling(z, np.ones(rows, np.float32), z.astype(np.int32), z.astype(np.uint32)))


@pytest.mark.parametrize("kind", ["ar", "tree-ready", "chain"])
def test_the_first_step_runs_the_program_precompile_prepared(kind, models, program_cache):
    be = _backend(kind, models)
    thread = be.precompile([False])
    _prefill_one(be)                    # the prefill's outputs replace the buffers precompile saw
    thread.join()
    watch, names = C.CompileWatch(), []
    stop_listening = C.on_compile(names.append)
    active = np.zeros(be.slots, bool)
    active[0] = True
    calls = len(be.step_calls(False))   # a width backend: any width may come first; run each once
    for w in (sorted(be.widths, reverse=True) if calls > 1 else [None]):
        if w is not None:
            be.force = [w]
        be.collect(be.dispatch(active, be._noop_sampling(False), np.zeros(be.slots, np.int32), False))
    stop_listening()
    assert watch.since == 0, names          # the programs that compiled anyway


def test_without_the_program_cache_nothing_runs_beside_the_steps(models, tmp_path, monkeypatch):
    monkeypatch.setenv(C.PROGRAM_CACHE_ENV, "0")
    with C.program_cache(False):
        be = _backend("tree-ready", models)
        assert be.step_calls(False) and be.precompile([False]) is None


@pytest.mark.parametrize("mode", ["ar", "tree-ready"])
def test_run_batch_with_precompile_equals_plain_decoding(mode, models, reference, program_cache):
    target, drafter = models
    prompts, params, ref = reference
    be = (Generator.from_model(target).backend(SLOTS, KV) if mode == "ar"
          else SpecEngine(target, drafter, _spec(mode), slots=SLOTS, kv_len=KV).backend(SLOTS, KV))
    _, outs, _ = run_batch(be, prompts, params)
    assert outs == ref
