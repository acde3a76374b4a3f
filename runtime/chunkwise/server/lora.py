"""LoRA adapters as models of the API, with vLLM's names: `--lora-modules NAME=PATH ...` at start, a request
whose `model` names an adapter runs it, /v1/models lists each with its `parent`, and with
`--allow-runtime-lora` `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST
/v1/unload_lora_adapter {"lora_name"}` change the set while serving (they read paths the client names, hence
the flag). An unloaded adapter takes no new requests; those in flight on it finish (engine/lora/store.py)."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse

from chunkwise.engine.datatypes.lora import LoRARequest
from chunkwise.server.errors import APIError, bad_request

if TYPE_CHECKING:
    from chunkwise.engine import AsyncEngine


class ServedAdapters:
    """The adapters this server answers to, by the model name clients send."""

    def __init__(self, base_name: str, allow_runtime: bool) -> None:
        self.base_name = base_name
        self.allow_runtime = allow_runtime
        self._served: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # start-up registers from the loading thread

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a name served by nobody."""
        if model is None or model == self.base_name:
            return None
        with self._lock:
            lora = self._served.get(model)
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
                "root": lora.lora_path,
                "parent": self.base_name,
            }
            for lora in served
        ]

    def load(self, engine: AsyncEngine, name: str, path: str) -> LoRARequest:
        """Read, check and serve an adapter; ValueError for a bad one (nothing changes then)."""
        if name == self.base_name:
            raise ValueError(f"lora_name {name!r} is the base model's name")
        with self._lock:
            if name in self._served:
                raise KeyError(name)
            lora = LoRARequest(name, next(self._ids), path)
        engine.register_adapter(lora)
        with self._lock:
            self._served[name] = lora
        return lora

    def unload(self, engine: AsyncEngine, name: str) -> bool:
        with self._lock:
            lora = self._served.pop(name, None)
        if lora is None:
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
