"""The fleet router: `chunkwise router`, an OpenAI-compatible pass-through in front of several replicas.

Each request goes to the replica that minimises its predicted completion time (seed, "Prefix-aware
composition"), from each replica's /metrics, the router's own in-flight accounting and a per-replica prefix
index built with the engine's chained block hashes. Modules: prompt.py (request body -> token ids -> block
hashes), prefix_index.py, estimates.py (what /metrics says about a replica), replica.py (one replica's state
and in-flight accounting), policies.py, discovery.py (static list or EndpointSlices), telemetry.py (the
router's own /metrics), proxy.py (the ASGI app), args.py and run.py (`chunkwise router`), bench.py.

Kept import-free, like chunkwise.server: `chunkwise --help` must not pull in httpx or Starlette.
"""
