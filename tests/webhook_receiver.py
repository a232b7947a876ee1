"""A real local HTTP endpoint for webhook tests."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


class Receiver:
    """A local HTTP endpoint that records JSON POSTs; it answers 500 to the first `failures`."""

    def __init__(self, failures: int = 0):
        self.received, self.attempts, self.failures = [], 0, failures
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.attempts += 1
                if outer.attempts <= outer.failures:
                    self.send_response(500)
                else:
                    outer.received.append(json.loads(body))
                    self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, count: int, timeout: float = 10.0) -> list[dict]:
        deadline = time.time() + timeout
        while len(self.received) < count and time.time() < deadline:
            time.sleep(0.02)
        return self.received

    def close(self):
        self.server.shutdown()
