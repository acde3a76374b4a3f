"""Digests of the engine's answers to a fixed set of requests, to show a restructuring changed no byte.

    PYTHONPATH=runtime .venv/bin/python tools/response_digest.py [--server] > after.txt
    git worktree add /tmp/before REV
    PYTHONPATH=/tmp/before/runtime .venv/bin/python tools/response_digest.py [--server] > before.txt
    diff before.txt after.txt

Only the public surface is used (`chunkwise.LLM`, `SamplingParams`, `StructuredOutput`, `chunkwise serve`),
so the same script runs against any tree since structured outputs landed. Each line is one engine setting and
request set: the sha256 of its outputs' token ids, texts, finish and stop reasons, log-probs (to 6 places)
and cached-token counts; with --server, of the JSON bodies of completions and chat completions (streamed and
whole) from a real server, with the fields that differ on every call (id, created, timings) taken out. The
bundled pylm model answers, on the CPU's default kernels: compare runs made on the same machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "# Parse a comma-separated line into fields\ndef parse_csv_line(line):\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",  # shares a prefix with the first
]

# Engine settings: each runs every request set below in one generate call.
ENGINES: dict[str, dict[str, Any]] = {
    "default": {},
    "chunked-64": {"max_num_batched_tokens": 64},
    "small-kv-recompute": {"num_blocks": 24, "preemption_mode": "recompute"},
    "small-kv-swap": {"num_blocks": 24, "preemption_mode": "swap"},
    "ngram-speculation": {"speculative_method": "ngram", "num_speculative_tokens": 3},
    "no-prefix-cache": {"enable_prefix_caching": False},
}


def request_sets() -> dict[str, list[Any]]:
    from chunkwise import SamplingParams, StructuredOutput

    return {
        "greedy": [SamplingParams(max_tokens=40, temperature=0.0) for _ in PROMPTS],
        "seeded": [
            SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=11 + i)
            for i in range(len(PROMPTS))
        ],
        "mixed": [
            SamplingParams(max_tokens=32, temperature=0.0, logprobs=3),
            SamplingParams(max_tokens=32, temperature=1.0, top_k=20, seed=5, n=3),
            SamplingParams(
                max_tokens=48, temperature=0.0, stop=["\n\n", "return"], include_stop_str_in_output=True
            ),
            SamplingParams(
                max_tokens=24, temperature=0.7, seed=9, presence_penalty=0.5, frequency_penalty=0.3
            ),
            SamplingParams(
                max_tokens=16, temperature=0.0, structured=StructuredOutput("regex", "[a-z_]+\\(")
            ),
        ],
    }


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _logprobs(lps: Any) -> Any:
    if lps is None:
        return None
    out = []
    for lp in lps:
        d = lp if isinstance(lp, dict) else getattr(lp, "__dict__", {"repr": repr(lp)})
        out.append(json.loads(json.dumps(d, default=repr), parse_float=lambda x: round(float(x), 6)))
    return out


def offline_lines() -> list[str]:
    from chunkwise import LLM

    lines = []
    sets = request_sets()
    for name, kwargs in ENGINES.items():
        llm = LLM(model="pylm", max_model_len=256, **kwargs)
        for set_name, params in sets.items():
            outs = llm.generate(PROMPTS, params)
            record = [
                {
                    "cached": o.num_cached_tokens,
                    "outputs": [
                        {
                            "ids": c.token_ids,
                            "text": c.text,
                            "finish": c.finish_reason,
                            "stop": c.stop_reason,
                            "logprobs": _logprobs(c.logprobs),
                        }
                        for c in o.outputs
                    ],
                }
                for o in outs
            ]
            lines.append(f"offline {name} {set_name} {digest(record)}")
        del llm
    return lines


VOLATILE = {"id", "created", "system_fingerprint", "time_info", "timings"}


def _stable(body: Any) -> Any:
    if isinstance(body, dict):
        return {k: _stable(v) for k, v in body.items() if k not in VOLATILE}
    if isinstance(body, list):
        return [_stable(v) for v in body]
    return body


def _post(url: str, payload: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        raw = resp.read().decode()
    if payload.get("stream"):
        events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
        return [_stable(json.loads(e)) if e != "[DONE]" else e for e in events]
    return _stable(json.loads(raw))


def server_lines() -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "chunkwise.cli", "serve", "--model", "pylm", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"the server did not start: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}"
                )
            time.sleep(0.5)
        lines = []
        for stream in (False, True):
            for i, prompt in enumerate(PROMPTS):
                body = _post(
                    base + "/v1/completions",
                    {
                        "model": "pylm",
                        "prompt": prompt,
                        "max_tokens": 24,
                        "temperature": 0.8,
                        "seed": 3 + i,
                        "logprobs": 2,
                        "stream": stream,
                        "n": 1 + i % 2,
                    },
                )
                lines.append(f"server completions stream={stream} prompt{i} {digest(body)}")
            body = _post(
                base + "/v1/chat/completions",
                {
                    "model": "pylm",
                    "messages": [{"role": "user", "content": "Write a function that sorts a list."}],
                    "max_tokens": 32,
                    "temperature": 0.0,
                    "stream": stream,
                },
            )
            lines.append(f"server chat stream={stream} {digest(body)}")
        return lines
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--server", action="store_true", help="also the HTTP server's bodies (starts `chunkwise serve`)"
    )
    args = p.parse_args()
    import chunkwise

    print(f"# chunkwise from {os.path.dirname(chunkwise.__file__)}", file=sys.stderr)
    for line in offline_lines():
        print(line, flush=True)
    if args.server:
        for line in server_lines():
            print(line, flush=True)


if __name__ == "__main__":
    main()
