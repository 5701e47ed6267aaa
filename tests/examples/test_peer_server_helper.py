"""The PEER example's embedded-server helper (examples/peer_financial_qa/server.py): a server
that exits early or never gets healthy is reported with its log's tail; a healthy one is
waited for and stopped. Stand-in servers are small Python scripts."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.peer_financial_qa.server import EmbeddedServer, ServerStartError  # noqa: E402


def _fake_server(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "fake_serve.py"
    script.write_text(textwrap.dedent(body))
    return [sys.executable, str(script)]


def test_server_helper_reports_early_exit_with_log_tail(tmp_path):
    cmd = _fake_server(tmp_path, """
        import sys
        print("loading model", sys.argv[sys.argv.index('--model') + 1], file=sys.stderr)
        print("RuntimeError: weights not found", file=sys.stderr)
        sys.exit(7)
    """)
    with pytest.raises(ServerStartError) as e:
        EmbeddedServer("tiny", command=cmd, timeout_s=20).start()
    msg = str(e.value)
    assert "exited with code 7" in msg and "weights not found" in msg and "loading model tiny" in msg


def test_server_helper_times_out_with_log_tail(tmp_path):
    cmd = _fake_server(tmp_path, """
        import sys, time
        print("still compiling kernels...", file=sys.stderr, flush=True)
        time.sleep(30)
    """)
    srv = EmbeddedServer("tiny", command=cmd, timeout_s=1.0)
    with pytest.raises(ServerStartError) as e:
        srv.start()
    assert "not healthy after" in str(e.value) and "still compiling kernels" in str(e.value)
    assert srv.proc is None  # stopped


def test_server_helper_waits_for_health_and_stops(tmp_path):
    cmd = _fake_server(tmp_path, """
        import sys, time
        from http.server import BaseHTTPRequestHandler, HTTPServer
        port = int(sys.argv[sys.argv.index('--port') + 1])
        time.sleep(0.5)
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == '/health' else 404)
                self.end_headers()
            def log_message(self, *a):
                pass
        HTTPServer(('127.0.0.1', port), H).serve_forever()
    """)
    with EmbeddedServer("tiny", command=cmd, timeout_s=20) as srv:
        proc = srv.proc
        assert proc is not None and proc.poll() is None
        assert srv.base_url.endswith("/v1")
    assert proc.poll() is not None
