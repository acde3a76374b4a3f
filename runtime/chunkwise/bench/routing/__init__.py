"""Routing policies side by side across local replicas (`python -m chunkwise.bench.routing.run`): the
workloads (workloads.py), the router each run starts (router.py) and the report (report.py).
docs/router-bench.md says how to run it and what it measured."""
