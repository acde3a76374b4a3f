"""The adapters an engine knows, by name: where each lives, and the most recently used ones read into host
memory (max_cpu_loras of them; an adapter pushed out is read again from its directory when next needed)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from chunkwise.engine.datatypes.config import ModelConfig
from chunkwise.engine.datatypes.lora import LoRARequest
from chunkwise.engine.lora.adapter import LoRAAdapter, read_adapter


class AdapterStore:
    """One name is one adapter for the engine's life: its path is remembered when it is first registered,
    so that a request still in flight after its adapter is removed (unloaded) finds its weights, and a name
    never comes back with other weights under requests (or prefix-cache blocks) made with the old ones."""

    def __init__(self, base: ModelConfig, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.base = base
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._known: dict[str, LoRARequest] = {}  # the adapters served now
        self._paths: dict[str, str] = {}  # every name ever registered -> its path
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        # The server's request threads register adapters while the engine thread reads them.
        self._lock = threading.Lock()

    def register(self, request: LoRARequest) -> LoRAAdapter:
        """Serve `request`'s adapter (read and checked now, so that a bad one is the caller's error, never
        the step loop's)."""
        with self._lock:
            path = self._paths.get(request.lora_name)
            if path is not None and path != request.lora_path:
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r} is already loaded from {path!r}, not "
                    f"{request.lora_path!r}: a name keeps its adapter for the engine's life, so give the new "
                    "one another name"
                )
            adapter = self._host.get(request.lora_name)
            if adapter is None:
                adapter = read_adapter(request.lora_name, request.lora_path, self.base, self.max_lora_rank)
                self._remember(adapter)
            else:
                self._host.move_to_end(request.lora_name)
            self._known[request.lora_name] = request
            self._paths[request.lora_name] = request.lora_path
            return adapter

    def get(self, name: str) -> LoRAAdapter:
        """The weights of an adapter registered at some point (read again if pushed out of host memory)."""
        with self._lock:
            adapter = self._host.get(name)
            if adapter is not None:
                self._host.move_to_end(name)
                return adapter
            path = self._paths.get(name)
            if path is None:
                raise KeyError(f"LoRA adapter {name!r} was never loaded")
            adapter = read_adapter(name, path, self.base, self.max_lora_rank)
            self._remember(adapter)
            return adapter

    def remove(self, name: str) -> bool:
        """Stop serving an adapter (requests in flight on it still finish); False when it was not served."""
        with self._lock:
            return self._known.pop(name, None) is not None

    def known(self) -> dict[str, LoRARequest]:
        """The adapters served now, by name."""
        with self._lock:
            return dict(self._known)

    def in_host_memory(self) -> list[str]:
        with self._lock:
            return list(self._host)

    def _remember(self, adapter: LoRAAdapter) -> None:
        self._host[adapter.name] = adapter
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
