"""The logging proxy in front of an OpenAI-compatible server (llama-server here).

Clients talk to the proxy; it forwards every request to the current upstream and answers with the
upstream's answer, byte for byte. Each answered chat completion (``/v1/chat/completions``, not
streamed) is appended to a JSONL traffic log as ``{"time", "messages", "completion",
"finish_reason"}``: the prompt and what was served, one line per request, written whole under a
lock (a reader never sees half a line, except the very last one of a killed process, which
``traffic.read_rows`` skips and counts).

:meth:`TrafficProxy.switch` points new requests at another upstream at once; requests already on
the old one finish there (:meth:`drain` waits, bounded, until none is left), so a swap drops
nothing. Streamed and non-chat requests are forwarded and not recorded.

Only the standard library: ``http.server``'s threading server, ``http.client`` upstream.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional

RECORDED_PATHS = ("/v1/chat/completions",)
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class TrafficProxy:
    """A threading HTTP proxy on ``host:port`` (port 0: a free one) recording into ``log_path``."""

    def __init__(self, upstream: str, log_path: str | Path, host: str = "127.0.0.1", port: int = 0,
                 timeout_s: float = 600.0):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._upstream = upstream.rstrip("/")
        self._inflight: dict[str, int] = {}
        self.requests = self.errors = self.recorded = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet: the traffic log is the record
                pass

            def do_GET(self) -> None:
                proxy._forward(self, None)

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                proxy._forward(self, self.rfile.read(n) if n else b"")

        try:
            self.server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise ValueError(f"adapt: cannot listen on {host}:{port} ({e}); set adapt.port to a free port") from None
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="traffic-proxy", daemon=True)

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> "TrafficProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def upstream(self) -> str:
        with self._lock:
            return self._upstream

    def switch(self, upstream: str) -> str:
        """New requests go to ``upstream`` from now on; returns the old one (still finishing its own)."""
        with self._lock:
            old, self._upstream = self._upstream, upstream.rstrip("/")
            return old

    def in_flight(self, upstream: Optional[str] = None) -> int:
        with self._lock:
            return self._inflight.get((upstream or self._upstream).rstrip("/"), 0)

    def drain(self, upstream: str, timeout_s: float) -> float:
        """Wait until no request is on ``upstream``; returns the seconds waited. A TimeoutError
        (naming how many are left) after ``timeout_s``."""
        t0, key = time.monotonic(), upstream.rstrip("/")
        with self._idle:
            while self._inflight.get(key, 0):
                left = timeout_s - (time.monotonic() - t0)
                if left <= 0:
                    raise TimeoutError(f"{self._inflight[key]} request(s) still on {key} after {timeout_s:.0f} s "
                                       "(adapt.drain_timeout_s)")
                self._idle.wait(min(left, 0.5))
        return time.monotonic() - t0

    # ---------------------------------------------------------------- one request

    def _forward(self, h: BaseHTTPRequestHandler, body: Optional[bytes]) -> None:
        with self._lock:
            upstream = self._upstream
            self._inflight[upstream] = self._inflight.get(upstream, 0) + 1
            self.requests += 1
        try:
            status, headers, data = self._call(upstream, h.command, h.path, h.headers, body)
        except (OSError, http.client.HTTPException) as e:
            status, headers = 502, [("Content-Type", "application/json")]
            data = json.dumps({"error": {"message": f"proxy: upstream {upstream} failed: {e}"}}).encode()
        finally:
            with self._idle:
                self._inflight[upstream] -= 1
                self._idle.notify_all()
        if status >= 500:
            with self._lock:
                self.errors += 1
        if status == 200 and body and h.path.split("?")[0] in RECORDED_PATHS:
            self._record(body, data)
        try:
            h.send_response(status)
            for k, v in headers:
                if k.lower() not in _HOP_HEADERS:
                    h.send_header(k, v)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
        except OSError:  # the client went away
            pass

    def _call(self, upstream: str, method: str, path: str, headers, body: Optional[bytes]):
        u = urllib.parse.urlsplit(upstream)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=self.timeout_s)
        try:
            fwd = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
            conn.request(method, path, body=body, headers=fwd)
            r = conn.getresponse()
            return r.status, r.getheaders(), r.read()
        finally:
            conn.close()

    def _record(self, body: bytes, data: bytes) -> None:
        try:
            req, resp = json.loads(body), json.loads(data)
            if req.get("stream"):
                return
            choice = resp["choices"][0]
            row = {"time": time.time(), "messages": req["messages"], "completion": choice["message"]["content"],
                   "finish_reason": choice.get("finish_reason")}
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            row = {"time": time.time(), "unparsed": True}  # kept, so the reader counts it as malformed
        line = json.dumps(row, ensure_ascii=False) + "\n"
        with self._lock:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(line)
            self.recorded += 1
