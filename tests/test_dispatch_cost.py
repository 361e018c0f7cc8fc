"""bench/dispatch_cost.py: the HLO counts it reports, its error lines, and one tiny run against a second checkout
(this one again, through the subprocess path), whose compiled step must count the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hyspec_jax.bench.dispatch_cost import hlo_stats

REPO = Path(__file__).resolve().parent.parent

# hand-written in the text form `compiled.as_text()` prints: the entry runs a fusion, a copy and a loop whose body
# runs a custom call; the fusion's own body (a multiply) is not a launch
MODULE = """HloModule jit_f, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_computation (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %multiply.1 = f32[4]{0} multiply(%param_0, %param_0)
}

%body.1 (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %cc = f32[4]{0} custom-call(%x), custom_call_target="k"
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %cc)
}

%cond.1 (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main.2 (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %y = f32[4]{0} copy(%f)
  %z = s32[] constant(0)
  %t0 = (s32[], f32[4]{0}) tuple(%z, %y)
  %w = (s32[], f32[4]{0}) while(%t0), condition=%cond.1, body=%body.1
  ROOT %r = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_hlo_stats_counts_launches_of_the_entry_and_its_loops_not_fusion_bodies():
    h = hlo_stats(MODULE)
    assert h["ops"] == {"fusion": 1, "copy": 1, "custom-call": 1, "while": 1}
    assert h["launches"] == 3
    assert h["computations"] == 4
    assert h["instructions"] == 2 + 5 + 4 + 7


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hyspec_jax.bench.dispatch_cost", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600, check=False)


def test_errors_are_one_line(tmp_path):
    r = _run("--json", str(tmp_path / "x.json"), "--calls", "0")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = _run("--json", str(tmp_path / "x.json"), "--base", str(tmp_path))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"error: {tmp_path} is not a checkout (no hyspec_jax/)"]


def test_tiny_run_against_a_second_checkout(tmp_path):
    out = tmp_path / "d.json"
    r = _run("--json", str(out), "--batch", "1", "--calls", "3", "--repeats", "1", "--max-tokens", "3",
             "--base", str(REPO))
    assert r.returncode == 0, r.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 2
    here, there = (run["batches"]["1"] for run in runs)
    assert here["hlo"] == there["hlo"] and here["hlo"]["launches"] > 0
    assert here["arg_leaves"] == there["arg_leaves"] > 100         # the weights are arguments
    assert here["steps"] == there["steps"] == 2                     # 3 tokens: the prefill's, then 2 steps
    for row in (here, there):
        assert 0 < row["args_only_us"] and 0 < row["dispatch_us"] and row["step_us"] > 0
    assert (out.with_suffix(".md")).read_text().count("\n| ") == 3   # header + one row per checkout
