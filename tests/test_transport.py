"""serve/transport.py's read-deadline protocols on both of uvicorn's HTTP/1.1 implementations (h11; httptools, the
one `hyspec serve` runs where it is installed), in-process with a small ASGI app: a half-sent head or body is
closed after the deadline, a request that arrived is not (however long its response streams), a head still
incomplete past the limit gets 400, keep-alive requests each get their own deadline. And the uvicorn internals it
subclasses (no public option does the job): the installed uvicorn is in pyproject.toml's tested range, and the
methods and attributes transport.py relies on are there, named in the failure when one moved."""

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


# --- the uvicorn internals serve/transport.py builds on -------------------------------------------------------------
# uvicorn has no public option for a request read deadline, so transport.py subclasses its HTTP/1.1 protocol classes
# (uvicorn.protocols.http.*_impl, not public API) and pyproject.toml pins uvicorn to the releases it was tested
# with. The tests below name what it relies on, so that a uvicorn outside the pin, or one that moved these, fails
# here with what moved rather than as a hung or misbehaving connection in the tests above.

# base class → {method transport.py overrides or calls: its parameters after self}
PRIVATE_METHODS = {
    "h11": ("uvicorn.protocols.http.h11_impl", "H11Protocol", {
        "__init__": ["config", "server_state", "app_state", "_loop"],
        "connection_made": ["transport"], "data_received": ["data"], "connection_lost": ["exc"]}),
    "httptools": ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol", {
        "__init__": ["config", "server_state", "app_state", "_loop"],
        "connection_made": ["transport"], "data_received": ["data"], "connection_lost": ["exc"],
        "on_message_begin": [], "on_url": ["url"], "on_header": ["name", "value"], "on_headers_complete": [],
        "on_message_complete": [], "send_400_response": ["msg"]}),
}
PROTOCOL_IDS = [p.id for p in PROTOCOLS]


def _pinned_uvicorn() -> str:
    import tomllib
    from pathlib import Path
    deps = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    return next(d for d in deps["dependencies"] if d.replace(" ", "").startswith("uvicorn"))


def test_installed_uvicorn_is_in_the_pinned_range():
    from importlib.metadata import version

    from packaging.requirements import Requirement
    req = Requirement(_pinned_uvicorn())
    assert req.specifier, "pyproject.toml must pin uvicorn to a tested range: serve/transport.py subclasses its " \
                          "private protocol classes"
    assert req.specifier.contains(version("uvicorn")), (
        f"uvicorn {version('uvicorn')} is outside {req} (pyproject.toml), the releases serve/transport.py was tested "
        "with: run tests/test_transport.py against it, then widen the pin")


@pytest.mark.parametrize("which", PROTOCOLS, ids=PROTOCOL_IDS)
def test_uvicorn_protocol_methods_transport_overrides_are_there(which):
    import importlib
    import inspect
    module, name, methods = PRIVATE_METHODS["httptools" if which else "h11"]
    try:
        base = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"serve/transport.py subclasses {module}.{name}, which uvicorn {uvicorn.__version__} lacks: {e}")
    cls = read_deadline_protocol(TIMEOUT, prefer_httptools=which)
    assert issubclass(cls, base)
    moved = []
    for method, params in methods.items():
        fn = getattr(base, method, None)
        got = None if fn is None else [p for p in inspect.signature(fn).parameters if p != "self"]
        if got != params:
            moved.append(f"{name}.{method}({', '.join(params)}): uvicorn {uvicorn.__version__} has "
                         + ("no such method" if got is None else f"{method}({', '.join(got)})"))
    assert not moved, "serve/transport.py overrides or calls uvicorn internals that changed:\n" + "\n".join(moved)


class _Transport:
    """The bits of an asyncio transport uvicorn's protocols use; records what they write and whether they closed."""

    def __init__(self):
        self.written, self.closed = b"", False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def write(self, data):
        self.written += data

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


@pytest.mark.parametrize("which", PROTOCOLS, ids=PROTOCOL_IDS)
def test_the_protocol_runs_on_uvicorns_attributes(which):
    """The subclass built and driven as uvicorn's server does (its keywords; connection_made, data_received,
    connection_lost): the attributes it reads are there, the deadline arms and disarms, the head limit answers 400."""
    async def app(scope, receive, send):       # never reached: no request completes here
        raise AssertionError("no request should reach the app")

    async def main():
        from uvicorn.server import ServerState
        cls = read_deadline_protocol(TIMEOUT, prefer_httptools=which)
        config = uvicorn.Config(app, http=cls, lifespan="off", h11_max_incomplete_event_size=HEAD_LIMIT,
                                log_level="critical")
        config.load()
        loop = asyncio.get_running_loop()
        out = []
        big = b"GET /x HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (HEAD_LIMIT + 100)
        # still incomplete past the limit (h11's own check; transport.py's data_received on httptools), and on
        # httptools complete but over it (transport.py's on_url / on_header)
        for payload in [big] + ([big + b"\r\n\r\n"] if which else []):
            proto = config.http_protocol_class(config=config, server_state=ServerState(), app_state={}, _loop=loop)
            missing = [a for a in ("config", "loop") if not hasattr(proto, a)]
            assert not missing, f"uvicorn {uvicorn.__version__}'s {cls.__mro__[2].__name__} sets no {missing}"
            transport = _Transport()
            proto.connection_made(transport)
            assert proto.transport is transport and proto._deadline is not None     # armed from the first byte
            if not which:
                assert hasattr(proto, "conn") and hasattr(proto.conn, "trailing_data"), \
                    f"uvicorn {uvicorn.__version__}'s H11Protocol keeps no h11 Connection in .conn"
            proto.data_received(payload[:20])
            assert proto._deadline is not None and not transport.closed                 # a head arriving
            proto.data_received(payload[20:])
            out.append(transport.written)
            assert transport.closed, "a head over the limit leaves the connection open"
            proto.connection_lost(None)
            assert proto._deadline is None                                              # disarmed
        return out

    answers = asyncio.run(main())
    assert answers and all(a.startswith(b"HTTP/1.1 400") for a in answers), answers
