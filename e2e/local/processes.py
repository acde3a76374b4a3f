"""Child processes of the local fleet: engines, routers and the operator, each with its own log file.

Every child is started in its own process group and stopped by its own pid (SIGTERM, then SIGKILL after a
grace period), never by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
CHUNKWISE = str(BIN / "chunkwise")


def address_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_hosts(port: int, count: int, first: int = 2, skip: Sequence[str] = ()) -> list[str]:
    """`count` loopback addresses 127.0.0.<first>.. on which `port` is free (the whole 127/8 is loopback)."""
    found: list[str] = []
    for last in range(first, 255):
        host = f"127.0.0.{last}"
        if host not in skip and address_free(host, port):
            found.append(host)
            if len(found) == count:
                return found
    raise RuntimeError(f"no {count} free loopback addresses for port {port}")


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # One thread each: several engines share a couple of cores, as pods would share a node's CPUs.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    # Replica addresses must never go through a proxy from the environment.
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.0/8,localhost"
    env.update(extra or {})
    return env


class Child:
    def __init__(
        self, name: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._out = log.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=child_env(env),
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self, grace: float = 10.0) -> int | None:
        self.terminate()
        if not self.wait(grace):
            self.kill()
            self.wait(5)
        self._out.close()
        return self.proc.returncode

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def serve_argv(host: str, port: int = 8000, *extra: str) -> list[str]:
    return [
        CHUNKWISE,
        "serve",
        "--model",
        "tiny",
        "--host",
        host,
        "--port",
        str(port),
        "--log-level",
        "warning",
        *extra,
    ]


def router_argv(host: str, port: int, replicas: Sequence[str], *extra: str) -> list[str]:
    return [
        CHUNKWISE, "router", "--host", host, "--port", str(port), "--replicas", ",".join(replicas),
        "--log-level", "warning", *extra,
    ]  # fmt: skip


def wait_healthy(url: str, timeout: float, child: Child | None = None) -> None:
    """Until GET url/health answers 200; fails early if the child has exited."""
    deadline = time.monotonic() + timeout
    with httpx.Client(trust_env=False) as client:
        while True:
            try:
                if client.get(url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if child is not None and not child.alive():
                raise RuntimeError(f"{child.name} exited with {child.proc.returncode}:\n{child.tail()}")
            if time.monotonic() > deadline:
                tail = child.tail() if child is not None else ""
                raise TimeoutError(f"{url} not healthy within {timeout} s\n{tail}")
            time.sleep(0.2)
