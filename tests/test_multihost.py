"""Multi-host on JAX's own runtime, on one machine: two processes with two fake CPU devices each
(`jax.distributed` over loopback, gloo collectives) run `hyspec generate --tensor-parallel-size 4` over the
global mesh; process 0 prints the same greedy tokens as one process on one device, process 1 prints nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

PROMPT = "In the beginning"
ARGS = ["generate", "--max-tokens", "6", "--temperature", "0", "--spec-mode", "ar", "--json"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _json_line(out: str) -> dict:
    lines = [x for x in out.splitlines() if x.startswith("{")]     # gloo logs its connections on stdout too
    assert len(lines) == 1, out
    return json.loads(lines[0])


def test_two_processes_equal_one(capsys):
    from hyspec_jax import cli
    assert cli.main(ARGS + [PROMPT]) == 0
    want = _json_line(capsys.readouterr().out)["token_ids"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", HYSPEC_PROGRAM_CACHE="0",
               HYSPEC_COORDINATOR=f"127.0.0.1:{_free_port()}", HYSPEC_NUM_PROCESSES="2")
    cmd = [sys.executable, "-m", "hyspec_jax.cli"] + ARGS + ["--tensor-parallel-size", "4", PROMPT]
    procs = [subprocess.Popen(cmd, env=dict(env, HYSPEC_PROCESS_ID=str(i)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert _json_line(outs[0][0])["token_ids"] == want
    assert not [x for x in outs[1][0].splitlines() if x.startswith("{")]
