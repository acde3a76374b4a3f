"""The `chunkwise` command: serve, router, bench, replay, inspect, fetch-model, operator."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chunkwise.engine.distributed.lws import LWSPlace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkwise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from chunkwise.server.args import add_serve_args

    add_serve_args(sub.add_parser("serve", help="serve the OpenAI-compatible API"))
    from chunkwise.router.args import add_router_args

    add_router_args(sub.add_parser("router", help="route OpenAI requests across replicas"))
    from chunkwise.bench.cli import add_bench_args

    add_bench_args(sub.add_parser("bench", help="benchmarks: serving client, side-by-side comparisons"))
    from chunkwise.sim.cli import add_replay_args

    add_replay_args(
        sub.add_parser("replay", help="the scheduler on a virtual clock with a calibrated cost model")
    )
    from chunkwise.checkpoint_report import add_inspect_args

    add_inspect_args(
        sub.add_parser("inspect", help="what the loader understands of a checkpoint, and the memory it needs")
    )
    from chunkwise.fetch.args import add_fetch_args

    add_fetch_args(
        sub.add_parser(
            "fetch-model", help="fetch a model (hf://, s3://, gs://, http(s):// archive) into a directory"
        )
    )
    sub.add_parser(
        "operator",
        help="run the Kubernetes operator (kopf run -m chunkwise_operator.main); `operator render -f FILE` "
        "prints what it would apply",
        add_help=False,
    )

    args, rest = parser.parse_known_args(argv)
    if args.command == "operator":
        if rest[:1] == ["render"]:
            # Pure builders only: rendering needs neither Kopf nor a cluster.
            from chunkwise_operator.render import main as render

            return render(rest[1:])
        from chunkwise_operator.main import run_operator

        return run_operator(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "serve":
        from chunkwise.engine.distributed.lws import LWSPlace

        # A LeaderWorkerSet worker pod (LWS_WORKER_INDEX > 0) runs its pipeline stage's ranks, no server.
        try:
            place = LWSPlace.from_env()
        except ValueError as e:
            print(f"chunkwise serve: {e}", file=sys.stderr)
            return 2
        if place is not None and place.worker_index > 0:
            return _serve_stage(args, place)
        from chunkwise.server.run import serve

        return serve(args)
    if args.command == "router":
        from chunkwise.router.run import serve_router

        return serve_router(args)
    if args.command == "bench":
        from chunkwise.bench.cli import run_bench

        return run_bench(args)
    if args.command == "inspect":
        from chunkwise.checkpoint_report import run_inspect

        return run_inspect(args)
    if args.command == "fetch-model":
        from chunkwise.fetch.args import run_fetch

        return run_fetch(args)
    if args.command == "replay":
        from chunkwise.sim.cli import run_replay_cli

        return run_replay_cli(args)
    parser.error(f"unknown command {args.command}")
    return 2


def _serve_stage(args: argparse.Namespace, place: LWSPlace) -> int:
    """`chunkwise serve` in a LeaderWorkerSet worker pod: its pipeline stage's ranks with the engine options
    given (every stage runs the leader's config; its tensor and pipeline sizes must be these), until the
    leader goes."""
    import logging

    from chunkwise.engine.args import engine_config_from_args
    from chunkwise.engine.loop.stage_worker import run_stage_worker

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = engine_config_from_args(args)
        place.check(config.pipeline_parallel_size)
    except ValueError as e:
        logging.getLogger("chunkwise.cli").error("invalid engine arguments for a worker pod: %s", e)
        return 2
    return run_stage_worker(config, place)


if __name__ == "__main__":
    sys.exit(main())
