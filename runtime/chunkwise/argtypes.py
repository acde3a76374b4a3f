"""argparse value types shared by the commands' flags: a bad value is a usage error naming the flag."""

from __future__ import annotations

import argparse
import json

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def lora_module(value: str) -> tuple[str, str]:
    """--lora-modules: NAME=PATH, or vLLM's JSON form {"name": ..., "path": ...}."""
    if value.lstrip().startswith("{"):
        try:
            data = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{value!r} is not valid JSON ({e})") from e
        name, path = (data.get("name"), data.get("path")) if isinstance(data, dict) else (None, None)
    else:
        name, sep, path = value.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{value!r} is not NAME=PATH")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise argparse.ArgumentTypeError(f"{value!r} needs a non-empty name and path")
    return name, path
