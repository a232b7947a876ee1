"""POSTs JSON to a webhook from a background thread, retrying with backoff, so that a slow or
failing receiver never delays a request."""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request

_log = logging.getLogger(__name__)


class Webhook:
    def __init__(self, url: str, attempts: int = 5, backoff: float = 0.5, timeout: float = 5.0):
        self.url, self.attempts, self.backoff, self.timeout = url, attempts, backoff, timeout
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tollway-webhook", daemon=True)
        self._thread.start()

    def send(self, payload: dict) -> None:
        self._queue.put(payload)

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what is queued (within `timeout`), then stop."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (payload := self._queue.get()) is not None:
            self._deliver(payload)

    def _deliver(self, payload: dict) -> None:
        body = json.dumps(payload).encode()
        for attempt in range(self.attempts):
            request = urllib.request.Request(self.url, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout):
                    return  # any 2xx; urlopen raises on the rest
            except urllib.error.HTTPError as e:  # a non-2xx answer: it holds the connection open
                e.close()
                problem = e
            except (urllib.error.URLError, OSError) as e:
                problem = e
            if attempt + 1 < self.attempts:
                time.sleep(self.backoff * 2 ** attempt)
        _log.error("webhook %s: gave up after %d attempts (%s); payload: %s", self.url, self.attempts, problem, body)
