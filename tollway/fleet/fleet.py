"""`tollway serve --replicas N`: N replicas as a Ray Serve deployment, and the router and its
HTTP front.

The replicas are one Serve deployment of replica.py's class: Serve places them (CPUs per
replica, a GPU each on CUDA, on any node of a cluster), polls each one's load and health, and
replaces one that dies. Which replica serves a request is tollway's tier-aware policy
(router.py), run as the deployment's request router (serve_router.py) on the ingress's event
loop: for each request the ingress calls the deployment through its handle with the
request's RoutingHint, the router picks the replica, and that replica answers with its id; the
ingress then proxies the HTTP request to that replica's own tollway API (as SGLang's router
fronts its workers). So a replica meters, records and authenticates its requests exactly as a
single `tollway serve` does, and streams pass straight from it to the client.

Serve's HTTP proxy is off (the ingress is the front, and a proxy actor per node would compete
with the engines for cores); its controller, one actor, reserves no core from Ray's count.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import secrets
import sys

import httpx

from tollway.fleet.metrics import FleetMetrics
from tollway.fleet.replica import Replica, ReplicaSpec
from tollway.fleet.router import ReplicaState, Router, RoutingHint
from tollway.server.log_level import uvicorn_logging

LOOPBACK = "127.0.0.1"
APP = "tollway"  # the Serve application (and its one deployment, Replica)
HEALTH_CHECK_SECONDS = 2.0  # how often Serve checks that each replica's engine still runs
REPORT_SECONDS = 0.25  # how often Serve polls each replica's load for the router
FIRST_REPORT_SECONDS = 60.0  # the replicas run once Serve says so; their reports reach the router within this
CHOOSE_SECONDS = 30.0  # a routing call that takes longer is failed, and tried again
ANSWER_SECONDS = 10.0  # a replica that does not answer its /health within this is lost


def import_ray():
    try:
        import ray
        from ray import serve  # noqa: F401 -- Serve comes with ray[serve], not with ray alone
    except ImportError:
        raise ValueError("--replicas runs the replicas on Ray Serve: pip install 'tollway[ray]'") from None
    return ray


class Fleet:
    serving: dict[str, Fleet] = {}  # by Serve application: where its request router finds the fleet

    def __init__(self, spec: ReplicaSpec, replicas: int, ray_address: str | None = None):
        if replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {replicas}")
        self.spec, self.size, self.ray_address = spec, replicas, ray_address
        self.secret = secrets.token_hex(16)  # the replicas take call ids only beside it
        self.router = Router([])
        self.metrics = FleetMetrics(self.router)
        self.handle = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the ingress's, where the request router must run
        self._ray = None
        self._own_ray = False
        self._deployed = False  # the application is (being) deployed: shutdown deletes it
        self._closing = False

    def start(self) -> None:
        """Start Ray (or join it) and Serve, then the replicas; returns once every replica serves."""
        ray = self._ray = import_ray()
        from ray import serve
        from ray.serve.config import RequestRouterConfig

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
        spec = dataclasses.replace(self.spec, config=config, secret=self.secret)
        # Replicas on this machine only listen on loopback; joining a cluster, on their node's address.
        host = None if self.ray_address else LOOPBACK
        resources = replica_resources(config, cluster, self.size)
        logging_config = serve_logging(spec.log_level)
        Fleet.serving[APP] = self
        deployment = serve.deployment(
            Replica, num_replicas=self.size, ray_actor_options=resources,
            # A call is the router's choice only (the request itself goes over HTTP): never queue one.
            max_ongoing_requests=10_000, health_check_period_s=HEALTH_CHECK_SECONDS,
            graceful_shutdown_timeout_s=1.0, logging_config=logging_config, request_router_config=RequestRouterConfig(
                request_router_class="tollway.fleet.serve_router.TierRequestRouter",
                request_router_kwargs={"fleet": APP}, request_routing_stats_period_s=REPORT_SECONDS))
        try:
            # One engine starts alone first: it measures what a first start measures (kernel
            # crossover, step profile) into the shared cache, and the replicas read it there
            # rather than each measure while they share the cores.
            measured = ray.remote(start_engine).options(**resources).remote(config)
            serve.start(proxy_location="Disabled", logging_config=logging_config)
            ray.get(measured)
            self._deployed = True
            serve.run(deployment.bind(spec, host), name=APP, route_prefix=None)
        except Exception as e:
            self.shutdown()
            raise ValueError(f"a replica did not start: {e}") from None

    async def connect(self) -> None:
        """Take the deployment's handle, its request router on this event loop (the ingress's,
        where the policy's state is read and changed), and wait until every replica has
        reported."""
        from ray import serve

        self.loop = asyncio.get_running_loop()
        # options() starts the handle's request router now, on this loop: the replicas' reports
        # reach the policy before the first call.
        self.handle = serve.get_deployment_handle(Replica.__name__, APP).options()
        deadline = asyncio.get_running_loop().time() + FIRST_REPORT_SECONDS
        while len(self.router.replicas) < self.size:
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError("the replicas did not report")
            await asyncio.sleep(0.05)

    async def disconnect(self) -> None:
        if self.handle is not None:
            await self.handle.shutdown_async()

    async def route(self, hint: RoutingHint) -> ReplicaState:
        """The replica the router picks for a request (Serve's request router runs the policy)."""
        replica_id = await asyncio.wait_for(self.handle.placed.remote(hint), CHOOSE_SECONDS)
        return next(r for r in self.router.replicas if r.replica_id == replica_id)

    async def check(self, replica: ReplicaState, client: httpx.AsyncClient) -> None:
        """After a transport error: take the replica out if it does not answer."""
        if replica.alive:
            try:
                (await client.get(replica.url + "/health", timeout=ANSWER_SECONDS)).raise_for_status()
            except httpx.HTTPError:
                self.lost(replica)
                # A hung replica is killed, so that its connections close and its streams end;
                # Serve starts another in its place.
                try:
                    self._ray.kill(self._ray.get_actor(replica.actor_name, namespace="serve"))
                except ValueError:  # gone already
                    pass

    def lost(self, replica: ReplicaState) -> None:
        if replica.alive and not self._closing:
            print(f"tollway: replica {replica.index} is gone; its queued requests go to the others", file=sys.stderr)
            self.router.died(replica)

    async def drain(self, index: int) -> int:
        """Route nothing more to replica `index`, and send the requests it has queued (not
        started) to the others; those running finish. Returns how many were shed."""
        self.router.replicas[index].draining = True
        return await self.handle.shed.remote(RoutingHint(replica=index))

    async def resume(self, index: int) -> None:
        await self.handle.resume.remote(RoutingHint(replica=index))
        self.router.replicas[index].draining = False

    def home(self) -> ReplicaState | None:
        """Where requests other than completions go: the first replica serving. Every replica
        serves the Batch API and runs its jobs, each job on one replica at a time (claimed in
        the shared store), so they move to another when theirs dies."""
        return next((r for r in self.router.replicas if r.alive), None)

    def shutdown(self) -> None:
        from ray import serve

        self._closing = True
        if self._own_ray:  # Serve and the replicas end with the instance
            self._ray.shutdown()
        elif self._deployed:
            serve.delete(APP)
        Fleet.serving.pop(APP, None)


def start_engine(config) -> None:
    """Start an engine and drop it: a first start on a machine measures it into the shared cache."""
    from tollway.engine import Engine

    Engine(config, progress=False)


def serve_logging(level: str) -> dict:
    """Serve's logging config at --log-level, in Python's level names (uvicorn's trace is below
    them all). Serve's access log stays off at every level: its requests are the ingress's
    routing calls, one per attempt, and the clients' requests are in uvicorn's access logs."""
    return {"log_level": "DEBUG" if level == "trace" else level.upper(), "enable_access_log": False}


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
    print(f"tollway: starting {replicas} replicas of {spec.model_name} on Ray Serve "
          f"({'joining ' + ray_address if ray_address else 'a local instance'})", file=sys.stderr)
    fleet.start()
    try:
        print(f"tollway: serving {spec.model_name} on http://{host}:{port}/v1 from {replicas} replicas",
              file=sys.stderr)
        uvicorn.run(create_ingress(fleet), host=host, port=port, **uvicorn_logging(spec.log_level))
    finally:
        fleet.shutdown()
    return 0
