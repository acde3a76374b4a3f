"""The adapters an engine knows, by name: where each lives, and the most recently used ones read into host
memory (max_cpu_loras of them; an adapter pushed out is read again from its directory when next needed)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from chunkwise.engine.datatypes.config import ModelConfig
from chunkwise.engine.datatypes.lora import LoRARequest
from chunkwise.engine.lora.adapter import LoRAAdapter, read_adapter


class AdapterStore:
    """Adapters by name, as served, and by key, as the engine runs them. A name's first adapter has the name
    as its key; loaded again from another path (after an unload), it gets a key of its own ("name#1", ...),
    so requests still in flight on the old weights finish on them, and its prefix-cache blocks (hashed with
    the key) are never those of the old weights. A router hashes an adapter's prompts with its name, which
    matches the first version (router/prompt.py)."""

    def __init__(self, base: ModelConfig, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.base = base
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._served: dict[str, tuple[LoRARequest, str]] = {}  # name -> (its request, its key)
        self._keys: dict[tuple[str, str], str] = {}  # (name, path) -> key, for every adapter ever registered
        self._paths: dict[str, str] = {}  # key -> path
        self._names: dict[str, str] = {}  # key -> name
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # by key, least recently used first
        # The server's request threads register adapters while the engine thread reads them.
        self._lock = threading.Lock()

    def register(self, request: LoRARequest) -> str:
        """Serve `request`'s adapter (read and checked now, so that a bad one is the caller's error, never
        the step loop's); returns its key."""
        name, path = request.lora_name, request.lora_path
        with self._lock:
            served = self._served.get(name)
            if served is not None and served[0].lora_path != path:
                raise ValueError(
                    f"LoRA adapter {name!r} is already loaded from {served[0].lora_path!r}, not {path!r}: "
                    "unload it first, or give the new one another name"
                )
            key = self._keys.get((name, path))
            if key is None:
                versions = sum(1 for n, _ in self._keys if n == name)
                key = name if versions == 0 else f"{name}#{versions}"
            if key not in self._host:
                self._remember(key, read_adapter(name, path, self.base, self.max_lora_rank))
            else:
                self._host.move_to_end(key)
            self._keys[(name, path)] = key
            self._paths[key], self._names[key] = path, name
            self._served[name] = (request, key)
            return key

    def get(self, key: str) -> LoRAAdapter:
        """The weights of an adapter registered at some point (read again if pushed out of host memory)."""
        with self._lock:
            adapter = self._host.get(key)
            if adapter is not None:
                self._host.move_to_end(key)
                return adapter
            path = self._paths.get(key)
            if path is None:
                raise KeyError(f"LoRA adapter {key!r} was never loaded")
            adapter = read_adapter(self._names[key], path, self.base, self.max_lora_rank)
            self._remember(key, adapter)
            return adapter

    def name_of(self, key: str) -> str:
        return self._names[key]

    def remove(self, name: str) -> bool:
        """Stop serving an adapter (requests in flight on it still finish); False when it was not served."""
        with self._lock:
            return self._served.pop(name, None) is not None

    def known(self) -> dict[str, LoRARequest]:
        """The adapters served now, by name."""
        with self._lock:
            return {name: request for name, (request, _) in self._served.items()}

    def in_host_memory(self) -> list[str]:
        with self._lock:
            return list(self._host)

    def _remember(self, key: str, adapter: LoRAAdapter) -> None:
        self._host[key] = adapter
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
