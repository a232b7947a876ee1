"""The mode advisor (tollway advise): on a small linear profile, a class with a tight TPOT SLO
gets the fast lane and a loose one the cheapest lane that serves it; a class no lane can serve
is reported as such; a real run's records are judged as simulated ones are; bad TOML is refused
in one line; the CLI writes JSON and HTML; classes are derived from a real ledger file."""
from __future__ import annotations

import json

import pytest

from test_sim import config, linear_profile
from tollway.cli import main
from tollway.meter.ledger import Ledger, LedgerRow
from tollway.sim.advisor import Advisor, judge_class
from tollway.sim.ledger_classes import classes_from_ledger
from tollway.sim.traffic_classes import load_classes, make_class
from tollway.traffic.records import RequestRecord
from tollway.traffic.stats import SLO

MIX = """
[classes.chat]
rate = 1
prompt_tokens = 64
output_tokens = 32
slo = "ttft=500ms,tpot=50ms"

[classes.bulk]
rate = 2
prompt_tokens = "mean=128,stdev=16,min=64,max=256"
output_tokens = 32
slo = "ttft=30s,tpot=2s"

[classes.impossible]
rate = 0.5
prompt_tokens = 64
output_tokens = 16
slo = "tpot=5ms"
"""


def fast_config():
    cfg = config()
    cfg.tiers["fast"].tpot_target = 0.05  # reachable on the linear profile (its steps cost 20 ms and up)
    return cfg


@pytest.fixture(scope="module")
def advice(tmp_path_factory):
    path = tmp_path_factory.mktemp("advise") / "mix.toml"
    path.write_text(MIX)
    return Advisor(fast_config(), linear_profile(), load_classes(path), requests=300).advise(progress=False)


def test_a_tight_tpot_gets_fast_and_a_loose_one_the_cheapest_lane_that_meets_it(advice):
    chat, bulk, _ = advice.classes
    assert chat.lane == "fast"
    assert not chat.lanes["standard"].meets and "TPOT" in chat.lanes["standard"].why_not
    assert chat.lanes["fast"].tpot_p99 <= 0.05 < chat.lanes["standard"].tpot_p99
    assert bulk.lane in ("standard", "batch")
    serving = [o for o in bulk.lanes.values() if o.meets and not o.breaks]
    cheapest = min(o.cost_per_m_output for o in serving)
    assert bulk.lanes[bulk.lane].cost_per_m_output <= cheapest * 1.02
    assert all(o.why_not for lane, o in bulk.lanes.items() if lane != bulk.lane)
    assert advice.usd_per_hour == 2.0 and advice.cost_per_m_output > 0


def test_a_class_no_lane_can_serve_is_reported(advice):
    impossible = advice.classes[2]
    assert impossible.lane is None
    assert set(impossible.lanes) == {"fast", "standard", "batch"}
    assert all(not o.meets and o.why_not.startswith("misses the SLO: TPOT") for o in impossible.lanes.values())
    assert advice.to_dict()["assignment"] == {"chat": "fast", "bulk": advice.classes[1].lane, "impossible": None}


def test_a_measured_class_is_judged_as_a_simulated_one():
    """judge_class, which benchmarks/advise_check.py applies to a real run's records: a failed
    request is past every limit, so one in a hundred misses a p99 SLO."""
    chat = make_class("chat", 1, 8, 9, "ttft=500ms,tpot=50ms", 99, ["fast"], "chat")
    records = [RequestRecord(i, "real", "priority", False, 8, 9, sent=float(i), first_token=i + 0.1,
                             end=i + 0.1 + 8 * 0.04, output_tokens=9) for i in range(100)]
    served = judge_class(chat, "fast", records, 1.5)
    assert served.meets and served.failed == 0 and served.cost_per_m_output == 1.5
    assert served.ttft_p99 == pytest.approx(0.1) and served.tpot_p99 == pytest.approx(0.04)
    records[0] = RequestRecord(0, "real", "priority", False, 8, 9, sent=0.0, end=0.2, error="http_429")
    refused = judge_class(chat, "fast", records, 1.5)
    assert not refused.meets and refused.failed == 1 and refused.ttft_at is None and refused.tpot_at is None


@pytest.mark.parametrize("text, message", [
    ("[classes.a]\nrate = 1\nprompt_tokens = 8\noutput_tokens = 8\n", "missing slo"),
    ("[classes.a]\nrate = -1\nprompt_tokens = 8\noutput_tokens = 8\nslo = 'tpot=1s'\n", "rate"),
    ("[classes.a]\nrate = 1\nprompt_tokens = 'lots'\noutput_tokens = 8\nslo = 'tpot=1s'\n", "prompt_tokens"),
    ("[classes.a]\nrate = 1\nprompt_tokens = 8\noutput_tokens = 8\nslo = 'fast:tpot=1s'\n", "no tier prefix"),
    ("[classes.a]\nrate = 1\nprompt_tokens = 8\noutput_tokens = 8\nslo = 'tpot=1s'\nlanes = ['turbo']\n", "lanes"),
    ("[classes.a]\nrate = 1\nprompt_tokens = 8\noutput_tokens = 8\nslo = 'tpot=1s'\ncolour = 1\n", "unknown keys"),
    ("percentile = 150\n[classes.a]\nrate = 1\nprompt_tokens = 8\noutput_tokens = 8\nslo = 'tpot=1s'\n", "percentile"),
    ("[classes\n", "not TOML"),
    ("title = 'x'\n", "unknown top-level"),
])
def test_the_toml_loader_refuses_bad_input_in_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_classes(path)
    profile = tmp_path / "p.json"
    linear_profile().save(profile)
    assert main(["advise", "--profile", str(profile), "--classes", str(path), "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tollway: error:") and message in err and "\n" not in err


def test_the_cli_writes_json_and_html(tmp_path, capsys):
    classes, profile, config_toml = tmp_path / "mix.toml", tmp_path / "p.json", tmp_path / "engine.toml"
    classes.write_text(MIX.split("[classes.impossible]")[0])
    linear_profile().save(profile)
    config_toml.write_text("[scheduler]\nnum_blocks = 4096\nmax_num_seqs = 64\n[tiers.fast]\ntpot_target = 0.05\n")
    out = tmp_path / "advice"
    assert main(["advise", "--profile", str(profile), "--config", str(config_toml), "--classes", str(classes),
                 "--requests", "300", "--output", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "recommended: chat → fast" in printed and "$2.00/hour" in printed
    data = json.loads((out / "advice.json").read_text())
    assert data["assignment"]["chat"] == "fast" and data["usd_per_hour"] == 2.0
    assert set(data["classes"][0]["lanes"]) == {"fast", "standard", "batch"}
    page = (out / "advice.html").read_text()
    assert "<svg" in page and "chat in fast (recommended)" in page


def _row(i: int, created: float, key: str, tags: list[str], prompt: int, output: int) -> LedgerRow:
    return LedgerRow(f"r{i}", created, key, "standard", "m", prompt, output, 0, 0.01, 0.1, 1.0, 0.5, 1e-4, 2e-4,
                     "length", tags)


def test_classes_derived_from_a_ledger_file(tmp_path, capsys):
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path)
    for i in range(40):  # alice: 30 requests in 100 s, prompts 100-200; bob: 10, one tag "nightly"
        ledger.record(_row(i, 1000.0 + i * 2.5, "alice" if i % 4 else "bob", ["nightly"] if i % 4 == 0 else [],
                           100 + i * 2 if i % 4 else 500, 50 if i % 4 else 200))
    ledger.close()
    slo = SLO.parse("ttft=2s,tpot=100ms,alice:tpot=30ms")
    alice, bob = classes_from_ledger(path, "key", slo, 0.95, start=1000.0, end=1100.0)
    assert (alice.name, bob.name) == ("alice", "bob")
    assert alice.rate == pytest.approx(30 / 100) and bob.rate == pytest.approx(10 / 100)
    assert alice.slo == {"ttft": 2.0, "tpot": 0.03} and bob.slo == {"ttft": 2.0, "tpot": 0.1}
    assert (alice.prompt.low, alice.prompt.high, alice.output.mean) == (102, 178, 50) and bob.prompt.mean == 500
    (nightly,) = classes_from_ledger(path, "tag", slo, 0.99)
    assert nightly.name == "nightly" and nightly.output.mean == 200
    with pytest.raises(ValueError, match="no limits for the class 'alice'"):
        classes_from_ledger(path, "key", SLO.parse("bob:tpot=1s"), 0.99)
    profile = tmp_path / "p.json"
    linear_profile().save(profile)
    assert main(["advise", "--profile", str(profile), "--ledger", str(path), "--slo", "ttft=5s,tpot=1s",
                 "--requests", "100", "--output", str(tmp_path / "out"), "--format", "json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["assignment"].keys() == {"alice", "bob"}
