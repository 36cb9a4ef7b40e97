"""The stack's HTTP client (extproc/stack/http_client.py) does what urllib did for it: an
answer other than 2xx is an error, a redirect is not followed, each request goes on a
connection of its own, and a server that does not answer in time is an error. Every such
error is an httpx.HTTPError, which wait_until counts as "not yet" by default."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from extproc.stack import http_client
from extproc.stack.processes import free_port, http_ok, wait_until
from extproc.stack.prometheus import scrape, scrape_metric

METRICS = b"# TYPE up gauge\nup 1\n"


class Server(ThreadingHTTPServer):
    def __init__(self, address: tuple[str, int]) -> None:
        super().__init__(address, Handler)
        self.peers: list[tuple[str, int]] = []
        self.cookies: list[str | None] = []
        self.bodies: list[bytes] = []


class Handler(BaseHTTPRequestHandler):
    # HTTP/1.1: the server keeps a connection open for the next request unless the client
    # closes it, so a client that reused connections would show as one peer.
    protocol_version = "HTTP/1.1"
    server: Server

    def do_GET(self) -> None:
        self.server.peers.append(self.client_address)
        self.server.cookies.append(self.headers["cookie"])
        if self.path == "/metrics":
            self._answer(200, METRICS, {"set-cookie": "session=1; Path=/"})
        elif self.path == "/moved":
            self._answer(302, b"", {"location": "/metrics"})
        elif self.path == "/unavailable":
            self._answer(503, b"not yet")
        else:
            self._answer(404, b"no such page")

    def do_POST(self) -> None:
        self.server.peers.append(self.client_address)
        self.server.cookies.append(self.headers["cookie"])
        self.server.bodies.append(self.rfile.read(int(self.headers["content-length"])))
        self._answer(200, b"{}")

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in {"content-length": str(len(body)), **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, Server]]:
    server = Server(("127.0.0.1", free_port()))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_2xx_answer_is_read_and_each_request_has_a_connection_of_its_own(server):
    url, state = server
    assert scrape(f"{url}/metrics") == {("up", ()): 1.0}
    assert http_ok(f"{url}/metrics") is True
    response = http_client.post(f"{url}/post", b'{"a": 1}', {"content-type": "x"}, timeout_s=2)
    assert response.json() == {}
    assert state.bodies == [b'{"a": 1}']
    assert len(state.peers) == 3
    assert len(set(state.peers)) == 3  # three source ports: no connection was reused
    assert state.cookies == [None, None, None]  # /metrics set one; no later request sent it


@pytest.mark.parametrize("path", ["/unavailable", "/missing", "/moved"])
def test_any_other_answer_is_an_http_error_and_a_redirect_is_not_followed(server, path):
    url, state = server
    with pytest.raises(httpx.HTTPStatusError):
        http_client.get(f"{url}{path}", timeout_s=2)
    with pytest.raises(httpx.HTTPStatusError):
        http_ok(f"{url}{path}")
    with pytest.raises(httpx.HTTPStatusError):
        scrape(f"{url}{path}")
    assert scrape_metric(f"{url}{path}", "up") is None
    assert len(state.peers) == 4  # /moved's location (/metrics) was never asked for


def test_a_server_that_does_not_answer_in_time_is_a_timeout():
    # Listening, never accepting: the connection completes in the backlog, no answer comes.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/metrics"
        started = time.monotonic()
        with pytest.raises(httpx.TimeoutException):
            http_client.get(url, timeout_s=0.2)
        assert time.monotonic() - started < 5
        assert scrape_metric(url, "up") is None


def test_wait_until_counts_no_answer_and_a_non_2xx_answer_as_not_yet(server):
    url, _ = server
    down = f"http://127.0.0.1:{free_port()}/health"
    # Ignored (by default), so the wait ends in its timeout, naming the last error.
    with pytest.raises(AssertionError, match="last error: ConnectError"):
        wait_until(lambda: http_ok(down), 0.2, "the server", interval_s=0.01)
    with pytest.raises(AssertionError, match="last error: HTTPStatusError: Server error '503"):
        wait_until(lambda: http_ok(f"{url}/unavailable"), 0.2, "the server", interval_s=0.01)
    assert wait_until(lambda: http_ok(f"{url}/metrics"), 5, "the server") is True
