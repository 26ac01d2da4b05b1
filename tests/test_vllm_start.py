"""How ``models/vllm_engine.VllmEngine`` starts an engine, with a stand-in for vLLM's server (a script
that binds the port it is given and answers /health, or says what vLLM says when the port is taken):
nothing here needs vLLM installed."""

import functools
import socket
import sys

import pytest
import torch

import specforge.models.vllm_engine as vllm_engine
from specforge.jsonhttp import wait_healthy
from specforge.models.vllm_engine import EngineError, EngineSpec, VllmEngine

FAKE_SERVER = """#!{python}
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


try:
    srv = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as e:
    print(f"ERROR 11-29 10:00:00 [api_server.py:1] OSError: {{e}}", flush=True)
    sys.exit(1)
srv.serve_forever()
"""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_SERVER.format(python=sys.executable))
    python.chmod(0o755)
    return EngineSpec(model_path="m", layer_ids=[1, 2], dtype=torch.float32, max_model_len=8, python=str(python),
                      startup_timeout_s=60)


def test_a_port_taken_before_the_engine_binds_it_is_picked_again(fake_vllm, tmp_path, monkeypatch):
    """``free_port`` releases the port it found; another process may bind it before vLLM does. The
    engine then exits ("Address already in use") and is started again on a new port. Control: with
    one try the same start is one EngineError naming the cause."""
    held = socket.socket()  # listening, never answering: a health probe there waits out its timeout
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    real = vllm_engine.free_port
    monkeypatch.setattr(vllm_engine, "wait_healthy", functools.partial(wait_healthy, probe_timeout_s=0.5))
    try:
        for tries in (vllm_engine.PORT_TRIES, 1):
            picks = iter([taken])
            monkeypatch.setattr(vllm_engine, "free_port", lambda: next(picks, None) or real())
            monkeypatch.setattr(vllm_engine, "PORT_TRIES", tries)
            if tries == 1:
                with pytest.raises(EngineError, match="exited .*Address already in use"):
                    VllmEngine(fake_vllm, log_dir=str(tmp_path / "logs"), storage_root=str(tmp_path))
                continue
            engine = VllmEngine(fake_vllm, log_dir=str(tmp_path / "logs"), storage_root=str(tmp_path))
            try:
                assert engine.alive() and not engine.url.endswith(f":{taken}")
                assert "Address already in use" in (tmp_path / "logs" / f"vllm-{taken}.log").read_text()
            finally:
                engine.close()
    finally:
        held.close()
