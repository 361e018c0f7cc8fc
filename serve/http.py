"""A small HTTP/1.1 server on asyncio streams (standard library only).

Enough of HTTP/1.1 for OpenAI clients, curl and load tools: persistent connections, Content-Length and
chunked request bodies, `Expect: 100-continue`, fixed-length responses and chunked streaming responses
(server-sent events). One task per connection; requests on a connection are served one after another.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("hyspec.serve")

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 32 * 1024 * 1024

REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           408: "Request Timeout", 411: "Length Required", 413: "Payload Too Large", 422: "Unprocessable Entity",
           429: "Too Many Requests", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
           501: "Not Implemented", 503: "Service Unavailable", 505: "HTTP Version Not Supported"}


class ProtocolError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: dict[str, str]
    body: bytes
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(urlsplit(self.target).query)

    def disconnected(self) -> bool:
        """True once the client closed its side (or the connection is gone)."""
        return self.reader.at_eof() or self.writer.is_closing()


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, obj, status: int = 200, headers: dict[str, str] | None = None) -> "Response":
        return cls(status, json.dumps(obj, ensure_ascii=False).encode(), "application/json", headers or {})


@dataclass
class StreamingResponse:
    """A chunked response whose body chunks come from an async iterator (closed when the client leaves)."""
    chunks: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/event-stream"
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    """The request head up to the blank line; None at a clean EOF between requests."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial.strip():
            return None
        raise ProtocolError(400, "incomplete request head") from None
    except asyncio.LimitOverrunError:
        raise ProtocolError(431, "request head too large") from None
    return head


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    while lines and not lines[0]:   # tolerate stray CRLF before a request (RFC 9112 §2.2)
        lines.pop(0)
    parts = lines[0].split(" ") if lines else []
    if len(parts) != 3:
        raise ProtocolError(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise ProtocolError(505, f"unsupported HTTP version {version}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ProtocolError(400, "malformed header line")
        key = name.lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    return method, target, version, headers


async def _read_body(reader, writer, headers: dict[str, str]) -> bytes:
    te = headers.get("transfer-encoding", "").lower()
    length = headers.get("content-length")
    if headers.get("expect", "").lower() == "100-continue" and (te or (length and length != "0")):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    if te:
        if te != "chunked":
            raise ProtocolError(501, f"unsupported transfer-encoding {te!r}")
        body = bytearray()
        while True:
            line = await reader.readuntil(b"\r\n")
            try:
                size = int(line.split(b";")[0].strip(), 16)
            except ValueError:
                raise ProtocolError(400, "malformed chunk size") from None
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":   # trailers
                    pass
                return bytes(body)
            if len(body) + size > MAX_BODY_BYTES:
                raise ProtocolError(413, "request body too large")
            body += await reader.readexactly(size)
            if await reader.readexactly(2) != b"\r\n":
                raise ProtocolError(400, "malformed chunk")
    if length is None:
        return b""
    try:
        n = int(length)
    except ValueError:
        raise ProtocolError(400, "malformed Content-Length") from None
    if n < 0:
        raise ProtocolError(400, "malformed Content-Length")
    if n > MAX_BODY_BYTES:
        raise ProtocolError(413, "request body too large")
    return await reader.readexactly(n)


def _head_bytes(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def error_body(status: int, message: str) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()


class HTTPServer:
    """Serves `handler` on host:port. `stop_accepting()` closes the listener; connections finish their
    current request and close."""

    def __init__(self, handler: Handler, *, server_header: str = "hyspec"):
        self.handler = handler
        self.server_header = server_header
        self.closing = False
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self.in_flight = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve_connection, host, port, limit=MAX_HEADER_BYTES,
                                                  reuse_address=True)
        return self._server.sockets[0].getsockname()[1]

    def stop_accepting(self) -> None:
        self.closing = True
        if self._server is not None:
            self._server.close()

    async def close_idle(self) -> None:
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            while not self.closing:
                try:
                    head = await _read_head(reader)
                    if head is None:
                        break
                    method, target, version, headers = _parse_head(head)
                    body = await _read_body(reader, writer, headers)
                except ProtocolError as e:
                    await self._send(writer, Response(e.status, error_body(e.status, e.message)), close=True)
                    break
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    await self._send(writer, Response(400, error_body(400, "malformed request")), close=True)
                    break
                keep_alive = (headers.get("connection", "").lower() != "close" and version == "HTTP/1.1") or \
                    headers.get("connection", "").lower() == "keep-alive"
                req = Request(method, target, version, headers, body, reader, writer)
                self.in_flight += 1
                try:
                    try:
                        resp = await self.handler(req)
                    except Exception:  # noqa: BLE001 - a handler bug must not take the server down
                        log.exception("handler failed for %s %s", method, target)
                        resp = Response(500, error_body(500, "internal server error"))
                    close = not keep_alive or self.closing
                    if isinstance(resp, StreamingResponse):
                        ok = await self._stream(writer, resp, close)
                        if not ok:
                            break
                    else:
                        await self._send(writer, resp, close=close)
                finally:
                    self.in_flight -= 1
                if close:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            self._connections.discard(task)
            try:
                writer.close()
            except Exception:  # noqa: BLE001
                pass

    def _headers(self, resp, close: bool, extra: dict[str, str]) -> dict[str, str]:
        h = {"Server": self.server_header, "Content-Type": resp.content_type}
        h.update(extra)
        h.update(resp.headers)
        if close:
            h["Connection"] = "close"
        return h

    async def _send(self, writer: asyncio.StreamWriter, resp: Response, close: bool) -> None:
        h = self._headers(resp, close, {"Content-Length": str(len(resp.body))})
        writer.write(_head_bytes(resp.status, h) + resp.body)
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, resp: StreamingResponse, close: bool) -> bool:
        """Send a chunked response; False when the client went away in the middle."""
        h = self._headers(resp, close, {"Transfer-Encoding": "chunked", "Cache-Control": "no-cache"})
        try:
            writer.write(_head_bytes(resp.status, h))
            await writer.drain()
            async for chunk in resp.chunks:
                if not chunk:
                    continue
                if writer.is_closing():
                    return False
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        except (ConnectionError, RuntimeError):
            return False
        finally:
            aclose = getattr(resp.chunks, "aclose", None)
            if aclose is not None:
                await aclose()   # lets the generator release its request (frees the slot)
