"""The OpenAI-compatible server: a real `hyspec serve` process on loopback, driven by the official `openai`
client and raw HTTP, against `hyspec_jax.runtime.engine.Engine` (plain decoding) run alone on each prompt as the oracle (and a direct
forward of the target for logprobs).

Three servers per module (a tiny random model in a tmp dir, byte-level tokenizer, a Jinja chat template): plain
decoding with an API key (from the environment), a short request-read timeout, a connection cap and CORS; a
chain speculative one launched the vLLM way (MODEL positional, --speculative-config, --max-num-seqs); a tree
one. The plain server's last test sends SIGTERM and checks the drain.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from hyspec_jax.config import FULL, LINEAR, DrafterConfig, TargetConfig  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hyspec_jax.serve.chat import ChatTemplate, chatml  # noqa: E402
from hyspec_jax.serve.text import ChoiceText, IncrementalDetokenizer  # noqa: E402
from hyspec_jax.tokenizer import byte_level_tokenizer  # noqa: E402

CONTEXT = 256
SLOTS = 8
QUEUE = 32
CHUNK = 32
GAMMA = 4
TREE_DEPTH, TREE_NODES = 3, 6      # the tree server: 3 levels of top-2 children (beam 3), 6 verified nodes per slot
NAME = "tiny-test"
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]: {% endif %}")
STARTUP_TIMEOUT = 300
API_KEY = "sk-test-key"
READ_TIMEOUT = 3          # the plain server's --request-read-timeout
MAX_CONNECTIONS = 100     # the plain server's --max-connections (the 429 test opens 60 connections)
ORIGIN = "http://example.test"


def parse_text(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples by name, read by prometheus_client's own parser."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out.setdefault(smp.name, []).append((dict(smp.labels), smp.value))
    return out


def _tiny_dir(root: Path) -> Path:
    from hyspec_jax.io.hf import save_pretrained
    from hyspec_jax.models.target import create_model
    tok = byte_level_tokenizer()
    V = tok.get_vocab_size()
    cfg = TargetConfig(model_type="qwen3_5_text", vocab_size=V, hidden_size=64, num_hidden_layers=3,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
                       layer_types=(LINEAR, FULL, LINEAR), linear_num_key_heads=1, linear_num_value_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16, eos_token_id=(V - 1,))
    out = root / NAME
    save_pretrained(create_model(cfg, seed=5), out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE,
                                                           "eos_token": "<|endoftext|>"}))
    return out


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path, model_dir: Path):
        self.proc, self.port, self.log, self.model_dir = proc, port, log, model_dir
        self.base = f"http://127.0.0.1:{port}"

    def client(self, api_key: str | None = None, **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key or self.api_key, max_retries=0,
                             timeout=120, **kw)

    @property
    def api_key(self) -> str:
        return API_KEY if self.log.name == "server.log" else "unused"

    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"}

    def raw(self, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None):
        """One HTTP/1.1 request on a fresh connection -> (status, headers, body bytes)."""
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request(method, path, body=body, headers={**self.auth(), **(headers or {})})
            r = conn.getresponse()
            return r.status, r.headers, r.read()
        finally:
            conn.close()

    def metrics(self) -> dict:
        return parse_text(self.metrics_text())

    def metrics_text(self) -> str:
        status, _, body = self.raw("GET", "/metrics")
        assert status == 200
        return body.decode()


def _value(m: dict, name: str, **labels) -> float:
    return sum(v for lab, v in m.get(name, []) if all(lab.get(k) == str(x) for k, x in labels.items()))


def _drafter_dir(root: Path, model_dir: Path) -> Path:
    from hyspec_jax.io.drafter_io import save_drafter
    from hyspec_jax.models import drafter as D
    tcfg = TargetConfig.from_pretrained(model_dir)
    dcfg = DrafterConfig.from_target(tcfg, num_layers=1, target_layer_ids=(0, 1), markov_rank=8,
                                       block_size=GAMMA)
    out = root / "drafter"
    save_drafter(D.create_drafter(dcfg, seed=1), out)
    return out


def _own_hyspec_cache(root: Path) -> dict[str, str]:
    """A hyspec cache of this run's own (the start-up calibration's kept times: a re-run must time again), the
    compilation cache still the shared one."""
    from hyspec_jax.compilation import compilation_cache_dir
    from hyspec_jax.paths import cache_dir
    own = root / "hyspec"
    own.mkdir(exist_ok=True)
    (cache_dir() / "kernels").mkdir(parents=True, exist_ok=True)
    (own / "kernels").symlink_to(cache_dir() / "kernels", target_is_directory=True)    # built once, shared
    return {"HYSPEC_CACHE": str(own), "HYSPEC_JAX_CACHE": str(compilation_cache_dir())}


def _launch(cmd: list[str], log: Path, **env_extra: str) -> subprocess.Popen:
    env = dict(os.environ, **env_extra)
    # Test-only: a cheaper XLA backend optimisation level roughly halves the CPU compile time of the buckets.
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Start the servers (an AR one, a chain and a tree speculative one); they compile their buckets while the
    oracle compiles."""
    root = tmp_path_factory.mktemp("serve")
    model_dir = _tiny_dir(root)
    drafter_dir = _drafter_dir(root, model_dir)
    serve = [sys.executable, "-m", "hyspec_jax.serve"]
    base = ["--served-model-name", NAME, "--port", "0", "--max-model-len", str(CONTEXT), "--drain-timeout", "60"]
    spec = json.dumps({"method": "chain", "model": str(drafter_dir), "num_speculative_tokens": GAMMA})
    procs = {
        "ar": (_launch(serve + ["--model", str(model_dir)] + base + [
            "--max-batch", str(SLOTS), "--max-queue", str(QUEUE), "--prefill-chunk", str(CHUNK),
            "--request-read-timeout", str(READ_TIMEOUT), "--max-connections", str(MAX_CONNECTIONS),
            "--allowed-origins", json.dumps([ORIGIN]), "--max-body-bytes", "65536", "--max-logprobs", "5"],
            root / "server.log", HYSPEC_API_KEY=API_KEY), root / "server.log"),
        "chain": (_launch(serve + [str(model_dir)] + base + [
            "--speculative-config", spec, "--max-num-seqs", "4", "--prefill-chunk", "16", "--seed", "7",
            "--dtype", "float32", "--tensor-parallel-size", "1", "--disable-log-requests"],
            root / "server-chain.log"), root / "server-chain.log"),
        "tree": (_launch(serve + ["--model", str(model_dir)] + base + [
            "--spec-mode", "tree", "--drafter", str(drafter_dir), "--max-batch", "4", "--prefill-chunk", "16",
            "--tree-depth", str(TREE_DEPTH), "--tree-topk", "2", "--tree-beam", "3", "--verify-nodes",
            str(TREE_NODES), "--max-logprobs", "0"], root / "server-tree.log"), root / "server-tree.log"),
        # no budget table: the verify width chosen each round from round times the server takes at start-up
        "calibrated": (_launch(serve + ["--model", str(model_dir)] + base + [
            "--spec-mode", "tree", "--drafter", str(drafter_dir), "--max-batch", "2", "--prefill-chunk", "16",
            "--tree-depth", str(TREE_DEPTH), "--tree-topk", "2", "--tree-beam", "3", "--verify-nodes",
            str(TREE_NODES), "--max-logprobs", "0", "--startup-calibration", "2"], root / "server-calibrated.log",
            **_own_hyspec_cache(root)), root / "server-calibrated.log"),
    }
    yield procs, model_dir
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)


def _wait_port(proc: subprocess.Popen, log: Path, model_dir: Path) -> "Server":
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        m = re.search(r"on http://127\.0\.0\.1:(\d+)", text)
        if m:
            return Server(proc, int(m.group(1)), log, model_dir)
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{text}")
        time.sleep(0.2)
    pytest.fail(f"server did not start in {STARTUP_TIMEOUT}s:\n{log.read_text(errors='replace')}")


@pytest.fixture(scope="module")
def oracle(launched):
    """Plain decoding, greedy / seeded sampling on one prompt alone (the same model directory the server loads)."""
    from hyspec_jax.compilation import enable_compilation_cache
    from hyspec_jax.runtime.engine import Engine
    from hyspec_jax.io.hf import load_pretrained
    from hyspec_jax.sampling import SamplingParams
    enable_compilation_cache()     # as `hyspec generate` does (and the server): re-runs skip XLA compiles
    cfg, model = load_pretrained(launched[1])
    gen = Engine(model)
    eos = cfg.eos_token_id
    cache = {}

    def run(ids, max_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=0, stop_ids=eos, **penalties):
        key = (tuple(ids), max_tokens, temperature, top_p, top_k, seed, tuple(stop_ids),
               tuple(sorted(penalties.items())))
        if key not in cache:
            p = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                               stop_token_ids=tuple(stop_ids), **penalties)
            res = gen.generate([list(ids)], p)[0]
            cache[key] = (res.token_ids, res.finish_reason)
        return cache[key]
    for n in (16, 32, 64):     # compile the prompt buckets the tests use now, while the server compiles
        run([1] * n, 2)
    return run


@pytest.fixture(scope="module")
def server(launched, oracle):
    procs, model_dir = launched
    return _wait_port(*procs["ar"], model_dir)


@pytest.fixture(scope="module")
def spec_server(launched, oracle):
    procs, model_dir = launched
    return _wait_port(*procs["chain"], model_dir)


@pytest.fixture(scope="module")
def tree_server(launched, oracle):
    procs, model_dir = launched
    return _wait_port(*procs["tree"], model_dir)


@pytest.fixture(scope="module")
def calibrated_server(launched, oracle):
    procs, model_dir = launched
    return _wait_port(*procs["calibrated"], model_dir)


TOK = byte_level_tokenizer()
EOS = TOK.get_vocab_size() - 1


def enc(text: str) -> list[int]:
    return TOK.encode(text).ids


def dec(ids: list[int]) -> str:
    return TOK.decode([t for t in ids if t != EOS], skip_special_tokens=True)


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


def complete(client, stream: bool, **kw) -> tuple[list[int], str, str | None]:
    """One completion through the official client, streamed or not: (token ids, text, finish reason)."""
    if not stream:
        r = client.completions.create(**kw)
        return extra(r.choices[0], "token_ids"), r.choices[0].text, r.choices[0].finish_reason
    ids, text, why = [], "", None
    for ch in client.completions.create(stream=True, **kw):
        ids += extra(ch.choices[0], "token_ids") or []
        text += ch.choices[0].text
        why = ch.choices[0].finish_reason or why
    return ids, text, why


# ------------------------------------------------------------------------------------------------
# Host-side pieces (no server)
# ------------------------------------------------------------------------------------------------
def test_incremental_detokenizer_concatenates_to_full_decode():
    rng = np.random.default_rng(0)
    texts = ["héllo wörld ✓ 日本語 🙂", "plain ascii", "ﬁ€𝄞"]
    for text in texts:
        ids = enc(text)
        d = IncrementalDetokenizer(TOK)
        out = "".join(d.push(t) for t in ids) + d.flush()
        assert out == text
    for _ in range(20):   # random bytes: invalid UTF-8 included
        ids = [int(x) for x in rng.integers(0, EOS, size=int(rng.integers(1, 40)))]
        d = IncrementalDetokenizer(TOK)
        parts = [d.push(t) for t in ids]
        assert "".join(parts) + d.flush() == TOK.decode(ids)


def test_choice_text_stop_string_holds_back_partial_matches():
    ids = enc("abc STOP def")
    c = ChoiceText(TOK, ("STOP",), frozenset())
    sent = []
    for t in ids[:-1]:
        assert not c.feed([t], None) or c.finish == "stop"
        sent.append(c.take()[0])
        if c.finish:
            break
    assert c.finish == "stop"
    assert "".join(sent) + c.take()[0] == "abc "
    assert c.completion_tokens == len(enc("abc STOP"))
    assert all("S" not in s for s in sent[:-1])


def test_chat_template_fallback_is_chatml(tmp_path):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    t = ChatTemplate(tmp_path, TOK)
    assert t.kind == "fallback ChatML"
    assert t.render(msgs) == chatml(msgs) == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi"
                                              "<|im_end|>\n<|im_start|>assistant\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    t = ChatTemplate(tmp_path, TOK)
    assert t.render(msgs) == "[system]: be brief\n[user]: hi\n[assistant]: "


def test_stream_chunk_template_renders_what_a_whole_chunk_does():
    from hyspec_jax.serve.app import ChunkTemplate, _sse
    head = {"id": "cmpl-x", "object": "text_completion", "created": 7, "model": "m \"q\" ✓"}
    for tail in ({}, {"usage": None}):
        render = ChunkTemplate(head, tail)
        for choice in ({"index": 0, "text": "héllo \n\"x\"", "logprobs": None, "finish_reason": None},
                       {"index": 3, "delta": {}, "logprobs": None, "finish_reason": "stop", "token_ids": [1, 2]}):
            assert render(choice) == _sse({**head, "choices": [choice], **tail})
        for text in ("", "héllo \n\"x\" \\ \u2028 \x01 ✓"):
            for ids in (None, [], [5, 123456]):
                extra = {} if ids is None else {"token_ids": ids}
                base = {"index": 2, "logprobs": None, "finish_reason": None, **extra}
                assert render.text(2, "text", text, ids) == render({"index": 2, "text": text, **base})
                assert render.text(2, "delta", text, ids) == render({"index": 2, "delta": {"content": text}, **base})


def test_a_failed_engine_stops_the_server_with_its_error():
    """The request loop's failure (a device error) stops the server: uvicorn is told to exit, new requests get 503
    naming the error in one line (not "shutting down"), and /health's message is the same line."""
    from types import SimpleNamespace
    from hyspec_jax.serve.app import APIError, OpenAIServer, engine_error
    from hyspec_jax.serve.server import _stop_on_engine_failure
    err = RuntimeError("RESOURCE_EXHAUSTED: out of memory trying to instantiate a command buffer\n" + "x" * 500)
    assert engine_error(err) == "RuntimeError: RESOURCE_EXHAUSTED: out of memory trying to instantiate a command buffer"
    assert len(engine_error(RuntimeError("y" * 1000))) == 300 and engine_error(ValueError()) == "ValueError"
    sched = SimpleNamespace(failed=None, on_batch=None)
    front = OpenAIServer(scheduler=sched, tokenizer=None, chat=None, model=None, metrics=None, options=None)
    userver = SimpleNamespace(should_exit=False)
    assert front.unavailable().message == "the server is shutting down"
    sched.failed = err
    _stop_on_engine_failure(front, userver)(err)
    assert userver.should_exit and front.draining
    e = front.unavailable()
    assert isinstance(e, APIError) and e.status == 503
    assert e.message == f"the engine failed ({engine_error(err)}); the server is stopping"


def test_step_histogram_exposes_what_prometheus_histogram_does():
    """The ITL histogram, observed a step at a time, renders the samples of prometheus_client's own Histogram fed
    the same values one by one (bucket edges included)."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from hyspec_jax.serve.metrics import ITL_BUCKETS, StepHistogram
    values = [0.0, 0.01, 0.0100001, 0.3, 79.9, 80.0, 81.0, 1e-4, 2.5]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    h = StepHistogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                      ITL_BUCKETS, "m", ours)
    h.observe_many(values[:4])
    h.observe_many([])
    h.observe_many(values[4:])
    ref = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                    ("model_name",), registry=theirs, buckets=ITL_BUCKETS).labels(model_name="m")
    for v in values:
        ref.observe(v)
    assert generate_latest(ours) == generate_latest(theirs)


def test_inbox_wakes_a_waiting_take_with_everything_put():
    import asyncio

    from hyspec_jax.serve.app import Inbox

    async def main():
        box = Inbox()
        waiter = asyncio.create_task(box.take())
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        loop.call_soon(box.put_nowait, 1)
        loop.call_soon(box.put_nowait, 2)
        first = await waiter
        box.put_nowait(3)
        return first, await box.take(), box.items
    assert asyncio.run(main()) == ([1, 2], [3], [])


def test_handoff_wakes_the_event_loop_once_per_flush_and_loses_nothing():
    """Items put from another thread reach their queues in order, with at most one wake-up per flush (a whole
    step's tokens for every request in one), also when puts race the event loop's delivery."""
    import asyncio
    import threading

    from hyspec_jax.serve.app import Handoff, Inbox

    class Counted(Handoff):
        wakeups = 0

        def _deliver(self):
            Counted.wakeups += 1
            super()._deliver()

    async def main():
        h = Counted()
        h.loop = asyncio.get_running_loop()
        queues = [Inbox(), Inbox()]
        steps, done = 2000, threading.Event()

        def producer():
            for k in range(steps):
                for q in queues:
                    h.put(q, k)
                h.flush()
            done.set()
        threading.Thread(target=producer).start()
        got = [[], []]
        while len(got[0]) < steps or len(got[1]) < steps:
            for q, g in zip(queues, got):
                if q.items:
                    g += await q.take()
            await asyncio.sleep(0)
        assert done.wait(10)
        assert got == [list(range(steps))] * 2
        assert 1 <= Counted.wakeups <= steps
    asyncio.run(main())


def test_stream_events_coalesce_what_is_queued():
    """Events queued for a choice by the time its stream runs are sent as one chunk with all their tokens."""
    import asyncio
    import types

    from hyspec_jax.serve.app import Choice, FrontOptions, Inbox, OpenAIServer, ServedModel

    aborted = []
    sched = types.SimpleNamespace(abort=lambda er, reason="abort": aborted.append(reason))
    model = ServedModel(name=NAME, root="", max_model_len=CONTEXT, vocab_size=TOK.get_vocab_size(),
                        eos_token_ids=frozenset(), mode="ar", created=0)
    srv = OpenAIServer(scheduler=sched, tokenizer=TOK, chat=None, model=model, metrics=None, options=FrontOptions())

    class Req:
        async def receive(self):
            await asyncio.sleep(3600)

    async def main():
        choices = [Choice(0, 0, ChoiceText(TOK, (), frozenset()))]
        choices[0].engine = types.SimpleNamespace(finished=True)
        queue = Inbox()
        ids = enc("hello")
        for k, t in enumerate(ids):
            queue.put_nowait((0, [t], "length" if k == len(ids) - 1 else None, None))
        chunks = []
        async for c in srv.events(Req(), choices, queue):
            chunks.append(c.text.take())
        return chunks
    assert asyncio.run(main()) == [("hello", enc("hello"))]
    assert aborted == []


def test_streamed_logprobs_arrive_with_their_tokens_and_score_nothing():
    """A streamed completion with logprobs renders each chunk's from what arrived with its tokens (the request
    loop's programs computed them): the scoring forward runs 0 times for it (once per request was the echo's,
    for the prompt, where it ran once per chunk over the whole sequence), and the values equal the scorer's over
    the finished sequence. The front end in-process (its scorer spied on), driven by the official client."""
    import asyncio

    import httpx

    from hyspec_jax.models.target import create_model
    from hyspec_jax.runtime.engine import Engine
    from hyspec_jax.runtime.scheduler import Scheduler
    from hyspec_jax.runtime.scoring import Scorer
    from hyspec_jax.serve.app import FrontOptions, OpenAIServer, ServedModel, build_app
    from hyspec_jax.serve.metrics import ServerMetrics
    from tests.test_engine import TCFG

    k, kv = 3, 128
    eng = Engine(create_model(TCFG, seed=0))
    backend = eng.backend(2, kv, logprobs=k)
    scorer = Scorer(eng.tgraph, eng.tparams, max_len=kv, top_k=k)
    calls = []

    class Spy:
        def score(self, ids, start=1):
            calls.append((len(ids), start))
            return scorer.score(ids, start)
    metrics = ServerMetrics(NAME)
    sched = Scheduler(backend, metrics)
    model = ServedModel(name=NAME, root="", max_model_len=kv - 1, vocab_size=TCFG.vocab_size,
                        eos_token_ids=frozenset(), mode="ar", created=0)
    srv = OpenAIServer(scheduler=sched, tokenizer=TOK, chat=None, model=model, metrics=metrics,
                       options=FrontOptions(max_logprobs=k, log_requests=False), scorer=Spy(), version="test")
    prompt = enc("stream my logprobs")

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(srv)), base_url="http://test")
        client = openai.AsyncOpenAI(api_key="none", base_url="http://test/v1", http_client=http)
        out = {}
        for echo in (False, True):
            ids, lps, tops = [], [], []
            stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                                     logprobs=k, echo=echo, stream=True,
                                                     extra_body={"return_token_ids": True, "ignore_eos": True})
            async for ch in stream:
                c = ch.choices[0]
                ids += extra(c, "token_ids") or []
                if c.logprobs is not None:
                    lps += c.logprobs.token_logprobs
                    tops += c.logprobs.top_logprobs
            out[echo] = ids, lps, tops, len(calls)
        await http.aclose()
        return out
    sched.start()
    try:
        out = asyncio.run(main())
    finally:
        sched.stop()
        sched.join(10)
    ids, lps, tops, n_calls = out[False]
    assert len(ids) == 12 and n_calls == 0, calls
    want = scorer.score(prompt + ids, len(prompt))
    np.testing.assert_allclose(lps, want.logprobs, atol=1e-4)
    for top, best in zip(tops, want.top_logprobs):     # the best alternative (tokens of equal text merge)
        np.testing.assert_allclose(max(top.values()), best[0], atol=1e-4)
    ids, lps, tops, n_calls = out[True]
    assert n_calls == 1 and calls[0] == (len(prompt), 1)          # the echoed prompt's, once
    assert lps[0] is None and len(lps) == len(prompt) + 12
    np.testing.assert_allclose(lps[1:], scorer.score(prompt + ids, 1).logprobs, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# The server
# ------------------------------------------------------------------------------------------------
def test_health_and_models(server):
    status, _, body = server.raw("GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    assert extra(models.data[0], "max_model_len") == CONTEXT


def test_completion_greedy_equals_generator(server, oracle):
    client = server.client()
    prompt = "The quick brown fox"
    want, why = oracle(enc(prompt), 20)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0,
                                  extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert extra(c, "token_ids") == want
    assert c.text == dec(want)
    assert c.finish_reason == why
    assert r.usage.prompt_tokens == len(enc(prompt))
    assert r.usage.completion_tokens == len(want)
    assert r.usage.total_tokens == len(enc(prompt)) + len(want)
    # token-id prompts are the same request
    r2 = client.completions.create(model=NAME, prompt=enc(prompt), max_tokens=20, temperature=0)
    assert r2.choices[0].text == c.text
    # a list of prompts: one choice each, usage summed
    other, _ = oracle(enc("x"), 20)
    r3 = client.completions.create(model=NAME, prompt=[prompt, "x"], max_tokens=20, temperature=0)
    assert [ch.index for ch in r3.choices] == [0, 1]
    assert [ch.text for ch in r3.choices] == [dec(want), dec(other)]
    assert r3.usage.prompt_tokens == len(enc(prompt)) + 1
    assert r3.usage.completion_tokens == len(want) + len(other)


def test_completion_stream_equals_non_stream(server, oracle):
    client = server.client()
    prompt = "Streaming, please"
    want, why = oracle(enc(prompt), 24)
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(ch.usage is None for ch in chunks[:-1])
    text = "".join(ch.choices[0].text for ch in chunks[:-1])
    assert text == dec(want)
    assert [ch.choices[0].finish_reason for ch in chunks[:-1]][-1] == why
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-2])
    assert chunks[-1].usage.prompt_tokens == len(enc(prompt))
    assert chunks[-1].usage.completion_tokens == len(want)
    # the wire format ends with the [DONE] sentinel
    status, headers, body = server.raw("POST", "/v1/completions", json.dumps(
        {"prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": True}), {"Content-Type": "application/json"})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_chat_uses_template_stream_and_usage(server, oracle):
    client = server.client()
    msgs = [{"role": "system", "content": "terse"}, {"role": "user", "content": "Hi!"}]
    ids = enc("[system]: terse\n[user]: Hi!\n[assistant]: ")
    want, why = oracle(ids, 16)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=16, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(want)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == dec(want)
    assert r.choices[0].finish_reason == why
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_completion_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == dec(want)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == why
    assert chunks[-1].usage.completion_tokens == len(want) and chunks[-1].usage.prompt_tokens == len(ids)


def test_32_concurrent_requests_equal_each_prompt_alone(server, oracle):
    """Greedy prompts of different lengths (some longer than the prefill chunk) and seeded sampled prompts with
    their own temperature/top-p/top-k, all in flight together over 8 slots: each equals its prompt run alone."""
    rng = np.random.default_rng(1)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    jobs = []
    for i in range(32):
        n = int(rng.integers(1, 12)) if i % 5 else int(rng.integers(10, 16))   # some prompts of 33..64 tokens
        prompt = (f"{i}: " + " ".join(rng.choice(words, n)))[:64]
        sp = dict(temperature=0.0, top_p=1.0, top_k=0, seed=0)
        if i % 8 == 3:
            sp = dict(temperature=float(rng.uniform(0.5, 1.5)), top_p=float(rng.uniform(0.5, 1.0)),
                      top_k=int(rng.integers(0, 40)), seed=int(rng.integers(0, 2**31)))
        jobs.append((prompt, int(rng.integers(4, 17)), sp, i % 4 == 1))
    assert any(len(enc(p)) > CHUNK for p, *_ in jobs)
    wants = [oracle(enc(p), m, **sp) for p, m, sp, _ in jobs]
    client = server.client()

    def call(job):
        prompt, m, sp, stream = job
        body = {"return_token_ids": True, "top_k": sp["top_k"]}
        return complete(client, stream, model=NAME, prompt=prompt, max_tokens=m, temperature=sp["temperature"],
                        top_p=sp["top_p"], seed=sp["seed"], extra_body=body)

    before = server.metrics()
    with cf.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(call, jobs))
    after = server.metrics()
    tokens = sum(len(ids) for ids, _, _ in got)
    steps = _value(after, "hyspec:engine_steps_total", kind="decode") - _value(
        before, "hyspec:engine_steps_total", kind="decode")
    assert steps < 0.75 * tokens     # requests shared decoding steps (continuous batching, not one by one)
    for (prompt, *_), (want, why), (ids, text, fr) in zip(jobs, wants, got):
        assert ids == want, prompt
        assert text == dec(want), prompt
        assert fr == why


def test_long_prompt_is_chunked_between_decode_steps(server):
    """A 200-token prompt is prefilled in ⌈200/32⌉ = 7 chunks while a running stream keeps receiving tokens."""
    import threading
    client = server.client()
    times: list[float] = []
    started = threading.Event()

    def stream_a():
        for ch in client.completions.create(model=NAME, prompt="keep going", max_tokens=CONTEXT - 20,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "return_token_ids": True}):
            now = time.perf_counter()
            times.extend([now] * len(extra(ch.choices[0], "token_ids") or []))   # one per token (text may lag)
            if len(times) >= 5:
                started.set()

    t = threading.Thread(target=stream_a)
    t.start()
    assert started.wait(60)
    before = server.metrics()
    t0 = time.perf_counter()
    r = client.completions.create(model=NAME, prompt="y" * 200, max_tokens=1, temperature=0)
    t1 = time.perf_counter()
    after = server.metrics()
    t.join(120)
    assert r.usage.prompt_tokens == 200 and r.usage.completion_tokens == 1
    prefills = _value(after, "hyspec:engine_steps_total", kind="prefill") - _value(
        before, "hyspec:engine_steps_total", kind="prefill")
    assert prefills == 7
    assert times[-1] > t1                            # the stream outlived the long prompt's prefill
    assert sum(t0 < x < t1 for x in times) >= 5     # and kept receiving tokens between its 7 chunks


def test_stop_strings_and_stop_token_ids(server, oracle):
    client = server.client()
    prompt = "Stop me if you can"
    want, _ = oracle(enc(prompt), 40)
    pieces = [TOK.decode([t]) for t in want]
    printable = [len(p) == 1 and p.isascii() and p.isprintable() for p in pieces]
    k = next(k for k in range(1, len(want) - 1) if printable[k] and printable[k + 1]
             and (pieces[k] + pieces[k + 1]) not in dec(want[:k + 1]))
    stop = pieces[k] + pieces[k + 1]
    for stream in (False, True):
        kw = dict(model=NAME, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\x00never"])
        if stream:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            why = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            r = client.completions.create(**kw)
            text, why, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert text == dec(want[:k]), stream
        assert why == "stop"
        assert usage.completion_tokens == k + 2
    j = 6
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0,
                                  extra_body={"stop_token_ids": [want[j]], "return_token_ids": True})
    first = want.index(want[j])
    assert extra(r.choices[0], "token_ids") == want[:first + 1]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == dec(want[:first])


def _error(status: int, body: bytes) -> dict:
    obj = json.loads(body)
    assert set(obj) == {"error"} and {"message", "type", "param", "code"} <= set(obj["error"]), obj
    assert isinstance(obj["error"]["message"], str) and obj["error"]["message"]
    return obj["error"]


LONG_PROMPT = "x" * (CONTEXT + 10)
BAD = [
    # (path, body, status, param)
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/completions", "", 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stop": 7}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "model": 12}, 400, "model"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": CONTEXT}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 3}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [999]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -3}, 400,
     "frequency_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400,
     "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model"),
]


def test_bad_inputs_get_openai_errors_and_do_not_disturb_others(server, oracle):
    prompt = "A request that runs during the bad ones"
    want, _ = oracle(enc(prompt), 48)
    client = server.client()

    def good():
        ids = []
        for ch in client.completions.create(model=NAME, prompt=prompt, max_tokens=48, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True}):
            ids += extra(ch.choices[0], "token_ids") or []
        return ids

    with cf.ThreadPoolExecutor(2) as pool:
        bg = pool.submit(good)
        for path, body, status, param in BAD:
            raw = body if isinstance(body, str) else json.dumps(body)
            got, headers, out = server.raw("POST", path, raw, {"Content-Type": "application/json"})
            assert got == status, (body, out)
            err = _error(got, out)
            assert err["param"] == param, (body, err)
            assert err["code"] == status and err["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
        for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                     ("DELETE", "/v1/models", 405)]:
            got, _, out = server.raw(method, path)
            assert got == status
            _error(got, out)
        assert bg.result() == want
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="unknown", messages=[{"role": "user", "content": "x"}])
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0)
    assert r.choices[0].text == dec(want[:5]) and r.usage.completion_tokens == 5


def _send_raw(port: int, body: dict) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (API_KEY.encode(), len(data), data))
    return s


def _wait_idle(server, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if _value(m, "vllm:num_requests_running") == 0 and _value(m, "vllm:num_requests_waiting") == 0:
            return m
        time.sleep(0.05)
    raise AssertionError("server did not go idle")


def test_disconnect_mid_stream_frees_the_slot(server, oracle):
    before = server.metrics()
    s = _send_raw(server.port, {"prompt": "never ending", "max_tokens": CONTEXT - 20, "temperature": 0,
                                "stream": True, "ignore_eos": True})
    buf = b""
    while buf.count(b"data: ") < 3:
        buf += s.recv(4096)
    assert buf.startswith(b"HTTP/1.1 200")
    s.close()
    m = _wait_idle(server)
    assert _value(m, "hyspec:requests_aborted_total") == _value(before, "hyspec:requests_aborted_total") + 1
    generated = _value(m, "vllm:generation_tokens_total") - _value(before, "vllm:generation_tokens_total")
    assert 3 <= generated < CONTEXT - 20     # it stopped early: the slot was freed, not run to max_tokens
    prompt = "after the disconnect"
    want, _ = oracle(enc(prompt), 10)
    client = server.client()
    for _ in range(3):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
        assert r.choices[0].text == dec(want)


def test_full_queue_answers_429_and_others_complete(server, oracle):
    n = SLOTS + QUEUE + 20
    socks = [_send_raw(server.port, {"prompt": f"long {i}", "max_tokens": CONTEXT - 20, "temperature": 0,
                                     "stream": True, "ignore_eos": True}) for i in range(n)]
    statuses = []
    for s in socks:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
        statuses.append(int(head.split(b" ")[1]))
        if statuses[-1] == 429:
            body = head.split(b"\r\n\r\n", 1)[1]
            length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
            while len(body) < length:
                body += s.recv(4096)
            assert re.search(rb"(?i)\r\nretry-after: 1\r\n", head)
            err = _error(429, body)
            assert err["type"] == "RateLimitError" and err["code"] == 429
    assert statuses.count(429) >= 1 and statuses.count(200) >= SLOTS + QUEUE
    assert set(statuses) == {200, 429}
    for s in socks:
        s.close()
    _wait_idle(server)
    prompt = "queue drained"
    want, _ = oracle(enc(prompt), 8)
    r = server.client().completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].text == dec(want)


def test_metrics_parse_and_move(server):
    status, headers, body = server.raw("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = body.decode()
    try:
        from prometheus_client.parser import text_string_to_metric_families
        families = {f.name for f in text_string_to_metric_families(text)}
        assert {"vllm:num_requests_running", "vllm:time_to_first_token_seconds",
                "vllm:spec_decode_num_drafts"} <= families
    except ImportError:
        pass
    before = parse_text(text)
    prompt = "count me"
    r = server.client().completions.create(model=NAME, prompt=prompt, max_tokens=7, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7
    after = server.metrics()
    d = lambda name, **kw: _value(after, name, **kw) - _value(before, name, **kw)  # noqa: E731
    assert d("vllm:prompt_tokens_total") == len(enc(prompt))
    assert d("vllm:generation_tokens_total") == 7
    assert d("vllm:request_success_total", finished_reason="length") == 1
    assert d("vllm:time_to_first_token_seconds_count") == 1
    assert d("vllm:e2e_request_latency_seconds_count") == 1
    assert d("vllm:inter_token_latency_seconds_count") == 6
    assert d("hyspec:engine_steps_total", kind="decode") >= 6
    # the loop pipelines the steps of a lone request until its last one, and times its prefill
    assert 1 <= d("hyspec:engine_steps_ahead_total") < d("hyspec:engine_steps_total", kind="decode")
    assert d("hyspec:engine_prefill_seconds_total") > 0
    assert d("hyspec:engine_decode_dispatch_seconds_total") > 0 and d("hyspec:engine_decode_collect_seconds_total") > 0
    assert d("hyspec:request_errors_total") == 0
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:spec_decode_num_drafts_total",
                 "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"):
        assert name in after
    # every bucket was compiled at start-up: nothing the tests above did compiled anything new
    assert _value(after, "hyspec:compilations_at_startup") > 0
    assert _value(after, "hyspec:compilations_after_startup_total") == 0
    assert _value(after, "hyspec:request_errors_total", status="400") >= 20   # the bad-input test's


def test_speculative_chain_server_is_lossless_and_counts_drafts(spec_server, oracle):
    """--spec-mode chain (a random DSpark drafter, γ = 4, 4 slots, prefill chunks of 16): concurrent greedy
    requests equal plain autoregressive decoding; seeded sampling is reproducible; the speculative counters add
    up (draft tokens = γ · drafts, accepted = Σ accepted per position, non-increasing in the position)."""
    client = spec_server.client()
    rng = np.random.default_rng(3)
    prompts = [(f"spec {i}: " + "lorem ipsum dolor sit amet " * int(rng.integers(0, 6)))[:60] for i in range(10)]
    assert any(len(enc(p)) > 16 for p in prompts)
    max_tokens = [int(rng.integers(3, 25)) for _ in prompts]
    wants = [oracle(enc(p), m) for p, m in zip(prompts, max_tokens)]

    def call(args):
        p, m = args
        r = client.completions.create(model=NAME, prompt=p, max_tokens=m, temperature=0,
                                      extra_body={"return_token_ids": True})
        return extra(r.choices[0], "token_ids"), r.choices[0].finish_reason, r.usage.completion_tokens

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(call, zip(prompts, max_tokens)))
    for (want, why), (ids, fr, n) in zip(wants, got):
        assert ids == want and fr == why and n == len(want)

    def sampled(seed):
        chunks = client.completions.create(model=NAME, prompt="sample me", max_tokens=20, temperature=0.9,
                                           top_p=0.9, seed=seed, stream=True, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in chunks)
    a, b = sampled(11), sampled(11)
    assert a == b and len(enc(a)) > 0
    m = spec_server.metrics()
    drafts = _value(m, "vllm:spec_decode_num_drafts_total")
    accepted = _value(m, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [_value(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=k) for k in range(GAMMA)]
    assert drafts > 0
    assert _value(m, "vllm:spec_decode_num_draft_tokens_total") == GAMMA * drafts
    assert accepted == sum(per_pos) <= GAMMA * drafts
    assert all(x >= y for x, y in zip(per_pos, per_pos[1:]))
    # rounds commit 1 + accepted tokens each: generation tokens cannot exceed that
    assert _value(m, "vllm:generation_tokens_total") <= drafts + accepted + len(prompts) + 2
    assert _value(m, "hyspec:compilations_after_startup_total") == 0
    models = client.models.list()
    assert extra(models.data[0], "spec_mode") == "chain"


def test_speculative_tree_server_equals_plain_decoding(tree_server, oracle):
    """--spec-mode tree (the random DSpark drafter; 3 levels of top-2 children, beam 3, 6 verified nodes per slot;
    4 slots, prefill chunks of 16): 8 concurrent greedy requests — prompts shorter and longer than a chunk,
    admitted as slots free, streamed or not — return exactly the token ids, text and finish reason of plain
    autoregressive decoding of each prompt alone; the tree counters add up (5 draft tokens per round)."""
    client = tree_server.client()
    rng = np.random.default_rng(4)
    prompts = [(f"tree {i}: " + "the quick brown fox " * int(rng.integers(0, 4)))[:56] for i in range(8)]
    assert any(len(enc(p)) > 16 for p in prompts) and any(len(enc(p)) <= 16 for p in prompts)
    max_tokens = [int(rng.integers(4, 21)) for _ in prompts]
    wants = [oracle(enc(p), m) for p, m in zip(prompts, max_tokens)]
    before_text = tree_server.metrics_text()
    before = parse_text(before_text)

    def call(args):
        i, p, m = args
        return complete(client, bool(i % 2), model=NAME, prompt=p, max_tokens=m, temperature=0,
                        extra_body={"return_token_ids": True})

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(call, [(i, p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]))
    for p, (want, why), (ids, text, fr) in zip(prompts, wants, got):
        assert ids == want, p
        assert text == dec(want), p
        assert fr == why, p
    m = tree_server.metrics()
    d = lambda name, **kw: _value(m, name, **kw) - _value(before, name, **kw)  # noqa: E731
    drafts, accepted = d("vllm:spec_decode_num_drafts_total"), d("vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [d("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=k) for k in range(TREE_DEPTH)]
    assert drafts > 0 and accepted > 0           # some rounds committed an accepted branch, not just the bonus
    assert d("vllm:spec_decode_num_draft_tokens_total") == (TREE_NODES - 1) * drafts
    assert accepted == sum(per_pos) <= TREE_DEPTH * drafts
    # every round verified the fixed TREE_NODES a request; a round serves one or more requests
    from hyspec_jax.bench.serve_load import _rounds_by_width
    rounds = _rounds_by_width(before_text, tree_server.metrics_text())
    assert list(rounds) == [str(TREE_NODES)] and 0 < rounds[str(TREE_NODES)] <= drafts
    assert all(x >= y for x, y in zip(per_pos, per_pos[1:]))
    assert d("vllm:generation_tokens_total") == sum(len(w) for w, _ in wants)
    assert _value(m, "hyspec:compilations_after_startup_total") == 0
    assert extra(client.models.list().data[0], "spec_mode") == "tree"


def test_a_server_without_a_table_times_its_widths_at_start_up(calibrated_server, oracle):
    """--startup-calibration 2 and no budget table: the start-up log gives every width's round time over each
    decoding bucket (1 and 2 rows) and the widths kept; greedy requests then equal plain decoding, every round runs
    a kept width, and nothing compiles while serving."""
    log = calibrated_server.log.read_text(errors="replace")
    kept = {}
    for rows in (1, 2):
        m = re.search(rf"round ms over {rows} rows by width: 1: [\d.]+, 2: [\d.]+, 4: [\d.]+, {TREE_NODES}: "
                      rf"[\d.]+; kept \[([\d, ]+)\]", log)
        assert m, log
        kept[rows] = {w.strip() for w in m.group(1).split(",")}
    cache = calibrated_server.log.parent / "hyspec" / "width_times.json"
    assert f"round times kept in {cache}" in log, log
    assert sorted(e["batch"] for e in json.loads(cache.read_text())["entries"].values()) == [1, 2]
    client = calibrated_server.client()
    before = calibrated_server.metrics_text()
    prompts = ["calibrated rounds", "the quick brown fox " * 2]
    for p in prompts:
        want, why = oracle(enc(p), 12)
        ids, text, fr = complete(client, False, model=NAME, prompt=p, max_tokens=12, temperature=0,
                                 extra_body={"return_token_ids": True})
        assert (ids, fr) == (want, why), p
    from hyspec_jax.bench.serve_load import _rounds_by_width
    rounds = _rounds_by_width(before, calibrated_server.metrics_text())
    assert rounds and set(rounds) <= kept[1] | kept[2], (rounds, kept)
    assert _value(calibrated_server.metrics(), "hyspec:compilations_after_startup_total") == 0


@pytest.fixture(scope="module")
def target_logprobs(launched):
    """log_softmax of a direct (eager, no-cache) forward of the target: [T-1, V] rows for positions 1..T-1."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hyspec_jax.io.hf import load_pretrained
    from hyspec_jax.models.target import forward_full
    _, model = load_pretrained(launched[1])
    graphdef, params = nnx.split(model)

    def run(ids: list[int]) -> np.ndarray:
        logits = forward_full(graphdef, params, jnp.asarray([ids], jnp.int32))
        return np.asarray(jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1))
    return run


def _check_logprobs(lp: np.ndarray, ids: list[int], start: int, got: list[float], tops: list, k: int):
    """got[j] = log p(ids[start + j] | ids[:start + j]); tops[j]: the k most likely tokens there."""
    want = [float(lp[start + j - 1, t]) for j, t in enumerate(ids[start:])]
    np.testing.assert_allclose(got, want, atol=2e-4)
    for j, top in enumerate(tops):
        row = lp[start + j - 1]
        best = np.sort(row)[::-1][:k]
        np.testing.assert_allclose(sorted(top, reverse=True)[:k], best, atol=2e-4)


def test_logprobs_and_echo_are_the_targets(server, oracle, target_logprobs):
    """/v1/completions logprobs (with echo: the prompt's too) and chat logprobs, streamed or not, equal the
    log-probabilities of a direct forward of the target at the emitted tokens."""
    client = server.client()
    prompt = "Score these tokens"
    p = enc(prompt)
    want, _ = oracle(p, 8)
    lp = target_logprobs(p + want)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=3, echo=True)
    c = r.choices[0]
    assert c.text == prompt + dec(want)
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert c.logprobs.tokens == [TOK.decode([t]) for t in p + want]
    _check_logprobs(lp, p + want, 1, c.logprobs.token_logprobs[1:], [list(d.values())
                                                                       for d in c.logprobs.top_logprobs[1:]], 1)
    assert all(1 <= len(d) <= 3 + 1 for d in c.logprobs.top_logprobs[1:])   # top 3 + the chosen (equal texts merge)
    # streamed, no echo: the completion's tokens only
    got = []
    for ch in client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                        stream=True):
        if ch.choices[0].logprobs is not None:
            got += ch.choices[0].logprobs.token_logprobs
    _check_logprobs(lp, p + want, len(p), got, [], 0)
    # chat: the rendered prompt's tokens, then the answer's
    msgs = [{"role": "user", "content": "logprobs?"}]
    ids = enc("[user]: logprobs?\n[assistant]: ")
    cwant, _ = oracle(ids, 6)
    clp = target_logprobs(ids + cwant)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [TOK.decode([t]) for t in cwant]
    _check_logprobs(clp, ids + cwant, len(ids), [e.logprob for e in content],
                    [[t.logprob for t in e.top_logprobs] for e in content], 2)
    streamed = []
    for ch in client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                             stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += [e.logprob for e in ch.choices[0].logprobs.content]
    np.testing.assert_allclose(streamed, [e.logprob for e in content], atol=1e-6)


def test_speculative_logprobs_equal_the_targets(spec_server, oracle, target_logprobs):
    """Under speculative decoding (chain) the reported logprobs are still the target's at the emitted tokens."""
    prompt = "speculate and score"
    p = enc(prompt)
    want, _ = oracle(p, 12)
    r = spec_server.client().completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                                extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert extra(c, "token_ids") == want
    _check_logprobs(target_logprobs(p + want), p + want, len(p), c.logprobs.token_logprobs,
                    [list(d.values()) for d in c.logprobs.top_logprobs], 1)


def test_n_choices_are_seeded_requests(server, oracle):
    """n = 3 sampled choices of one prompt (seed s): choice j equals the prompt run alone with seed s + j; greedy
    n = 2 gives two equal choices; usage counts the prompt once."""
    client = server.client()
    prompt = "three ways"
    wants = [oracle(enc(prompt), 10, temperature=0.9, seed=40 + j) for j in range(3)]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0.9, seed=40, n=3,
                                  extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [extra(c, "token_ids") for c in r.choices] == [w for w, _ in wants]
    assert r.usage.prompt_tokens == len(enc(prompt))
    assert r.usage.completion_tokens == sum(len(w) for w, _ in wants)
    g, _ = oracle(enc(prompt), 6)
    chunks = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "n"}], n=2,
                                                 max_tokens=6, temperature=0, stream=True))
    texts = ["".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == j)
             for j in range(2)]
    assert texts[0] == texts[1] and texts[0]


def test_tokenize_detokenize_version(server):
    status, _, body = server.raw("POST", "/tokenize", json.dumps({"prompt": "héllo"}))
    assert status == 200 and json.loads(body)["tokens"] == enc("héllo")
    assert json.loads(body)["count"] == len(enc("héllo")) and json.loads(body)["max_model_len"] == CONTEXT
    status, _, body = server.raw("POST", "/tokenize", json.dumps({"messages": [{"role": "user", "content": "x"}]}))
    assert json.loads(body)["tokens"] == enc("[user]: x\n[assistant]: ")
    status, _, body = server.raw("POST", "/detokenize", json.dumps({"tokens": enc("round trip")}))
    assert status == 200 and json.loads(body)["prompt"] == "round trip"
    status, _, body = server.raw("GET", "/version")
    assert status == 200 and json.loads(body)["version"]


def test_api_key_request_id_cors_and_body_limit(server):
    """/v1/* needs the key (401, OpenAI-style body, for the official client an AuthenticationError); /health and
    /metrics do not; X-Request-Id is echoed (or made); CORS answers the allowed origin only; a body over
    --max-body-bytes gets 413."""
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    status, headers, body = server.raw("GET", "/v1/models", headers={"Authorization": "Bearer nope"})
    assert status == 401 and _error(status, body)["code"] == 401
    status, _, _ = server.raw("GET", "/health", headers={"Authorization": ""})
    assert status == 200
    status, headers, _ = server.raw("GET", "/v1/models", headers={"X-Request-Id": "abc-123"})
    assert status == 200 and headers["x-request-id"] == "abc-123"
    status, headers, _ = server.raw("GET", "/v1/models")
    assert len(headers["x-request-id"]) >= 16
    status, headers, _ = server.raw("OPTIONS", "/v1/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Authorization": ""})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = server.raw("GET", "/v1/models", headers={"Origin": "http://elsewhere.test"})
    assert "access-control-allow-origin" not in headers
    status, _, body = server.raw("POST", "/v1/completions", json.dumps({"prompt": "x" * 70000}))
    assert status == 413 and _error(status, body)["code"] == 413
    log = server.log.read_text()
    assert re.search(r'"GET /v1/models" 401 tokens=0\+0 [\d.]+ms id=', log)


def test_stalled_clients_are_closed_and_the_connection_cap_answers_503(server):
    """A half-sent request head or body is closed after --request-read-timeout; past --max-connections open
    connections a new request gets 503; the server then serves normally."""
    def closed_after(payload: bytes) -> float:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=READ_TIMEOUT + 20)
        s.sendall(payload)
        t0 = time.monotonic()
        assert s.recv(100) == b""
        s.close()
        return time.monotonic() - t0
    for payload in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                    + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\""):
        assert READ_TIMEOUT - 0.5 < closed_after(payload) < READ_TIMEOUT + 10
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        status, _, _ = server.raw("GET", "/health")
        assert status == 503
    finally:
        for s in idle:
            s.close()
    time.sleep(0.5)
    assert server.raw("GET", "/health")[0] == 200


@pytest.mark.parametrize("flags,message", [
    (["--tensor-parallel-size", "64"], "--tensor-parallel-size 64 but only"),
    (["--speculative-config", "{bad"], "--speculative-config is not valid JSON"),
    (["--speculative-config", '{"method": "medusa"}'], "method 'medusa' is not one of"),
    (["--speculative-config", '{"method": "chain"}', "--spec-mode", "tree"], "disagrees with --spec-mode"),
    (["--decode-buckets", "1,x"], "--decode-buckets must be 'auto', 'none' or row counts"),
    (["--decode-buckets", "0,4"], "--decode-buckets must be 'auto', 'none' or row counts"),
    (["--recalibrate", "--startup-calibration", "0"], "--recalibrate times the widths at start-up"),
])
def test_launch_flag_errors_are_one_line(flags, message):
    r = subprocess.run([sys.executable, "-m", "hyspec_jax.serve", "--port", "0"] + flags, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.startswith("hyspec serve: error")]
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_speculative_config_server_reports_chain(spec_server):
    log = spec_server.log.read_text()
    assert "mode chain, 4 slots" in log
    assert "tokens=" not in log          # --disable-log-requests


def test_serve_load_reports_what_vllm_bench_serve_does(spec_server, server, tmp_path):
    """bench/serve_load.py (httpx) against a running server at a tiny size: every request ok, the summaries and
    throughputs present and consistent; the held-out pack loads as token-id prompts."""
    from hyspec_jax.bench import serve_load
    out = tmp_path / "load.json"
    assert serve_load.main(["--url", spec_server.base, "--concurrency", "1,2", "--num-requests", "3",
                            "--max-tokens", "5", "--warmup", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert report["meta"]["device"] and report["meta"]["jax"] and report["meta"]["commit"]    # provenance
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert r["ok"] == 3 and r["output_tokens"] == 15 and r["mode"] == "chain"
        assert r["throughput_tok_s"] == pytest.approx(15 / r["wall_s"])
        assert r["total_token_throughput"] > r["throughput_tok_s"]
        for key in ("ttft_s", "tpot_s", "itl_s", "latency_s"):
            assert set(r[key]) == {"mean", "std", "p50", "p90", "p99"} and r[key]["p50"] > 0
        assert r["ttft_s"]["p99"] <= r["latency_s"]["p99"]
        assert r["server"]["spec_drafts"] > 0 and r["server"]["compilations_after_startup"] == 0
        assert r["server"]["engine_dispatch_seconds"] > 0 and r["server"]["engine_collect_seconds"] > 0
    # --waves: at least K x concurrency requests a level
    assert serve_load.main(["--url", spec_server.base, "--concurrency", "1,4", "--num-requests", "3", "--waves", "2",
                            "--max-tokens", "2", "--warmup", "0", "--json", str(out)]) == 0
    assert [(r["concurrency"], r["requests"], r["ok"]) for r in json.loads(out.read_text())["results"]] == [
        (1, 3, 3), (4, 8, 8)]
    with pytest.raises(SystemExit):
        serve_load.main(["--url", spec_server.base, "--waves", "-1"])
    # several --url: the servers take turns level by level, the order reversed every other level
    assert serve_load.main(["--url", server.base, "--url", f"B={spec_server.base}", "--concurrency", "1,2,1",
                            "--num-requests", "2", "--max-tokens", "2", "--warmup", "0", "--api-key", API_KEY,
                            "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["concurrency"], r["mode"], r["ok"]) for r in rows] == [
        (1, "ar", 2), (1, "B", 2), (2, "B", 2), (2, "ar", 2), (1, "ar", 2), (1, "B", 2)]
    assert rows[1]["server"]["spec_drafts"] > 0 and rows[0]["server"]["spec_drafts"] == 0
    with pytest.raises(SystemExit):        # two servers of one name
        serve_load.main(["--url", f"x={server.base}", "--url", f"x={spec_server.base}", "--warmup", "0",
                         "--api-key", API_KEY])
    pack = serve_load.heldout_prompts()
    assert len(pack) == 96 and all(len(x) == 32 and all(isinstance(t, int) for t in x) for x in pack)


PENALIZED = ((dict(frequency_penalty=1.5), {}), (dict(presence_penalty=2.0), {}), ({}, dict(repetition_penalty=1.6)),
             (dict(frequency_penalty=-0.5, presence_penalty=0.5), dict(repetition_penalty=0.7)), ({}, {}))


@pytest.mark.parametrize("which", ["ar", "chain", "tree"])
def test_penalties_equal_the_generators(which, server, spec_server, tree_server, oracle):
    """frequency / presence penalties (the client's own fields) and repetition_penalty (extra_body), concurrently
    with different values (one request without): each answer is the engine's AR output with the same penalties —
    on the speculative servers too (the round penalizes the target at every node). Placed after the tests that
    count compilations after start-up: the first penalized request compiles the penalized programs."""
    srv = {"ar": server, "chain": spec_server, "tree": tree_server}[which]
    client = srv.client()
    prompt = "penalize the the the repetition repetition"
    wants = [oracle(enc(prompt), 24, **fields, **body) for fields, body in PENALIZED]
    assert len({tuple(w) for w, _ in wants}) >= 3         # the penalties change the output here

    def call(args):
        fields, body = args
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, **fields,
                                      extra_body={"return_token_ids": True, **body})
        return extra(r.choices[0], "token_ids"), r.choices[0].finish_reason

    with cf.ThreadPoolExecutor(len(PENALIZED)) as pool:
        got = list(pool.map(call, PENALIZED))
    assert got == [(list(w), why) for w, why in wants]
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=8,
                                          temperature=0, presence_penalty=1.0)
    assert chat.choices[0].message.content is not None


def test_sigterm_drains_in_flight_requests_then_exits(server, oracle):
    """Last test of the module: SIGTERM stops the listener, lets the streaming request finish, exits 0."""
    prompt = "drain me"
    want, _ = oracle(enc(prompt), 60, stop_ids=())
    stream = server.client().completions.create(model=NAME, prompt=prompt, max_tokens=60, temperature=0,
                                                stream=True, extra_body={"return_token_ids": True,
                                                                         "ignore_eos": True})
    it = iter(stream)
    ids = list(extra(next(it).choices[0], "token_ids") or [])
    server.proc.send_signal(signal.SIGTERM)
    for ch in it:
        ids += extra(ch.choices[0], "token_ids") or []
    assert ids == want
    assert server.proc.wait(60) == 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
    assert "SIGTERM: draining" in server.log.read_text()


def test_server_freezes_its_start_up_objects_and_logs_long_collections(caplog):
    """After warm-up the server moves its start-up objects (the model, programs, modules: ~740k on the CPU, a full
    collection of them 110-140 ms — a stall of every stream) out of the collector's view, and logs a collection that
    still takes over 50 ms."""
    import gc
    import time as _time

    from hyspec_jax.serve.server import freeze_startup_objects
    before = list(gc.callbacks)
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
        (cb,) = [c for c in gc.callbacks if c not in before]
        cb("start", {"generation": 2})
        _time.sleep(0.06)
        with caplog.at_level("WARNING", logger="hyspec.serve"):
            cb("stop", {"generation": 2})
        assert "garbage collection (generation 2) took" in caplog.text
    finally:
        gc.callbacks[:] = before
        gc.unfreeze()
