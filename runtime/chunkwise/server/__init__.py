"""The OpenAI-compatible HTTP front: `build_app(engine, ...)` (app.py), request models (protocol.py), one
serving path for completions and chat with SSE streaming (serving.py), each endpoint's request side
(endpoints.py) and answer shapes (formatters.py), chat templating (chat.py), OpenAI error bodies (errors.py),
and `chunkwise serve` (args.py, run.py).

Kept import-free: `chunkwise --help` and the operator command import this package without FastAPI or torch.
"""
