"""LoRA adapters as models of the API, with vLLM's names: `--lora-modules NAME=PATH ...` at start, a request
whose `model` names an adapter runs it, /v1/models lists each with its `parent`, and with
`--allow-runtime-lora` `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST
/v1/unload_lora_adapter {"lora_name"}` change the set while serving (they read paths the client names, hence
the flag). An unloaded adapter takes no new requests; those in flight on it finish (engine/lora/store.py)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse

from chunkwise.engine.datatypes.lora import LoRARequest
from chunkwise.server.errors import APIError, bad_request

if TYPE_CHECKING:
    from chunkwise.engine import AsyncEngine


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "chunkwise" / "adapters"


def local_adapter_dir(name: str, path: str, cache_dir: Path) -> str:
    """`path` itself, or for a URI (hf://, s3://, gs://, an http(s) archive) the directory under `cache_dir`
    it is fetched into by `chunkwise fetch-model --adapter`'s code: once, a second load of it reuses it."""
    if "://" not in path:
        return path
    from chunkwise.fetch.errors import FetchError, UsageError
    from chunkwise.fetch.options import FetchOptions
    from chunkwise.fetch.run import fetch_model
    from chunkwise.fetch.uri import parse_uri

    dest = cache_dir / f"{name}-{hashlib.sha256(path.encode()).hexdigest()[:16]}"
    try:
        fetch_model(parse_uri(path), dest, FetchOptions(adapter=True))
    except (FetchError, UsageError, OSError) as e:
        raise ValueError(f"lora_path {path!r} could not be fetched: {e}") from e
    return str(dest)


class ServedAdapters:
    """The adapters this server answers to, by the model name clients send. A path may be a URI, fetched
    into `cache_dir` (/v1/models still reports the path as given, as vLLM does: the operator compares it)."""

    def __init__(self, base_name: str, allow_runtime: bool, cache_dir: Path | None = None) -> None:
        self.base_name = base_name
        self.allow_runtime = allow_runtime
        self.cache_dir = cache_dir or default_cache_dir()
        self._served: dict[str, tuple[LoRARequest, str]] = {}  # name -> (the engine's request, path as given)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # start-up registers from the loading thread

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a name served by nobody."""
        if model is None or model == self.base_name:
            return None
        with self._lock:
            served = self._served.get(model)
        lora = served[0] if served is not None else None
        if lora is None:
            names = [self.base_name, *self.names()]
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {', '.join(map(repr, names))}",
                param="model",
                code="model_not_found",
            )
        return lora

    def names(self) -> list[str]:
        with self._lock:
            return list(self._served)

    def cards(self, created: int) -> list[dict[str, Any]]:
        with self._lock:
            served = list(self._served.values())
        return [
            {
                "id": lora.lora_name,
                "object": "model",
                "created": created,
                "owned_by": "chunkwise",
                "root": given,
                "parent": self.base_name,
            }
            for lora, given in served
        ]

    def load(self, engine: AsyncEngine, name: str, path: str) -> LoRARequest:
        """Read, check and serve an adapter; ValueError for a bad one (nothing changes then)."""
        if name == self.base_name:
            raise ValueError(f"lora_name {name!r} is the base model's name")
        with self._lock:
            if name in self._served:
                raise KeyError(name)
            lora_id = next(self._ids)
        lora = LoRARequest(name, lora_id, local_adapter_dir(name, path, self.cache_dir))
        engine.register_adapter(lora)
        with self._lock:
            self._served[name] = (lora, path)
        return lora

    def unload(self, engine: AsyncEngine, name: str) -> bool:
        with self._lock:
            served = self._served.pop(name, None)
        if served is None:
            return False
        engine.remove_adapter(name)
        return True


def _runtime(adapters: ServedAdapters) -> None:
    if not adapters.allow_runtime:
        raise APIError(
            404,
            "loading LoRA adapters at run time is off (start the server with --allow-runtime-lora)",
            code="not_found",
        )


async def load_adapter(
    adapters: ServedAdapters, engine_of: Callable[[], AsyncEngine], name: str, path: str
) -> JSONResponse:
    """POST /v1/load_lora_adapter: 200, or 409 for a name already served, 400 naming a bad adapter."""
    _runtime(adapters)
    engine = engine_of()
    try:
        # Reading the weights is disk work: off the event loop.
        await asyncio.to_thread(adapters.load, engine, name, path)
    except KeyError:
        raise APIError(
            409, f"the LoRA adapter {name!r} is already loaded", param="lora_name", code="conflict"
        ) from None
    except ValueError as e:
        raise bad_request(str(e), param="lora_path") from e
    return JSONResponse({"lora_name": name, "lora_path": path, "status": "loaded"})


def unload_adapter(adapters: ServedAdapters, engine_of: Callable[[], AsyncEngine], name: str) -> JSONResponse:
    """POST /v1/unload_lora_adapter: 200, or 404 for a name not served."""
    _runtime(adapters)
    if not adapters.unload(engine_of(), name):
        raise APIError(404, f"the LoRA adapter {name!r} is not loaded", param="lora_name", code="not_found")
    return JSONResponse({"lora_name": name, "status": "unloaded"})
