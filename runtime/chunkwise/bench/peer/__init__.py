"""`chunkwise bench compare vllm`: chunkwise side by side with the peer engine, vLLM, on one checkpoint, one
workload, one dtype and the same pinned cores.

Three modes:

- throughput (offline): one persistent worker process per (engine, dtype), each running
  `peer_worker.py` under its own interpreter (vLLM lives in a separate virtualenv) and pinned to --cpus.
  Runs alternate A B, then B A, ... for --repeats; each repeat draws a fresh workload seed (the same for
  both engines), so neither engine's prefix cache ever holds a block of an earlier repeat. Each engine
  generates the whole workload in one offline `generate` call; the figure is output tokens per second of
  wall time (and per second of the worker's CPU time, beside it).
- convoy (online): `chunkwise serve` and vLLM's OpenAI server, both up and pinned to --cpus, driven in turn
  by the same streaming client (chunkwise.bench.serve) with decoding streams and long prompts injected
  while they decode; the streams run through the whole window (from the first long prompt's arrival to the
  last one's first token: the client cuts them when it closes, and the metrics check they were running);
  the figures are the streams' p99 and max inter-token latency inside the window, their steady median
  outside it, and the long prompts' time to first token.
- served (online): the same two servers, driven in turn by one client at a fixed concurrency on a random
  workload of vLLM's `vllm bench serve --dataset-name random` shape; output tok/s, mean and median TPOT, p99
  ITL and mean TTFT. With --vllm-client the client is vLLM's own `vllm bench serve` (the reference).

Every ratio is chunkwise over vLLM, one per repeat, reported as the median with its range
(chunkwise.bench.compare.Ratio). While one engine runs, the other's CPU time is watched: a peer that is
idle on the same core must stay idle, or the comparison is not fair, and the report says so.

base.py      the engines, PeerSettings, PeerReport, the alternation, vLLM's availability, process CPU time
offline.py   the throughput mode: WorkerProcess (peer_worker.py, which stays beside this package, in a
             subprocess) and compare_throughput
servers.py   the online modes' servers: ServerProcess (chunkwise serve or vLLM's, pinned), process_servers
convoy.py    the convoy mode: convoy_metrics, its client (http_serve) and compare_convoy
served.py    the served mode: compare_served, chunkwise's client and vLLM's (vllm_client)
cli.py       run_from_args: the command's checks, its defaults per mode, and the printed report
"""

from chunkwise.bench.peer.base import (
    ENGINES,
    IDLE_CPU_NOTE_FRACTION,
    PAUSE_NOTE,
    START_TIMEOUT_S,
    VLLM_IMPORT_TIMEOUT_S,
    VLLM_INSTALL_HINT,
    EngineName,
    Peer,
    PeerError,
    PeerReport,
    PeerSettings,
    agreement,
    alternation,
    check_vllm,
    paused,
    signal_tree,
    tree_cpu_seconds,
)
from chunkwise.bench.peer.cli import (
    MODE_DEFAULTS,
    MODES,
    format_report,
    parse_dtypes,
    resolve_mode_defaults,
    run_from_args,
)
from chunkwise.bench.peer.convoy import ServeFn, compare_convoy, convoy_metrics, http_serve, wait_quiet
from chunkwise.bench.peer.offline import (
    RUN_TIMEOUT_S,
    WORKER_PATH,
    RunReply,
    ThroughputRun,
    Worker,
    WorkerFactory,
    WorkerProcess,
    compare_throughput,
    process_workers,
)
from chunkwise.bench.peer.served import (
    SERVED_KEYS,
    VLLM_BENCH_WRAPPER,
    ServedFn,
    compare_served,
    http_served,
    served_figures,
    vllm_bench_command,
    vllm_client,
    vllm_random_shape,
)
from chunkwise.bench.peer.servers import (
    SERVED_MODEL_NAME,
    Server,
    ServerFactory,
    ServerProcess,
    process_servers,
    server_command,
    server_env,
)

__all__ = [
    "ENGINES",
    "IDLE_CPU_NOTE_FRACTION",
    "MODES",
    "MODE_DEFAULTS",
    "PAUSE_NOTE",
    "RUN_TIMEOUT_S",
    "SERVED_KEYS",
    "SERVED_MODEL_NAME",
    "START_TIMEOUT_S",
    "VLLM_BENCH_WRAPPER",
    "VLLM_IMPORT_TIMEOUT_S",
    "VLLM_INSTALL_HINT",
    "WORKER_PATH",
    "EngineName",
    "Peer",
    "PeerError",
    "PeerReport",
    "PeerSettings",
    "RunReply",
    "ServeFn",
    "ServedFn",
    "Server",
    "ServerFactory",
    "ServerProcess",
    "ThroughputRun",
    "Worker",
    "WorkerFactory",
    "WorkerProcess",
    "agreement",
    "alternation",
    "check_vllm",
    "compare_convoy",
    "compare_served",
    "compare_throughput",
    "convoy_metrics",
    "format_report",
    "http_serve",
    "http_served",
    "parse_dtypes",
    "paused",
    "process_servers",
    "process_workers",
    "resolve_mode_defaults",
    "run_from_args",
    "served_figures",
    "server_command",
    "server_env",
    "signal_tree",
    "tree_cpu_seconds",
    "vllm_bench_command",
    "vllm_client",
    "vllm_random_shape",
    "wait_quiet",
]
