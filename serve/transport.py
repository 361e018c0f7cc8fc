"""What sits between the socket and the routes: a read deadline on uvicorn's h11 connections, and one ASGI
middleware for the API key, the body size limit, the request id and the access log.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`) but starts no timer while a request is being
received: a client that sends half a request head, or a body shorter than its Content-Length, would hold its
connection forever. `read_deadline_protocol` closes a connection whose request is not fully received within
`read_timeout` seconds of its first byte (of the connection, for its first request).
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
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("hyspec.serve")
access_log = logging.getLogger("hyspec.serve.access")

REQUEST_ID = "x-request-id"
SCOPE_TOKENS = "hyspec.tokens"          # (prompt, completion) tokens of a generation, set by the route
SCOPE_REQUEST_ID = "hyspec.request_id"


def read_deadline_protocol(read_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on receiving each request (head and body)."""

    class ReadDeadlineH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:   # type: ignore[override]
            super().connection_made(transport)
            self._deadline: asyncio.TimerHandle | None = None
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

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(read_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                log.info("closing a connection whose request did not arrive within %gs", read_timeout)
                self.transport.close()

    return ReadDeadlineH11Protocol


class BodyTooLarge(Exception):
    pass


async def _send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
                + headers})
    await send({"type": "http.response.body", "body": data})


class FrontDoor:
    """Pure ASGI middleware (outermost): request id (the client's `X-Request-Id` or a new one, echoed in the
    response), Bearer API key on /v1/* (401), request body limit (413), one access-log line per request
    (method, path, status, prompt + completion tokens, latency) and the status of every error response."""

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
