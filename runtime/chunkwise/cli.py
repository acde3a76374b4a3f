"""The `chunkwise` command: serve, router, bench, replay, operator."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkwise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from chunkwise.server.args import add_serve_args

    add_serve_args(sub.add_parser("serve", help="serve the OpenAI-compatible API"))
    from chunkwise.router.args import add_router_args

    add_router_args(sub.add_parser("router", help="route OpenAI requests across replicas"))
    sub.add_parser(
        "operator", help="run the Kubernetes operator (kopf run -m chunkwise_operator.main)", add_help=False
    )

    args, rest = parser.parse_known_args(argv)
    if args.command == "operator":
        from chunkwise_operator.main import run_operator

        return run_operator(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "serve":
        from chunkwise.server.run import serve

        return serve(args)
    if args.command == "router":
        from chunkwise.router.run import serve_router

        return serve_router(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
