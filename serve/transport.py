"""What sits between the socket and the routes: a read deadline on uvicorn's HTTP/1.1 connections, and one ASGI
middleware for the API key, the body size limit, the request id and the access log.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`) but starts no timer while a request is being
received: a client that sends half a request head, or a body shorter than its Content-Length, would hold its
connection forever. `read_deadline_protocol` closes a connection whose request is not fully received within
`read_timeout` seconds of its first byte (of the connection, for its first request).

The protocol is uvicorn's httptools one (llhttp, in C) where httptools is installed, else its h11 one: a streamed
response writes one chunk per token step, and h11's pure-Python state machine costs several times httptools' per
chunk on the event loop. The request head limit (`h11_max_incomplete_event_size`, `--max-header-bytes`) is h11's
own; on httptools it is enforced here, with h11's answer (400, connection closed).

uvicorn has no public option for a read deadline, so both protocols subclass uvicorn's own (private API, in
`uvicorn.protocols.http.*_impl`): pyproject.toml pins uvicorn to the releases tests/test_transport.py passed on,
and that test names every method overridden here and every attribute read.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

try:
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:          # uvicorn without its [standard] extras: h11 only
    httptools = None

log = logging.getLogger("hyspec.serve")
access_log = logging.getLogger("hyspec.serve.access")

REQUEST_ID = "x-request-id"
SCOPE_TOKENS = "hyspec.tokens"          # (prompt, completion) tokens of a generation, set by the route
SCOPE_REQUEST_ID = "hyspec.request_id"
SCOPE_BODY_SEND = "hyspec.body_send"    # the server's own `send`, for a streamed response's body messages


class _ReadDeadline:
    """The deadline timer of a connection protocol (mixed into uvicorn's; `loop`, `transport` are theirs)."""

    read_timeout: float
    _deadline: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.read_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            log.info("closing a connection whose request did not arrive within %gs", self.read_timeout)
            self.transport.close()


class _HeadTooLarge(Exception):
    pass


def read_deadline_protocol(read_timeout: float, prefer_httptools: bool = True) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol (httptools where installed and preferred, else h11) with a deadline on
    receiving each request (head and body)."""
    if prefer_httptools and httptools is not None:
        return _httptools_protocol(read_timeout)

    class ReadDeadlineH11Protocol(_ReadDeadline, H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:   # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                return
            state = self.conn.their_state
            if state is h11.SEND_BODY or (state is h11.IDLE and self.conn.trailing_data[0]):
                self._arm()           # a request is arriving: it has until the deadline
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    ReadDeadlineH11Protocol.read_timeout = read_timeout
    return ReadDeadlineH11Protocol


def _httptools_protocol(read_timeout: float) -> type[asyncio.Protocol]:
    class ReadDeadlineHttpToolsProtocol(_ReadDeadline, HttpToolsProtocol):
        # llhttp calls on_message_begin at a request's first byte and on_message_complete after its last body
        # byte: the deadline runs in between (and from the connection's start until its first request begins).
        # The head limit, two ways: the bytes of a head still incomplete after a read (httptools buffers a header
        # until its end, so a never-ending one would grow until the deadline), and the url and headers of a
        # complete one (both reset per request)
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            limit = self.config.h11_max_incomplete_event_size
            self._max_head = DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if limit is None else limit
            self._in_head, self._head_read, self._head_parsed, self._heads = True, 0, 0, 0

        def connection_made(self, transport: asyncio.Transport) -> None:   # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            in_head, heads = self._in_head, self._heads
            super().data_received(data)
            # all of it head bytes: in a head before and after, and no head completed in between
            if in_head and self._in_head and heads == self._heads and not self.transport.is_closing():
                self._head_read += len(data)
                if self._head_read > self._max_head:
                    self.send_400_response("Request head too large.")   # writes, then closes

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _count(self, n: int) -> None:
            self._head_parsed += n
            if self._head_parsed > self._max_head:
                raise _HeadTooLarge()   # feed_data raises HttpParserCallbackError: uvicorn answers 400, closes

        def on_headers_complete(self) -> None:
            self._in_head, self._head_read, self._head_parsed = False, 0, 0
            self._heads += 1
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            self._in_head = True
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    ReadDeadlineHttpToolsProtocol.read_timeout = read_timeout
    return ReadDeadlineHttpToolsProtocol


class BodyTooLarge(Exception):
    pass


async def _send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
                + headers})
    await send({"type": "http.response.body", "body": data})


class FrontDoor:
    """Pure ASGI wrapper of the whole application (outside FastAPI's own middleware): request id (the client's
    `X-Request-Id` or a new one, echoed in the response), Bearer API key on /v1/* (401), request body limit (413),
    one access-log line per request (method, path, status, prompt + completion tokens, latency) and the status of
    every error response (also a 500 of Starlette's error middleware, which runs inside it).

    It also leaves the `send` it was given — uvicorn's — in the scope (`SCOPE_BODY_SEND`): a streamed response,
    once its start went down the whole chain, sends its chunks there (its last message goes down the chain again).
    The layers between here and the route (this one, Starlette's error middleware, CORS, the exception handlers)
    act on the start message only, and a token stream's chunks would otherwise pass each of their wrappers one by
    one."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, log_requests: bool,
                 on_error: Callable[[int], None], error_body: Callable[[int, str], dict]):
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes
        self.log_requests, self.on_error, self.error_body = log_requests, on_error, error_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        headers = dict(scope.get("headers") or [])
        rid = headers.get(REQUEST_ID.encode(), b"").decode("latin-1")[:128] or uuid.uuid4().hex
        scope[SCOPE_REQUEST_ID] = rid
        scope[SCOPE_BODY_SEND] = send
        extra = [(REQUEST_ID.encode(), rid.encode("latin-1"))]
        status = {"code": 0}

        async def send_wrapped(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = dict(message)
                message["headers"] = list(message.get("headers") or []) + extra
            await send(message)

        try:
            refusal = self._refuse(scope, headers)
            if refusal is not None:
                await _send_json(send_wrapped, refusal[0], self.error_body(refusal[0], refusal[1]), refusal[2])
                return
            received = {"n": 0}

            async def receive_limited():
                message = await receive()
                if message["type"] == "http.request":
                    received["n"] += len(message.get("body", b""))
                    if received["n"] > self.max_body:
                        raise BodyTooLarge()
                return message

            try:
                await self.app(scope, receive_limited, send_wrapped)
            except BodyTooLarge:
                if status["code"] == 0:
                    await _send_json(send_wrapped, 413, self.error_body(413, self._too_large()), [])
        finally:
            if status["code"] >= 400:
                self.on_error(status["code"])
            if self.log_requests:
                p, c = scope.get(SCOPE_TOKENS, (0, 0))
                client = scope.get("client") or ("-", 0)
                access_log.info('%s "%s %s" %d tokens=%d+%d %.1fms id=%s', client[0], scope["method"], scope["path"],
                                status["code"] or 499, p, c, (time.perf_counter() - t0) * 1e3, rid)

    def _too_large(self) -> str:
        return f"request body larger than {self.max_body} bytes"

    def _refuse(self, scope, headers: dict) -> tuple[int, str, list] | None:
        """(status, message, extra headers) of a request refused before the routes, or None."""
        if self.api_key and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            got = headers.get(b"authorization", b"").decode("latin-1")
            want = f"Bearer {self.api_key}"
            if not hmac.compare_digest(got.encode(), want.encode()):
                return 401, "Incorrect API key provided: send it as 'Authorization: Bearer <key>'.", [
                    (b"www-authenticate", b"Bearer")]
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return 413, self._too_large(), [(b"connection", b"close")]
        return None
