"""The bench's arithmetic on crafted request timings: percentiles, TPOT, throughput over the
measured window, goodput under per-tier SLOs, errors by kind, and cost; and its parsers."""
from __future__ import annotations

import random

import pytest

from tollway.traffic.patterns import sweep_rates
from tollway.traffic.records import RequestRecord
from tollway.traffic.stats import SLO, percentile, summarize
from tollway.traffic.workload import Lengths, parse_mix


def record(index, tier, sent, ttft, tpot, tokens, warmup=False, error=None, cost=None):
    first = sent + ttft
    end = first + tpot * (tokens - 1)
    chunks = [first + tpot * k for k in range(tokens)]
    return RequestRecord(index, "s", tier, warmup, 10, tokens, sent, first, chunks, end, tokens, cost,
                         error=error)


def crafted():
    # Four fast requests with TTFTs 0.1..0.4 s and 50 ms per token; two standard ones at 200 ms per
    # token; one warm-up request (ignored) and one that failed with a 429.
    records = [record(i, "fast", i * 0.5, 0.1 * (i + 1), 0.05, 11, cost=0.001) for i in range(4)]
    records += [record(4, "standard", 0.0, 1.0, 0.2, 11, cost=0.0005), record(5, "standard", 1.0, 2.0, 0.2, 11, cost=0.0005)]
    records.append(record(6, "standard", -5.0, 0.1, 0.01, 3, warmup=True))
    failed = RequestRecord(7, "s", "standard", False, 10, 11, 2.0)
    failed.error, failed.end = "http_429", 2.01
    return records + [failed]


def test_percentiles_interpolate_between_ranks():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([0.1, 0.2, 0.3, 0.4], 0.5) == pytest.approx(0.25)
    assert percentile([0.4, 0.1, 0.3, 0.2], 0.9) == pytest.approx(0.37)
    values = [random.Random(1).random() for _ in range(101)]
    assert percentile(values, 0.5) == sorted(values)[50]


def test_a_stage_summary_from_known_timings():
    s = summarize(crafted(), SLO({}), usd_per_hour=None)
    fast, standard, total = s["tiers"]["fast"], s["tiers"]["standard"], s["all"]
    # The window: first measured send (0.0) to the last end (standard #5: 1 + 2 + 0.2 * 10 = 5.0).
    assert s["window"] == pytest.approx(5.0)
    assert fast["requests"] == fast["completed"] == 4
    assert standard["requests"] == 3 and standard["completed"] == 2 and standard["errors"] == {"http_429": 1}
    assert fast["ttft"]["p50"] == pytest.approx(0.25) and fast["ttft"]["p99"] == pytest.approx(0.397)
    assert fast["ttft"]["mean"] == pytest.approx(0.25)
    assert fast["tpot"]["p50"] == pytest.approx(0.05) and standard["tpot"]["p99"] == pytest.approx(0.2)
    assert fast["itl"]["p90"] == pytest.approx(0.05)
    assert fast["tok_s_per_user"]["mean"] == pytest.approx(20.0) and standard["tok_s_per_user"]["mean"] == pytest.approx(5.0)
    assert fast["e2e"]["p50"] == pytest.approx(0.75)  # TTFT 0.25 + 10 x 50 ms, at the median
    assert total["output_tokens"] == 66 and total["prompt_tokens"] == 60
    assert total["output_tok_s"] == pytest.approx(66 / 5.0) and total["total_tok_s"] == pytest.approx(126 / 5.0)
    assert total["requests_per_s"] == pytest.approx(6 / 5.0)
    # Server-reported cost per tier; the whole run's from it too, since every request has one.
    assert fast["cost_per_m_output"] == pytest.approx(0.004 / 44 * 1e6)
    assert total["cost"] == pytest.approx(0.005) and total["cost_source"] == "server"
    assert s["tiers"]["fast"]["goodput_requests_per_s"] is None  # no SLO given


def test_a_request_completed_without_text_has_no_ttft_but_counts():
    """A model that emits only tokens decoding to nothing completes a request with no first token:
    the summary used to crash sorting its None TTFT."""
    silent = RequestRecord(9, "s", "standard", False, 10, 5, 1.0, end=1.5, output_tokens=5)
    s = summarize(crafted() + [silent], SLO({"*": {"ttft": 1.0}}), usd_per_hour=None)
    standard = s["tiers"]["standard"]
    assert standard["completed"] == 3 and standard["ttft"]["p50"] == pytest.approx(1.5)  # the two with text
    assert standard["e2e"]["p50"] == pytest.approx(3.0)  # 0.5 s (silent), 3.0, 5.0: silent counts here
    assert standard["goodput_share"] == pytest.approx(1 / 4)  # no TTFT: it met no TTFT limit


def test_goodput_counts_requests_within_every_limit_of_their_tier():
    slo = SLO.parse("ttft=2.5s,tpot=250ms,fast:ttft=250ms")
    assert slo.for_tier("fast") == {"ttft": 0.25, "tpot": 0.25} and slo.for_tier("batch") == {"ttft": 2.5, "tpot": 0.25}
    s = summarize(crafted(), slo, None)
    # fast: TTFT 0.1 and 0.2 meet 250 ms, 0.3 and 0.4 do not; standard: both meet, the 429 does not.
    assert s["tiers"]["fast"]["goodput_share"] == pytest.approx(0.5)
    assert s["tiers"]["standard"]["goodput_share"] == pytest.approx(2 / 3)
    assert s["all"]["goodput_requests_per_s"] == pytest.approx(4 / 5.0)
    tight = summarize(crafted(), SLO.parse("standard:tpot=100ms"), None)
    assert tight["tiers"]["standard"]["goodput_requests_per_s"] == 0


def test_machine_price_gives_cost_per_million_tokens_split_by_metered_engine_time():
    records = crafted()
    s = summarize(records, SLO({}), usd_per_hour=36.0)  # 1 cent per second, over a 5 s window
    assert s["all"]["cost"] == pytest.approx(0.05) and s["all"]["cost_source"] == "usd_per_hour"
    assert s["all"]["cost_per_m_output"] == pytest.approx(0.05 / 66 * 1e6)
    assert s["tiers"]["fast"]["cost"] is None  # two tiers share the machine, and no engine time was reported
    for r in records:
        r.engine_seconds = 0.3 if r.tier == "fast" else 0.2
    s = summarize(records, SLO({}), usd_per_hour=36.0)
    # fast: 4 x 0.3 s of the 1.6 s metered to completed requests.
    assert s["tiers"]["fast"]["cost"] == pytest.approx(0.05 * 1.2 / 1.6)
    assert s["tiers"]["fast"]["cost"] + s["tiers"]["standard"]["cost"] == pytest.approx(0.05)


@pytest.mark.parametrize("text", ["fast:ttft", "ttft=", "itl=5ms", "ttft=-1s", "ttft=abc"])
def test_bad_slo_is_refused(text):
    with pytest.raises(ValueError, match="--slo"):
        SLO.parse(text)


def test_lengths_and_mix_parse_and_draw():
    assert Lengths.parse("64", "x").draw(random.Random(0)) == 64
    spread = Lengths.parse("mean=100,stdev=50,min=60,max=120", "x")
    draws = [spread.draw(random.Random(i)) for i in range(200)]
    assert min(draws) == 60 and max(draws) == 120 and len(set(draws)) > 20
    assert parse_mix("fast=1,standard=3") == {"fast": 0.25, "standard": 0.75}
    for bad in ("mean=0", "stdev=3", "mean=5,min=9,max=3", "abc"):
        with pytest.raises(ValueError, match="--prompt"):
            Lengths.parse(bad, "--prompt-tokens")
    for bad in ("gold=1", "fast=x", "fast=0", "fast=-1,standard=2"):
        with pytest.raises(ValueError, match="--mix"):
            parse_mix(bad)


def test_sweep_rates_fall_evenly_between_the_measured_ends():
    assert sweep_rates(1.0, 5.0, 3) == pytest.approx([2.0, 3.0, 4.0])
    assert sweep_rates(1.0, 5.0, 0) == [] and sweep_rates(5.0, 1.0, 2) == []
