"""Multi-host runs on one machine, for the multi-host tests: N processes of `python -m hyspec_jax.cli ARGS`, each
with D fake CPU devices, under one `jax.distributed` coordinator on loopback (gloo collectives between them)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    """The processes of one command; their output goes to files (a full pipe would stall one process, and with it
    every other at the next collective)."""
    procs: list[subprocess.Popen]
    logs: list[tuple]

    def wait(self, timeout: float = 600) -> list[str]:
        """Every process's stdout, once all exited 0 (else an AssertionError with the tail of each stderr)."""
        try:
            for p in self.procs:
                p.wait(timeout=timeout)
        finally:
            for p in self.procs:
                p.kill()
        outs, errs = [], []
        for out, err in self.logs:
            out.seek(0)
            err.seek(0)
            outs.append(out.read())
            errs.append(err.read())
            out.close()
            err.close()
        assert [p.returncode for p in self.procs] == [0] * len(self.procs), [e[-3000:] for e in errs]
        return outs


def launch(args: list[str], processes: int, devices: int, env: dict[str, str] | None = None,
           program: list[str] | None = None) -> Run:
    """Start `hyspec ARGS` (or `program ARGS`: another command that runs `launch.init_distributed`) as `processes`
    processes of `devices` fake CPU devices each (one process: no coordinator); returns at once."""
    base = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **(env or {}))
    if processes > 1:
        base.update(HYSPEC_COORDINATOR=f"127.0.0.1:{free_port()}", HYSPEC_NUM_PROCESSES=str(processes))
    cmd = [*(program or [sys.executable, "-m", "hyspec_jax.cli"]), *args]
    procs, logs = [], []
    for i in range(processes):
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by wait)
        env_i = dict(base, HYSPEC_PROCESS_ID=str(i)) if processes > 1 else base
        procs.append(subprocess.Popen(cmd, env=env_i, stdout=out, stderr=err, text=True))
        logs.append((out, err))
    return Run(procs, logs)
