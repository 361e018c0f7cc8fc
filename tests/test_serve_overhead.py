"""bench/serve_overhead.py: its scripted backend under the request loop, and one tiny run of the harness (a real
server process over that backend, driven by serve_load's client)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hyspec_jax.bench import serve_overhead as so
from hyspec_jax.runtime.scheduler import run_batch
from hyspec_jax.sampling import SamplingParams

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("per_step", [1, 3])
def test_scripted_backend_streams_the_passage_on_a_serial_device(per_step):
    ids = list(range(100, 140))
    be = so.make_backend(4, 0.002, per_step, ids)
    prompts = [[k + 1] * (5 + k) for k in range(6)]
    reqs, outs, loop = run_batch(be, prompts, [SamplingParams(max_tokens=9)] * 6)
    for p, out in zip(prompts, outs):
        start = (p[0] * 7) % len(ids)
        assert out == [ids[(start + j) % len(ids)] for j in range(9)]     # the passage from the prompt's place
    assert be.device_steps >= 1 + 8 // per_step
    assert be.device_idle >= 0.0


def test_scripted_backend_with_uneven_steps_ends_requests_apart():
    ids = list(range(100, 140))
    be = so.make_backend(4, 0.001, 1, ids, tokens_max=4, prefill_s=0.002, seed=3)
    assert be.depth == 3
    prompts = [[k + 1] * 5 for k in range(8)]
    reqs, outs, loop = run_batch(be, prompts, [SamplingParams(max_tokens=12)] * 8)
    for p, out in zip(prompts, outs):
        start = (p[0] * 7) % len(ids)
        assert out == [ids[(start + j) % len(ids)] for j in range(12)]
    # steps of 1..4 tokens a request: not every round commits the same count for all rows
    assert any(len(set(c)) > 1 for c in zip(*[r.committed[:3] for r in reqs[:4]]))
    assert be.prefill_calls >= 2


def test_harness_runs_the_server_and_reports_per_token_costs(tmp_path):
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, "-m", "hyspec_jax.bench.serve_overhead", "--concurrency", "1,2",
                        "--num-requests", "3", "--max-tokens", "5", "--reps", "1", "--step-ms", "0.5",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert [row["concurrency"] for row in d["results"]] == [1, 2]
    for row in d["results"]:
        assert row["ok"] == 3 and row["output_tokens"] == 15 and row["server"] == "new"
        assert row["device"]["steps"] >= 5 and 0 < row["device"]["busy_fraction"] <= 1
        assert set(row["server_cpu_us_per_token"]) == {"main", "scheduler", "other", "total"}
    assert {s["concurrency"] for s in d["summary"]} == {1, 2}


def test_harness_runs_a_variant_with_server_flags(tmp_path):
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, "-m", "hyspec_jax.bench.serve_overhead", "--concurrency", "2",
                        "--num-requests", "4", "--max-tokens", "6", "--reps", "1", "--step-ms", "0.5",
                        "--tokens-per-step-max", "3", "--prefill-ms", "0.3",
                        "--variant", "wait=--max-queue 8", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert [row["server"] for row in rows] == ["new", "wait"]
    for row in rows:
        assert row["ok"] == 4 and row["output_tokens"] == 24 and row["device"]["prefill_calls"] >= 1


@pytest.mark.parametrize("flags,message", [
    (["--base", "/nonexistent"], "--base /nonexistent"),
    (["--variant", "nolabel"], "--variant must be LABEL=FLAGS"),
    (["--variant", "w=--max-queue x"], "--variant w: argument --max-queue"),
    (["--variant", "w=--no-such-flag"], "--variant w: not `hyspec serve` flags"),
])
def test_harness_flag_errors_are_one_line(flags, message):
    r = subprocess.run([sys.executable, "-m", "hyspec_jax.bench.serve_overhead"] + flags,
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(f"serve_overhead: error: {message}"), r.stderr

