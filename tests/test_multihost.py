"""Multi-host on JAX's own runtime, on one machine: two processes with two fake CPU devices each
(`jax.distributed` over loopback, gloo collectives) run `hyspec generate --tensor-parallel-size 4` over the
global mesh; process 0 prints the same greedy tokens as one process on one device, process 1 prints nothing."""

from __future__ import annotations

import json

import pytest

try:
    from tests.multihost_runs import launch
except ImportError:
    from multihost_runs import launch

pytestmark = pytest.mark.slow_module   # scheduled first by bin/test (tests/conftest.py)

PROMPT = "In the beginning"
ARGS = ["generate", "--max-tokens", "6", "--temperature", "0", "--spec-mode", "ar", "--json"]


def _json_line(out: str) -> dict:
    lines = [x for x in out.splitlines() if x.startswith("{")]     # gloo logs its connections on stdout too
    assert len(lines) == 1, out
    return json.loads(lines[0])


def test_two_processes_equal_one(capsys):
    from hyspec_jax import cli
    assert cli.main(ARGS + [PROMPT]) == 0
    want = _json_line(capsys.readouterr().out)["token_ids"]
    outs = launch(ARGS + ["--tensor-parallel-size", "4", PROMPT], processes=2, devices=2,
                  env={"HYSPEC_PROGRAM_CACHE": "0"}).wait()
    assert _json_line(outs[0])["token_ids"] == want
    assert not [x for x in outs[1].splitlines() if x.startswith("{")]
