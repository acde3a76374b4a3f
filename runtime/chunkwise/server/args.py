"""Flags of `chunkwise serve`: the shared engine flags plus the server's own."""

from __future__ import annotations

import argparse
from pathlib import Path

from chunkwise.argtypes import LOG_LEVELS, lora_module, non_negative_float, port, positive_int
from chunkwise.engine.args import add_engine_args

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_WAITING = 256
DEFAULT_QUEUE_DELAY_SLO_S = 30.0
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEFAULT_TENANT_HEADER = "x-tenant-id"


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    g.add_argument(
        "--port", type=port, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})"
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and /v1/models lists (default: the --model argument)",
    )
    g.add_argument(
        "--max-waiting",
        type=positive_int,
        default=DEFAULT_MAX_WAITING,
        help="bound of the waiting queue: requests accepted but not yet running; beyond it new requests get "
        f"429 (default {DEFAULT_MAX_WAITING})",
    )
    g.add_argument(
        "--queue-delay-slo-seconds",
        type=non_negative_float,
        default=DEFAULT_QUEUE_DELAY_SLO_S,
        help="load shedding: refuse (429) a request whose predicted queueing delay, queued prefill + decode "
        f"tokens over the measured token rate, exceeds this; 0 disables (default {DEFAULT_QUEUE_DELAY_SLO_S:g})",
    )
    g.add_argument(
        "--drain-timeout-seconds",
        type=non_negative_float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM/SIGINT, refuse new requests (503) and give those in flight this long to finish "
        f"before aborting them (default {DEFAULT_DRAIN_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"largest request body accepted; larger ones get 413 (default {DEFAULT_MAX_REQUEST_BYTES}, 1 MiB)",
    )
    g.add_argument(
        "--warm-up-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CPU, build oneDNN's kernel for every row count a step can run its layers at while the model loads "
        "(/health answers 503 until it is ready; a second or two for a small model), so the first requests do "
        "not pay for it (default on)",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters to serve from the start (needs --enable-lora): each NAME a model clients may send, "
        'PATH a PEFT adapter directory; vLLM\'s JSON form {"name": ..., "path": ...} too (default: none)',
    )
    g.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they read paths the client "
        "names; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) (default off)",
    )
    g.add_argument(
        "--lora-cache-dir",
        type=Path,
        default=None,
        help="where a LoRA adapter given as a URI (hf://, s3://, gs://, an http(s) archive; --lora-modules or "
        "/v1/load_lora_adapter) is fetched (default: $XDG_CACHE_HOME/chunkwise/adapters, ~/.cache/...)",
    )
    g.add_argument(
        "--tenant-header",
        default=DEFAULT_TENANT_HEADER,
        metavar="NAME",
        help="the request header naming a request's tenant, for --fairness vtc and the per-tenant metrics; "
        "without it the body's OpenAI `user` field names the tenant (default "
        f"{DEFAULT_TENANT_HEADER})",
    )
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log level (default info)")
