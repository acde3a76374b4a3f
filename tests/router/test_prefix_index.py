"""The per-replica prefix index: chained-hash prefix matches and an LRU that evicts leaves before roots."""

from __future__ import annotations

import pytest

from chunkwise.engine.cache.hashing import hash_prefix_blocks
from chunkwise.router.prefix_index import PrefixIndex

BLOCK = 4


def hashes(tokens: list[int]) -> list[int]:
    return hash_prefix_blocks(tokens, BLOCK)


def test_match_counts_leading_blocks_only() -> None:
    index = PrefixIndex(100)
    system = list(range(12))  # three full blocks
    index.insert(hashes([*system, 50, 51, 52, 53]))
    assert index.match(hashes([*system, 50, 51, 52, 53])) == 4
    # Same system prompt, another question: the shared three blocks match, the fourth does not.
    assert index.match(hashes([*system, 60, 61, 62, 63, 64])) == 3
    # The same tokens at another position are another prefix: chained hashes never match out of place.
    assert index.match(hashes([99, *system])) == 0
    assert index.match([]) == 0


def test_match_does_not_reorder_insert_does() -> None:
    index = PrefixIndex(2)
    a, b = hashes([1, 1, 1, 1]), hashes([2, 2, 2, 2])
    index.insert(a)
    index.insert(b)
    index.match(a)  # a lookup is not a use: a stays the oldest
    index.insert(hashes([3, 3, 3, 3]))
    assert (a[0] in index, b[0] in index) == (False, True)


def test_eviction_takes_leaves_before_the_shared_root() -> None:
    index = PrefixIndex(4)
    root = [7] * BLOCK
    first = hashes([*root, *([1] * BLOCK), *([2] * BLOCK)])  # root, x1, x2
    index.insert(first)
    second = hashes([*root, *([3] * BLOCK)])  # root, y1
    index.insert(second)
    assert len(index) == 4
    index.insert(hashes([*root, *([4] * BLOCK)]))  # root, z1: one block must go
    assert len(index) == 4
    # The oldest leaf went (the deepest block of the first chain); the root, shared by all, stayed.
    assert first[0] in index and first[2] not in index and first[1] in index
    assert index.match(second) == 2


def test_resize_and_clear() -> None:
    index = PrefixIndex(10)
    index.insert(hashes(list(range(40))))
    assert len(index) == 10
    index.resize(3)
    assert len(index) == 3
    assert index.match(hashes(list(range(40)))) == 3
    index.clear()
    assert len(index) == 0
    with pytest.raises(ValueError, match="positive"):
        PrefixIndex(0)
