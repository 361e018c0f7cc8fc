"""Serving across hosts: process 0 runs the request loop and tells every other process each device call it makes.

Under JAX's multi-controller runtime (`launch.init_distributed`) every process must launch the same jitted programs
on the same host inputs in the same order (the programs are SPMD over a mesh spanning the processes). `hyspec
generate` gets that by running the same loop everywhere; a server cannot (requests arrive at one process only).
So, as tpu-inference / JetStream do, process 0 holds the HTTP server and the scheduler and the others follow:

- on process 0, `BroadcastBackend` wraps the backend the scheduler drives: each `prefill` / `dispatch` first sends
  its host inputs (`Channel.send`), then runs as before; `BroadcastScorer` does the same for an echoed prompt's
  logprobs forward (the generated tokens' come out of the programs above, on every process alike);
- on the others, `follow` builds nothing new: it receives each call and runs it on its own copy of the same backend
  (the same programs, compiled at start-up in the same order on every process), discarding the outputs, until
  process 0 sends `stop` (its SIGTERM drain is over). What process 0 decides from outputs it read travels with the
  call: a round's verify width (`runtime.width.WidthBackend`), whose chooser learns only from collected rounds,
  is process 0's choice, sent, never a follower's own.

The scheduler, the engine and the programs are unchanged: this module is the one place that knows about followers.
"""

from __future__ import annotations

import io
import logging
import threading
from typing import NamedTuple

import numpy as np

from hyspec_jax.runtime.backend import Backend, StepResult
from hyspec_jax.runtime.width import WidthBackend

log = logging.getLogger("hyspec.multihost")

STOP, PREFILL, DISPATCH, SCORE = "stop", "prefill", "dispatch", "score"


class Channel:
    """Ordered messages from process 0 to every other process, over the coordinator's key-value store.

    Why the key-value store and not `multihost_utils.broadcast_one_to_all`: the broadcast is a collective program
    (a compile per payload shape, device memory, and every follower blocked inside a gloo / NCCL collective while
    the server idles, where collective timeouts end it), whereas the store is a plain gRPC call to the coordinator
    that JAX's runtime already runs (about 0.1 ms on loopback for a set, a get and a delete), with no device work,
    a follower waiting in a polling get for as long as the server idles. Each message is one key per follower and
    sequence number; the follower deletes it once read, so the store holds only messages in flight."""

    PREFIX = "hyspec/serve"
    POLL_MS = 60_000        # a follower's blocking get returns this often while idle (then waits again)

    def __init__(self):
        import jax
        from jax._src import distributed
        self.client = distributed.global_state.client
        if self.client is None:
            raise RuntimeError("a multi-host channel needs jax.distributed (launch.init_distributed)")
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.seq = 0
        self.closed = False
        # one call at a time on process 0: the message order must be the order in which the programs are launched
        # (the scheduler's thread and the scorer's executor threads both call)
        self.lock = threading.RLock()

    def send(self, op: str, **arrays: np.ndarray) -> None:
        """Process 0: one call (op and its host inputs) to every follower."""
        if self.closed:     # the followers are gone: a collective program would wait for them forever
            raise RuntimeError("the multi-host channel is closed: the other processes have stopped")
        buf = io.BytesIO()
        np.savez(buf, op=np.array(op), **arrays)       # no pickle: plain arrays only
        data = buf.getvalue()
        for p in range(1, self.processes):
            self.client.key_value_set_bytes(f"{self.PREFIX}/{p}/{self.seq}", data)
        self.seq += 1

    def close(self) -> None:
        """Process 0: tell the followers to return (once); no call is sent after this."""
        with self.lock:
            if not self.closed:
                self.send(STOP)
                self.closed = True

    def receive(self) -> tuple[str, dict[str, np.ndarray]]:
        """A follower: the next call from process 0 (waits for as long as it takes)."""
        key = f"{self.PREFIX}/{self.process}/{self.seq}"
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, self.POLL_MS)
                break
            except RuntimeError as e:       # jax.errors.JaxRuntimeError
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self.client.key_value_delete(key)
        self.seq += 1
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        return str(arrays.pop("op")), arrays


class _Sampling(NamedTuple):
    """What `BroadcastBackend.sampling` hands the scheduler: the host values (sent) and the device arrays (used)."""
    host: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    device: object


def _sampling_host(temperature, top_p, top_k, seed) -> tuple[np.ndarray, ...]:
    # copies: the scheduler reuses its mirror arrays
    return (np.array(temperature, np.float32), np.array(top_p, np.float32), np.array(top_k, np.int32),
            np.array(seed, np.uint32))


def _penalty_fields(penalty: "_Sampling | None") -> dict:
    if penalty is None:
        return {}
    return dict(zip(("presence", "frequency", "repetition"), penalty.host))


class BroadcastBackend:
    """Process 0's backend: the wrapped one, each device call first sent to the followers (see the module
    docstring). Everything else (slots, shapes, depth, compile, ...) is the wrapped backend's."""

    def __init__(self, inner: Backend, channel: Channel):
        self.inner, self.channel = inner, channel

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def sampling(self, temperature, top_p, top_k, seed) -> _Sampling:
        host = _sampling_host(temperature, top_p, top_k, seed)
        return _Sampling(host, self.inner.sampling(*host))

    def penalty(self, presence, frequency, repetition) -> _Sampling:
        host = tuple(np.array(x, np.float32) for x in (presence, frequency, repetition))
        return _Sampling(host, self.inner.penalty(*host))

    def prefill(self, slots, tokens, valid, reset, sampling: _Sampling, penalty: _Sampling | None = None):
        t, p, k, s = sampling.host
        with self.channel.lock:
            self.channel.send(PREFILL, slots=np.asarray(slots, np.int32), tokens=np.asarray(tokens, np.int32),
                              valid=np.asarray(valid, bool), reset=np.asarray(reset, bool), temperature=t, top_p=p,
                              top_k=k, seed=s, **_penalty_fields(penalty))
            if penalty is None:
                return self.inner.prefill(slots, tokens, valid, reset, sampling.device)
            return self.inner.prefill(slots, tokens, valid, reset, sampling.device, penalty.device)

    def dispatch(self, active, sampling: _Sampling, steps, stochastic, penalty: _Sampling | None = None):
        t, p, k, s = sampling.host
        extra, width = {}, {}
        if isinstance(self.inner, WidthBackend):
            # chosen from the rounds collected so far, which only this process reads: sent with the call, so that
            # every process launches the same round program
            width["width"] = self.inner.round_width(active)
            extra["width"] = np.asarray(width["width"], np.int32)
        with self.channel.lock:
            self.channel.send(DISPATCH, active=np.asarray(active, bool), steps=np.asarray(steps, np.int32),
                              stochastic=np.asarray(bool(stochastic)), temperature=t, top_p=p, top_k=k, seed=s,
                              **extra, **_penalty_fields(penalty))
            if penalty is None:
                return self.inner.dispatch(active, sampling.device, steps, stochastic, **width)
            return self.inner.dispatch(active, sampling.device, steps, stochastic, penalty.device, **width)

    def collect(self, handle) -> StepResult:
        return self.inner.collect(handle)       # a read of this process's copy: nothing to send


class BroadcastScorer:
    """Process 0's `runtime.scoring.Scorer`: each scoring call first sent to the followers."""

    def __init__(self, inner, channel: Channel):
        self.inner, self.channel = inner, channel

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def score(self, ids: list[int], start: int = 1):
        with self.channel.lock:
            self.channel.send(SCORE, ids=np.asarray(ids, np.int32), start=np.asarray(start, np.int64))
            return self.inner.score(ids, start)


def follow(backend: Backend, channel: Channel, scorer=None) -> None:
    """A process other than 0: run every call process 0 sends on this process's copy of the backend (and scorer)
    until it sends `stop`. Outputs are discarded: process 0 reads its own."""
    calls = 0
    while True:
        op, a = channel.receive()
        if op == STOP:
            log.info("follower %d: stop after %d calls", channel.process, calls)
            return
        calls += 1
        if op in (PREFILL, DISPATCH):
            samp = backend.sampling(a["temperature"], a["top_p"], a["top_k"], a["seed"])
            # penalized calls run the penalized programs here too (their history is per-process device state)
            pen = {} if "presence" not in a else {
                "penalty": backend.penalty(a["presence"], a["frequency"], a["repetition"])}
            if op == PREFILL:
                backend.prefill(a["slots"], a["tokens"], a["valid"], a["reset"], samp, **pen)
            else:
                # process 0's width (a `WidthBackend`): this process's chooser reads no round, so never chooses
                width = {} if "width" not in a else {"width": int(a["width"])}
                backend.dispatch(a["active"], samp, a["steps"], bool(a["stochastic"]), **pen, **width)
        elif op == SCORE:
            if scorer is None:
                raise RuntimeError("process 0 scores logprobs but this process built no scorer")
            try:
                scorer.score(a["ids"].tolist(), int(a["start"]))
            except ValueError:      # the same inputs failed the same check on process 0: no device call on either
                pass
        else:
            raise RuntimeError(f"unknown call {op!r} from process 0")
