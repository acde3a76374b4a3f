"""What one rank of a tensor-parallel group holds of a model, vLLM's scheme (Megatron's):

- query heads: an equal share each, consecutive (rank r: heads [r * n, (r + 1) * n));
- KV heads: an equal share each when there are at least as many as ranks; with fewer, each rank keeps the
  one KV head its query heads read, so each KV head is replicated over world_size / num_key_value_heads ranks;
- the MLP's intermediate columns: an equal share each;
- the vocabulary (embedding rows, LM head rows): ceil(vocab_size / world_size) each, the last rank's shard
  padded past vocab_size (padding rows are zero, and their logits are cut off after the gather).

Sizes that do not divide are refused, naming the config field and the tensor-parallel size. At world size 1
every share is the whole."""

from __future__ import annotations

from dataclasses import dataclass

from chunkwise.engine.datatypes.config import ModelConfig


@dataclass(frozen=True)
class TPLayout:
    rank: int
    world_size: int
    num_heads: int  # query heads on this rank
    head_start: int  # the first one's index among the model's
    num_kv_heads: int  # KV heads on this rank (its KV cache's heads)
    kv_head_start: int
    kv_replicas: int  # ranks holding each of this rank's KV heads (1 unless KV heads < ranks)
    intermediate_size: int  # MLP columns on this rank
    intermediate_start: int
    vocab_shard: int  # embedding and LM head rows on this rank, padding included
    vocab_start: int
    vocab_size: int  # the model's

    @property
    def vocab_rows(self) -> int:
        """The rows of this rank's vocabulary shard that are real tokens (the rest are padding)."""
        return max(0, min(self.vocab_shard, self.vocab_size - self.vocab_start))

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, world_size: int = 1) -> TPLayout:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not one of tensor_parallel_size {world_size} ranks")
        heads, kv = config.num_attention_heads, config.num_key_value_heads

        def refuse(field: str, value: int, why: str) -> ValueError:
            return ValueError(
                f"{field} ({value}) does not divide over tensor_parallel_size {world_size}: {why}"
            )

        if heads % world_size:
            raise refuse("num_attention_heads", heads, "each rank holds the same number of query heads")
        if kv >= world_size and kv % world_size:
            raise refuse("num_key_value_heads", kv, "each rank holds the same number of KV heads")
        if kv < world_size and world_size % kv:
            raise refuse(
                "num_key_value_heads",
                kv,
                "with fewer KV heads than ranks, the ranks must split into equal groups, one per KV head",
            )
        if config.intermediate_size % world_size:
            raise refuse(
                "intermediate_size", config.intermediate_size, "each rank holds the same MLP columns"
            )
        num_heads = heads // world_size
        replicas = max(1, world_size // kv)
        num_kv = max(1, kv // world_size)
        inter = config.intermediate_size // world_size
        vocab_shard = -(-config.vocab_size // world_size)
        return cls(
            rank=rank,
            world_size=world_size,
            num_heads=num_heads,
            head_start=rank * num_heads,
            num_kv_heads=num_kv,
            kv_head_start=(rank // replicas) * num_kv,
            kv_replicas=replicas,
            intermediate_size=inter,
            intermediate_start=rank * inter,
            vocab_shard=vocab_shard,
            vocab_start=rank * vocab_shard,
            vocab_size=config.vocab_size,
        )
