"""Serve's request router for the replicas' deployment: tollway's tier-aware policy (router.py)
picks the replica of each call, from the replicas' reports.

Serve makes this router in the process that holds the deployment's handle (the ingress) and
calls it there: update_replicas with the running replicas, each carrying its latest report
(Replica.record_routing_stats, polled by Serve), and choose_replicas for each call, whose first
argument is the request's RoutingHint. Serve pickles this class by value to ship it, so the
router finds the state it shares with the ingress (the policy's view of each replica, the
router's metrics) through Fleet.serving, by the application's name.

Which replicas there are is Serve's word: a replica in update_replicas joins the router's list,
with the next index, at its first report; one that leaves it (it died, or failed its health
checks) is dead to the router. Serve starts a replacement of a dead replica by itself, and the
replacement joins as a new index once running.
"""
from __future__ import annotations

import asyncio

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from tollway.fleet.fleet import Fleet
from tollway.fleet.load import ReplicaLoad
from tollway.fleet.router import ReplicaState, RoutingHint


class TierRequestRouter(RequestRouter):
    def initialize_state(self, fleet: str) -> None:
        self.fleet = Fleet.serving[fleet]
        if asyncio.get_running_loop() is not self.fleet.loop:
            raise RuntimeError("Serve runs the request router on a loop of its own: ray.serve was imported "
                               "before tollway.fleet set RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0")

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        router = self.fleet.router
        known = {state.replica_id: state for state in router.replicas}
        for replica in replicas:
            report = replica.routing_stats
            if not report:  # not polled yet
                continue
            load, state = ReplicaLoad(**report["load"]), known.get(replica.replica_id.unique_id)
            if state is None:
                router.replicas.append(ReplicaState(len(router.replicas), report["url"], load, report["at"],
                                                    replica_id=replica.replica_id.unique_id,
                                                    actor_name=report["actor_name"]))
                router.notify()
            elif state.alive and report["at"] > state.asked:
                router.reported(state, load, report["at"])
        running = {replica.replica_id.unique_id for replica in replicas}
        for state in router.replicas:
            if state.alive and state.replica_id not in running:
                self.fleet.lost(state)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hint: RoutingHint = pending_request.args[0]
        candidates = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        chosen = self._choose(hint, candidates)
        if chosen is None:  # nowhere now (the ingress holds requests until there is): ask again later
            pending_request.routing_context.should_backoff = True
            return []
        return [[candidates[chosen.replica_id]]]

    def _choose(self, hint: RoutingHint, candidates: dict[str, RunningReplica]) -> ReplicaState | None:
        router = self.fleet.router
        if hint.replica is not None:
            pinned = router.replicas[hint.replica]
            return pinned if pinned.replica_id in candidates else None
        # Serve drops a replica it cannot reach before its update says so.
        absent = {state.index for state in router.replicas if state.replica_id not in candidates}
        choice = router.choose(hint.tier, hint.prompt_text, hint.exclude | absent)
        if choice is None:
            return None
        chosen, why = choice
        router.sent(chosen, hint.tier, hint.prompt_text, hint.tokens)
        self.fleet.metrics.routed.labels(hint.tier, str(chosen.index), why).inc()
        return chosen
