"""`chunkwise router` as the routing benchmark starts it: the same flags and the same code (`serve_router`),
with the baseline policies (policies.BASELINES, e.g. `llm-d`) accepted by --policy as well.

    python -m chunkwise.bench.routing.router --replicas URL,... --policy llm-d [router flags]

`chunkwise router --policy` offers the router's own policies only (router/args.py): the baselines are
other routers' policies, reproduced for comparison, not something to deploy.
"""

from __future__ import annotations

import argparse
import sys

from chunkwise.router.args import add_router_args


def parser() -> argparse.ArgumentParser:
    from chunkwise.router.policies import BASELINES

    p = argparse.ArgumentParser(
        prog="python -m chunkwise.bench.routing.router", description=__doc__.split("\n")[0]
    )
    add_router_args(p)
    for action in p._actions:
        if action.dest == "policy" and action.choices is not None:
            own = tuple(action.choices)
            action.choices = (*own, *(name for name in BASELINES if name not in own))
    return p


def main(argv: list[str] | None = None) -> int:
    from chunkwise.router.run import serve_router

    return serve_router(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
