"""Prometheus metrics, named after vLLM's (vllm:* -> tollway:*) with a `tier` label wherever a
request is involved, so each lane's latency and load can be read apart.

Fed from the engine thread after every step (AsyncEngine's on_step hook): the plan, its
measured time and the outputs it produced, and the final outputs of requests aborted between
steps. They are only recorded there, and counted FOLD_EVERY steps at a time and before every
scrape: a step's Python runs with caches that the model's weights have just swept, so counting
each step as it comes costs several times what counting many at once does. What the engine
holds now (requests running and waiting, KV in use) is read at scrape time from the occupancy
the engine publishes after every change (watch()), so it is never stale for want of a step; so
are the watchdog's findings. With a meter (bill()), its cost per lane and budgets' spend are
read from it at scrape time. Scraping reads the registry from the event loop;
prometheus_client's metrics are thread-safe.
"""
from __future__ import annotations

import threading
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tollway.config import TIERS
from tollway.step_report import StepReport

_LATENCY = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0)
_STEP = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
FINISH_REASONS = ("stop", "length")  # those request_success counts (an abort is not a success)
FOLD_EVERY = 64  # steps recorded before the engine thread counts them


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, tier = self.registry, ["model_name", "tier"]
        self.model = model_name
        self.ttft = Histogram("tollway:time_to_first_token_seconds", "Time to first token.", tier,
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("tollway:inter_token_latency_seconds", "Time between generated tokens.", tier,
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("tollway:e2e_request_latency_seconds", "Arrival to finish.", tier,
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("tollway:request_queue_time_seconds", "Arrival to first scheduled.", tier,
                               buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("tollway:prompt_tokens", "Prompt tokens of finished requests.", tier, registry=r)
        self.generation_tokens = Counter("tollway:generation_tokens", "Generated tokens.", tier, registry=r)
        self.finished = Counter("tollway:request_success", "Finished requests.", tier + ["finished_reason"], registry=r)
        self.preemptions = Counter("tollway:num_preemptions", "Requests preempted (by recompute).", tier, registry=r)
        self.prefix_queries = Counter("tollway:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      ["model_name"], registry=r)
        self.prefix_hits = Counter("tollway:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   ["model_name"], registry=r)
        self.step_seqs = Histogram("tollway:step_num_sequences", "Sequences per step.", ["model_name"],
                                   buckets=_COUNTS, registry=r)
        self.step_tokens = Histogram("tollway:step_num_tokens", "Tokens per step.", ["model_name"],
                                     buckets=_COUNTS, registry=r)
        self.step_seconds = Histogram("tollway:step_seconds", "Measured step time.", ["model_name"],
                                      buckets=_STEP, registry=r)
        self.step_predicted = Histogram("tollway:step_predicted_seconds", "The step model's forecast of each step.",
                                        ["model_name"], buckets=_STEP, registry=r)
        self.step_error = Histogram("tollway:step_prediction_error_seconds", "|measured - predicted| per step.",
                                    ["model_name"], buckets=_STEP, registry=r)
        self.drafts = Counter("tollway:spec_decode_num_draft_tokens", "Speculative draft tokens proposed.",
                              ["model_name"], registry=r)
        self.accepted = Counter("tollway:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                ["model_name"], registry=r)
        self.steps_paused = Counter("tollway:steps_paused", "Steps stopped between layers for a fast arrival.",
                                    ["model_name"], registry=r)
        self._children: dict[tuple, object] = {}  # (metric, labels) -> its labelled child
        self._pending: deque[StepReport] = deque()  # not yet counted
        self._folding = threading.Lock()
        # Every series exported at 0 from the start, not from its first event: a rate() over a series
        # that does not exist yet is no data, and a board's panel stays empty instead of showing 0.
        for metric in (self.ttft, self.itl, self.e2e, self.queue, self.prompt_tokens, self.generation_tokens,
                       self.preemptions):
            for t in TIERS:
                self._of(metric, model_name, t)
        for t in TIERS:
            for reason in FINISH_REASONS:
                self._of(self.finished, model_name, t, reason)
        for metric in (self.prefix_queries, self.prefix_hits, self.step_seqs, self.step_tokens, self.step_seconds,
                       self.step_predicted, self.step_error, self.drafts, self.accepted, self.steps_paused):
            self._of(metric, model_name)

    def _of(self, metric, *labels):
        """metric.labels(*labels), remembered: labels() locks and looks up on every call, and
        this runs several times per step."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def on_step(self, report: StepReport) -> None:
        """Called on the engine thread with each step's report (and with the final outputs of
        requests aborted between steps). Recorded; fold() counts it."""
        self._pending.append(report)
        if len(self._pending) >= FOLD_EVERY:
            self.fold()

    def fold(self) -> None:
        """Count the steps recorded so far, in order (from either thread)."""
        with self._folding:
            while self._pending:
                report = self._pending.popleft()
                if report.ran:
                    self._on_plan(report.plan, report.result, report.preempted_tiers)
                if report.paused:
                    self._of(self.steps_paused, self.model).inc()
                for out in report.outputs:
                    self._on_output(out)

    def _on_plan(self, plan, result, preempted: tuple[str, ...]) -> None:
        m, of = self.model, self._of
        of(self.step_seqs, m).observe(len(plan.seqs))
        of(self.step_tokens, m).observe(plan.num_tokens)
        of(self.step_seconds, m).observe(result.seconds)
        if plan.predicted_seconds is not None:
            of(self.step_predicted, m).observe(plan.predicted_seconds)
            of(self.step_error, m).observe(abs(result.seconds - plan.predicted_seconds))
        drafts = sum(s.num_draft for s in plan.seqs)
        if drafts:
            of(self.drafts, m).inc(drafts)
            of(self.accepted, m).inc(sum(max(0, len(result.tokens.get(s.request_id, [])) - 1)
                                         for s in plan.seqs if s.num_draft))
        for tier in preempted:
            of(self.preemptions, m, tier).inc()

    def _on_output(self, out) -> None:
        m, labels, of = self.model, (self.model, out.tier), self._of
        n = len(out.new_token_ids)
        if n:
            of(self.generation_tokens, *labels).inc(n)
            last = out.previous_token_time
            if last is None:
                of(self.ttft, *labels).observe(out.first_token_time - out.arrival_time)
                of(self.queue, *labels).observe(out.first_scheduled_time - out.arrival_time)
                of(self.prefix_queries, m).inc(len(out.prompt_token_ids))
                of(self.prefix_hits, m).inc(out.num_cached_prompt_tokens)
            else:
                itl = of(self.itl, *labels)
                for _ in range(n):  # accepted drafts arrive together: they share the gap
                    itl.observe((out.time - last) / n)
        if out.finished:
            if out.finish_reason != "abort":
                of(self.e2e, *labels).observe(out.time - out.arrival_time)
                of(self.prompt_tokens, *labels).inc(len(out.prompt_token_ids))
                of(self.finished, m, out.tier, out.finish_reason).inc()

    def watch(self, engine, watchdog) -> None:
        """Serve the occupancy `engine` (an AsyncEngine) publishes, and `watchdog`'s count."""
        self.registry.register(_EngineCollector(self.model, engine, watchdog))

    def bill(self, meter) -> None:
        """Also serve `meter`'s engine seconds and cost per lane, and its budgets' spend."""
        self.registry.register(_MeterCollector(self.model, meter))

    def exposition(self) -> bytes:
        self.fold()
        return generate_latest(self.registry)


class _EngineCollector:
    """What the engine holds, as last published, and the watchdog's findings: read at scrape time."""

    def __init__(self, model_name: str, engine, watchdog):
        self.model, self.engine, self.watchdog = model_name, engine, watchdog

    def collect(self):
        occupancy = self.engine.occupancy
        running = GaugeMetricFamily("tollway:num_requests_running", "Requests with KV in the cache.",
                                    labels=["model_name", "tier"])
        waiting = GaugeMetricFamily("tollway:num_requests_waiting", "Requests queued (incl. preempted).",
                                    labels=["model_name", "tier"])
        for t in TIERS:
            running.add_metric([self.model, t], occupancy.running.get(t, 0))
            waiting.add_metric([self.model, t], occupancy.waiting.get(t, 0))
        kv = GaugeMetricFamily("tollway:kv_cache_usage_perc", "Share of KV blocks in use (0-1).", labels=["model_name"])
        kv.add_metric([self.model], occupancy.kv_usage)
        self.watchdog.check()
        stalled = CounterMetricFamily("tollway:stalled_requests",
                                      "Requests found holding a slot without progress for longer than any step "
                                      "takes, and stretches of KV held with no request (the watchdog's).",
                                      labels=["model_name"])
        stalled.add_metric([self.model], self.watchdog.stalls)
        return [running, waiting, kv, stalled]


class _MeterCollector:
    """The meter's running totals, read at scrape time: they are kept by the meter, not here."""

    def __init__(self, model_name: str, meter):
        self.model, self.meter = model_name, meter

    def collect(self):
        seconds = CounterMetricFamily("tollway:engine_seconds", "Engine seconds the meter charged to each lane.",
                                      labels=["model_name", "tier"])
        cost = CounterMetricFamily("tollway:cost_dollars", "Engine cost charged to each lane (seconds x price).",
                                   labels=["model_name", "tier"])
        for tier, charged in self.meter.tier_seconds.items():
            seconds.add_metric([self.model, tier], charged)
            cost.add_metric([self.model, tier], self.meter.cost(charged))
        spent = GaugeMetricFamily("tollway:budget_spent_dollars", "Billed dollars in the budget's current period.",
                                  labels=["budget"])
        limit = GaugeMetricFamily("tollway:budget_limit_dollars", "The budget's limit per period.", labels=["budget"])
        for b in self.meter.budgets.burn():
            spent.add_metric([b["budget"]], b["spent"])
            limit.add_metric([b["budget"]], b["limit"])
        return [seconds, cost, spent, limit]
