"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its own tokens and any extras (a cache salt), so equal hashes
mean equal prefixes, not merely equal blocks. The hash must be the same in every process: the fleet router
builds its per-replica prefix index with these same functions, so Python's salted hash() is not usable.

A cache hit is trusted on the hash alone, so the hash is 128 bits of BLAKE2b: two different prefixes share
one with probability about n^2 / 2^129 for n cached blocks (below 1e-20 for a billion), and finding a prefix
that collides with another tenant's would take a second preimage of BLAKE2b, not a birthday search.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from functools import lru_cache

BlockHash = int

_ROOT = b"chunkwise-v2"
HASH_BYTES = 16


def hash_block(parent: BlockHash | None, tokens: Sequence[int], extra: str | None = None) -> BlockHash:
    data = (_ROOT if parent is None else parent.to_bytes(HASH_BYTES, "little")) + _packer(len(tokens)).pack(
        *tokens
    )
    if extra:
        data += b"\x00salt\x00" + extra.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=HASH_BYTES).digest(), "little")


@lru_cache(maxsize=16)
def _packer(n: int) -> struct.Struct:
    # Tokens as little-endian int64 (one per block size in use): the bytes hashed everywhere, whatever the
    # machine's own byte order.
    return struct.Struct(f"<{n}q")


def block_extra(cache_salt: str | None, lora_key: str | None) -> str | None:
    """What a request's first block hashes beside its tokens: its cache salt and its LoRA adapter's key, so
    that the same prompt under two adapters (whose KV differs) never shares a block."""
    if lora_key is None:
        return cache_salt
    return f"{cache_salt or ''}\x00lora\x00{lora_key}"


def hash_prefix_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra: str | None = None,
    start: int = 0,
    parent: BlockHash | None = None,
    end: int | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of token_ids from block index `start` up to `end` (default: every full
    block), a chain continued from `parent`.

    Only full blocks are hashed: a partial block's content is still changing.
    """
    out: list[BlockHash] = []
    last = len(token_ids) // block_size if end is None else min(end, len(token_ids) // block_size)
    for i in range(start, last):
        parent = hash_block(
            parent, token_ids[i * block_size : (i + 1) * block_size], extra if i == 0 else None
        )
        out.append(parent)
    return out
