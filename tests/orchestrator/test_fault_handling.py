"""How a fault reads from the driver's side, on small real processes and a real HTTP server:
a request timeout or a passed case deadline ends the workload at once, the client sends the
server's API key, a stopped (hung) server is stopped without waiting out the grace period, and
exit codes, signals and lost port races are named."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from orchestrator.client import workload as wl
from orchestrator.common.net import free_port
from orchestrator.common.processes import describe_exit
from orchestrator.engines.vllm import server as eng


class _Server(BaseHTTPRequestHandler):
    """Streams `max_tokens` one-token chunks `delay_s` apart; answers 401 without the key."""

    protocol_version = "HTTP/1.1"
    delay_s = 0.0
    key: str | None = None

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.key and self.headers.get("Authorization") != f"Bearer {self.key}":
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            time.sleep(self.delay_s)
            self._send({"choices": [{"text": "a", "token_ids": [7], "finish_reason": None}]})
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        self._send({"choices": [], "usage": usage})
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _send(self, obj: dict) -> None:
        self._chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _chunk(self, data: bytes) -> None:
        try:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        except OSError:  # the client gave up
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_a_request_timeout_ends_the_workload_at_once(url: str, monkeypatch) -> None:
    monkeypatch.setattr(_Server, "delay_s", 0.5)  # each request takes 50 s
    p = wl.WorkloadParams("w", 1, 100, concurrency=2, requests=10)
    t0 = time.monotonic()
    with pytest.raises(wl.WorkloadTimeoutError, match=r"within the request timeout \(1 s\)") as e:
        wl.run_workload(url, "m", p, vocab_size=2048, request_timeout_s=1.0)
    # One timeout, not ten: the other user stops too.
    assert time.monotonic() - t0 < 3
    assert 1 <= len(e.value.records) <= 2
    assert any("timed out" in (r["error"] or "") for r in e.value.records)


def test_a_passed_case_deadline_ends_the_workload(url: str, monkeypatch) -> None:
    monkeypatch.setattr(_Server, "delay_s", 0.05)
    p = wl.WorkloadParams("w", 1, 100, requests=10)
    t0 = time.monotonic()
    with pytest.raises(wl.WorkloadTimeoutError, match="case deadline passed during workload 'w'"):
        wl.run_workload(url, "m", p, vocab_size=2048, deadline=time.monotonic() + 0.5)
    assert time.monotonic() - t0 < 2


def test_the_api_key_is_sent(url: str, monkeypatch) -> None:
    monkeypatch.setattr(_Server, "key", "k3y-value")
    p = wl.WorkloadParams("w", 1, 3)
    assert wl.run_workload(url, "m", p, vocab_size=2048).to_dict()["errors"] == 1  # 401
    d = wl.run_workload(url, "m", p, vocab_size=2048, api_key="k3y-value").to_dict()
    assert d["errors"] == 0


def test_api_key_from_args_and_env() -> None:
    assert eng.api_key(["--api-key", "a1", "--x"], {}) == "a1"
    assert eng.api_key(["--api_key=b2"], {"VLLM_API_KEY": "env"}) == "b2"
    assert eng.api_key(["--port", "1"], {"VLLM_API_KEY": "env"}) == "env"
    assert eng.api_key([], {}) is None
    assert eng.auth_headers("a1") == {"Authorization": "Bearer a1"}
    assert eng.auth_headers(None) == {}


def test_exit_descriptions() -> None:
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-200) == "killed by signal 200"
    assert describe_exit(None) == "exited"
    assert eng.is_port_clash("OSError: [Errno 98] Address already in use")
    assert not eng.is_port_clash("OSError: [Errno 13] Permission denied")


def test_a_stopped_server_is_stopped_without_waiting_out_the_grace(tmp_path: Path) -> None:
    proc = eng.start_server(
        [sys.executable, "-c", "import time; time.sleep(300)"], {}, tmp_path / "server.log"
    )
    time.sleep(0.2)
    proc.send_signal(signal.SIGSTOP)  # a hung server: SIGTERM alone would stay pending
    t0 = time.monotonic()
    assert eng.stop_server(proc, grace_s=20) == -signal.SIGTERM
    assert time.monotonic() - t0 < 5


def test_wait_ready_names_the_signal_that_killed_the_server(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    proc.kill()
    proc.wait()
    with pytest.raises(eng.ServerStartError, match="server process killed by SIGKILL after"):
        eng.wait_ready(
            "http://127.0.0.1:9",
            timeout_s=5,
            alive=lambda: proc.poll() is None,
            returncode=lambda: proc.returncode,
        )


def test_a_death_faster_than_the_watch_is_still_a_death() -> None:
    """A killed server refuses connections at once: every request fails before the first
    poll, and the workload must still end as a death, not as a measurement with errors."""
    port = free_port("127.0.0.1")
    p = wl.WorkloadParams("w", 1, 1, requests=2)
    with pytest.raises(wl.ServerDiedError, match="server died during workload 'w'") as e:
        wl.run_workload(f"http://127.0.0.1:{port}", "m", p, vocab_size=2048, alive=lambda: False)
    assert len(e.value.records) == 2 and all(r["error"] for r in e.value.records)
