"""Replicas past one machine: `tollway serve --replicas N` runs N engines as Ray actors
(replica.py, fleet.py) behind a tier-aware router (router.py, affinity.py) and an HTTP front
that serves the same OpenAI API (ingress.py); /metrics merges the replicas' (metrics.py), and
/dashboard/data their dashboards' data (dashboard.py)."""
