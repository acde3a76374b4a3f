"""Engine flags for every command that builds an engine, derived from the config fields (config.option):
vLLM's names with dashes, each help line ending in the field's default."""

from __future__ import annotations

import argparse
import types
from collections.abc import Sequence
from typing import Any, Literal, Union, get_args, get_origin

from chunkwise.engine.datatypes.config import EngineArg, EngineConfig, engine_args, engine_config_from_kwargs


def _shown_default(a: EngineArg) -> str:
    if a.default is None:
        return a.unset or "none"
    if isinstance(a.default, bool):
        return "on" if a.default else "off"
    return str(a.default)


def _argparse_kind(tp: Any) -> dict[str, Any]:
    if get_origin(tp) in (Union, types.UnionType):
        (tp,) = [t for t in get_args(tp) if t is not type(None)]
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}
    if get_origin(tp) is Literal:
        return {"choices": list(get_args(tp))}
    if tp in (int, float):
        return {"type": tp}
    if tp is str:
        return {}
    raise TypeError(f"no flag for an engine option of type {tp!r}")


def add_engine_args(
    p: argparse.ArgumentParser, names: Sequence[str] | None = None, title: str = "engine"
) -> None:
    """The engine's flags (all of them, or those named), in one argument group."""
    table = engine_args()
    unknown = sorted(set(names or ()) - set(table))
    if unknown:
        raise ValueError(f"no engine options named {unknown}")
    g = p.add_argument_group(title)
    for a in table.values() if names is None else (table[n] for n in names):
        if not a.has_engine_flag:
            continue
        g.add_argument(
            a.flag,
            # None (not given) lets the config apply its default, and lets engine_config_from_kwargs tell
            # an unset budget from one given. The model is read from the namespace, so it gets its own.
            default=a.default if a.name == "model" else None,
            help=f"{a.help} (default: {_shown_default(a)})".replace("%", "%%"),
            **_argparse_kind(a.type),
        )


def engine_config_from_args(ns: argparse.Namespace, **overrides: object) -> EngineConfig:
    """The engine options in `ns`, the commands' own flags of an engine option's name included."""
    kwargs = {name: getattr(ns, name, None) for name in engine_args() if name != "model"}
    kwargs.update(overrides)
    return engine_config_from_kwargs(ns.model, **kwargs)
