"""The request loop against a scripted backend: every request gets exactly its own tokens — cut at its stop token or
max_tokens, also inside a multi-token step — whatever shares the batch, with more requests than slots, pipelined
steps and aborts (no device: the backend is a deterministic stand-in, so the loop's bookkeeping is what is tested)."""

from __future__ import annotations

import numpy as np
import pytest

from hyspec_jax.runtime.backend import Backend, StepResult
from hyspec_jax.runtime.scheduler import EngineRequest, Scheduler, run_batch
from hyspec_jax.sampling import SamplingParams

DEPTH = 2


class ScriptedBackend(Backend):
    """Slot b's stream after a prompt [p, ...] is p·100, p·100 + 1, ...; a step gives 1 + (its number % 3) tokens
    (≤ DEPTH + 1), like a speculative round accepting 0..DEPTH drafts. The stream position lives "on the device":
    a step the loop discards still advances it, as a real round's state does."""

    mode, depth = "scripted", DEPTH

    def __init__(self, slots: int):
        self.slots, self.kv_len, self.shapes = slots, 1 << 12, [(slots, 16), (1, 64)]
        self.base = np.zeros(slots, np.int64)
        self.pos = np.zeros(slots, np.int64)
        self.dispatched = 0
        self.prefill_rows = 0

    @staticmethod
    def sampling(*args):
        return None

    def prefill(self, slots, tokens, valid, reset, sampling):
        first = np.zeros(len(slots), np.int32)
        for i, b in enumerate(slots):
            if b >= self.slots:
                continue
            self.prefill_rows += 1
            if reset[i]:
                self.base[b] = int(tokens[i, 0]) * 100
            first[i], self.pos[b] = self.base[b], 1     # a prompt's last chunk gives the stream's first token
        return first

    def dispatch(self, active, sampling, steps, stochastic):
        self.dispatched += 1
        n = 1 + self.dispatched % 3
        toks = np.zeros((self.slots, DEPTH + 1), np.int32)
        count = np.where(active, n, 0).astype(np.int32)
        for b in np.flatnonzero(active):
            toks[b, :n] = self.base[b] + self.pos[b] + np.arange(n)
            self.pos[b] += n
        return StepResult(tokens=toks, count=count, accepted=np.maximum(count - 1, 0), drafted=DEPTH)

    def collect(self, handle):
        return handle


def expected(prompt: list[int], p: SamplingParams) -> tuple[list[int], str]:
    out = []
    for k in range(p.max_tokens):
        t = prompt[0] * 100 + k
        out.append(t)
        if t in p.stop_token_ids:
            return out, "stop"
    return out, "length"


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_every_request_gets_its_own_tokens(slots):
    rng = np.random.default_rng(slots)
    prompts = [[int(10 + i)] + [1] * int(rng.integers(0, 40)) for i in range(9)]
    params = []
    for i in range(9):
        m = int(rng.integers(1, 14))
        stop = (prompts[i][0] * 100 + int(rng.integers(0, 12)),) if i % 2 else ()
        params.append(SamplingParams(max_tokens=m, stop_token_ids=stop))
    be = ScriptedBackend(slots)
    reqs, outs, loop = run_batch(be, prompts, params)
    for prompt, p, r, out in zip(prompts, params, reqs, outs):
        want, reason = expected(prompt, p)
        assert out == want and r.finish_reason == reason, (prompt[0], out, want)
        assert sum(r.committed) >= len(out) - 1 and len(r.committed) == len(r.accepted)
    assert loop.steps_collected == be.dispatched         # every dispatched step is read back


class BoundedBackend(ScriptedBackend):
    """A slot holds `max_context` positions plus a step's overshoot: a step dispatched for a slot whose stream has
    passed max_context would write outside it (on a GPU: another slot's memory), so dispatch asserts it never is."""

    def __init__(self, slots: int, max_context: int):
        super().__init__(slots)
        self.kv_len = max_context + DEPTH + 1
        self.plen = np.zeros(slots, np.int64)

    @property
    def overshoot(self) -> int:
        return DEPTH + 1

    def prefill(self, slots, tokens, valid, reset, sampling):
        for i, b in enumerate(slots):
            if b < self.slots:
                self.plen[b] = (0 if reset[i] else self.plen[b]) + int(valid[i].sum())
        return super().prefill(slots, tokens, valid, reset, sampling)

    def dispatch(self, active, sampling, steps, stochastic):
        for b in np.flatnonzero(active):     # pos: the tokens generated on the device, the last one not yet written
            assert self.plen[b] + self.pos[b] - 1 <= self.max_context, (b, self.plen[b], self.pos[b])
        return super().dispatch(active, sampling, steps, stochastic)


def test_steps_go_ahead_beside_finishing_requests():
    # one long request shares 3 slots with a stream of short ones, each within a step of its end most of its life:
    # the loop keeps dispatching ahead while any request surely needs the next step (the rows that finish in
    # flight waste only their row of it), not only while none could finish
    be = ScriptedBackend(3)
    prompts = [[5]] + [[10 + i] for i in range(12)]
    params = [SamplingParams(max_tokens=60)] + [SamplingParams(max_tokens=5)] * 12
    reqs, outs, loop = run_batch(be, prompts, params)
    assert outs == [expected(p, q)[0] for p, q in zip(prompts, params)]
    assert loop.steps_collected == be.dispatched
    # only the long request's last step, alone and within reach of max_tokens, waits for the one before it
    assert loop.steps_ahead >= be.dispatched - 2, (loop.steps_ahead, be.dispatched)


class TwoTokenBackend(ScriptedBackend):
    """A deep round (reach 8) that commits 2 tokens every step, as a speculative round with τ = 2 does."""

    depth = 7

    def dispatch(self, active, sampling, steps, stochastic):
        self.dispatched += 1
        toks = np.zeros((self.slots, self.depth + 1), np.int32)
        count = np.where(active, 2, 0).astype(np.int32)
        for b in np.flatnonzero(active):
            toks[b, :2] = self.base[b] + self.pos[b] + np.arange(2)
            self.pos[b] += 2
        return StepResult(tokens=toks, count=count, accepted=np.maximum(count - 1, 0), drafted=self.depth)


def test_steps_go_ahead_until_the_request_likely_ends():
    # one request of 40 tokens, 2 a step, a round's reach 8: the step ahead goes out while the request likely needs
    # it after the step in flight (2 more tokens), not only while it surely does (8): only its last step waits
    be = TwoTokenBackend(1)
    reqs, outs, loop = run_batch(be, [[5]], [SamplingParams(max_tokens=40)])
    assert outs == [expected([5], SamplingParams(max_tokens=40))[0]]
    assert loop.steps_collected == be.dispatched
    assert loop.steps_ahead >= be.dispatched - 2, (loop.steps_ahead, be.dispatched)


def test_a_step_ahead_never_passes_a_slots_context():
    # prompts that nearly fill their slots, beside others: the step ahead must leave out no row's bound, whatever
    # the step in flight commits (BoundedBackend asserts it)
    ctx = 40
    be = BoundedBackend(3, ctx)
    prompts = [[5], [6] + [1] * 11, [7], [8] + [1] * 10, [9]]
    params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=ctx - 12),
              SamplingParams(max_tokens=4), SamplingParams(max_tokens=ctx - 11), SamplingParams(max_tokens=6)]
    reqs, outs, loop = run_batch(be, prompts, params)
    assert outs == [expected(p, q)[0] for p, q in zip(prompts, params)]
    assert loop.steps_collected == be.dispatched


class LazyFirstBackend(ScriptedBackend):
    """Prefill returns its first tokens as a device would: an array read later. Reading it records how many steps
    had been dispatched by then."""

    def __init__(self, slots: int):
        super().__init__(slots)
        self.prefills: list[tuple[int, int | None]] = []      # (steps dispatched at the prefill, ... at its read)

    def prefill(self, slots, tokens, valid, reset, sampling):
        first = super().prefill(slots, tokens, valid, reset, sampling)
        be, k = self, len(self.prefills)
        self.prefills.append((self.dispatched, None))

        class Pending:
            def __array__(self, dtype=None, copy=None):
                be.prefills[k] = (be.prefills[k][0], be.dispatched)
                return first
        return Pending()


def test_first_tokens_are_read_after_the_next_step_goes_out():
    # the device keeps a slot's last token, so the step after a prefill goes out before its first tokens are read;
    # a request whose first token ends it (max_tokens 1, a stop token) wastes only its row of that step
    be = LazyFirstBackend(3)
    prompts = [[5], [6], [7], [8], [9], [11], [12]]
    params = [SamplingParams(max_tokens=9), SamplingParams(max_tokens=1), SamplingParams(max_tokens=6),
              SamplingParams(max_tokens=5, stop_token_ids=frozenset({800})), SamplingParams(max_tokens=7),
              SamplingParams(max_tokens=1), SamplingParams(max_tokens=4)]
    reqs, outs, loop = run_batch(be, prompts, params)
    assert outs == [expected(p, q)[0] for p, q in zip(prompts, params)]
    assert [r.finish_reason for r in reqs] == ["length", "length", "length", "stop", "length", "length", "length"]
    assert all(read is not None for _, read in be.prefills)           # every prefill's tokens were read
    assert all(read > at for at, read in be.prefills), be.prefills    # ... after a step went out behind it
    assert loop.steps_collected == be.dispatched


def test_abort_frees_the_slot_for_the_next_request():
    be = ScriptedBackend(1)
    sched = Scheduler(be)
    got: dict[int, list] = {0: [], 1: []}
    reasons: dict[int, str] = {}
    reqs: list[EngineRequest] = []

    def sink_for(i):
        def sink(toks, reason, logprobs):
            got[i].extend(toks)
            if reason:
                reasons[i] = reason
            if i == 0 and len(got[0]) >= 4 and 0 not in reasons:
                sched.abort(reqs[0])          # the client leaves mid-stream
        return sink
    for i, prompt in enumerate(([5], [6])):
        reqs.append(EngineRequest(prompt_ids=prompt, max_tokens=50, sink=sink_for(i)))
        sched.submit(reqs[-1])
    sched.run_until_idle()
    # the aborting owner is not called back; the request ends as aborted and its slot serves the next one
    assert reqs[0].finished and reqs[0].finish_reason == "abort" and reasons == {1: "length"}
    assert got[0] == [500 + k for k in range(len(got[0]))] and 4 <= len(got[0]) < 50
    assert got[1] == [600 + k for k in range(50)]


def test_on_batch_follows_every_device_calls_sink_calls():
    """on_batch (the server's one wake-up per loop iteration) comes after each iteration's sink calls (a prefill's
    first tokens, a step's tokens): no token is left waiting for a wake-up, and a step's tokens for every request
    are handed over together."""
    be = ScriptedBackend(3)
    log: list = []
    sched = Scheduler(be, on_batch=lambda: log.append("batch"))
    for i, prompt in enumerate(([5], [6], [7])):
        sched.submit(EngineRequest(prompt_ids=prompt, max_tokens=7,
                                   sink=lambda toks, reason, lps, i=i: log.append((i, list(toks), reason))))
    sched.run_until_idle()
    assert log[-1] == "batch"
    tokens = [e for e in log if e != "batch"]
    assert sorted(t for _, toks, _ in tokens for t in toks) == sorted(p * 100 + k for p in (5, 6, 7) for k in range(7))
    # between two wake-ups: at most one event per request (a step gives each request its tokens in one call)
    batch: list = []
    for e in log:
        if e == "batch":
            assert len({i for i, _, _ in batch}) == len(batch), batch
            batch = []
        else:
            batch.append(e)
    assert log.count("batch") < len(tokens)      # fewer wake-ups than sink calls: three requests per step


def test_the_loop_reports_its_time_in_each_steps_dispatch_and_collect():
    """Every collected decoding step reports the loop's seconds in its dispatch and in its collect (the server's
    hyspec:engine_decode_dispatch_seconds / _collect_seconds: whether the host or the device sets the period);
    the collect of a step the device is still running includes the wait."""
    import time

    from hyspec_jax.runtime.scheduler import LoopObserver

    class SlowDevice(ScriptedBackend):
        def dispatch(self, *args, **kw):
            time.sleep(0.002)                      # the host's launch
            return super().dispatch(*args, **kw), time.perf_counter() + 0.01

        def collect(self, handle):
            res, done = handle
            time.sleep(max(0.0, done - time.perf_counter()))    # the device finishes 10 ms after the launch
            return res

    class Times(LoopObserver):
        def __init__(self):
            self.calls: list[tuple[float, float]] = []

        def decode_host_time(self, dispatch, collect):
            self.calls.append((dispatch, collect))

    be, obs = SlowDevice(2), Times()
    sched = Scheduler(be, obs)
    out = {}
    for prompt in ([3], [4]):
        sched.submit(EngineRequest(prompt_ids=prompt, max_tokens=6,
                                   sink=lambda toks, reason, lps, p=prompt[0]: out.setdefault(p, []).extend(toks)))
    sched.run_until_idle()
    assert out == {p: [p * 100 + k for k in range(6)] for p in (3, 4)}
    assert len(obs.calls) == be.dispatched
    assert all(d >= 0.002 for d, _ in obs.calls)
    assert sum(c for _, c in obs.calls) >= 0.004 * len(obs.calls)    # mostly waiting on the 10 ms device


class FailingBackend(ScriptedBackend):
    """A device that fails at its third decoding step (what an out-of-memory or a lost GPU looks like to the loop)."""

    def dispatch(self, *args, **kw):
        if self.dispatched == 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\nmore lines of detail")
        return super().dispatch(*args, **kw)


def test_a_failed_engine_fails_every_request_it_holds_and_takes_no_more():
    """The loop's thread dies with the device error: the running and the queued requests end with "error" (never
    left hanging), `failed` keeps the error, on_failure is called once with it, and later submissions are refused."""
    from hyspec_jax.runtime.scheduler import ShuttingDown
    seen: list[BaseException] = []
    sched = Scheduler(FailingBackend(2), on_failure=seen.append)
    ends: dict[int, str] = {}
    reqs = []
    for i in range(4):                       # 2 running, 2 waiting
        reqs.append(EngineRequest(prompt_ids=[10 + i], max_tokens=40,
                                  sink=lambda toks, why, lps, i=i: ends.__setitem__(i, why) if why else None))
        sched.submit(reqs[-1])
    sched.start()
    assert sched.join(30)
    assert ends == {i: "error" for i in range(4)} and all(r.finished for r in reqs)
    assert len(seen) == 1 and seen[0] is sched.failed and "RESOURCE_EXHAUSTED" in str(sched.failed)
    with pytest.raises(ShuttingDown):
        sched.submit(EngineRequest(prompt_ids=[9], max_tokens=4, sink=lambda toks, why, lps: None))
