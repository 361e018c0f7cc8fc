"""The OpenAI-compatible API on FastAPI: routes, requests → engine requests, responses and SSE streams.

Generation requests become `EngineRequest`s of the one request loop (`hyspec_jax.runtime.scheduler`, on its own
thread); their sinks hand tokens to the request's asyncio queue, all of a device call's at once (`Handoff`: one
event-loop wake-up per step, not one per request). A stream writes one SSE chunk per choice with every token that
arrived since its last write (several steps' when the event loop is behind), as the hand-written server's socket
writes coalesced them. A client that goes away (`http.disconnect`)
aborts its engine requests, which frees their slots at the next step. `logprobs` arrive with the tokens: the
programs that emitted them computed them from the target's logits (`hyspec_jax.logprobs`; the backend's
`SlotLayout.logprobs` = --max-logprobs), so they are the target's whatever mode decoded, and a chunk renders its
own tokens' only. An `echo`ed prompt's, which no program emitted, are scored once per request by a no-cache target
forward (`hyspec_jax.runtime.scoring`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
import uuid
from collections import deque
from typing import AsyncGenerator, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer

from hyspec_jax.logprobs import TokenScores
from hyspec_jax.runtime.scheduler import EngineRequest, QueueFull, Scheduler, ShuttingDown
from hyspec_jax.sampling import SamplingParams
from hyspec_jax.serve.chat import ChatTemplate, TemplateError
from hyspec_jax.serve.metrics import CONTENT_TYPE, ServerMetrics
from hyspec_jax.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       Message, TokenizeRequest, error_body, unknown_fields, unsupported,
                                       validation_error)
from hyspec_jax.serve.text import ChoiceText
from hyspec_jax.serve.transport import SCOPE_BODY_SEND, SCOPE_REQUEST_ID, SCOPE_TOKENS, FrontDoor

log = logging.getLogger("hyspec.serve")

DEFAULT_COMPLETION_TOKENS = 16     # OpenAI's default max_tokens for /v1/completions


@dataclasses.dataclass(frozen=True)
class ServedModel:
    name: str
    root: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    mode: str
    created: int


@dataclasses.dataclass(frozen=True)
class FrontOptions:
    """The HTTP front end's settings (`hyspec serve` flags)."""
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = 32 * 1024 * 1024
    log_requests: bool = True
    max_logprobs: int = 20          # 0: no logprobs / echo scoring (no scoring programs compiled)


@dataclasses.dataclass(frozen=True)
class GenParams:
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    n: int
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


_json = json.JSONEncoder(ensure_ascii=False).encode   # json.dumps(ensure_ascii=False) builds an encoder per call
_json_str = json.encoder.encode_basestring             # what that encoder does with a str (C; no escapes of non-ASCII)


def engine_error(e: BaseException) -> str:
    """A failed engine's error in one line for a client or a log: its type and its message's first line (XLA's
    run to many lines), at most 300 characters."""
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _sse(obj) -> bytes:
    return b"data: " + _json(obj).encode() + b"\n\n"


class ChunkTemplate:
    """`_sse` of a one-choice stream chunk with everything but the choice rendered once per request: the hot path
    (a chunk per choice per step) renders only the small choice object. Bytes equal `_sse` of the whole chunk."""

    _MARK = "\x00choice\x00"

    def __init__(self, head: dict, tail: dict):
        text = json.dumps({**head, "choices": [self._MARK], **tail}, ensure_ascii=False)
        pre, post = text.split(json.dumps(self._MARK))
        self.pre, self.post = b"data: " + pre.encode(), post.encode() + b"\n\n"

    def __call__(self, choice: dict) -> bytes:
        return self.pre + _json(choice).encode() + self.post

    def text(self, index: int, key: str, text: str, token_ids: list[int] | None) -> bytes:
        """The chunk of a choice's next text without logprobs, as `self` renders {"index": index, key: text,
        "logprobs": None, "finish_reason": None[, "token_ids": token_ids]} — key "text" (completions) or
        "delta" ({"content": text}, chat) — without building and encoding the dict: once per token per stream."""
        value = _json_str(text) if key == "text" else '{"content": ' + _json_str(text) + "}"
        ids = "" if token_ids is None else ', "token_ids": [' + ", ".join(map(str, token_ids)) + "]"
        return (self.pre + f'{{"index": {index}, "{key}": {value}, "logprobs": null, "finish_reason": null{ids}}}'
                .encode() + self.post)


class EventStream(Response):
    """An SSE response of an async iterator of chunks. Unlike Starlette's StreamingResponse it runs no second task
    listening for the disconnect (`OpenAIServer.events` watches for it and ends the stream) and sends its chunks
    to the front door's `send` (`SCOPE_BODY_SEND`), past the wrappers that look at the response start only; the
    start and the last message go down the whole chain. The chunks are written by a task of its own: a token
    step then resumes that task's few frames, not the twenty-odd coroutines of the ASGI stack above this call
    (uvicorn's cycle, the middleware, Starlette's and FastAPI's routing), each of which a wake-up of this
    coroutine would pass through twice."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncGenerator[bytes, None]):
        self.chunks, self.status_code, self.background = chunks, 200, None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await asyncio.get_running_loop().create_task(self._pump(scope.get(SCOPE_BODY_SEND, send)))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, body) -> None:
        # (a cancelled __call__ cancels this task too: it awaits it)
        try:
            async for chunk in self.chunks:
                await body({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await self.chunks.aclose()       # its cleanup (aborting what still runs) now, not at garbage collection


class Inbox:
    """A request's engine events on the event loop: `put_nowait` (`Handoff` delivering, the disconnect watcher),
    `take` (the request's coroutine) returns every event that arrived since its last call. asyncio.Queue does
    the same one item at a time, with more Python per item."""

    __slots__ = ("items", "waiter")

    def __init__(self):
        self.items: list = []
        self.waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self.items.append(item)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self) -> list:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


class Handoff:
    """Engine events from the request loop's thread to the asyncio side, one wake-up per device call: sinks
    `put` (loop thread), the scheduler's `on_batch` calls `flush` after a step's sink calls, and the event loop
    then moves every pending event into its request's queue. Without it each request's sink woke the event loop
    (`call_soon_threadsafe`) on its own, in the middle of the loop's host work for the step."""

    def __init__(self):
        self.loop: asyncio.AbstractEventLoop | None = None
        self._items: deque = deque()
        self._armed = False

    def put(self, queue: Inbox, item) -> None:
        self._items.append((queue, item))

    def flush(self) -> None:
        # _deliver clears _armed before it pops: an item put after its last pop always arms a new delivery
        if self._items and not self._armed and self.loop is not None:
            self._armed = True
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:      # the event loop is closed (shutdown): nobody is listening any more
                self._armed = False

    def _deliver(self) -> None:
        self._armed = False
        items = self._items
        while items:
            queue, item = items.popleft()
            queue.put_nowait(item)


def _params(req: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> GenParams:
    """The sampling fields both endpoints share, with the checks a model cannot express."""
    penalties = {}
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        v = getattr(req, name)
        penalties[name] = neutral if v is None else float(v)
        try:        # SamplingParams holds the one range check of each
            SamplingParams(**{name: penalties[name]})
        except ValueError as e:
            raise APIError(400, str(e), param=name) from None
    if req.logit_bias:
        raise unsupported("logit_bias")
    if req.min_tokens:
        raise unsupported("min_tokens", " (only 0)")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(s == "" for s in stop):
        raise APIError(400, "'stop' strings must not be empty", param="stop")
    bad = [t for t in req.stop_token_ids or () if t >= vocab_size]
    if bad:
        raise APIError(400, f"'stop_token_ids' outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                       param="stop_token_ids")
    top_k = req.top_k or 0
    return GenParams(temperature=1.0 if req.temperature is None else req.temperature,
                     top_p=1.0 if req.top_p is None else req.top_p, top_k=0 if top_k == -1 else top_k,
                     seed=req.seed, n=req.n or 1, stop=stop, stop_token_ids=frozenset(req.stop_token_ids or ()),
                     ignore_eos=bool(req.ignore_eos), stream=bool(req.stream),
                     include_usage=bool(req.stream_options and req.stream_options.include_usage),
                     return_token_ids=bool(req.return_token_ids), **penalties)


class Choice:
    """One choice: its engine request, its text, the logprobs of its tokens as they arrived (aligned with
    text.token_ids) and how many of them were sent; the text offset of its next token (completions logprobs)."""

    def __init__(self, index: int, prompt: int, text: ChoiceText):
        self.index, self.prompt, self.text = index, prompt, text
        self.engine: EngineRequest | None = None
        self.logprobs: list[float] = []
        self.top_ids: list[list[int]] = []
        self.top_logprobs: list[list[float]] = []
        self.scored = 0
        self.offset = 0

    def feed(self, toks: list[int], finish: str | None, scores: TokenScores | None) -> bool:
        """`ChoiceText.feed`, keeping the scores of the tokens it kept (a stop string may end it mid-way)."""
        n = len(self.text.token_ids)
        stopped = self.text.feed(toks, finish)
        if scores is not None:
            kept = len(self.text.token_ids) - n
            self.logprobs += scores.logprobs[:kept]
            self.top_ids += scores.top_ids[:kept]
            self.top_logprobs += scores.top_logprobs[:kept]
        return stopped

    def take_scores(self, n: int) -> TokenScores:
        """The scores of the next n tokens to send (those `ChoiceText.take` gave)."""
        a, b = self.scored, self.scored + n
        if b > len(self.logprobs):
            raise APIError(500, "the engine returned no logprobs for these tokens")
        self.scored = b
        return TokenScores(self.logprobs[a:b], self.top_ids[a:b], self.top_logprobs[a:b])


class OpenAIServer:
    """The served model's state behind the routes."""

    def __init__(self, *, scheduler: Scheduler, tokenizer: Tokenizer, chat: ChatTemplate, model: ServedModel,
                 metrics: ServerMetrics, options: FrontOptions, scorer=None, version: str = "",
                 seed: int | None = None):
        self.scheduler, self.tokenizer, self.chat, self.model = scheduler, tokenizer, chat, model
        self.metrics, self.options, self.scorer, self.version = metrics, options, scorer, version
        self.draining = False
        self.handoff = Handoff()
        scheduler.on_batch = self.handoff.flush
        # requests without a seed: random seeds, or with --seed a reproducible sequence of them
        self._seeds = random.Random(seed) if seed is not None else random.SystemRandom()

    # --- helpers ---------------------------------------------------------------------------------------
    def unavailable(self) -> APIError:
        """The 503 of a server that takes no more requests: its engine failed, or it is draining."""
        if self.scheduler.failed is not None:
            return APIError(503, f"the engine failed ({engine_error(self.scheduler.failed)}); the server is stopping")
        return APIError(503, "the server is shutting down")

    def check_model(self, name: str | None) -> str:
        if name is None:
            return self.model.name      # like vLLM: the one served model
        if name != self.model.name:
            raise APIError(404, f"The model '{name}' does not exist. This server serves '{self.model.name}'.",
                           param="model")
        return name

    def warn_unknown(self, req, endpoint: str) -> None:
        extra = unknown_fields(req)
        if extra:
            log.warning("%s: ignoring fields this server does not know: %s", endpoint, ", ".join(extra))

    def check_context(self, prompt_len: int, max_tokens: int | None, default: int | None, param: str,
                      max_param: str) -> int:
        limit = self.model.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                                f"has {prompt_len} tokens (at least one must be left for the completion). "
                                f"Please reduce the length of the prompt.", param=param)
        room = limit - prompt_len
        if max_tokens is None:
            return room if default is None else min(default, room)
        if max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in "
                                f"the completion). Please reduce the length of the prompt or of {max_param}.",
                           param=max_param)
        return max_tokens

    def check_logprobs(self, k: int | None, param: str) -> None:
        if k is None:
            return
        if self.scorer is None:
            raise unsupported(param, ": this server was started with --max-logprobs 0")
        if k > self.options.max_logprobs:
            raise APIError(400, f"'{param}' must be at most {self.options.max_logprobs} (--max-logprobs), got {k}",
                           param=param)

    def render_chat(self, messages: list[Message], add_generation_prompt: bool, kwargs: dict | None) -> str:
        msgs = []
        for m in messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(p.text for p in content)
            elif content is None:
                if m.role != "assistant":
                    raise APIError(400, f"content is required for role {m.role!r}", param="messages")
                content = ""
            msg = {"role": m.role, "content": content}
            if m.name is not None:
                msg["name"] = m.name
            msgs.append(msg)
        try:
            return self.chat.render(msgs, add_generation_prompt=add_generation_prompt, **(kwargs or {}))
        except TemplateError as e:
            raise APIError(400, str(e), param="messages") from None

    def encode_prompts(self, prompt) -> list[tuple[list[int], str | None]]:
        """/v1/completions `prompt` (string, strings, token ids, lists of token ids) -> [(ids, text or None)]."""
        if isinstance(prompt, str):
            items: list = [prompt]
        elif not prompt:
            raise APIError(400, "'prompt' must not be an empty list", param="prompt")
        elif isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        out = []
        V = self.model.vocab_size
        for item in items:
            if isinstance(item, str):
                ids, text = self.tokenizer.encode(item).ids, item
            else:
                bad = [t for t in item if t >= V]
                if bad:
                    raise APIError(400, f"prompt token ids outside the vocabulary [0, {V}): {bad[:5]}", param="prompt")
                ids, text = list(item), None
            if not ids:
                raise APIError(400, "the prompt is empty (0 tokens)", param="prompt")
            out.append((ids, text))
        return out

    # --- generation --------------------------------------------------------------------------------------
    def start(self, prompts: list[list[int]], params: GenParams, max_tokens: list[int], extra_stops: frozenset[int],
              logprobs: bool) -> tuple[list[Choice], Inbox]:
        """Submit n engine requests per prompt (logprobs: their tokens' logprobs wanted); returns the choices (index
        = prompt · n + j) and their queue."""
        if self.draining:
            raise self.unavailable()
        self.handoff.loop = asyncio.get_running_loop()
        queue = Inbox()
        put = self.handoff.put
        stops = params.stop_token_ids | extra_stops | (frozenset() if params.ignore_eos else self.model.eos_token_ids)
        choices = []
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        for p, ids in enumerate(prompts):
            for j in range(params.n):
                c = Choice(len(choices), p, ChoiceText(self.tokenizer, params.stop, stops))

                def sink(toks, finish, scores, i=c.index):
                    put(queue, (i, toks, finish, scores))
                c.engine = EngineRequest(prompt_ids=ids, max_tokens=max_tokens[p], sink=sink,
                                         temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                         seed=seed + c.index, stop_token_ids=stops,
                                         presence_penalty=params.presence_penalty,
                                         frequency_penalty=params.frequency_penalty,
                                         repetition_penalty=params.repetition_penalty, logprobs=logprobs)
                choices.append(c)
        submitted = []
        try:
            for c in choices:
                self.scheduler.submit(c.engine)
                submitted.append(c.engine)
        except QueueFull:
            for er in submitted:
                self.scheduler.abort(er)
            raise APIError(429, f"the request queue is full ({self.scheduler.max_queue} waiting); retry later",
                           headers={"Retry-After": "1"}) from None
        except ShuttingDown:
            for er in submitted:
                self.scheduler.abort(er)
            raise self.unavailable() from None
        return choices, queue

    async def events(self, request: Request, choices: list[Choice], queue: Inbox) -> AsyncIterator[Choice]:
        """Feed engine events into the choices; yields every choice that changed, once for all the events queued
        by then (a caller that fell behind sends several steps' tokens in one chunk). Ends early (returns) when
        the client disconnects; always aborts what is still running."""
        async def watch():
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    queue.put_nowait((None, [], "disconnect", None))
                    return
        watcher = asyncio.create_task(watch())
        open_ = len(choices)
        try:
            while open_:
                changed: dict[int, Choice] = {}
                for i, toks, finish, scores in await queue.take():
                    if i is None:
                        return
                    c = choices[i]
                    if c.text.finish is None:
                        if finish == "error":
                            raise APIError(500, "the engine failed while generating")
                        if c.feed(toks, finish, scores):
                            self.scheduler.abort(c.engine, "stop")
                        if c.text.finish is not None:
                            open_ -= 1
                        changed[i] = c
                for c in changed.values():
                    yield c
        finally:
            watcher.cancel()
            for c in choices:
                if not c.engine.finished:
                    self.scheduler.abort(c.engine, "stop" if c.text.finish == "stop" else "abort")

    async def score(self, ids: list[int], start: int):
        return await asyncio.get_running_loop().run_in_executor(None, self.scorer.score, ids, start)

    def token_str(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False)

    def completion_logprobs(self, ids: list[int], scores, k: int, first_none: bool, offset: int) -> dict:
        """The legacy completions `logprobs` object of `ids` (their scores; the first token without one when
        first_none: the start of an echoed prompt). offset: text offset of the first token."""
        tokens, lps, tops, offsets = [], [], [], []
        j = 0
        for n, t in enumerate(ids):
            s = self.token_str(t)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            if n == 0 and first_none:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(scores.logprobs[j])
            top: dict[str, float] = {}
            for a, b in zip(scores.top_ids[j][:k], scores.top_logprobs[j][:k]):
                top.setdefault(self.token_str(a), b)    # most likely first: tokens with equal text keep the best
            top.setdefault(s, scores.logprobs[j])
            tops.append(top)
            j += 1
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, ids: list[int], scores, k: int) -> dict:
        def entry(t, lp):
            s = self.token_str(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        content = []
        for j, t in enumerate(ids):
            e = entry(t, scores.logprobs[j])
            e["top_logprobs"] = [entry(a, b) for a, b in zip(scores.top_ids[j][:k], scores.top_logprobs[j][:k])]
            content.append(e)
        return {"content": content}

    # --- /v1/completions -----------------------------------------------------------------------------------
    async def completions(self, request: Request, req: CompletionRequest):
        self.warn_unknown(req, "completions")
        model = self.check_model(req.model)
        params = _params(req, self.model.vocab_size)
        if req.best_of not in (None, 1):
            raise unsupported("best_of", " (only 1)")
        if req.suffix:
            raise unsupported("suffix")
        self.check_logprobs(req.logprobs, "logprobs")
        echo, k = bool(req.echo), req.logprobs
        items = self.encode_prompts(req.prompt)
        prompts = [ids for ids, _ in items]
        max_tokens = [self.check_context(len(ids), req.max_tokens, DEFAULT_COMPLETION_TOKENS, "prompt", "max_tokens")
                      for ids in prompts]
        echo_text = [(text if text is not None else self.tokenizer.decode(ids)) if echo else "" for ids, text in items]
        choices, queue = self.start(prompts, params, max_tokens, frozenset(), k is not None)
        for c in choices:
            c.offset = len(echo_text[c.prompt])
        rid = f"cmpl-{request.scope.get(SCOPE_REQUEST_ID) or uuid.uuid4().hex}"
        created = int(time.time())

        async def logprobs_of(c: Choice, ids: list[int], first: bool) -> dict | None:
            """The logprobs of this chunk of choice c: its new tokens' as they arrived (and in its first the echoed
            prompt's, scored once)."""
            if k is None:
                return None
            scores = c.take_scores(len(ids))
            if first and echo:
                prompt = prompts[c.prompt]
                out = self.completion_logprobs(prompt + ids, await self.score(prompt, 1) + scores, k, True, 0)
                c.offset += sum(len(s) for s in out["tokens"][len(prompt):])
            else:
                out = self.completion_logprobs(ids, scores, k, False, c.offset)
                c.offset += sum(len(s) for s in out["tokens"])
            return out

        def token_fields(c: Choice, ids: list[int], first: bool) -> dict:
            if not params.return_token_ids:
                return {}
            extra = {"token_ids": ids}
            if first:
                extra["prompt_token_ids"] = prompts[c.prompt]
            return extra

        def usage() -> dict:
            p = sum(len(x) for x in prompts)
            done = sum(c.text.completion_tokens for c in choices)
            request.scope[SCOPE_TOKENS] = (p, done)
            return {"prompt_tokens": p, "completion_tokens": done, "total_tokens": p + done}

        if not params.stream:
            async for _ in self.events(request, choices, queue):
                pass
            if any(c.text.finish is None for c in choices):
                return Response(status_code=499)     # the client left
            out = []
            for c in choices:
                text, ids = c.text.take()
                out.append({"index": c.index, "text": echo_text[c.prompt] + text,
                            "logprobs": await logprobs_of(c, ids, True), "finish_reason": c.text.finish,
                            **token_fields(c, ids, True)})
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": out, "usage": usage()})

        async def stream() -> AsyncIterator[bytes]:
            usage_field = {"usage": None} if params.include_usage else {}
            first = [True] * len(choices)
            render = ChunkTemplate({"id": rid, "object": "text_completion", "created": created, "model": model},
                                   usage_field)

            async def chunk(c: Choice, text: str, ids: list[int], finish) -> bytes:
                lp = None if k is None else await logprobs_of(c, ids, first[c.index])
                extra = token_fields(c, ids, first[c.index])
                first[c.index] = False
                return render({"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish, **extra})
            try:
                for c in choices:
                    if echo_text[c.prompt]:
                        yield await chunk(c, echo_text[c.prompt], [], None)
                async for c in self.events(request, choices, queue):
                    text, ids = c.text.take()
                    if c.text.finish is not None:
                        yield await chunk(c, text, ids, c.text.finish)
                    elif text or (ids and (params.return_token_ids or k is not None)):
                        if k is None and not first[c.index]:     # the common case, per token: no dict, no await
                            yield render.text(c.index, "text", text, ids if params.return_token_ids else None)
                        else:
                            yield await chunk(c, text, ids, None)
                u = usage()
                if params.include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                "choices": [], "usage": u})
            except APIError as e:
                yield _sse(e.body())
            yield b"data: [DONE]\n\n"

        return EventStream(stream())

    # --- /v1/chat/completions ------------------------------------------------------------------------------
    async def chat_completions(self, request: Request, req: ChatCompletionRequest):
        self.warn_unknown(req, "chat/completions")
        model = self.check_model(req.model)
        params = _params(req, self.model.vocab_size)
        for name in ("tools", "functions"):
            if getattr(req, name):
                raise unsupported(name, " (tool calling)")
        rf = req.response_format
        if rf is not None and rf.get("type") != "text":
            raise unsupported("response_format", " other than {\"type\": \"text\"}")
        if req.echo:
            raise unsupported("echo", " for chat (use /v1/completions with echo)")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        k = (req.top_logprobs or 0) if req.logprobs else None
        self.check_logprobs(k, "top_logprobs")
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        text = self.render_chat(req.messages, req.add_generation_prompt is not False, req.chat_template_kwargs)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise APIError(400, "the rendered chat prompt is empty", param="messages")
        max_tokens = self.check_context(len(ids), req.max_completion_tokens or req.max_tokens, None, "messages",
                                        max_param)
        choices, queue = self.start([ids], params, [max_tokens], self.chat.stop_token_ids, k is not None)
        rid = f"chatcmpl-{request.scope.get(SCOPE_REQUEST_ID) or uuid.uuid4().hex}"
        created = int(time.time())

        def logprobs_of(c: Choice, new: list[int]) -> dict | None:
            """The logprobs of this chunk of choice c: its new tokens' as they arrived."""
            if k is None:
                return None
            return self.chat_logprobs(new, c.take_scores(len(new)), k)

        def usage() -> dict:
            done = sum(c.text.completion_tokens for c in choices)
            request.scope[SCOPE_TOKENS] = (len(ids), done)
            return {"prompt_tokens": len(ids), "completion_tokens": done, "total_tokens": len(ids) + done}

        if not params.stream:
            async for _ in self.events(request, choices, queue):
                pass
            if any(c.text.finish is None for c in choices):
                return Response(status_code=499)
            out = []
            for c in choices:
                content, tids = c.text.take()
                choice = {"index": c.index, "message": {"role": "assistant", "content": content},
                          "logprobs": logprobs_of(c, tids), "finish_reason": c.text.finish}
                if params.return_token_ids:
                    choice["token_ids"] = tids
                    choice["prompt_token_ids"] = ids
                out.append(choice)
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                                 "choices": out, "usage": usage()})

        async def stream() -> AsyncIterator[bytes]:
            usage_field = {"usage": None} if params.include_usage else {}
            render = ChunkTemplate({"id": rid, "object": "chat.completion.chunk", "created": created,
                                    "model": model}, usage_field)

            async def chunk(c: Choice, delta: dict, finish, tids=None) -> bytes:
                ch = {"index": c.index, "delta": delta,
                      "logprobs": logprobs_of(c, tids) if tids and k is not None else None,
                      "finish_reason": finish}
                if params.return_token_ids and tids is not None:
                    ch["token_ids"] = tids
                return render(ch)
            try:
                for c in choices:
                    yield await chunk(c, {"role": "assistant", "content": ""}, None)
                async for c in self.events(request, choices, queue):
                    text, tids = c.text.take()
                    if text or (tids and (params.return_token_ids or k is not None)):
                        if k is None:     # the common case, per token: no dict, no await
                            yield render.text(c.index, "delta", text, tids if params.return_token_ids else None)
                        else:
                            yield await chunk(c, {"content": text}, None, tids)
                    if c.text.finish is not None:
                        yield await chunk(c, {}, c.text.finish, [])
                u = usage()
                if params.include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                "choices": [], "usage": u})
            except APIError as e:
                yield _sse(e.body())
            yield b"data: [DONE]\n\n"

        return EventStream(stream())

    # --- small endpoints ---------------------------------------------------------------------------------
    def model_card(self) -> dict:
        m = self.model
        return {"id": m.name, "object": "model", "created": m.created, "owned_by": "hyspec", "root": m.root,
                "parent": None, "max_model_len": m.max_model_len, "spec_mode": m.mode}

    def tokenize(self, req: TokenizeRequest) -> dict:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of 'prompt' and 'messages'", param="prompt")
        if req.messages is not None:
            text = self.render_chat(req.messages, req.add_generation_prompt is not False, None)
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        else:
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False).ids
        return {"count": len(ids), "max_model_len": self.model.max_model_len, "tokens": ids}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(req.model)
        bad = [t for t in req.tokens if t >= self.model.vocab_size]
        if bad:
            raise APIError(400, f"token ids outside the vocabulary [0, {self.model.vocab_size}): {bad[:5]}",
                           param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}


async def parse(request: Request, model: type[BaseModel]):
    """The request body as `model`, validated straight from the JSON bytes (pydantic-core parses them; any
    Content-Type, as curl's default form type); errors as one OpenAI 400."""
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def build_app(server: OpenAIServer) -> FrontDoor:
    """The FastAPI application of `server` (CORS inside it, with allowed origins) behind the front door. The front
    door wraps the whole application rather than being one of its middleware, so the `send` it leaves for token
    streams (`SCOPE_BODY_SEND`) is uvicorn's own, not Starlette's error-middleware wrapper of it."""
    app = FastAPI(title="hyspec serve", version=server.version, docs_url=None, redoc_url=None)
    opts = server.options

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return error(validation_error(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"{request.url.path} does not accept {request.method}"}.get(e.status_code, str(e.detail))
        return JSONResponse(error_body(e.status_code, msg), status_code=e.status_code, headers=e.headers)

    @app.get("/health")
    async def health():
        if server.scheduler.failed is not None:
            return JSONResponse({"status": "error", "message": engine_error(server.scheduler.failed)},
                                status_code=503)
        if server.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": server.version}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model_info(name: str):
        if name != server.model.name:
            raise APIError(404, f"The model '{name}' does not exist", param="model")
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.completions(request, await parse(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.chat_completions(request, await parse(request, ChatCompletionRequest))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return server.tokenize(await parse(request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return server.detokenize(await parse(request, DetokenizeRequest))

    if opts.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(opts.allowed_origins), allow_credentials=True,
                           allow_methods=["*"], allow_headers=["*"])
    return FrontDoor(app, api_key=opts.api_key, max_body_bytes=opts.max_body_bytes, log_requests=opts.log_requests,
                     on_error=server.metrics.request_error, error_body=error_body)
