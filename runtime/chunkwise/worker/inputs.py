"""Flat-batch inputs: token rows at their positions over a paged cache -> ids, positions, attention metadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from chunkwise.attention.backend import AttentionMetadata


@dataclass(frozen=True)
class Row:
    """One request's slice of a step: tokens at positions start_pos.. over its block table."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]


def build_batch(
    rows: Sequence[Row], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    ids: list[int] = []
    pos_parts = []
    slot_parts = []
    qsl = [0]
    seq_lens = []
    for row in rows:
        n = len(row.token_ids)
        ids.extend(row.token_ids)
        pos = np.arange(row.start_pos, row.start_pos + n)
        table = np.asarray(row.block_table, dtype=np.int64)
        pos_parts.append(pos)
        slot_parts.append(table[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + n)
        seq_lens.append(row.start_pos + n)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    tables = np.zeros((len(rows), max_blocks), dtype=np.int64)
    for i, row in enumerate(rows):
        nb = -(-seq_lens[i] // block_size)
        tables[i, :nb] = row.block_table[:nb]
    query_lens = [qsl[i + 1] - qsl[i] for i in range(len(rows))]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.long, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
        block_tables=torch.from_numpy(tables).to(device),
        slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(device),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)
    positions = torch.from_numpy(np.concatenate(pos_parts)).to(device)
    return input_ids, positions, meta
