"""`hyspec bench serve-compile` at a tiny size: both phases run in their own processes over one cache, every
program of the server's start-up set is timed, and the cached phase reads what the cold one wrote: it compiles
nothing (JAX's persistent-cache events, counted in each phase's `cache`). How fast either phase is, is bench/'s to
record, not a test's to assert."""

from __future__ import annotations

import json

import pytest

from hyspec_jax.bench import serve_compile

pytestmark = pytest.mark.slow_module   # scheduled first by bin/test (tests/conftest.py)


def _tiny_run(out, logprobs: int, workers: int) -> tuple[dict, dict]:
    """serve-compile at a tiny size: the (cold, cached) phases of its report."""
    assert serve_compile.main(["--tiny", "--max-batch", "4", "--max-model-len", "64", "--prefill-chunk", "32",
                               "--max-logprobs", str(logprobs), "--no-progress", "--compile-workers", str(workers),
                               "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    return report["phases"]["cold"], report["phases"]["cached"]


def _cached_compiled_nothing(cold: dict, cached: dict, programs: int) -> None:
    """The cold phase compiled (and wrote) its programs; the cached phase asked for the same XLA compilations, at
    least one per program, and read every one from the persistent cache."""
    assert cold["cache"]["requests"] - cold["cache"]["hits"] >= programs, cold["cache"]
    assert cached["cache"]["requests"] >= programs and cached["cache"]["hits"] == cached["cache"]["requests"], \
        cached["cache"]
    assert cached["cache"]["requests"] == cold["cache"]["requests"]     # the same compilations, each read back


def test_tiny_run_times_every_program_cold_and_cached(tmp_path):
    out = tmp_path / "sc.json"
    cold, cached = _tiny_run(out, 2, 1)
    names = [p["program"] for p in cold["programs"]]
    # 2 prefill shapes, the decoding step of both sampling flavours over 1 row (a CPU's decoding bucket) and over
    # all 4 slots, the scorer's 2 length buckets
    assert names == ["prefill [2x16]", "prefill [1x32]", "decode [1, greedy]", "decode [4, greedy]",
                     "decode [1, sampling]", "decode [4, sampling]", "score [1x16]", "score [1x64]"]
    assert [p["program"] for p in cached["programs"]] == names
    _cached_compiled_nothing(cold, cached, len(names))
    md = out.with_suffix(".md").read_text()
    assert f"| from the persistent cache | {len(names)} | 0 / {cached['cache']['hits']} |" in md
    assert cold["compile_workers"] == 1
    # where each program's time went: XLA ran its passes cold and none from the cache, and the parts add up to the
    # program's own time (each part measured, the rest what is left)
    for phase in (cold, cached):
        assert phase["xla_passes"]
        for p in phase["programs"]:
            split = p["split"]
            assert set(split) == set(serve_compile.SPLIT_KEYS) and min(split.values()) >= 0
            if phase is cold:
                assert split["trace"] > 0 and split["lower"] > 0, (p["program"], split)
            assert sum(split.values()) == pytest.approx(p["seconds"], rel=0.05, abs=0.05), (p["program"], split)
    # as a one-device CPU server, both phases keep the traced programs on disk: the cached phase traces only the
    # stored programs' calls
    assert cold["program_cache"] and cached["program_cache"]
    traced = {ph["phase"]: sum(p["split"]["trace"] for p in ph["programs"]) for ph in (cold, cached)}
    assert traced["cached"] < 0.5 * traced["cold"], traced
    assert all(p["split"]["passes"] > 0 and p["split"]["codegen"] > 0 for p in cold["programs"])
    assert all(p["split"]["passes"] == 0 for p in cached["programs"])
    assert "| program, cold / cached | trace | lower |" in md


def test_programs_compiled_side_by_side_are_the_same_set(tmp_path):
    out = tmp_path / "sc2.json"
    cold, cached = _tiny_run(out, 0, 2)
    names = {"prefill [2x16]", "prefill [1x32]", "decode [1, greedy]", "decode [4, greedy]", "decode [1, sampling]",
             "decode [4, sampling]"}
    assert cold["compile_workers"] == 2
    assert sorted(p["program"] for p in cold["programs"]) == sorted(names)
    assert sorted(p["program"] for p in cached["programs"]) == sorted(names)
    _cached_compiled_nothing(cold, cached, len(names))      # the compile threads' events counted too
    md = out.with_suffix(".md").read_text()
    assert "threads side by side" in md
    # side by side, only each phase's split: the cold one ran XLA's passes
    assert cold["split"]["passes"] > 0 and all("split" not in p for p in cold["programs"])
    assert "Per program only with `--compile-workers 1`" in md


def test_bad_sizes_fail_in_one_line(capsys):
    assert serve_compile.main(["--tiny", "--max-batch", "0"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert serve_compile.main(["--tiny", "--decode-buckets", "4,x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--decode-buckets must be" in err


def test_xla_pass_log_counts_leaf_passes_once():
    """A pipeline nested in another is logged as one of its passes too: only the leaf passes count, each pass run
    as the interval ending at its log line; stages traced inside another count once."""
    log = ["I1207 12:00:00.000000    7 hlo_pass_pipeline.cc:302] Running HLO pass pipeline on module jit_f: outer\n",
           "I1207 12:00:00.000000    7 hlo_pass_pipeline.cc:302] Running HLO pass pipeline on module jit_f: inner\n",
           "I1207 12:00:00.500000    7 hlo_pass_pipeline.cc:206] HLO pass: dce time: 500 ms (500 ms) (cumulative: 1 s)\n",
           "I1207 12:00:00.700000    7 hlo_pass_pipeline.cc:206] HLO pass: inner time: 700 ms (700 ms)\n",
           "I1207 12:00:01.700000    7 hlo_pass_pipeline.cc:206] HLO pass: gemm-fusion-autotuner time: 1 s (1 s)\n",
           "I1207 12:00:01.800000    7 other.cc:1] HLO pass: not-a-pass-line time: 9 s\n"]
    passes = serve_compile.parse_xla_passes(log, 2026)
    assert [(name, round(b - a, 3)) for a, b, _, name in passes] == [("dce", 0.5), ("gemm-fusion-autotuner", 1.0)]
    t0 = passes[0][0]
    spans = [("trace", t0 - 1.0, t0 - 0.5, 7), ("trace", t0 - 0.9, t0 - 0.8, 7),     # a jit traced inside another
             ("xla", t0, t0 + 2.0, 7)]
    split = serve_compile.split_time(spans, passes, t0 - 2.0, t0 + 3.0, seconds=4.0)
    assert split == dict(trace=0.5, lower=0.0, passes=0.5, autotune=1.0, codegen=0.5, rest=1.5)
