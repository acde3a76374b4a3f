"""`chunkwise serve` flags: defaults documented in the help, engine flags shared."""

from __future__ import annotations

import argparse

import pytest

from chunkwise.cli import main
from chunkwise.server.args import add_serve_args


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p


def test_defaults() -> None:
    ns = parser().parse_args([])
    assert (ns.host, ns.port, ns.served_model_name, ns.model) == ("127.0.0.1", 8000, None, "tiny")
    assert (ns.max_waiting, ns.queue_delay_slo_seconds, ns.drain_timeout_seconds) == (256, 30.0, 30.0)
    assert (ns.max_request_bytes, ns.log_level) == (1 << 20, "info")
    # The server builds oneDNN's kernels before it listens; the engine option's own default is off.
    assert ns.warm_up_kernels is True
    assert parser().parse_args(["--no-warm-up-kernels"]).warm_up_kernels is False
    # The shared engine flags are there too.
    assert ns.max_num_seqs is None and ns.enable_prefix_caching is None


def test_every_server_flag_documents_its_default() -> None:
    p = parser()
    group = next(g for g in p._action_groups if g.title == "server")
    for action in group._group_actions:
        assert action.help and "default" in action.help, action.dest


@pytest.mark.parametrize(
    "argv",
    [["--port", "70000"], ["--max-waiting", "0"], ["--max-request-bytes", "-1"], ["--log-level", "loud"]],
)
def test_bad_flags_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(argv)


def test_invalid_engine_config_exits_2_without_serving() -> None:
    assert main(["serve", "--max-num-seqs", "0", "--port", "0", "--log-level", "critical"]) == 2
