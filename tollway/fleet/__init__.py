"""Replicas past one machine: `tollway serve --replicas N` runs N engines as a Ray Serve
deployment (replica.py, fleet.py) whose request router is tollway's tier-aware policy
(serve_router.py over router.py, affinity.py), behind an HTTP front that serves the same OpenAI
API (ingress.py); /metrics merges the replicas' (metrics.py), and /dashboard/data their
dashboards' data (dashboard.py)."""
