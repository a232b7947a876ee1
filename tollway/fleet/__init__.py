"""Replicas past one machine: `tollway serve --replicas N` runs N engines as a Ray Serve
deployment (replica.py, fleet.py) whose request router is tollway's tier-aware policy
(serve_router.py over router.py, affinity.py), behind an HTTP front that serves the same OpenAI
API (ingress.py); /metrics merges the replicas' (metrics.py), and /dashboard/data their
dashboards' data (dashboard.py)."""
import os

# The router runs on the ingress's event loop, not on a loop of Serve's own: the policy's state
# then has one writer, and the ingress's waits wake on their own loop. Serve reads this, its
# documented setting, once, when ray.serve is imported, so it is set before any module here imports it.
os.environ["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] = "0"
