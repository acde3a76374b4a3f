"""Pipeline parallelism below the model: which consecutive layers each stage holds (stage_layers, vLLM's
split), and a stage's point-to-point traffic (PipelineStage).

A stage's ranks are global ranks stage * tp .. stage * tp + tp - 1. Between stages the hidden states and the
residual stream (one [2, T, hidden] tensor) go from each rank to the rank of the same tensor-parallel index
in the next stage. The last stage's tensor-parallel rank 0 sends each logits tensor it computes to global
rank 0 (stage 0), which samples from them. At one stage (SINGLE_STAGE) nothing here communicates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Each stage's layers, consecutive, as even as possible; as vLLM splits them, the layers left over go one
    each to the stages before the last (which also runs the final norm and the LM head), last first.
    Fewer layers than stages is a ValueError naming both fields."""
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be positive, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"num_hidden_layers ({num_layers}) is fewer than pipeline_parallel_size {num_stages}: each stage "
            "holds at least one layer"
        )
    sizes = [num_layers // num_stages] * num_stages
    for i in range(2, num_layers % num_stages + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


@dataclass(frozen=True)
class PipelineStage:
    """One rank's stage: its layers, and the global ranks it exchanges tensors with (None: nobody).

    prev_rank/next_rank: where its hidden states come from and go to; logits_to: global rank 0, on the
    last stage's tensor-parallel rank 0 only; logits_from: on global rank 0, the rank that sends them."""

    stage: int
    num_stages: int
    layers: range
    prev_rank: int | None = None
    next_rank: int | None = None
    logits_to: int | None = None
    logits_from: int | None = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @classmethod
    def of(cls, rank: int, tp_size: int, pp_size: int, num_layers: int) -> PipelineStage:
        """Global `rank`'s stage among pp_size stages of tp_size ranks each (global rank = stage * tp + tp rank)."""
        stage, tp_rank = divmod(rank, tp_size)
        layers = stage_layers(num_layers, pp_size)[stage]
        last = pp_size - 1
        return cls(
            stage=stage,
            num_stages=pp_size,
            layers=layers,
            prev_rank=rank - tp_size if stage > 0 else None,
            next_rank=rank + tp_size if stage < last else None,
            logits_to=0 if stage == last and tp_rank == 0 and pp_size > 1 else None,
            logits_from=last * tp_size if rank == 0 and pp_size > 1 else None,
        )

    def recv_hidden(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden, residual), each [num_tokens, hidden_size]."""
        assert self.prev_rank is not None
        buf = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
        dist.recv(buf, self.prev_rank)
        return buf[0], buf[1]

    def send_hidden(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """This stage's output to the next (one message: hidden and residual stacked)."""
        assert self.next_rank is not None
        dist.send(torch.stack((x, residual)), self.next_rank)

    def send_logits(self, logits: torch.Tensor) -> None:
        # Both ends skip an empty tensor (a step whose rows sample nothing), as the collectives do.
        if self.logits_to is not None and logits.numel():
            dist.send(logits.contiguous(), self.logits_to)

    def recv_logits(self, rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
        """On global rank 0: the next logits tensor the last stage computed (float32, [rows, vocab])."""
        assert self.logits_from is not None
        logits = torch.empty((rows, vocab_size), dtype=torch.float32, device=device)
        if rows:
            dist.recv(logits, self.logits_from)
        return logits


def single_stage(num_layers: int) -> PipelineStage:
    """Pipeline size 1: the one stage holds every layer and sends nothing."""
    return PipelineStage(stage=0, num_stages=1, layers=range(num_layers))
