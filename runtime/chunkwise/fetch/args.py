"""Flags of `chunkwise fetch-model URI DIR`, and its exit codes: 0 fetched (or already there), 2 a bad URI
or flag, 1 the fetch failed. The reason is the last line of stderr and, in a pod, the container's
termination message (/dev/termination-log), so that `kubectl describe pod` shows it."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from chunkwise.argtypes import LOG_LEVELS, non_negative_float, non_negative_int, positive_float
from chunkwise.fetch.options import (
    DEFAULT_BACKOFF_S,
    DEFAULT_PROGRESS_INTERVAL_S,
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT_S,
)

TERMINATION_LOG = Path("/dev/termination-log")
# Kubernetes keeps the first 4096 bytes of a termination message.
TERMINATION_LOG_MAX_BYTES = 4096

DESCRIPTION = """\
Fetch a model into DIR so that `chunkwise serve --model DIR` loads it, or (--adapter) a PEFT LoRA
adapter so that `--lora-modules NAME=DIR` does. URI is one of:
  hf://org/name[@revision]   Hugging Face Hub (HF_ENDPOINT, HF_TOKEN or --token-file)
  s3://bucket/prefix         every object under the prefix (AWS_ENDPOINT_URL[_S3], AWS credentials)
  gs://bucket/prefix         Google Cloud Storage (STORAGE_EMULATOR_HOST; GOOGLE_OAUTH_ACCESS_TOKEN,
                             --token-file or the GKE metadata server's token)
  http(s)://host/model.tgz   a .tar, .tar.gz/.tgz, .tar.xz or .zip archive, extracted into DIR
                             (#sha256=HEX or --sha256 verifies it)
A full fetch must find config.json (a model) or adapter_config.json and adapter_model.safetensors
(an adapter) at its top, else it fails naming what it found. Downloads resume after a crash or a dropped connection; DIR/.chunkwise-fetch.json is written last and
makes a second run a no-op. Exit codes: 0 done, 2 bad URI or flags, 1 the fetch failed."""

log = logging.getLogger("chunkwise.fetch")


def add_fetch_args(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("uri", metavar="URI", help="the model's URI (see above)")
    parser.add_argument("dir", metavar="DIR", help="the directory to fetch into (created if missing)")
    g = parser.add_argument_group("fetch-model")
    g.add_argument(
        "--tokenizer-only",
        action="store_true",
        help="fetch only what the tokenizer needs (tokenizer.json, tokenizer_config.json, config.json, ...): "
        "the router's pod",
    )
    g.add_argument(
        "--adapter",
        action="store_true",
        help="URI is a PEFT LoRA adapter: require adapter_config.json and adapter_model.safetensors at its top "
        "(without it, an adapter is recognised by its adapter_config.json where no config.json is)",
    )
    g.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="GLOB",
        help="fetch only files whose path matches GLOB (fnmatch; repeatable; adds to --tokenizer-only)",
    )
    g.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="a file holding the bearer token for hf://, gs:// or http(s):// (e.g. a mounted Secret); "
        "hf:// otherwise reads HF_TOKEN",
    )
    g.add_argument("--sha256", default=None, metavar="HEX", help="the http(s) archive's SHA-256")
    g.add_argument(
        "--force",
        action="store_true",
        help="if DIR holds (or is part-way through) another URI's model, delete its files and fetch this one",
    )
    g.add_argument(
        "--retries",
        type=non_negative_int,
        default=DEFAULT_RETRIES,
        metavar="N",
        help="retries of a failed request or dropped connection, each resuming where it stopped, with "
        f"exponential backoff; counted per stall, reset by progress (default {DEFAULT_RETRIES})",
    )
    g.add_argument(
        "--retry-backoff-seconds",
        type=non_negative_float,
        default=DEFAULT_BACKOFF_S,
        metavar="SECONDS",
        help=f"the first retry's wait, doubled for each further one up to 60 (default {DEFAULT_BACKOFF_S:g})",
    )
    g.add_argument(
        "--timeout-seconds",
        type=positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"connect/read timeout; a stalled read counts as a dropped connection (default {DEFAULT_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--progress-interval-seconds",
        type=positive_float,
        default=DEFAULT_PROGRESS_INTERVAL_S,
        metavar="SECONDS",
        help=f"how often to log bytes done, rate and ETA (default {DEFAULT_PROGRESS_INTERVAL_S:g})",
    )
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log level (default info)")


def run_fetch(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from chunkwise.fetch.errors import FetchError, UsageError

    try:
        _run(args)
    except UsageError as e:
        return _fail(f"fetch-model: {e}", 2)
    except FetchError as e:
        return _fail(f"fetch-model failed: {e}", 1)
    except KeyboardInterrupt:
        return _fail("fetch-model interrupted", 130)
    except Exception as e:
        log.exception("unexpected error")
        return _fail(f"fetch-model failed: {type(e).__name__}: {e}", 1)
    return 0


def _run(args: argparse.Namespace) -> None:
    from chunkwise.fetch.errors import UsageError
    from chunkwise.fetch.options import FetchOptions
    from chunkwise.fetch.run import fetch_model
    from chunkwise.fetch.select import Selection
    from chunkwise.fetch.uri import parse_uri

    uri = parse_uri(args.uri, sha256=args.sha256)
    token = None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise UsageError(f"cannot read --token-file {args.token_file}: {e.strerror or e}") from e
        if not token:
            raise UsageError(f"--token-file {args.token_file} is empty")
    options = FetchOptions(
        selection=Selection(args.tokenizer_only, tuple(args.include)),
        token=token,
        force=args.force,
        retries=args.retries,
        backoff_s=args.retry_backoff_seconds,
        timeout_s=args.timeout_seconds,
        progress_interval_s=args.progress_interval_seconds,
        adapter=args.adapter,
    )
    fetch_model(uri, Path(args.dir), options)


def _fail(message: str, code: int) -> int:
    message = " ".join(message.split())  # one line, whatever the exception's text held
    log.error("%s", message)
    write_termination_message(message)
    return code


def write_termination_message(message: str, path: Path | None = None) -> None:
    path = path or TERMINATION_LOG
    try:
        if path.exists():
            with open(path, "w", encoding="utf-8") as f:
                f.write(message.encode("utf-8")[:TERMINATION_LOG_MAX_BYTES].decode("utf-8", "ignore"))
    except OSError:
        pass  # not in a pod, or not writable: stderr has it
