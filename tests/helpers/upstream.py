"""A stand-in for an OpenAI-compatible server (llama-server's chat API), in a thread: answers
``/v1/chat/completions`` with ``"<tag>: <last user message>"`` after ``delay_s``; ``die()`` makes
it exit like a crashed process (``proc.poll()`` then returns its code)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Proc:
    def __init__(self):
        self.returncode = None

    def poll(self):
        return self.returncode


class FakeServer:
    def __init__(self, tag: str, delay_s: float = 0.0):
        self.tag, self.delay_s, self.answered = tag, delay_s, 0
        self.proc = _Proc()
        me = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, code, body: bytes):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, b'{"status": "ok"}')

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                time.sleep(me.delay_s)
                if me.proc.returncode is not None:  # died meanwhile: the connection drops unanswered
                    self.close_connection = True
                    return
                if me.tag == "garbled":
                    return self._send(200, b'{"choices": []}')
                text = f"{me.tag}: {req['messages'][-1]['content']}"
                me.answered += 1
                self._send(200, json.dumps({"choices": [{"message": {"role": "assistant", "content": text},
                                                         "finish_reason": "stop"}]}).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def die(self, code: int = -9):
        self.proc.returncode = code
        self.httpd.shutdown()
        self.httpd.server_close()

    def stop(self):
        if self.proc.returncode is None:
            self.die(0)


class FakeServers:
    """What ``Adapter`` starts servers with: one FakeServer per draft folder started, named by it."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s, self.started = delay_s, []

    def start(self, draft):
        s = FakeServer(draft.name, self.delay_s)
        self.started.append(s)
        return s


def chat(url: str, text: str, timeout_s: float = 30.0) -> tuple[int, dict]:
    """One chat request (status, JSON answer); status 0 for a connection error."""
    import urllib.error
    import urllib.request

    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 8}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:
        return 0, {}
