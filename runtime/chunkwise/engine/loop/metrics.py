"""Every Prometheus metric the runtime exports, in one place.

Names follow vLLM (`vllm:*`) so that existing dashboards, KEDA recipes and inference-aware routers work
unchanged; ours live under `chunkwise:*`. Each `EngineMetrics` owns its own CollectorRegistry (no global
state), so one process can build several apps, as the tests do.

Sources:
- request timings, token counts and step timings come from the engine loop: `EngineMetrics.on_step` is an
  `AsyncEngine` observer, called on the loop thread after every step;
- gauges and the scheduler's cumulative counters (preemptions, prefix-cache lookups) are read at scrape time
  from the snapshot the loop publishes (`AsyncEngine.scheduler_stats()`), through a custom collector;
- admission rejections are counted by the server when it sheds load.

prometheus_client adds `_total` to a counter's samples itself (a counter family "x" exposes "x_total"), so
counters are declared under their family name and expose exactly the contracted `..._total` names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from chunkwise import metric_names as N
from chunkwise.engine.sched.output import SchedulerStats
from chunkwise.engine.sched.shedding import REJECT_REASONS

if TYPE_CHECKING:
    from chunkwise.engine.datatypes.outputs import RequestOutput
    from chunkwise.engine.datatypes.request import Request
    from chunkwise.engine.loop.step import StepStats

FINISHED_REASONS = ("stop", "length", "abort", "error")

# Step time: about 1 ms to 5 s with ~25% spacing below 100 ms, fine enough for a p99 by interpolation.
STEP_DURATION_BUCKETS = (
    0.001, 0.00125, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.006, 0.008,
    0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08,
    0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
)  # fmt: skip
SCHEDULER_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _SchedulerCollector(Collector):
    """Gauges and cumulative scheduler counters, read at scrape time from the published stats."""

    def __init__(self, model_name: str, source: Callable[[], SchedulerStats | None]) -> None:
        self.model_name = model_name
        self.source = source
        # Whether the per-priority series are exported (EngineMetrics.set_scheduling_policy).
        self.banded = False

    def collect(self) -> Iterable[Metric]:
        s = self.source() or SchedulerStats()
        m = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge(N.NUM_REQUESTS_RUNNING, "Requests in the running batch.", s.num_running)
        yield gauge(
            N.NUM_REQUESTS_WAITING,
            "Requests waiting to be scheduled (preempted included).",
            s.num_waiting,
        )
        yield gauge(
            N.NUM_REQUESTS_SWAPPED,
            "Requests preempted by swapping, KV in host memory.",
            s.num_swapped,
        )
        yield gauge(N.KV_CACHE_USAGE, "Fraction of KV cache blocks in use (1 = full).", s.kv_usage)
        if s.max_lora:
            lora = GaugeMetricFamily(
                N.LORA_REQUESTS_INFO,
                "The LoRA adapters of the running and the waiting requests (vLLM's labels); the value is when "
                "they were read.",
                labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            )
            running, waiting = ",".join(s.running_lora_adapters), ",".join(s.waiting_lora_adapters)
            lora.add_metric([running, waiting, str(s.max_lora)], time.time())
            yield lora
            adapters = GaugeMetricFamily(
                N.LORA_ADAPTERS,
                "Each LoRA adapter served (1), and whether its weights are on the device now.",
                labels=["model_name", "lora_name", "resident"],
            )
            resident = set(s.resident_lora_adapters)
            for name in s.served_lora_adapters:
                adapters.add_metric([self.model_name, name, str(name in resident).lower()], 1.0)
            yield adapters
            yield counter(N.LORA_LOADS, "LoRA adapters copied into a device slot.", s.lora_loads)
            yield counter(
                N.LORA_LOAD_SECONDS,
                "Time spent copying LoRA adapters into device slots (reading them first if needed).",
                s.lora_load_seconds,
            )
        yield gauge(
            N.OUTPUT_LENGTH_ESTIMATE,
            "Output length admission reserved for the last admitted request.",
            s.last_output_length_estimate,
        )
        yield gauge(
            N.SPEC_DRAFT_LENGTH,
            "Current speculative draft length.",
            s.spec_draft_length,
        )
        swap, recompute = s.num_preemptions_swap, s.num_preemptions_recompute
        yield counter(N.NUM_PREEMPTIONS, "Cumulative preemptions.", swap + recompute)
        modes = CounterMetricFamily(
            N.PREEMPTIONS_BY_MODE, "Cumulative preemptions by mode.", labels=["model_name", "mode"]
        )
        modes.add_metric([self.model_name, "swap"], swap)
        modes.add_metric([self.model_name, "recompute"], recompute)
        yield modes
        yield counter(
            N.PREEMPTION_FALLBACKS,
            "Preemptions that chose swap but recomputed, the host swap space being full (raise "
            "--swap-space-bytes).",
            s.num_preemption_fallbacks,
        )
        yield counter(
            N.STALLED_REQUESTS,
            "Requests the scheduler's watchdog failed: work waiting, nothing running, nothing admitted (a bug "
            "or a leaked block; each is logged).",
            s.num_stalled_requests,
        )
        yield counter(
            N.PREFIX_CACHE_QUERIES,
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield counter(N.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        # The prefix cache's host tier (--kv-offloading-size).
        yield counter(
            N.HOST_PREFIX_CACHE_HITS,
            "Prompt tokens found in the prefix cache's host tier (counted in vllm:prefix_cache_hits too).",
            s.host_cache_hits,
        )
        yield counter(
            N.HOST_PREFIX_CACHE_RESTORES,
            "KV blocks copied from the host tier back to the device on a prefix-cache hit.",
            s.host_cache_restores,
        )
        yield counter(
            N.HOST_PREFIX_CACHE_OFFLOADS,
            "KV blocks evicted from the device prefix cache and copied to the host tier.",
            s.host_cache_offloads,
        )
        yield counter(
            N.HOST_PREFIX_CACHE_EVICTIONS,
            "KV blocks dropped from the host tier's LRU (lost to the prefix cache).",
            s.host_cache_evictions,
        )
        yield gauge(
            N.HOST_PREFIX_CACHE_USAGE,
            "Fraction of the host tier's KV blocks in use (1 = full; 0 without --kv-offloading-size).",
            s.host_cache_usage,
        )
        yield counter(
            N.SPEC_DRAFT_TOKENS,
            "Speculative tokens proposed.",
            s.spec_num_draft_tokens,
        )
        yield counter(
            N.SPEC_ACCEPTED_TOKENS,
            "Speculative tokens accepted.",
            s.spec_num_accepted_tokens,
        )
        if self.banded:
            yield from self._bands(s)

    def _bands(self, s: SchedulerStats) -> Iterable[Metric]:
        """--scheduling-policy priority: the queue, the batch and the preemptions per priority band."""
        labels = ["model_name", "priority"]
        families = (
            (
                GaugeMetricFamily,
                N.NUM_REQUESTS_RUNNING_BY_PRIORITY,
                "Requests running, by priority.",
                s.running_by_priority,
            ),
            (
                GaugeMetricFamily,
                N.NUM_REQUESTS_QUEUED_BY_PRIORITY,
                "Requests waiting or swapped, by priority.",
                s.queued_by_priority,
            ),
            (
                CounterMetricFamily,
                N.PREEMPTIONS_BY_PRIORITY,
                "Cumulative preemptions, by the victim's priority.",
                s.preemptions_by_priority,
            ),
        )
        for kind, name, doc, values in families:
            family = kind(name, doc, labels=labels)
            for priority, value in sorted(values.items()):
                family.add_metric([self.model_name, str(priority)], value)
            yield family
        c = CounterMetricFamily(
            N.PRIORITY_PREEMPTIONS,
            "Preemptions of running requests for a waiting one of higher priority (in vllm:num_preemptions too).",
            labels=["model_name"],
        )
        c.add_metric([self.model_name], s.num_priority_preemptions)
        yield c


class EngineMetrics:
    """The runtime's metrics for one served model, in a registry of their own."""

    def __init__(
        self,
        model_name: str,
        stats_source: Callable[[], SchedulerStats | None] | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._stats_source: Callable[[], SchedulerStats | None] = stats_source or (lambda: None)
        r = self.registry
        labels = ["model_name"]

        self.prompt_tokens = Counter(
            N.PROMPT_TOKENS,
            "Prompt tokens of requests that started generating.",
            labels,
            registry=r,
        ).labels(model_name)
        self.generation_tokens = Counter(N.GENERATION_TOKENS, "Generated tokens.", labels, registry=r).labels(
            model_name
        )
        self.request_success = Counter(
            N.REQUEST_SUCCESS,
            "Finished requests, by finish reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        for reason in FINISHED_REASONS:
            self.request_success.labels(model_name, reason)
        # Per LoRA adapter: no series until an adapter's first request ends (none without --enable-lora).
        self.lora_requests = Counter(
            N.LORA_REQUESTS,
            "Finished requests that ran a LoRA adapter, by adapter.",
            [*labels, "lora_name"],
            registry=r,
        )
        self.ttft = Histogram(
            N.TIME_TO_FIRST_TOKEN,
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            N.INTER_TOKEN_LATENCY,
            "Time between tokens.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            N.E2E_REQUEST_LATENCY,
            "Arrival to finish.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.queue_time = Histogram(
            N.REQUEST_QUEUE_TIME,
            "Arrival to first scheduled.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.iteration_tokens = Histogram(
            N.ITERATION_TOKENS,
            "Tokens computed per step (decode rows + prefill chunks).",
            labels,
            buckets=ITERATION_TOKENS_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.step_duration = Histogram(
            N.STEP_DURATION,
            "Wall time of one engine step (schedule + forward + sample + emit).",
            labels,
            buckets=STEP_DURATION_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.scheduler_seconds = Histogram(
            N.SCHEDULER_SECONDS,
            "Time in schedule() per step.",
            labels,
            buckets=SCHEDULER_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.admission_rejections = Counter(
            N.ADMISSION_REJECTIONS,
            "Requests refused at admission (load shedding), by reason.",
            [*labels, "reason"],
            registry=r,
        )
        for reason in REJECT_REASONS:
            self.admission_rejections.labels(model_name, reason)
        # vLLM's info metric (value 1; the facts are labels): the router reads the KV capacity from it.
        self.cache_config_info = Gauge(
            N.CACHE_CONFIG_INFO,
            "KV cache configuration.",
            [*labels, "block_size", "num_gpu_blocks", "enable_prefix_caching"],
            registry=r,
        )
        self._collector = _SchedulerCollector(model_name, lambda: self._stats_source())
        r.register(self._collector)
        # Created by set_scheduling_policy("priority"): none under fcfs, where every request is band 0.
        self.ttft_by_priority: Histogram | None = None
        self.queue_time_by_priority: Histogram | None = None
        # Loop-thread state: when each streaming request last produced tokens.
        self._last_token_time: dict[str, float] = {}

    def set_stats_source(self, source: Callable[[], SchedulerStats | None]) -> None:
        self._stats_source = source

    def set_cache_config(self, block_size: int, num_blocks: int, enable_prefix_caching: bool) -> None:
        self.cache_config_info.clear()
        self.cache_config_info.labels(
            self.model_name, str(block_size), str(num_blocks), str(enable_prefix_caching)
        ).set(1)

    def set_scheduling_policy(self, policy: str) -> None:
        """Under "priority", export the per-band series (chunkwise:*_by_priority*)."""
        if policy != "priority" or self.ttft_by_priority is not None:
            return
        self._collector.banded = True
        labels = ["model_name", "priority"]
        self.ttft_by_priority = Histogram(
            N.TIME_TO_FIRST_TOKEN_BY_PRIORITY,
            "Time to first token, by priority.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.queue_time_by_priority = Histogram(
            N.REQUEST_QUEUE_TIME_BY_PRIORITY,
            "Arrival to first scheduled, by priority.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def record_rejection(self, reason: str) -> None:
        self.admission_rejections.labels(self.model_name, reason).inc()

    def on_step(
        self, step: StepStats | None, outputs: Sequence[RequestOutput], finished: Sequence[Request]
    ) -> None:
        """An AsyncEngine observer: runs on the engine loop thread after each step."""
        if step is not None:
            self.step_duration.observe(step.step_seconds)
            self.scheduler_seconds.observe(step.schedule_seconds)
            if step.num_batched_tokens > 0:
                self.iteration_tokens.observe(step.num_batched_tokens)
        now = time.monotonic()
        for out in outputs:
            choices = out.outputs
            # n > 1: one delta per choice that progressed (the prompt still counts once, below).
            n = len(choices[0].token_ids) if len(choices) == 1 else sum(len(c.token_ids) for c in choices)
            if n == 0:
                continue
            self.generation_tokens.inc(n)
            last = self._last_token_time.pop(out.request_id, None)
            if last is None:
                # The request's first tokens: its prompt has been processed.
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                first = out.first_token_time if out.first_token_time is not None else now
                self.ttft.observe(max(0.0, first - out.arrival_time))
                last, n = first, n - 1
            if n > 0:
                # Several tokens in one delta (speculative decoding) share the interval.
                gap = max(0.0, now - last) / n
                for _ in range(n):
                    self.itl.observe(gap)
            if not out.finished:
                self._last_token_time[out.request_id] = now
        # A request's last output says how it ended as the client saw it: a stop string found on the output
        # side ends it before (or after) the scheduler hears of it, which then records another reason or none.
        ended = (
            {o.request_id: o.outputs[0].finish_reason for o in outputs if o.finished and len(o.outputs) == 1}
            if finished
            else {}
        )
        for req in finished:
            self._last_token_time.pop(req.request_id, None)
            reason = ended.get(req.request_id) or req.finish_reason or "abort"
            self.request_success.labels(self.model_name, reason).inc()
            if req.lora_name is not None:
                self.lora_requests.labels(self.model_name, req.lora_name).inc()
            if req.finished_time is not None:
                self.e2e.observe(max(0.0, req.finished_time - req.arrival_time))
            if req.first_scheduled_time is not None:
                self.queue_time.observe(max(0.0, req.first_scheduled_time - req.arrival_time))
            if self.ttft_by_priority is not None and self.queue_time_by_priority is not None:
                band = (self.model_name, str(req.priority))
                if req.first_token_time is not None:
                    self.ttft_by_priority.labels(*band).observe(
                        max(0.0, req.first_token_time - req.arrival_time)
                    )
                if req.first_scheduled_time is not None:
                    self.queue_time_by_priority.labels(*band).observe(
                        max(0.0, req.first_scheduled_time - req.arrival_time)
                    )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
