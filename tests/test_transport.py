"""serve/transport.py's read-deadline protocols on both of uvicorn's HTTP/1.1 implementations (h11; httptools, the
one `hyspec serve` runs where it is installed), in-process with a small ASGI app: a half-sent head or body is
closed after the deadline, a request that arrived is not (however long its response streams), a head still
incomplete past the limit gets 400, keep-alive requests each get their own deadline."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")

from hyspec_jax.serve.transport import httptools, read_deadline_protocol  # noqa: E402

TIMEOUT = 0.6
HEAD_LIMIT = 2048


async def slow_stream(scope, receive, send):
    """Reads the body, then streams 4 chunks over ~2 deadlines."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for i in range(4):
        await asyncio.sleep(TIMEOUT / 2)
        await send({"type": "http.response.body", "body": b"%d:%d;" % (i, len(body)), "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


PROTOCOLS = [pytest.param(False, id="h11"),
             pytest.param(True, id="httptools", marks=pytest.mark.skipif(httptools is None,
                                                                           reason="httptools not installed"))]


@pytest.fixture(params=PROTOCOLS)
def port(request):
    cls = read_deadline_protocol(TIMEOUT, prefer_httptools=request.param)
    assert ("HttpTools" in cls.__name__) == request.param
    config = uvicorn.Config(slow_stream, host="127.0.0.1", port=0, loop="asyncio", http=cls, lifespan="off",
                            h11_max_incomplete_event_size=HEAD_LIMIT, log_level="critical", timeout_keep_alive=30)
    sock = config.bind_socket()
    server = uvicorn.Server(config)
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    yield sock.getsockname()[1]
    server.should_exit = True
    t.join(10)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT * 10)


def _read_response(s: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        got = s.recv(4096)
        assert got, data
        data += got
    return data


def _closed_after(s: socket.socket) -> float:
    t0 = time.monotonic()
    while s.recv(4096):
        pass
    return time.monotonic() - t0


REQUEST = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"


@pytest.mark.parametrize("payload", [b"", b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Le",
                                     b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro"],
                         ids=["nothing", "half-head", "half-body"])
def test_a_stalled_request_is_closed_at_the_deadline(port, payload):
    with _connect(port) as s:
        s.sendall(payload)
        assert TIMEOUT * 0.7 < _closed_after(s) < TIMEOUT * 4


def test_a_received_request_streams_past_the_deadline_and_keep_alive_requests_get_their_own(port):
    with _connect(port) as s:
        for _ in range(2):
            s.sendall(REQUEST)
            t0 = time.monotonic()
            out = _read_response(s)
            assert time.monotonic() - t0 > TIMEOUT * 1.5          # the response outlived a deadline
            assert out.startswith(b"HTTP/1.1 200") and b"3:5;" in out
        s.sendall(REQUEST[:20])                                   # a third request, stalled: closed
        assert TIMEOUT * 0.7 < _closed_after(s) < TIMEOUT * 4


def test_a_head_over_the_limit_gets_400(port):
    with _connect(port) as s:           # still incomplete past the limit (h11's own check; httptools' ported)
        s.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (HEAD_LIMIT + 100))
        out = b""
        while got := s.recv(4096):
            out += got
        assert out.startswith(b"HTTP/1.1 400")
    with _connect(port) as s:                                     # a head under it is served
        s.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (HEAD_LIMIT // 2) + b"\r\n\r\n")
        assert _read_response(s).startswith(b"HTTP/1.1 200")


@pytest.mark.skipif(httptools is None, reason="httptools not installed")
def test_httptools_refuses_a_complete_head_over_the_limit():
    async def main():
        cls = read_deadline_protocol(TIMEOUT)
        config = uvicorn.Config(slow_stream, host="127.0.0.1", port=0, loop="asyncio", http=cls, lifespan="off",
                                h11_max_incomplete_event_size=HEAD_LIMIT, log_level="critical")
        server = uvicorn.Server(config)
        sock = config.bind_socket()
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        r, w = await asyncio.open_connection(*sock.getsockname()[:2])
        w.write(b"GET /x HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (HEAD_LIMIT + 100) + b"\r\n\r\n")
        out = await asyncio.wait_for(r.read(), TIMEOUT * 4)
        w.close()
        server.should_exit = True
        await task
        return out
    assert asyncio.run(main()).startswith(b"HTTP/1.1 400")


def test_a_whole_request_in_one_read_is_not_a_long_head(port):
    """A request whose head and body (over the head limit) arrive in one read is served."""
    body = b"b" * (HEAD_LIMIT * 4)
    with _connect(port) as s:
        s.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        out = _read_response(s)
        assert out.startswith(b"HTTP/1.1 200") and b"3:%d;" % len(body) in out
