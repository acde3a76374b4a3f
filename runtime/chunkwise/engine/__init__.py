"""The engine: EngineCore (the step loop), the output processor, AsyncEngine (streaming, for the server)
and LLM (the offline API).

core.py            EngineCore: the step loop over the parts builder.py makes; one step
builder.py         build_engine, ModelInfo: config -> model, KV cache, runner, probes, scheduler
calibration.py     start-up measurements the cost models begin from
step.py            StepStats, StepUpdate: a step's timings and its snapshot for the output side
output_processor   detokenization and stop strings -> RequestOutputs
async_engine.py    AsyncEngine: the step loop on a thread, deltas to asyncio
stream.py          RequestStream: one request's deltas as an async iterator
llm.py             LLM: generate() over a whole batch
"""

from chunkwise.engine.async_engine import AsyncEngine
from chunkwise.engine.core import EngineCore, ModelInfo
from chunkwise.engine.llm import LLM
from chunkwise.engine.output_processor import OutputProcessor, ProcessedOutputs
from chunkwise.engine.step import StepStats, StepUpdate
from chunkwise.engine.stream import RequestStream

__all__ = [
    "LLM",
    "AsyncEngine",
    "EngineCore",
    "ModelInfo",
    "OutputProcessor",
    "ProcessedOutputs",
    "RequestStream",
    "StepStats",
    "StepUpdate",
]
