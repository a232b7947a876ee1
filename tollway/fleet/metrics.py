"""The fleet's /metrics: every replica's own exposition, each sample labelled with its
`replica` beside `tier`, merged family by family; then the router's own series.

Replicas keep their metrics as a single server does (tollway/server/metrics.py); the ingress
scrapes them at its scrape time and relabels, so a replica's metrics need no knowledge of the
fleet. A dead replica's series drop out with it.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tollway.config import TIERS


def relabelled(expositions: dict[str, str]) -> list[Metric]:
    """The families of every replica's exposition (replica label -> text), merged by name,
    each sample carrying its replica."""
    families: dict[str, Metric] = {}
    for replica, text in expositions.items():
        for family in text_string_to_metric_families(text):
            # The text format gives counters' and histograms' creation times as gauges of
            # their own: per-process timestamps that mean nothing summed over a fleet.
            if family.name.endswith("_created") and family.type == "gauge":
                continue
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            merged.samples += [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
    return list(families.values())


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families


class FleetMetrics:
    """The router's series, and the exposition of the fleet (router's plus the replicas')."""

    def __init__(self, router):
        self.registry = CollectorRegistry()
        self.routed = Counter("tollway:router_requests", "Requests sent to a replica, and why that one.",
                              ["tier", "replica", "reason"], registry=self.registry)
        self.retried = Counter("tollway:router_retries",
                               "Requests sent again elsewhere: the replica refused (shed, queue full) or failed "
                               "before the response began.", ["tier", "why"], registry=self.registry)
        self.failed_streams = Counter("tollway:router_failed_streams",
                                      "Streams cut by their replica's failure after they began (ended with an error).",
                                      ["replica"], registry=self.registry)
        self.waiting = {t: 0 for t in TIERS}  # requests the ingress holds for capacity
        self.registry.register(_RouterState(router, self.waiting))

    def exposition(self, replica_texts: dict[str, str]) -> bytes:
        replicas = CollectorRegistry()
        replicas.register(_Families(relabelled(replica_texts)))
        return generate_latest(self.registry) + generate_latest(replicas)


class _RouterState:
    """Read at scrape time: each replica's state as the router sees it."""

    def __init__(self, router, waiting: dict[str, int]):
        self.router, self.waiting = router, waiting

    def collect(self):
        up = GaugeMetricFamily("tollway:replica_up", "1 while the replica is alive and taking requests.",
                               labels=["replica", "state"])
        outstanding = GaugeMetricFamily("tollway:replica_outstanding_tokens",
                                        "Tokens of work on the replica, as the router counts them.", labels=["replica"])
        fast_free = GaugeMetricFamily("tollway:replica_fast_free_slots",
                                      "Reserved fast slots not in use, as the router counts them.", labels=["replica"])
        for r in self.router.replicas:
            up.add_metric([str(r.index), r.state], float(r.routable))
            outstanding.add_metric([str(r.index)], r.outstanding_tokens)
            fast_free.add_metric([str(r.index)], r.fast_free)
        waiting = GaugeMetricFamily("tollway:router_waiting", "Requests the ingress holds until a replica has room.",
                                    labels=["tier"])
        for tier, n in self.waiting.items():
            waiting.add_metric([tier], n)
        return [up, outstanding, fast_free, waiting]
