"""The OpenAI-compatible HTTP front end: routes, request → engine requests, responses and SSE streams."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from tokenizers import Tokenizer

from hyspec_jax.serve.chat import ChatTemplate, TemplateError
from hyspec_jax.serve.http import Request, Response, StreamingResponse
from hyspec_jax.serve.metrics import ServerMetrics
from hyspec_jax.serve.protocol import (APIError, ChoiceText, GenParams, check_model, get_bool, parse_common,
                                       parse_json_body, parse_messages, parse_prompts)
from hyspec_jax.runtime.scheduler import EngineRequest, QueueFull, Scheduler, ShuttingDown

log = logging.getLogger("hyspec.serve")

DISCONNECT_POLL_S = 0.05
DEFAULT_COMPLETION_TOKENS = 16     # OpenAI's default max_tokens for /v1/completions


@dataclass
class ServedModel:
    name: str
    root: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    mode: str
    created: int


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class OpenAIApp:
    def __init__(self, *, scheduler: Scheduler, tokenizer: Tokenizer, chat: ChatTemplate, model: ServedModel,
                 metrics: ServerMetrics):
        self.scheduler, self.tokenizer, self.chat, self.model, self.metrics = scheduler, tokenizer, chat, model, metrics
        self.draining = False
        self.active_generations = 0
        self._watched: dict[int, tuple[Request, list[EngineRequest], asyncio.Queue]] = {}
        self._watcher: asyncio.Task | None = None

    # --- routing ---------------------------------------------------------------------------------------
    async def handle(self, req: Request) -> Response | StreamingResponse:
        try:
            resp = await self._route(req)
        except APIError as e:
            resp = Response.json(e.body(), e.status, e.headers)
        if resp.status >= 400:
            self.metrics.request_errors.inc(status=str(resp.status))
        return resp

    async def _route(self, req: Request) -> Response | StreamingResponse:
        path = req.path.rstrip("/") or "/"
        routes = {
            "/health": ("GET", self.health),
            "/v1/models": ("GET", self.models),
            "/metrics": ("GET", self.metrics_endpoint),
            "/v1/completions": ("POST", self.completions),
            "/v1/chat/completions": ("POST", self.chat_completions),
        }
        if path.startswith("/v1/models/") and req.method == "GET":
            return self.model_info(path[len("/v1/models/"):])
        if path not in routes:
            raise APIError(404, f"no route {req.method} {req.path}", code="not_found")
        method, fn = routes[path]
        if req.method != method:
            raise APIError(405, f"{req.path} accepts {method}, not {req.method}", code="method_not_allowed")
        return await fn(req)

    # --- simple endpoints --------------------------------------------------------------------------------
    async def health(self, req: Request) -> Response:
        if self.scheduler.failed is not None:
            return Response.json({"status": "error", "message": str(self.scheduler.failed)}, 503)
        if self.draining:
            return Response.json({"status": "draining"}, 503)
        return Response.json({"status": "ok"})

    def _model_card(self) -> dict:
        m = self.model
        return {"id": m.name, "object": "model", "created": m.created, "owned_by": "hyspec", "root": m.root,
                "parent": None, "max_model_len": m.max_model_len, "spec_mode": m.mode}

    async def models(self, req: Request) -> Response:
        return Response.json({"object": "list", "data": [self._model_card()]})

    def model_info(self, name: str) -> Response:
        if name != self.model.name:
            raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return Response.json(self._model_card())

    async def metrics_endpoint(self, req: Request) -> Response:
        return Response(200, self.metrics.render().encode(), "text/plain; version=0.0.4; charset=utf-8")

    # --- generation --------------------------------------------------------------------------------------
    def _check_context(self, prompt_len: int, params: GenParams, default: int | None, param: str = "prompt",
                       max_param: str = "max_tokens") -> int:
        limit = self.model.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                                f"has {prompt_len} tokens (at least one must be left for the completion). "
                                f"Please reduce the length of the prompt.", param=param,
                           code="context_length_exceeded")
        room = limit - prompt_len
        if params.max_tokens is None:
            return room if default is None else min(default, room)
        if params.max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, "
                                f"{params.max_tokens} in the completion). Please reduce the length of the prompt "
                                f"or of max_tokens.", param=max_param, code="context_length_exceeded")
        return params.max_tokens

    def _start(self, req: Request, prompts: list[list[int]], params: GenParams, max_tokens: list[int],
               extra_stops: frozenset[int]):
        """Submit one engine request per prompt; returns (engine requests, event queue)."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="service_unavailable")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stops = frozenset(params.stop_token_ids) | extra_stops | (
            frozenset() if params.ignore_eos else self.model.eos_token_ids)
        ereqs = []
        for i, ids in enumerate(prompts):
            def sink(toks, finish, i=i):
                loop.call_soon_threadsafe(queue.put_nowait, (i, toks, finish))
            ereqs.append(EngineRequest(prompt_ids=ids, max_tokens=max_tokens[i], sink=sink,
                                       temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                       seed=params.seed + i, stop_token_ids=stops))
        submitted = []
        try:
            for er in ereqs:
                self.scheduler.submit(er)
                submitted.append(er)
        except QueueFull:
            for er in submitted:
                self.scheduler.abort(er)
            raise APIError(429, f"the request queue is full ({self.scheduler.max_queue} waiting); retry later",
                           type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except ShuttingDown:
            for er in submitted:
                self.scheduler.abort(er)
            raise APIError(503, "the server is shutting down", code="service_unavailable") from None
        return ereqs, queue, stops

    async def _watch_all(self) -> None:
        """One poller for every generation in flight: when a client goes away, abort its engine requests (their
        slots free at the next step) and wake its handler."""
        while self._watched:
            await asyncio.sleep(DISCONNECT_POLL_S)
            for key, (req, ereqs, queue) in list(self._watched.items()):
                if req.disconnected():
                    for er in ereqs:
                        self.scheduler.abort(er, "abort")
                    queue.put_nowait((None, [], "disconnect"))
                    self._watched.pop(key, None)
        self._watcher = None

    async def _events(self, req, ereqs, queue, choices: list[ChoiceText]) -> AsyncIterator[int]:
        """Feed engine events into the choices; yields the index of every choice that changed."""
        key = id(queue)
        self._watched[key] = (req, ereqs, queue)
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch_all())
        self.active_generations += 1
        try:
            while any(c.finish is None for c in choices):
                i, toks, finish = await queue.get()
                if i is None:
                    return
                c = choices[i]
                if c.finish is not None:
                    continue
                if finish == "error":
                    raise APIError(500, "the engine failed while generating", code="engine_error")
                if c.feed(toks, finish):
                    self.scheduler.abort(ereqs[i], "stop")
                yield i
        finally:
            self._watched.pop(key, None)
            self.active_generations -= 1
            for er, c in zip(ereqs, choices):
                if not er.finished:
                    self.scheduler.abort(er, "stop" if c.finish == "stop" else "abort")

    def _usage(self, prompts: list[list[int]], choices: list[ChoiceText]) -> dict:
        p = sum(len(x) for x in prompts)
        c = sum(ch.completion_tokens for ch in choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    # --- /v1/completions -----------------------------------------------------------------------------------
    async def completions(self, req: Request) -> Response | StreamingResponse:
        body = parse_json_body(req.body)
        model = check_model(body, self.model.name)
        params = parse_common(body, self.model.vocab_size, max_tokens_names=("max_tokens",))
        echo = get_bool(body, "echo", False)
        for name in ("logprobs", "suffix"):
            v = body.get(name)
            if v not in (None, False) and not (name == "logprobs" and v == 0):
                raise APIError(400, f"'{name}' is not supported", param=name, code="unsupported_value")
        items = parse_prompts(body, self.tokenizer, self.model.vocab_size)
        prompts = [ids for ids, _ in items]
        max_tokens = [self._check_context(len(ids), params, DEFAULT_COMPLETION_TOKENS) for ids in prompts]
        echo_text = [(text if text is not None else self.tokenizer.decode(ids)) if echo else ""
                     for ids, text in items]
        ereqs, queue, stops = self._start(req, prompts, params, max_tokens, frozenset())
        choices = [ChoiceText(self.tokenizer, params.stop, stops) for _ in prompts]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def choice_extra(i: int, ids: list[int], first: bool) -> dict:
            if not params.return_token_ids:
                return {}
            extra = {"token_ids": ids}
            if first:
                extra["prompt_token_ids"] = prompts[i]
            return extra

        if not params.stream:
            async for _ in self._events(req, ereqs, queue, choices):
                pass
            if req.disconnected():
                return Response(499)
            out = []
            for i, c in enumerate(choices):
                text, ids = c.take()
                out.append({"index": i, "text": echo_text[i] + text, "logprobs": None,
                            "finish_reason": c.finish, **choice_extra(i, ids, True)})
            return Response.json({"id": rid, "object": "text_completion", "created": created, "model": model,
                                  "choices": out, "usage": self._usage(prompts, choices)})

        async def stream() -> AsyncIterator[bytes]:
            usage_field = {"usage": None} if params.include_usage else {}
            first = [True] * len(prompts)

            def chunk(i, text, ids, finish):
                extra = choice_extra(i, ids, first[i])
                first[i] = False
                return _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish,
                                          **extra}], **usage_field})
            try:
                for i in range(len(prompts)):
                    if echo_text[i]:
                        yield chunk(i, echo_text[i], [], None)
                async for i in self._events(req, ereqs, queue, choices):
                    c = choices[i]
                    text, ids = c.take()
                    if c.finish is not None:
                        yield chunk(i, text, ids, c.finish)
                    elif text or (ids and params.return_token_ids):
                        yield chunk(i, text, ids, None)
                if params.include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                "choices": [], "usage": self._usage(prompts, choices)})
            except APIError as e:
                yield _sse(e.body())
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream())

    # --- /v1/chat/completions ------------------------------------------------------------------------------
    async def chat_completions(self, req: Request) -> Response | StreamingResponse:
        body = parse_json_body(req.body)
        model = check_model(body, self.model.name)
        params = parse_common(body, self.model.vocab_size, max_tokens_names=("max_completion_tokens", "max_tokens"))
        params_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        messages = parse_messages(body)
        for name in ("tools", "functions"):
            if body.get(name):
                raise APIError(400, f"'{name}' (tool calling) is not supported", param=name,
                               code="unsupported_value")
        if body.get("logprobs") not in (None, False):
            raise APIError(400, "'logprobs' is not supported", param="logprobs", code="unsupported_value")
        rf = body.get("response_format")
        if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
            raise APIError(400, "'response_format' other than {\"type\": \"text\"} is not supported",
                           param="response_format", code="unsupported_value")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise APIError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs",
                           code="invalid_type")
        add_gen = get_bool(body, "add_generation_prompt", True)
        try:
            text = self.chat.render(messages, add_generation_prompt=add_gen, **kwargs)
        except TemplateError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise APIError(400, "the rendered chat prompt is empty", param="messages", code="invalid_value")
        max_tokens = self._check_context(len(ids), params, None, "messages", params_name)
        ereqs, queue, stops = self._start(req, [ids], params, [max_tokens], self.chat.stop_token_ids)
        choices = [ChoiceText(self.tokenizer, params.stop, stops)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        if not params.stream:
            async for _ in self._events(req, ereqs, queue, choices):
                pass
            if req.disconnected():
                return Response(499)
            c = choices[0]
            content, tids = c.take()
            choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                      "finish_reason": c.finish}
            if params.return_token_ids:
                choice["token_ids"] = tids
                choice["prompt_token_ids"] = ids
            return Response.json({"id": rid, "object": "chat.completion", "created": created, "model": model,
                                  "choices": [choice], "usage": self._usage([ids], choices)})

        async def stream() -> AsyncIterator[bytes]:
            usage_field = {"usage": None} if params.include_usage else {}

            def chunk(delta: dict, finish, tids=None):
                ch = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                if params.return_token_ids and tids is not None:
                    ch["token_ids"] = tids
                return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": [ch], **usage_field})
            try:
                yield chunk({"role": "assistant", "content": ""}, None)
                async for _ in self._events(req, ereqs, queue, choices):
                    c = choices[0]
                    text, tids = c.take()
                    if text or (tids and params.return_token_ids):
                        yield chunk({"content": text}, None, tids)
                    if c.finish is not None:
                        yield chunk({}, c.finish, [])
                if params.include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                "choices": [], "usage": self._usage([ids], choices)})
            except APIError as e:
                yield _sse(e.body())
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream())
