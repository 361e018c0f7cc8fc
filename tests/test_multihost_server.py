"""Multi-host `hyspec serve` on JAX's own runtime, on one machine: two processes with two fake CPU devices each
(`jax.distributed` over loopback, gloo collectives) serve the embedded model with --tensor-parallel-size 4 over the
global mesh. Process 0 holds the HTTP server and the scheduler and sends each device call to process 1
(`runtime/multihost.py`). Completions through the official `openai` client (one streamed) give the tokens of a
plain greedy decode in one process; SIGTERM to process 0 drains it, and both processes exit 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow_module   # scheduled first by bin/test (tests/conftest.py)

try:
    from tests.multihost_runs import free_port  # noqa: E402
except ImportError:     # before the multi-host test helpers moved to tests/multihost_runs.py
    from tests.test_multihost import _free_port as free_port  # noqa: E402

PROMPTS = ("In the beginning", "The cat sat on")
MAX_TOKENS = 8
STARTUP_TIMEOUT = 400
ARGS = ["--port", "0", "--tensor-parallel-size", "4", "--max-batch", "2", "--prefill-chunk", "16",
        "--max-model-len", "64", "--served-model-name", "default"]
LOGPROBS = {"ar": "2", "chain": "0"}      # the scoring programs compile in one case only


def _launch(mode: str, root: Path) -> tuple[list[subprocess.Popen], list[Path]]:
    env = dict(os.environ, HYSPEC_PROGRAM_CACHE="0", HYSPEC_COORDINATOR=f"127.0.0.1:{free_port()}",
               HYSPEC_NUM_PROCESSES="2",
               # two fake devices per process; the cheaper backend optimisation level of tests/test_server.py
               XLA_FLAGS="--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0")
    cmd = [sys.executable, "-m", "hyspec_jax.serve", "--spec-mode", mode, "--max-logprobs", LOGPROBS[mode]] + ARGS
    procs, logs = [], []
    for i in (0, 1):
        log = root / f"{mode}-{i}.log"
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(cmd, env=dict(env, HYSPEC_PROCESS_ID=str(i)), stdout=f,
                                          stderr=subprocess.STDOUT))
        logs.append(log)
    return procs, logs


def _wait_port(procs: list[subprocess.Popen], logs: list[Path]) -> int:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        m = re.search(r"on http://127\.0\.0\.1:(\d+)", logs[0].read_text(errors="replace"))
        if m:
            return int(m.group(1))
        for p, log in zip(procs, logs):
            if p.poll() is not None:
                pytest.fail(f"{log.name} exited with {p.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"server did not start in {STARTUP_TIMEOUT}s:\n{logs[0].read_text(errors='replace')[-3000:]}")


PENALTIES = dict(frequency_penalty=0.5, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def oracle():
    """Plain greedy decoding in this process, on one device: token ids per prompt (and the prompts' ids)."""
    from hyspec_jax.embedded import default_model_dir
    from hyspec_jax.runtime.engine import Engine
    from hyspec_jax.io.hf import load_pretrained
    from hyspec_jax.sampling import SamplingParams
    from hyspec_jax.tokenizer import load_tokenizer
    model_dir = default_model_dir()
    if model_dir is None:
        pytest.skip("no embedded model")
    tok = load_tokenizer(model_dir)
    ids = [tok.encode(p).ids for p in PROMPTS]
    _, model = load_pretrained(model_dir)
    gen = Engine(model)
    res = gen.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    pen = gen.generate(ids[:1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **PENALTIES))[0]
    return ids, [r.token_ids for r in res], pen.token_ids


@pytest.mark.parametrize("mode", ["ar", "chain"])
def test_two_process_server_equals_one_process(mode, oracle, tmp_path):
    procs, logs = _launch(mode, tmp_path)
    try:
        port = _wait_port(procs, logs)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        ids, want, want_penalized = oracle
        body = {"ignore_eos": True, "return_token_ids": True}
        r = client.completions.create(model="default", prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body=body)
        got = {c.index: c.model_extra["token_ids"] for c in r.choices}
        assert [got[i] for i in range(len(ids))] == want
        streamed = []
        for ch in client.completions.create(model="default", prompt=ids[1], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, extra_body=body):
            streamed += ch.choices[0].model_extra.get("token_ids") or []
        assert streamed == want[1]
        # penalized programs run on both processes too (the history is each process's device state)
        r = client.completions.create(model="default", prompt=ids[0], max_tokens=MAX_TOKENS, temperature=0,
                                      frequency_penalty=PENALTIES["frequency_penalty"],
                                      extra_body={**body, "repetition_penalty": PENALTIES["repetition_penalty"]})
        assert r.choices[0].model_extra["token_ids"] == want_penalized
        if mode == "ar":      # the programs' logprobs, and the echoed prompt's scoring forward on both processes
            r = client.completions.create(model="default", prompt=ids[0], max_tokens=2, temperature=0, logprobs=1,
                                          echo=True, extra_body=body)     # too (`BroadcastScorer`)
            lp = r.choices[0].logprobs
            assert r.choices[0].model_extra["token_ids"] == want[0][:2]
            assert len(lp.token_logprobs) == len(ids[0]) + 2 and lp.token_logprobs[0] is None
            assert all(x <= 0 for x in lp.token_logprobs[1:])
        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(120) for p in procs]
        assert codes == [0, 0], [log.read_text(errors="replace")[-3000:] for log in logs]
        assert "following process 0" in logs[1].read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
