"""The OpenAI-compatible HTTP front: `build_app(engine, ...)` (app.py), request models (protocol.py), the
completion and chat handlers with SSE streaming (serving.py), chat templating (chat.py), OpenAI error bodies
(errors.py), and `chunkwise serve` (args.py, run.py).

Kept import-free: `chunkwise --help` and the operator command import this package without FastAPI or torch.
"""
