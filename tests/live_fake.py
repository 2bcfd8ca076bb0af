"""A stand-in for `python -m model serve` in the Live server page's tests: http.server on a thread of its own, answering
GET /v1/engine/state with tests/live_state.json (or whatever a test puts in `state`), GET /v1/models, and POST
/v1/chat/completions and /v1/completions with a short streamed answer whose id names request 5, the fixture's student
request.

    with FakeServer() as fake:  # fake.url: http://127.0.0.1:PORT
        fake.chat = False       # chat refused as for a model without a chat format: the page falls back to text
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

STATE_FILE = Path(__file__).resolve().parent / "live_state.json"
ANSWER = ["con", " mèo", " ngủ"]


def fixture_state() -> dict:
    return json.loads(STATE_FILE.read_text(encoding="utf-8"))


class FakeServer:
    def __init__(self):
        self.state: dict | str = fixture_state()  # a str is sent as it is (garbage)
        self.chat = True
        self.status = 200
        self.posted: list[tuple[str, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._send(200, b'{"object": "list", "data": [{"id": "small", "object": "model"}]}')
                if self.path != "/v1/engine/state":
                    return self._send(404, b'{"error": {"message": "not found"}}')
                if fake.status != 200:
                    return self._send(fake.status, b'{"error": {"message": "no"}}')
                body = fake.state if isinstance(fake.state, str) else json.dumps(fake.state)
                self._send(200, body.encode("utf-8"))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint = self.path.removeprefix("/v1/")
                fake.posted.append((endpoint, body))
                if endpoint == "chat/completions" and not fake.chat:
                    error = {"error": {"message": "the model has no chat template: use /v1/completions",
                                       "type": "invalid_request_error", "param": "messages", "code": None}}
                    return self._send(400, json.dumps(error).encode())
                rid = "chatcmpl-5" if endpoint == "chat/completions" else "cmpl-5"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for k, piece in enumerate(ANSWER):
                    last = k == len(ANSWER) - 1
                    choice = ({"index": 0, "delta": {"content": piece}} if endpoint == "chat/completions"
                              else {"index": 0, "text": piece})
                    choice["finish_reason"] = "length" if last else None
                    self.wfile.write(f"data: {json.dumps({'id': rid, 'choices': [choice]})}\n\n".encode())
                usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                         "prompt_tokens_details": {"cached_tokens": 0}}
                self.wfile.write(f"data: {json.dumps({'id': rid, 'choices': [], 'usage': usage})}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
