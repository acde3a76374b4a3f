"""Flags of `chunkwise router`."""

from __future__ import annotations

import argparse

from chunkwise.argtypes import LOG_LEVELS, port, positive_float, positive_int
from chunkwise.engine.datatypes.config import DEFAULT_BLOCK_SIZE

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_POLICY = "predicted-completion"
DEFAULT_POLL_INTERVAL_S = 0.5
DEFAULT_MAX_TOKENS = 256
DEFAULT_PREFIX_CACHE_BLOCKS = 65536
# Stand-ins for a replica's speed until the router has measured it.
DEFAULT_PREFILL_RATE = 10_000.0
DEFAULT_TPOT_S = 0.02
# Scale from zero: how many requests a router holds while no replica is ready, and for how long (a cold
# start pulls an image and loads a model: minutes on a GPU node).
DEFAULT_WAKE_QUEUE_LIMIT = 128
DEFAULT_WAKE_TIMEOUT_S = 300.0
DEFAULT_KEEPALIVE_S = 10.0
# Kept here rather than imported from policies.py, so that `chunkwise --help` imports nothing heavy.
POLICY_NAMES = ("predicted-completion", "round-robin", "least-loaded", "prefix-affinity")


def _url_list(text: str) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()]


def add_router_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("router")
    g.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    g.add_argument(
        "--port", type=port, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})"
    )
    g.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        default=DEFAULT_POLICY,
        help=f"how to choose a replica (default {DEFAULT_POLICY})",
    )
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--replicas",
        type=_url_list,
        default=None,
        help="a static, comma-separated list of replica URLs, e.g. http://127.0.0.2:8000,http://127.0.0.3:8000",
    )
    src.add_argument(
        "--kube-service",
        default=None,
        help="discover replicas from the ready endpoints of this Kubernetes Service's EndpointSlices",
    )
    g.add_argument(
        "--namespace",
        default="default",
        help="the Service's namespace, with --kube-service (default default)",
    )
    g.add_argument(
        "--poll-interval-seconds",
        type=positive_float,
        default=DEFAULT_POLL_INTERVAL_S,
        help="how often to read each replica's /health and /metrics, and to list EndpointSlices "
        f"(default {DEFAULT_POLL_INTERVAL_S:g})",
    )
    g.add_argument(
        "--block-size",
        type=positive_int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"the replicas' KV block size, for prefix matching (default {DEFAULT_BLOCK_SIZE}, the engine's)",
    )
    g.add_argument(
        "--tokenizer",
        default="byte",
        help="how the replicas tokenize: 'byte' (the built-in models) or a Hugging Face model directory "
        "(default byte)",
    )
    g.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="read each replica's GET /v1/kv_events with its metrics and route on the exact prefix index it "
        "gives; a replica without them, or out of sync, is routed on the router's estimate (default on)",
    )
    g.add_argument(
        "--prefix-cache-blocks",
        type=positive_int,
        default=DEFAULT_PREFIX_CACHE_BLOCKS,
        help="blocks each replica's prefix cache holds, bounding the router's index of it; a replica that "
        f"exports vllm:cache_config_info overrides it (default {DEFAULT_PREFIX_CACHE_BLOCKS})",
    )
    g.add_argument(
        "--default-max-tokens",
        type=positive_int,
        default=DEFAULT_MAX_TOKENS,
        help=f"the output length assumed for a chat request without max_tokens (default {DEFAULT_MAX_TOKENS})",
    )
    g.add_argument(
        "--default-prefill-rate",
        type=positive_float,
        default=DEFAULT_PREFILL_RATE,
        help="prefill tokens/s assumed until the replicas have been measured "
        f"(default {DEFAULT_PREFILL_RATE:g})",
    )
    g.add_argument(
        "--default-tpot-seconds",
        type=positive_float,
        default=DEFAULT_TPOT_S,
        help=f"time per output token assumed until measured (default {DEFAULT_TPOT_S:g})",
    )
    g.add_argument(
        "--wake-inference-service",
        default=None,
        metavar="NAME",
        help="scale from zero: while no replica is ready, hold requests and raise this InferenceService's "
        "/scale (in --namespace) from 0 to 1; needs --kube-service",
    )
    g.add_argument(
        "--wake-queue-limit",
        type=positive_int,
        default=DEFAULT_WAKE_QUEUE_LIMIT,
        help=f"requests held at once while waking; past it, 503 (default {DEFAULT_WAKE_QUEUE_LIMIT})",
    )
    g.add_argument(
        "--wake-timeout-seconds",
        type=positive_float,
        default=DEFAULT_WAKE_TIMEOUT_S,
        help=f"how long a request is held for a replica; past it, 503 (default {DEFAULT_WAKE_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--keepalive-seconds",
        type=positive_float,
        default=DEFAULT_KEEPALIVE_S,
        help=f"SSE comment interval for a held streaming request (default {DEFAULT_KEEPALIVE_S:g})",
    )
    g.add_argument(
        "--epp-port",
        type=port,
        default=None,
        metavar="PORT",
        help="also serve as a Gateway API Inference Extension endpoint picker: Envoy ext_proc v3 and gRPC "
        "health, plaintext h2c, on --host:PORT (GAIE's convention is 9002; default off)",
    )
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log level (default info)")
