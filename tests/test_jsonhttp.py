"""specforge.jsonhttp: the one POST and health probe the engines' clients share."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specforge.jsonhttp import HttpFailure, get_text, healthy, post_json


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _reply(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._reply(200 if self.path == "/health" else 503, b"ok")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/echo":
            self._reply(200, json.dumps({"got": body}).encode())
        elif self.path == "/bad":
            self._reply(400, b"missing field 'prompt'")
        else:
            self._reply(200, b"<html>not json</html>")


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_post_json_round_trips_dict_and_bytes(server):
    assert post_json(f"{server}/echo", {"a": [1, 2]}, 5) == {"got": {"a": [1, 2]}}
    assert post_json(f"{server}/echo", b'{"b": 3}', 5) == {"got": {"b": 3}}


def test_post_json_names_status_and_body_of_an_http_error(server):
    with pytest.raises(HttpFailure) as e:
        post_json(f"{server}/bad", {}, 5)
    assert e.value.code == 400 and "missing field 'prompt'" in e.value.detail


def test_post_json_refuses_a_reply_that_is_not_json(server):
    with pytest.raises(HttpFailure) as e:
        post_json(f"{server}/html", {}, 5)
    assert e.value.code is None and "not JSON" in e.value.detail


def test_unreachable_is_a_failure_without_status():
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(HttpFailure) as e:
        post_json(f"{url}/echo", {}, 5)
    assert e.value.code is None and "refused" in e.value.detail.lower()
    with pytest.raises(HttpFailure):
        get_text(f"{url}/metrics", 5)
    assert not healthy(f"{url}/health", 1)


def test_healthy_only_on_200(server):
    assert healthy(f"{server}/health", 5)
    assert not healthy(f"{server}/loading", 5)  # 503 while an engine loads: the negative control
    assert get_text(f"{server}/health", 5) == "ok"


def test_wait_healthy_says_ready_exited_or_timeout(server):
    """A server that answers is ready; a dead process is said at once, before the deadline (the control:
    the same dead server with the process alive waits out its deadline)."""
    import time

    from specforge.jsonhttp import wait_healthy

    dead = f"http://127.0.0.1:{_closed_port()}/health"
    assert wait_healthy(f"{server}/health", time.monotonic() + 5, exited=lambda: False) == "ready"
    t0 = time.monotonic()
    assert wait_healthy(dead, t0 + 30, exited=lambda: True) == "exited"
    assert time.monotonic() - t0 < 5
    assert wait_healthy(dead, time.monotonic() + 0.3, exited=lambda: False, poll_s=0.05) == "timeout"
    assert wait_healthy(f"{server}/loading", time.monotonic() + 0.3, exited=lambda: False, poll_s=0.05) == "timeout"


def test_loopback_requests_ignore_a_proxy_other_hosts_keep_it(server, monkeypatch):
    """With ``http_proxy`` set and no ``no_proxy`` (a cluster's login environment), the engines we start
    on 127.0.0.1 are still reached directly. Control: urllib's default opener sends the same request to
    the (dead) proxy and gets nothing. Other hosts keep the environment's proxy."""
    import urllib.error
    import urllib.request

    from specforge.jsonhttp import is_loopback

    dead = f"http://127.0.0.1:{_closed_port()}"
    for var in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(var, dead)
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    assert healthy(f"{server}/health", timeout_s=5)
    assert post_json(f"{server}/echo", {"a": 1}, 5) == {"got": {"a": 1}}
    with pytest.raises(urllib.error.URLError):  # the control: an opener that reads the environment, as
        urllib.request.build_opener().open(f"{server}/health", timeout=5)  # urlopen's did: through the proxy
    assert is_loopback(server) and is_loopback("http://localhost:8000") and is_loopback("http://[::1]:8000/x")
    assert not is_loopback("http://10.0.0.7:8000") and not is_loopback("http://engine.internal:8000")
