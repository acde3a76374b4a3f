"""The prefix cache's second tier in host memory (vLLM's --kv-offloading-size): an LRU of block hash -> host slot.

A cached block that leaves the device cache by eviction (BlockPool.allocate hands it to other tokens) is
copied here first, under the same chained hash; a later lookup that misses the device but finds the hash here
restores it into a fresh device block, a copy instead of a prefill. The tier keeps its copy after a restore
(it is inclusive), so a restored block that is evicted again costs no second copy.

The copies themselves are the model runner's (worker/kv_tensors.py), made through the host KV tensors that
swap space uses: the tier owns the slots after the swap space's, [first_slot, first_slot + num_slots), and
records each step's copies for the scheduler to put in the step's output (take_copies):
- offloads, (device block, host slot): the runner makes them first, before anything else in the step writes
  a device block (copy-on-write, swap-in, the forward), so each reads the evicted block's KV as it was;
- restores, (host slot, device block): made with the step's swap-ins, after every offload.
A slot that leaves the LRU in a step in which a restore still has to read it is held back (quarantined) until
the step's copies are taken: an offload into it in the same step would be made before that read.
"""

from __future__ import annotations

from collections import OrderedDict

from chunkwise.engine.cache.events import KVEventLog
from chunkwise.engine.cache.hashing import BlockHash


class HostTier:
    def __init__(self, num_slots: int, first_slot: int = 0, events: KVEventLog | None = None) -> None:
        if num_slots < 0 or first_slot < 0:
            raise ValueError(
                f"HostTier: num_slots and first_slot must be >= 0, got {num_slots}, {first_slot}"
            )
        self.num_slots = num_slots
        self.first_slot = first_slot
        self.events = events
        # Insertion order is eviction order: head = least recently used (offloaded, restored or re-evicted).
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()
        self._hash_of: dict[int, BlockHash] = {}
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        # This step's copies, not yet taken: slot -> device block it is written from; (slot, block) reads.
        self._offloads: dict[int, int] = {}
        self._restores: list[tuple[int, int]] = []
        self._reading: set[int] = set()  # slots this step's restores read
        self._restoring: set[int] = set()  # device blocks this step's restores write
        self._quarantine: list[int] = []
        # Counters since start (metrics read them).
        self.num_offloads = 0
        self.num_restores = 0
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    @property
    def usage(self) -> float:
        return len(self._slots) / self.num_slots if self.num_slots else 0.0

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The host slot holding block_hash's KV, or None (a lookup only: the LRU order is left alone)."""
        return self._slots.get(block_hash)

    def offload(self, block_hash: BlockHash, block: int) -> None:
        """Device block `block`, holding block_hash's KV, is being evicted: keep a copy (the LRU's tail).

        Already here (restored earlier, or offloaded by another block): nothing to copy, it only becomes the
        most recently used. No slot free (every one held back this step): the block is simply lost, as it
        would be without the tier."""
        assert block not in self._restoring, f"block {block} is evicted in the step that restores into it"
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        if self.num_slots == 0:
            return
        while not self._free and self._slots:
            self._evict_lru()
        if not self._free:
            return
        slot = self._free.pop()
        self._slots[block_hash] = slot
        self._hash_of[slot] = block_hash
        self._offloads[slot] = block
        self.num_offloads += 1
        if self.events is not None:
            self.events.record_host(block_hash, True)

    def hold(self, block_hash: BlockHash, slot: int) -> None:
        """A restore from `slot` (block_hash's, as a lookup found it) is coming in this step: the slot becomes
        the most recently used and, whatever happens to its entry in this step, is not written again before
        the step's copies are taken."""
        assert self._slots.get(block_hash) == slot, f"slot {slot} no longer holds the hash looked up"
        self._slots.move_to_end(block_hash)
        self._reading.add(slot)

    def restore(self, slot: int, block: int) -> None:
        """Copy a held slot's KV into device block `block` in this step."""
        assert slot in self._reading, f"restore from slot {slot}, which was not held"
        self._restores.append((slot, block))
        self._restoring.add(block)
        self.num_restores += 1

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's copies, for its output: offloads (device block, slot) and restores (slot, block). Once
        taken, they are as good as made (the runner makes them before anything of a later step), so the slots
        held back for this step's reads are free again."""
        offloads = [(block, slot) for slot, block in self._offloads.items()]
        restores = self._restores
        self._offloads = {}
        self._restores = []
        self._reading.clear()
        self._restoring.clear()
        if self._quarantine:
            self._free.extend(self._quarantine)
            self._quarantine.clear()
        return offloads, restores

    def _evict_lru(self) -> None:
        block_hash, slot = self._slots.popitem(last=False)
        del self._hash_of[slot]
        if slot in self._reading:
            # A restore of this step reads it (after this step's offload into it, if there is one: that copy
            # must still be made): no one writes it again before the step's copies are taken.
            self._quarantine.append(slot)
        else:
            # Offloaded and evicted in the same step, unread: its copy need not be made (the slot's next
            # writer, if any, is another of this step's offloads, made instead).
            self._offloads.pop(slot, None)
            self._free.append(slot)
        self.num_evictions += 1
        if self.events is not None:
            self.events.record_host(block_hash, False)

    def check_invariants(self) -> None:
        """Raise AssertionError if the tier's bookkeeping is inconsistent (tests call this)."""
        held = list(self._slots.values())
        everything = held + self._free + self._quarantine
        assert sorted(everything) == list(range(self.first_slot, self.first_slot + self.num_slots)), (
            "HostTier: every slot is held, free or quarantined, exactly once"
        )
        assert {s: h for h, s in self._slots.items()} == self._hash_of
        assert set(self._offloads) <= set(self._hash_of) | set(self._quarantine), (
            "a pending offload writes a slot that nothing holds or reads"
        )
        assert self._reading >= set(self._quarantine), "a quarantined slot no restore reads"
