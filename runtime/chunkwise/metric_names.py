"""The name of every metric the engine exports and of those the router exports that others read: one owner.

engine/loop/metrics.py registers them; the router (router/estimates.py), the benchmark client (bench/serve.py) and the
operator (chunkwise_operator/scrape.py, held to these by a contract test: the operator image may not need
this package) read them. The vLLM names are kept where vLLM has the metric, so that dashboards, KEDA
triggers and the GAIE endpoint picker written for vLLM work unchanged. Importing this module imports nothing.
"""

from __future__ import annotations

# Gauges, read at scrape time from the scheduler's published stats.
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
NUM_REQUESTS_SWAPPED = "chunkwise:num_requests_swapped"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
OUTPUT_LENGTH_ESTIMATE = "chunkwise:output_length_estimate_tokens"
SPEC_DRAFT_LENGTH = "chunkwise:spec_draft_length"
# vLLM's info metric; its num_gpu_blocks label is the KV cache's capacity in blocks.
CACHE_CONFIG_INFO = "vllm:cache_config_info"
# vLLM's: the running and waiting requests' LoRA adapters (comma-separated labels) and max_lora.
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
# chunkwise's, for a router's LoRA affinity: each adapter served (label lora_name) and whether its weights
# are on the device now (label resident), and the slot fills with their time.
LORA_ADAPTERS = "chunkwise:lora_adapters"
LORA_LOADS = "chunkwise:lora_loads_total"
LORA_LOAD_SECONDS = "chunkwise:lora_load_seconds_total"
LORA_REQUESTS = "chunkwise:lora_requests_total"
# Per priority band (the `priority` label), under --scheduling-policy priority.
NUM_REQUESTS_RUNNING_BY_PRIORITY = "chunkwise:num_requests_running_by_priority"
NUM_REQUESTS_QUEUED_BY_PRIORITY = "chunkwise:num_requests_queued_by_priority"
PREEMPTIONS_BY_PRIORITY = "chunkwise:preemptions_by_priority_total"
PRIORITY_PREEMPTIONS = "chunkwise:priority_preemptions_total"
TIME_TO_FIRST_TOKEN_BY_PRIORITY = "chunkwise:time_to_first_token_by_priority_seconds"
REQUEST_QUEUE_TIME_BY_PRIORITY = "chunkwise:request_queue_time_by_priority_seconds"
# Exposed only by an engine configured for them (as vLLM's are), with why.
CONDITIONAL = {
    **{
        name: "--enable-lora"
        for name in (LORA_REQUESTS_INFO, LORA_ADAPTERS, LORA_LOADS, LORA_LOAD_SECONDS, LORA_REQUESTS)
    },
    **{
        name: "--scheduling-policy priority"
        for name in (
            NUM_REQUESTS_RUNNING_BY_PRIORITY,
            NUM_REQUESTS_QUEUED_BY_PRIORITY,
            PREEMPTIONS_BY_PRIORITY,
            PRIORITY_PREEMPTIONS,
            TIME_TO_FIRST_TOKEN_BY_PRIORITY,
            REQUEST_QUEUE_TIME_BY_PRIORITY,
        )
    },
}

# Counters.
NUM_PREEMPTIONS = "vllm:num_preemptions_total"
PREEMPTIONS_BY_MODE = "chunkwise:preemptions_total"
PREEMPTION_FALLBACKS = "chunkwise:preemption_fallbacks_total"
STALLED_REQUESTS = "chunkwise:stalled_requests_total"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"
ADMISSION_REJECTIONS = "chunkwise:admission_rejections_total"

# The prefix cache's host tier (--kv-offloading-size; all 0 without one): prompt tokens found there (of
# vllm:prefix_cache_hits), blocks copied back to the device and into host memory, blocks dropped from its LRU,
# and the fraction of its blocks in use.
HOST_PREFIX_CACHE_HITS = "chunkwise:host_prefix_cache_hits_total"
HOST_PREFIX_CACHE_RESTORES = "chunkwise:host_prefix_cache_restored_blocks_total"
HOST_PREFIX_CACHE_OFFLOADS = "chunkwise:host_prefix_cache_offloaded_blocks_total"
HOST_PREFIX_CACHE_EVICTIONS = "chunkwise:host_prefix_cache_evicted_blocks_total"
HOST_PREFIX_CACHE_USAGE = "chunkwise:host_prefix_cache_usage_perc"

# Histograms (exposed with _bucket, _sum and _count).
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "vllm:request_queue_time_seconds"
ITERATION_TOKENS = "vllm:iteration_tokens_total"
STEP_DURATION = "chunkwise:step_duration_seconds"
SCHEDULER_SECONDS = "chunkwise:scheduler_seconds"

# The router's, read by the operator's autoscaler: requests it holds while no replica is ready.
ROUTER_HELD_REQUESTS = "chunkwise:router_held_requests"

# Every exposed sample-name stem the design contract fixes (histograms add _bucket/_sum/_count).
CONTRACT_NAMES = (
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    KV_CACHE_USAGE,
    NUM_PREEMPTIONS,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    REQUEST_SUCCESS,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    E2E_REQUEST_LATENCY,
    REQUEST_QUEUE_TIME,
    ITERATION_TOKENS,
    SPEC_DRAFT_TOKENS,
    SPEC_ACCEPTED_TOKENS,
    STEP_DURATION,
    ADMISSION_REJECTIONS,
    PREEMPTIONS_BY_MODE,
    OUTPUT_LENGTH_ESTIMATE,
    SPEC_DRAFT_LENGTH,
)
