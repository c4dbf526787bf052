"""A tiny local OpenAI-compatible ``/v1/chat/completions`` server for tests (no network).

    with ChatStub(lambda body: (200, {"choices": [{"message": {"role": "assistant", "content": "hi"}}]})) as srv:
        ...  # srv.url, srv.requests (path, auth header, JSON body of each request)

``reply(body)`` returns ``(status, payload)``: a JSON-able payload, or bytes sent as they are.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any


class ChatStub:
    """Serves ``reply(body)`` on 127.0.0.1 (a free port) and records every request."""

    def __init__(self, reply: Callable[[dict[str, Any]], tuple[int, Any]]) -> None:
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                status, payload = reply(body)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                if not isinstance(payload, bytes):
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "ChatStub":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
