"""Print the third-party requirements of the chunkwise distribution and some of its extras, one per line.

The images' dependency layer is built from this (and pyproject.toml alone), so that it stays cached while
only the source changes; the package itself goes in later with --no-deps.

    python3 requirements.py pyproject.toml runtime,operator --exclude torch
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: dict[str, Any], extras: list[str], exclude: set[str]) -> list[str]:
    project = pyproject["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extras {unknown}; pyproject.toml has {sorted(optional)}")
    result: list[str] = []
    for requirement in [*project.get("dependencies", []), *(r for e in extras for r in optional[e])]:
        if requirement_name(requirement) not in exclude and requirement not in result:
            result.append(requirement)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject")
    parser.add_argument("extras", help="comma-separated extras, e.g. runtime,operator ('' for none)")
    parser.add_argument("--exclude", action="append", default=[], help="a requirement name to leave out")
    args = parser.parse_args(argv)
    import tomllib  # Python 3.11+, as in the images; imported here so the helpers load on 3.10 too

    with open(args.pyproject, "rb") as f:
        pyproject = tomllib.load(f)
    extras = [e.strip() for e in args.extras.split(",") if e.strip()]
    exclude = {requirement_name(name) for name in args.exclude}
    sys.stdout.write("".join(f"{r}\n" for r in requirements(pyproject, extras, exclude)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
