"""examples/server.py bounds its input: each case against a real server on 127.0.0.1, in this process.

Every socket has a timeout and every wait a deadline, so a server that fails to bound something fails
its test instead of hanging it; nothing leaves loopback.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from threadloader import LoaderClosedError, QueueFullError

from .conftest import GatedDecoder, encode, photo, post_predict
from .robustness_cases import HEAP_ADDRESS

HOST = "127.0.0.1"
#: Longest a test waits for any reply: a server that does not answer in time has failed.
CLIENT_TIMEOUT = 5.0


def _load_server() -> ModuleType:
    path = Path(__file__).parents[1] / "examples" / "server.py"
    spec = importlib.util.spec_from_file_location("example_server", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


server_module = _load_server()


@contextmanager
def running(mode: str = "batched", **limits: Any) -> Iterator[Any]:
    """The example server on an ephemeral loopback port, decoding on the CPU; stopped afterwards."""
    classifier = server_module.Classifier(
        mode=mode,
        device="cpu",
        max_batch=8,
        max_delay_ms=1.0,
        model="none",
        limits=server_module.Limits(**{"socket_timeout_s": 2.0, **limits}),
    )
    server = server_module.Server((HOST, 0), classifier)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()  # joins the connection threads
        classifier.close()
        thread.join(CLIENT_TIMEOUT)


def port_of(server: Any) -> int:
    return int(server.server_address[1])


def connect(server: Any) -> socket.socket:
    return socket.create_connection((HOST, port_of(server)), timeout=CLIENT_TIMEOUT)


def exchange(server: Any, raw: bytes) -> tuple[int, dict[str, Any]]:
    """Sends ``raw`` bytes as they are and reads one response (status, JSON body), which must be JSON."""
    with connect(server) as sock:
        sock.sendall(raw)
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.getheader("Content-Type") == "application/json"
        return response.status, json.loads(response.read())


def post(server: Any, body: bytes) -> tuple[int, dict[str, Any]]:
    return post_predict(port_of(server), body, timeout=CLIENT_TIMEOUT)


def png(width: int, height: int) -> bytes:
    return encode(photo(height, width, 1), "PNG")


GOOD = encode(photo(64, 80, 0), quality=90)


def test_a_good_image_is_answered() -> None:
    with running() as server:
        status, reply = post(server, GOOD)
    assert status == 200 and reply["shape"] == [3, 224, 224]


def test_a_200_mb_body_is_refused_before_it_is_read() -> None:
    """Only 64 KiB of the declared 200 MB are ever sent: the answer must come without the rest."""
    declared = 200 * 2**20
    head = f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n".encode()
    with running() as server:
        status, reply = exchange(server, head + bytes(64 * 2**10))
    assert status == 413
    assert reply["error"] == f"the body is {declared:,} bytes; this server takes at most {32 * 2**20:,}"


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ("Content-Length: 1000000000000\r\n", 413),
        ("Content-Length: -1\r\n", 400),
        ("Content-Length: abc\r\n", 400),
        ("Content-Length: 1e3\r\n", 400),
        ("Content-Length: 10\r\nContent-Length: 12\r\n", 400),
        ("", 411),
        ("Transfer-Encoding: chunked\r\n", 411),
    ],
    ids=["1e12", "negative", "abc", "float", "two", "missing", "chunked"],
)
def test_content_length_is_validated(headers: str, status: int) -> None:
    """The client keeps the connection open after its body: a server that reads to EOF never answers."""
    raw = f"POST /predict HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode() + GOOD
    with running() as server:
        got, reply = exchange(server, raw)
        assert (got, post(server, GOOD)[0]) == (status, 200)  # and the server still serves
    assert "Content-Length" in reply["error"] or "bytes" in reply["error"]


def _handler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "process_request_thread" in t.name]


def _wait_for_handlers(count: int) -> None:
    """Until ``count`` connection threads are left: each gives its connection slot back as it ends."""
    deadline = time.monotonic() + CLIENT_TIMEOUT
    while len(_handler_threads()) > count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_handler_threads()) == count


@pytest.mark.parametrize(
    "partial",
    [b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789", b"POST /pre"],
    ids=["body", "request-line"],
)
def test_a_half_open_request_times_out(partial: bytes) -> None:
    timeout = 0.5
    with running(socket_timeout_s=timeout) as server:
        before = len(_handler_threads())
        with connect(server) as sock:
            sock.sendall(partial)
            started = time.monotonic()
            assert sock.recv(1024) == b""  # the server hung up (this client's own timeout is 5 s)
            waited = time.monotonic() - started
        _wait_for_handlers(before)  # its thread is gone too
    assert timeout * 0.9 <= waited < timeout + 2


def _read_until_closed(sock: socket.socket) -> bytes:
    """All the server sends until it hangs up; a reset ends it too (it closed with bytes unread)."""
    data = b""
    with suppress(ConnectionResetError):
        while chunk := sock.recv(4096):
            data += chunk
    return data


TRICKLED = {
    "request-line": b"GET /",
    "headers": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ",
    "body": b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n",
}


@pytest.mark.parametrize("part", list(TRICKLED))
def test_a_trickled_request_is_dropped_at_its_deadline(part: str) -> None:
    """A slowloris: one byte every 0.2 s never trips the 1 s idle timeout, but the request's 1.5 s
    deadline drops it (408, or a bare hang-up when its last byte was still unread) and frees its slot."""
    deadline = 1.5
    with running(socket_timeout_s=1.0, request_timeout_s=deadline, max_connections=1) as server:
        before = len(_handler_threads())
        stop = threading.Event()
        with connect(server) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each byte goes out at once
            started = time.monotonic()
            sock.sendall(TRICKLED[part])

            def trickle() -> None:
                with suppress(OSError):  # the server hung up
                    while not stop.wait(0.2):
                        sock.sendall(b"a")

            trickler = threading.Thread(target=trickle)
            trickler.start()
            try:
                assert exchange(server, b"GET /health HTTP/1.1\r\n\r\n")[0] == 503  # it holds the slot
                sock.settimeout(deadline + 1.5)
                answer = _read_until_closed(sock)
                waited = time.monotonic() - started
            finally:
                stop.set()
                trickler.join(CLIENT_TIMEOUT)
        _wait_for_handlers(before)
        assert exchange(server, b"GET /health HTTP/1.1\r\n\r\n")[0] == 200  # the slot is free again
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert deadline * 0.9 <= waited < deadline + 1.0


def test_a_request_past_its_deadline_is_answered_408() -> None:
    """Silent past the deadline but within the idle timeout: nothing is left unread, so the 408 arrives."""
    deadline = 0.5
    with running(socket_timeout_s=CLIENT_TIMEOUT, request_timeout_s=deadline) as server:
        started = time.monotonic()
        status, reply = exchange(
            server, b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n01"
        )
        waited = time.monotonic() - started
    assert (status, reply) == (
        408,
        {"error": "the request did not arrive whole within 0.5 s: send it in one go"},
    )
    assert deadline * 0.9 <= waited < deadline + 1.0


def test_the_deadline_is_per_request_on_a_kept_alive_connection() -> None:
    """Requests on one connection for longer than the deadline are all served: it bounds each request."""
    deadline = 0.5
    with running(request_timeout_s=deadline) as server:
        connection = http.client.HTTPConnection(HOST, port_of(server), timeout=CLIENT_TIMEOUT)
        statuses, sockets = [], set()
        started = time.monotonic()
        try:
            while time.monotonic() - started < 2 * deadline:
                connection.request("POST", "/predict", GOOD)
                response = connection.getresponse()
                statuses.append(response.status)
                response.read()
                sockets.add(id(connection.sock))
                time.sleep(deadline / 4)  # idle between requests, counted in the next one's time
        finally:
            connection.close()
    assert len(statuses) >= 4 and set(statuses) == {200} and len(sockets) == 1  # one connection throughout


def test_connections_are_bounded() -> None:
    with running(max_connections=2, socket_timeout_s=CLIENT_TIMEOUT) as server, ExitStack() as idle:
        holders = [idle.enter_context(connect(server)) for _ in range(2)]
        for sock in holders:  # served (a thread each) once the server reads their first bytes
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        status, reply = exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (status, reply) == (503, {"error": "too many connections; retry later"})
        idle.close()  # the two hang up: their slots come back
        deadline = time.monotonic() + CLIENT_TIMEOUT
        while (status := exchange(server, b"GET /health HTTP/1.1\r\n\r\n")[0]) == 503:
            assert time.monotonic() < deadline
        assert status == 200


@pytest.mark.parametrize("mode", ["batched", "pillow"])
def test_an_image_over_the_pixel_limit_is_refused_from_its_header(mode: str) -> None:
    with running(mode, max_pixels=10_000, max_pixels_in_flight=10_000) as server:
        status, reply = post(server, png(200, 150))
        assert post(server, png(100, 100))[0] == 200  # at the limit
    assert status == 413
    assert reply["error"] == (
        "the image is 200x150, 30,000 pixels; this server decodes at most 10,000 pixels per image: "
        "send a smaller image"
    )


def test_decode_memory_in_flight_is_bounded() -> None:
    """Four concurrent images of P pixels with room for 2P: never more than two decode at once.

    The test's own wrapper around the decode counts the requests inside it, and holds each for up to a
    second or until all four are in, so that an unbounded server shows all four at once."""
    width, height, clients = 300, 200, 4
    body = png(width, height)
    inside, peak = 0, 0
    changed = threading.Condition()

    def counting(decode: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
        def wrapped(data: bytes) -> Any:
            nonlocal inside, peak
            with changed:
                inside += 1
                peak = max(peak, inside)
                changed.notify_all()
                changed.wait_for(lambda: inside == clients, timeout=1.0)
            try:
                return decode(data)
            finally:
                with changed:
                    inside -= 1

        return wrapped

    with running(max_pixels=width * height, max_pixels_in_flight=2 * width * height) as server:
        server.classifier._decode = counting(server.classifier._decode)
        answers: list[int] = []
        threads = [
            threading.Thread(target=lambda: answers.append(post(server, body)[0])) for _ in range(clients)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(4 * CLIENT_TIMEOUT)
    assert answers == [200] * clients and peak == 2


def test_error_replies_carry_no_internals(capsys: pytest.CaptureFixture[str]) -> None:
    junk = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    with running() as server:
        bad = [post(server, data) for data in (junk, b"not an image", GOOD[: len(GOOD) // 2])]

        def broken(data: bytes) -> Any:
            raise RuntimeError(f"state of {object()} in /srv/secret.py")

        server.classifier._decode = broken
        internal = post(server, GOOD)
    assert [status for status, _ in bad] == [400, 400, 400]
    assert "cannot identify image file (5000 bytes" in bad[0][1]["error"]
    messages = [reply["error"] for _, reply in [*bad, internal]]
    assert [m for m in messages if HEAP_ADDRESS.search(m) or "Traceback" in m] == []
    assert internal == (500, {"error": "internal error"})
    assert "secret" in capsys.readouterr().err  # the details are in the server's own log


def test_a_request_timeout_that_is_not_positive_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        server_module.main(["--request-timeout", "0"])
    assert exit_.value.code == 2
    assert "--request-timeout must be a positive number of seconds, got 0.0" in capsys.readouterr().err


#: Requests that http.server's own parsing refuses, before any handler of the example runs.
MALFORMED = {
    "PUT": (b"PUT /predict HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 501, "method 'PUT'"),
    "DELETE": (b"DELETE /predict HTTP/1.1\r\nHost: x\r\n\r\n", 501, "method 'DELETE'"),
    "request-line": (b"GARBAGE\r\n\r\n", 400, "Bad request syntax"),
    "version": (b"GET /health HTTP/x\r\n\r\n", 400, "Bad request version"),
    "HTTP/2": (b"GET /health HTTP/2.0\r\n\r\n", 505, "Invalid HTTP version"),
    "many-headers": (
        b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n",
        431,
        "Too many headers",
    ),
    "long-header": (b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431, "Line too long"),
    # No version: HTTP/0.9. The client sends no headers and waits; it must be answered without them.
    "HTTP/0.9": (b"GET /health\r\n", 505, "no HTTP version"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_the_http_machinerys_own_errors_are_json(name: str) -> None:
    raw, status, fragment = MALFORMED[name]
    with running() as server:
        got, reply = exchange(server, raw)
        assert post(server, GOOD)[0] == 200  # and the server still serves
    assert got == status and list(reply) == ["error"] and fragment in reply["error"], reply
    assert "<" not in reply["error"]  # no HTML


def test_head_is_refused_with_headers_only() -> None:
    """A reply to HEAD carries no body (HTTP says so); its headers are those of the JSON error."""
    with running() as server, connect(server) as sock:
        sock.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
        response = http.client.HTTPResponse(sock, method="HEAD")
        response.begin()
        assert (response.status, response.getheader("Content-Type")) == (501, "application/json")
        assert int(response.getheader("Content-Length", "0")) > 0 and response.read() == b""
        sock.settimeout(1.0)
        assert _read_until_closed(sock) == b""  # nothing after the headers, and the server hung up


@pytest.mark.parametrize("mode", ["batched", "pillow"])
def test_a_bad_image_is_named_without_the_decoders_internals(mode: str) -> None:
    """The same bad body twice gets the same message: no request counter, no sample index."""
    with running(mode) as server:
        replies = [post(server, b"not an image at all") for _ in range(2)]
    (status, reply), again = replies
    assert again == (status, reply) and status == 400
    assert reply["error"].startswith("the body is not an image this server decodes: ")
    assert "cannot identify image file (19 bytes" in reply["error"]
    assert "request" not in reply["error"] and "sample" not in reply["error"], reply


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"Content-Length: 10\r\nContent-Length: 12\r\n", "Content-Length must be given once, got 2: 10, 12"),
        (b"Content-Length: 10\r\nContent-Length: 10\r\n", "Content-Length must be given once, got 2: 10, 10"),
        (
            "Content-Length: \u0661\u0662\r\n".encode(),  # Arabic-Indic digits, in UTF-8
            "Content-Length must be a non-negative integer in ASCII digits, got '\u0661\u0662'",
        ),
    ],
    ids=["two", "repeated", "arabic-indic"],
)
def test_content_length_errors_say_what_was_sent(header: bytes, message: str) -> None:
    with running() as server:
        status, reply = exchange(server, b"POST /predict HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n" + GOOD)
    assert (status, reply) == (400, {"error": message})


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (QueueFullError("BatchDecoder queue is full (4 requests waiting, max_queue=4)"), "overloaded"),
        (LoaderClosedError("this BatchDecoder was closed; create a new one to decode"), "shutting down"),
    ],
    ids=["queue-full", "closed"],
)
def test_a_busy_or_closing_decoder_is_503_without_its_settings(error: Exception, message: str) -> None:
    def refuse(data: bytes) -> Any:
        raise error

    with running() as server:
        server.classifier._decode = refuse
        status, reply = post(server, GOOD)
    assert (status, reply) == (503, {"error": f"the server is {message}; retry later"})


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("GET", "/predict", "POST"), ("POST", "/stats", "GET"), ("POST", "/health", "GET")],
)
def test_a_path_served_by_another_method_is_405_with_allow(method: str, path: str, allow: str) -> None:
    with running() as server:
        connection = http.client.HTTPConnection(HOST, port_of(server), timeout=CLIENT_TIMEOUT)
        try:
            connection.request(method, path, GOOD if method == "POST" else None)
            response = connection.getresponse()
            status, headers, reply = response.status, response.headers, json.loads(response.read())
        finally:
            connection.close()
        assert post(server, GOOD)[0] == 200  # and the server still serves
    assert (status, headers["Allow"], headers["Content-Type"]) == (405, allow, "application/json")
    assert list(reply) == ["error"] and f"{allow} {path}" in reply["error"], reply
    assert "no such" not in reply["error"], reply


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_path_not_served_is_404_naming_it(method: str) -> None:
    with running() as server:
        status, reply = exchange(server, f"{method} /nope HTTP/1.1\r\nContent-Length: 0\r\n\r\n".encode())
    assert status == 404 and "'/nope'" in reply["error"] and "POST /predict" in reply["error"], reply


def test_a_request_cancelled_by_the_closing_decoder_is_503(capsys: pytest.CaptureFixture[str]) -> None:
    """Shutdown closes the decoder with ``cancel_pending=True``: a request still queued then raised
    ``CancelledError`` in its handler, answered 500 "internal error" with a traceback on stderr, where
    the docs promise a closing decoder's 503 "shutting down"."""
    gated = GatedDecoder()  # holds the only worker in the first request's decode
    with running() as server, ExitStack() as opened:
        opened.callback(gated.gate.set)  # never leave the worker held, whatever fails
        server.classifier.decoder.close()
        decoder = server_module.BatchDecoder(
            device="cpu", num_threads=1, max_delay_ms=0, size=(224, 224), decoder=gated
        )
        server.classifier.decoder, server.classifier._decode = decoder, decoder.decode
        answers: list[tuple[int, dict[str, Any]]] = []
        first = threading.Thread(target=lambda: answers.append(post(server, GOOD)))
        first.start()
        assert gated.entered.wait(CLIENT_TIMEOUT)
        second = threading.Thread(target=lambda: answers.append(post(server, GOOD)))
        second.start()
        deadline = time.monotonic() + CLIENT_TIMEOUT
        while decoder.stats().queue_depth == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        closing = threading.Thread(target=server.classifier.close)  # what the server's shutdown does
        closing.start()
        second.join(CLIENT_TIMEOUT)
        gated.gate.set()
        first.join(CLIENT_TIMEOUT)
        closing.join(CLIENT_TIMEOUT)
    assert answers[0] == (503, {"error": "the server is shutting down; retry later"})
    assert "Traceback" not in capsys.readouterr().err
