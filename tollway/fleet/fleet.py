"""`tollway serve --replicas N`: N replicas on Ray, and the router and its HTTP front.

Each replica is a plain Ray actor (replica.py) rather than a Ray Serve deployment. A Serve
handle picks the replica itself (power of two choices on queue length), and tier-aware
routing needs the router to pick each request's replica from the replicas' lane loads: Serve
offers that only through an alpha custom-router API. Serve would also run a controller and
an HTTP proxy actor per node, which on a small machine compete with the engines for cores.
Actors give the router what it needs from Ray: placement (CPUs per replica, on any node of a
cluster), handles to poll each replica's load and to drain it, and death detection. Each
actor serves the tollway API itself and the ingress proxies HTTP to the one the router picks
(as SGLang's router fronts its workers), so a replica meters, records and authenticates its
requests exactly as a single `tollway serve` does.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import sys

from tollway.fleet.metrics import FleetMetrics
from tollway.fleet.replica import Replica, ReplicaSpec
from tollway.fleet.router import ReplicaState, Router

LOOPBACK = "127.0.0.1"


def import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--replicas runs the replicas on Ray: pip install 'tollway[ray]'") from None
    return ray


class Fleet:
    def __init__(self, spec: ReplicaSpec, replicas: int, ray_address: str | None = None,
                 poll_seconds: float = 0.25, poll_timeout: float = 30.0):
        if replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {replicas}")
        self.spec, self.size, self.ray_address = spec, replicas, ray_address
        self.poll_seconds, self.poll_timeout = poll_seconds, poll_timeout
        self.actors: list = []
        self.router: Router | None = None
        self.metrics: FleetMetrics | None = None
        self._ray = None
        self._own_ray = False
        self._closing = False

    def start(self) -> None:
        """Start Ray (or join it), then the replicas; returns once every replica serves."""
        ray = self._ray = import_ray()
        if not ray.is_initialized():
            if self.ray_address:
                ray.init(address=self.ray_address)
            else:  # a local instance, sized to this machine
                ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
                self._own_ray = True
        cluster = ray.cluster_resources()
        config = copy.deepcopy(self.spec.config)
        # The replicas share the cores rather than each taking all of them.
        config.num_threads = config.num_threads or max(1, int(cluster.get("CPU", 1.0) // self.size))
        spec = dataclasses.replace(self.spec, config=config)
        actor = ray.remote(Replica).options(**replica_resources(config, cluster, self.size), max_concurrency=4)
        # Replicas on this machine only listen on loopback; joining a cluster, on their node's address.
        host = None if self.ray_address else LOOPBACK
        try:
            # The first replica alone first: it measures what a first start measures (kernel
            # crossover, step profile) into the shared cache, and the others read it there.
            self.actors = [actor.remote(spec, host)]
            ray.get(self.actors[0].address.remote())
            self.actors += [actor.remote(spec, host) for _ in range(1, self.size)]
            urls = ray.get([a.address.remote() for a in self.actors])
            loads = ray.get([a.load.remote() for a in self.actors])
        except Exception as e:
            self.shutdown()
            raise ValueError(f"a replica did not start: {e}") from None
        self.router = Router([ReplicaState(i, url, load, 0.0) for i, (url, load) in enumerate(zip(urls, loads))])
        self.metrics = FleetMetrics(self.router)

    async def watch(self) -> None:
        """Poll every live replica's load, for ever (the ingress runs it as a task)."""
        while True:
            await asyncio.gather(*(self._poll(r) for r in self.router.replicas if r.alive))
            await asyncio.sleep(self.poll_seconds)

    async def _poll(self, replica: ReplicaState) -> None:
        asked = self.router.clock()
        try:
            load = await asyncio.wait_for(self.actors[replica.index].load.remote(), self.poll_timeout)
        except Exception:  # noqa: BLE001 -- dead, its engine dead, or hung: out of the fleet either way
            self._lost(replica)
            return
        self.router.reported(replica, load, asked)

    async def check(self, replica: ReplicaState) -> None:
        """After a transport error: take the replica out if it does not answer."""
        if replica.alive:
            try:
                await asyncio.wait_for(self.actors[replica.index].address.remote(), 10.0)
            except Exception:  # noqa: BLE001 -- as in _poll
                self._lost(replica)

    def _lost(self, replica: ReplicaState) -> None:
        if replica.alive and not self._closing:
            print(f"tollway: replica {replica.index} is gone; its queued requests go to the others", file=sys.stderr)
            self.router.died(replica)
            # A hung replica is killed, so that its connections close and its streams end.
            self._ray.kill(self.actors[replica.index])

    async def drain(self, index: int) -> int:
        """Route nothing more to replica `index`, and send the requests it has queued (not
        started) to the others; those running finish. Returns how many were shed."""
        replica = self.router.replicas[index]
        replica.draining = True
        return await self.actors[index].shed.remote()

    async def resume(self, index: int) -> None:
        await self.actors[index].resume.remote()
        self.router.replicas[index].draining = False

    def home(self) -> ReplicaState | None:
        """Where requests other than completions go: the first live replica. Every replica
        serves the Batch API and runs its jobs, each job on one replica at a time (claimed in
        the shared store), so they move to another when theirs dies."""
        return next((r for r in self.router.replicas if r.alive), None)

    def shutdown(self) -> None:
        self._closing = True
        for actor in self.actors:
            self._ray.kill(actor)
        if self._own_ray:
            self._ray.shutdown()


def replica_resources(config, cluster: dict, size: int) -> dict:
    """What each replica asks Ray for: its share of the cores, and a GPU of its own when it
    runs on CUDA ("auto" does when the cluster has a GPU for every replica)."""
    wants_gpu = config.device == "cuda" or (config.device == "auto" and cluster.get("GPU", 0) >= size)
    return {"num_cpus": min(config.num_threads, cluster.get("CPU", 1.0) / size), "num_gpus": 1 if wants_gpu else 0}


def serve_fleet(spec: ReplicaSpec, replicas: int, ray_address: str | None, host: str, port: int) -> int:
    import uvicorn

    from tollway.fleet.ingress import create_ingress

    import_ray()  # before anything starts: without Ray, say so at once
    fleet = Fleet(spec, replicas, ray_address)
    print(f"tollway: starting {replicas} replicas of {spec.model_name} on Ray "
          f"({'joining ' + ray_address if ray_address else 'a local instance'})", file=sys.stderr)
    fleet.start()
    try:
        print(f"tollway: serving {spec.model_name} on http://{host}:{port}/v1 from {replicas} replicas",
              file=sys.stderr)
        uvicorn.run(create_ingress(fleet), host=host, port=port, log_level="warning")
    finally:
        fleet.shutdown()
    return 0
