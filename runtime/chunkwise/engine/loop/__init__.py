"""The engine's top layer: EngineCore (the step loop), the output processor, AsyncEngine (streaming, for
the server), LLM (the offline API) and the Prometheus metrics of all of it.

core.py            EngineCore: the step loop over the parts builder.py makes; one step
builder.py         build_engine, ModelInfo: config -> model, KV cache, runner, probes, scheduler
calibration.py     start-up measurements the cost models begin from
step.py            StepStats, StepUpdate: a step's timings and its snapshot for the output side
output_processor   detokenization and stop strings -> RequestOutputs
async_engine.py    AsyncEngine: the step loop on a thread, deltas to asyncio
stream.py          RequestStream: one request's deltas as an async iterator
llm.py             LLM: generate() over a whole batch
metrics.py         EngineMetrics: the Prometheus exposition of steps, requests and the scheduler
"""

from chunkwise.engine.loop.async_engine import AsyncEngine
from chunkwise.engine.loop.core import EngineCore, ModelInfo
from chunkwise.engine.loop.llm import LLM
from chunkwise.engine.loop.output_processor import OutputProcessor, ProcessedOutputs
from chunkwise.engine.loop.step import StepStats, StepUpdate
from chunkwise.engine.loop.stream import RequestStream

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
