"""The start-up compile side by side (`Backend.compile(workers=...)`, `compilation.precompile`): the pass records
the program calls it will make, compiles them on threads, and then only runs them — no program compiles twice,
and none is left to the pass. Shapes no other test uses (3 slots, KV 96), so every program here is new to the
process's jit caches."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hyspec_jax.compilation import CompileWatch, compile_workers
from hyspec_jax.runtime.engine import Engine
from tests.test_engine import _spec, models  # noqa: F401

pytestmark = pytest.mark.slow_module   # scheduled first by bin/test (tests/conftest.py)


def _compile_in_two_steps(be, workers):
    """Backend.compile's steps apart: the first job alone, the rest compiled ahead on threads, then run; returns
    (programs the threads compiled, programs the pass then compiled)."""
    jobs = be._compile_jobs((False, True), None)
    be._run_jobs(jobs[:1], None)
    ahead = CompileWatch()
    be._precompile(jobs[1:], workers, None)
    compiled_ahead = ahead.since
    after = CompileWatch()
    be._run_jobs(jobs[1:], None)
    return compiled_ahead, after.since


def test_plain_decoding_programs_compile_ahead_and_the_pass_compiles_nothing(models):
    target, _ = models
    be = Engine(target).backend(3, 96, decode_buckets=(1,))
    ahead, after = _compile_in_two_steps(be, 2)
    # every prefill shape but the first, and the step of 2 flavours x (bucket 1 + all slots)
    assert ahead >= len(be.shapes) - 1 + 4 and after == 0


def test_logprobs_are_computed_by_the_same_programs_and_compile_ahead(models):
    """A backend computing logprobs (`SlotLayout.logprobs`) has as many programs as one that does not, all
    compiled at start-up: requests with and without logprobs then compile nothing."""
    from hyspec_jax.runtime.scheduler import EngineRequest, Scheduler
    target, _ = models
    be = Engine(target).backend(3, 96, decode_buckets=(1,), logprobs=2)
    ahead, after = _compile_in_two_steps(be, 2)
    assert ahead >= len(be.shapes) - 1 + 4 and after == 0
    assert be.step_programs == 2           # the plain backend's: no flavour of its own
    watch = CompileWatch()
    sched = Scheduler(be)
    got = []
    for i in range(3):
        sched.submit(EngineRequest(prompt_ids=[5 + i] * (3 + 9 * i), max_tokens=4, temperature=0.5 * (i == 1),
                                   logprobs=i != 2, sink=lambda toks, why, lps: got.append(lps)))
    sched.run_until_idle()
    assert watch.since == 0
    assert sum(len(s) for s in got if s is not None) == 8


def test_weights_on_a_one_device_mesh_compile_ahead_too(models):
    """Such weights give programs whose outputs are placed by NamedSharding, unlike the start-up buffers: the calls
    recorded after the first job carry the outputs' placement, so nothing compiles twice."""
    target, _ = models
    graphdef, params = nnx.split(target)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    placed = nnx.merge(graphdef, jax.device_put(params, NamedSharding(mesh, PartitionSpec())))
    be = Engine(placed).backend(3, 112)
    ahead, after = _compile_in_two_steps(be, 2)
    assert ahead >= len(be.shapes) - 1 + 2 and after == 0


def test_every_width_of_a_width_backend_compiles_ahead(models):
    target, drafter = models
    eng = Engine(target, drafter, _spec("tree-ready"), slots=3, kv_len=96)
    be = eng.width_backend(3, 96, None, None, decode_buckets=(1,))
    widths = len(be.widths)
    assert widths >= 3
    labels = []
    ahead, after = _compile_in_two_steps(be, 2)
    assert after == 0 and ahead >= 2 * 2 * widths            # 2 flavours x 2 row counts x every width
    # progress: one line per job, in the threads' order, each naming its job
    be2 = Engine(target).backend(3, 80)
    be2.compile(labels.append, workers=2)
    assert len(labels) == len(be2.shapes) + 2 and all(lab.endswith("s") for lab in labels)


def test_capture_leaves_the_backend_as_it_was(models):
    target, _ = models
    be = Engine(target).backend(3, 64)
    before = [np.asarray(x) for x in jax.tree.leaves((be.state, be.anchor))]
    captured = []
    be._run_jobs(be._compile_jobs((False,), None), None, capture=captured)
    assert len(captured) == len(be.shapes) + 1 and not be._capturing and be._compile_rows is None
    after = [np.asarray(x) for x in jax.tree.leaves((be.state, be.anchor))]
    assert len(before) == len(after) and all(np.array_equal(a, b) for a, b in zip(before, after))


def test_compile_workers_setting(monkeypatch):
    monkeypatch.setenv("HYSPEC_COMPILE_WORKERS", "3")
    assert compile_workers() == 3
    monkeypatch.setenv("HYSPEC_COMPILE_WORKERS", "0")
    with pytest.raises(ValueError, match=">= 1"):
        compile_workers()
    monkeypatch.delenv("HYSPEC_COMPILE_WORKERS")
    assert compile_workers() == max(1, min(8, os.cpu_count() or 1))         # the CPU: side by side
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert compile_workers() == 1                       # a GPU: XLA's autotuner times kernels on the device


def test_with_the_program_cache_requests_compile_nothing(models, tmp_path, monkeypatch):
    """As a one-device CPU server (`compilation.program_cache`): the pass compiles the exported programs ahead and
    runs only its first; requests then compile nothing — the first program's too, now given its own outputs (the
    fresh buffers are committed like them, `sharding.place_buffers`)."""
    from hyspec_jax import compilation as C
    from hyspec_jax.runtime.scheduler import EngineRequest, Scheduler
    monkeypatch.setenv(C.CACHE_ENV, str(tmp_path / "xla"))
    monkeypatch.delenv(C.PROGRAM_CACHE_ENV, raising=False)
    target, _ = models
    with C.program_cache() as on:
        if not on:
            pytest.skip("no program cache here (a CPU only)")
        be = Engine(target).backend(3, 104, decode_buckets=(1,))
        be.compile(workers=2)
        assert list((tmp_path / "programs").glob("*.bin"))
        watch = CompileWatch()
        sched = Scheduler(be)
        for i in range(2):       # a short prompt: the first job's prefill shape
            sched.submit(EngineRequest(prompt_ids=[3 + i] * 5, max_tokens=3, temperature=0.5 * i,
                                       sink=lambda *a: None))
        sched.run_until_idle()
        assert watch.since == 0
