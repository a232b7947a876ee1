"""The committed `tollway bench` example: a short sweep against a real `tollway serve` on the
embedded default model, written to benchmarks/bench-example/ (bench.json and report.html).

    python benchmarks/bench_example.py    # about 5 min on a 2-core machine

It starts the server on a free port with its own data directory, waits for /health, runs
the sweep through the `tollway bench` command, and stops the server.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

OUTPUT = Path(__file__).resolve().parent / "bench-example"
BENCH = ["--model", "gemma3-270m", "--mix", "fast=0.2,standard=0.8", "--sweep", "4", "--sweep-max-concurrency", "16",
         "--max-requests", "16", "--prompt-tokens", "mean=96,stdev=32,min=32,max=160", "--output-tokens", "32",
         "--slo", "ttft=2s,tpot=500ms,fast:tpot=150ms", "--seed", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, server: subprocess.Popen, limit: float = 600.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"tollway serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit("tollway serve did not become ready")


def main() -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as data:
        server = subprocess.Popen([sys.executable, "-m", "tollway", "serve", "--port", str(port), "--data-dir", data,
                                   "--keys-db", os.path.join(data, "keys.sqlite")])
        try:
            wait_ready(url, server)
            return subprocess.call([sys.executable, "-m", "tollway", "bench", "--url", url, "--label", "tollway (example)",
                                    "--output", str(OUTPUT), *BENCH])
        finally:
            server.terminate()
            server.wait(30)


if __name__ == "__main__":
    sys.exit(main())
