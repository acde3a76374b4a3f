"""kubectl, as the kind suite drives a real cluster: the context it targets, JSON reads, port-forwards.

Everything goes through the kubectl binary with an explicit --context, so the suite can never act on
whatever cluster the current context happens to name.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def cluster_context() -> tuple[str | None, str | None]:
    """(kubectl context, None) when a kind cluster is configured, else (None, why the suite skips)."""
    cluster = os.environ.get("KIND_CLUSTER", "").strip()
    if not cluster:
        return None, (
            "KIND_CLUSTER is not set: the kind suite runs against a cluster made by e2e/kind/kind-up.sh "
            "(make e2e sets it)"
        )
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None, f"KIND_CLUSTER={cluster} but no kubectl binary on PATH"
    context = os.environ.get("KUBE_CONTEXT") or f"kind-{cluster}"
    try:
        out = subprocess.run(
            [kubectl, "config", "get-contexts", "-o", "name"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"kubectl config get-contexts failed: {e}"
    if context not in out.stdout.split():
        return None, f"no kubectl context {context} (run e2e/kind/kind-up.sh with KIND_CLUSTER={cluster})"
    return context, None


def wait_for(predicate: Callable[[], T | None], timeout: float, what: str, interval: float = 1.0) -> T:
    """Polls until predicate() is truthy and returns it; fails naming `what` and the last exception."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (subprocess.CalledProcessError, OSError, ValueError, KeyError) as e:
            last_error = e
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error})" if last_error is not None else ""
            raise AssertionError(f"{what}: not reached within {timeout:.0f} s{detail}")
        time.sleep(interval)


class Kubectl:
    def __init__(self, context: str, namespace: str = "default") -> None:
        self.context = context
        self.namespace = namespace

    def run(
        self, *args: str, input: str | None = None, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = ["kubectl", "--context", self.context, "--namespace", self.namespace, *args]
        result = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, argv, result.stdout, result.stderr)
        return result

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        result = self.run("get", kind, name, "-o", "json", "--ignore-not-found")
        text = result.stdout.strip()
        return json.loads(text) if text else None

    def items(self, kind: str, selector: str) -> list[dict[str, Any]]:
        result = self.run("get", kind, "-l", selector, "-o", "json")
        items: list[dict[str, Any]] = json.loads(result.stdout)["items"]
        return items

    def apply(self, manifest: str) -> None:
        self.run("apply", "-f", "-", input=manifest)

    def merge_patch(
        self, kind: str, name: str, patch: dict[str, Any], subresource: str | None = None
    ) -> None:
        args = ["patch", kind, name, "--type", "merge", "-p", json.dumps(patch)]
        if subresource is not None:
            args += ["--subresource", subresource]
        self.run(*args)

    def delete(self, kind: str, name: str, wait: bool = True) -> None:
        self.run("delete", kind, name, "--ignore-not-found", f"--wait={str(wait).lower()}", timeout=180)

    @contextlib.contextmanager
    def port_forward(self, target: str, port: int, timeout: float = 60) -> Iterator[str]:
        """`kubectl port-forward TARGET :PORT` on 127.0.0.1; yields http://127.0.0.1:<local port>.

        It reaches one pod behind the target, picked at start; a new one is needed after that pod goes.
        """
        argv = [
            "kubectl",
            "--context",
            self.context,
            "--namespace",
            self.namespace,
            "port-forward",
            "--address",
            "127.0.0.1",
            target,
            f":{port}",
        ]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, name="port-forward", daemon=True).start()
        seen: list[str] = []
        try:
            deadline = time.monotonic() + timeout
            local_port: int | None = None
            while local_port is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"port-forward {target}: no local port within {timeout} s: {seen}")
                try:
                    line = lines.get(timeout=remaining)
                except queue.Empty:
                    continue
                if line is None:
                    raise AssertionError(f"port-forward {target} exited: {''.join(seen)}")
                seen.append(line)
                match = re.search(r"Forwarding from 127\.0\.0\.1:(\d+) ->", line)
                if match:
                    local_port = int(match.group(1))
            yield f"http://127.0.0.1:{local_port}"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
