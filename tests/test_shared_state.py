"""Two real `tollway serve` processes sharing one real PostgreSQL database, driven by the
official openai client: a key made once with `tollway keys` works on both, a budget's cap
holds while both spend against it from many threads at once, and after a SIGKILL every
served request's row is in the ledger that `tollway usage` reads; a key's rpm and tpm hold
for both servers together."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import openai
import pytest

from tollway.cli import main
from tollway.config import default_tiers
from tollway.meter.ledger import Ledger

from live_server import MODEL, free_port, wait_until_up

PROMPT = list(range(1000, 1010))  # 10 tokens, whatever the tokenizer
NEW = 2
STANDARD = default_tiers()["standard"]
PRICE = (len(PROMPT) * STANDARD.price_input_per_m + NEW * STANDARD.price_output_per_m) / 1e6
ADMITTED = 12
WORKERS, EACH = 12, 3


def _serve(url: str, data_dir, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tollway", "serve", "--port", str(port),
                             "--database-url", url, "--data-dir", str(data_dir), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, f"http://127.0.0.1:{port}"


def test_two_servers_on_one_database_share_keys_and_never_pass_a_budget(postgres, tmp_path, capsys):
    url = postgres.new_database()
    assert main(["keys", "add", "--name", "alice", "--database-url", url]) == 0
    key = capsys.readouterr().out.strip()
    config = tmp_path / "tollway.toml"
    config.write_text(f'[[budgets]]\nkey = "alice"\nperiod = "daily"\nlimit = {ADMITTED * PRICE!r}\n')
    servers = [_serve(url, tmp_path / f"server{i}", "--config", str(config)) for i in range(2)]
    try:
        for proc, base in servers:
            wait_until_up(proc, base)
        clients = [openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0) for _, base in servers]
        served, refused, lock = [], [], threading.Lock()

        def spend(worker: int) -> None:
            for i in range(EACH):
                which = (worker + i) % 2
                try:
                    done = clients[which].completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW,
                                                             extra_body={"ignore_eos": True})
                except openai.RateLimitError as e:
                    with lock:
                        refused.append(e.code)
                    continue
                with lock:
                    served.append((which, done.id, done.usage.model_extra["price"]))

        threads = [threading.Thread(target=spend, args=(w,)) for w in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(served) == ADMITTED and refused == ["insufficient_quota"] * (WORKERS * EACH - ADMITTED)
        assert {which for which, _, _ in served} == {0, 1}  # both servers spent from the one budget
        assert sum(price for _, _, price in served) == pytest.approx(ADMITTED * PRICE)

        os.kill(servers[0][0].pid, signal.SIGKILL)
        servers[0][0].wait(10)
        with pytest.raises(openai.RateLimitError, match="daily budget of key 'alice' is spent"):
            clients[1].completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW)
    finally:
        for proc, _ in servers:
            proc.kill()
            proc.wait(10)
    rows = Ledger(url).rows()  # a fresh store: what a restarted server would read
    assert sorted(r.id for r in rows) == sorted(rid for _, rid, _ in served)
    assert sum(r.price for r in rows) <= ADMITTED * PRICE + 1e-12
    assert main(["usage", "--database-url", url, "--group-by", "key", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith(f"alice,{ADMITTED},")


def test_a_keys_rate_limits_hold_across_two_servers(postgres, tmp_path, capsys):
    url = postgres.new_database()
    rpm, tpm_requests = 8, 6
    tokens = len(PROMPT) + NEW  # what a request counts against tpm: its prompt and max_tokens
    keys = {}
    for name, limit in (("rpm", ["--rpm", str(rpm)]), ("tpm", ["--tpm", str(tpm_requests * tokens)])):
        assert main(["keys", "add", "--name", name, "--database-url", url, *limit]) == 0
        keys[name] = capsys.readouterr().out.strip()
    servers = [_serve(url, tmp_path / f"server{i}") for i in range(2)]
    try:
        for proc, base in servers:
            wait_until_up(proc, base)
        clients = {(name, i): openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
                   for name, key in keys.items() for i, (_, base) in enumerate(servers)}
        served = {(name, i): 0 for name, i in clients}
        refused, lock = [], threading.Lock()

        def call(name: str, which: int) -> None:
            try:
                clients[name, which].completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW,
                                                        extra_body={"ignore_eos": True})
            except openai.RateLimitError as e:
                with lock:
                    refused.append((name, e.code, int(e.response.headers["Retry-After"])))
                return
            with lock:
                served[name, which] += 1

        for name, which in clients:  # one each first: both servers serve from both windows
            call(name, which)

        def hammer(worker: int) -> None:
            for i in range(EACH):
                call(("rpm", "tpm")[worker % 2], (worker + i) % 2)

        threads = [threading.Thread(target=hammer, args=(w,)) for w in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for proc, _ in servers:
            proc.kill()
            proc.wait(10)
    assert min(served.values()) >= 1
    assert served["rpm", 0] + served["rpm", 1] == rpm and served["tpm", 0] + served["tpm", 1] == tpm_requests
    assert len(refused) == len(clients) + WORKERS * EACH - rpm - tpm_requests
    assert all(code == "rate_limit_exceeded" and 1 <= seconds <= 60 for _, code, seconds in refused)
