"""Public LLM request traces as benchmark workloads (no torch).

Three formats, read into `WorkItem`s sorted by arrival:

- `chunkwise`: chunkwise's own JSONL (`chunkwise.bench.workloads.load_jsonl`), prompts and all.
- `azure`: the Azure LLM inference traces (Azure/AzurePublicDataset, `AzureLLMInferenceTrace_code.csv`,
  `_conv.csv`, 2023 and 2024): CSV with the columns `TIMESTAMP,ContextTokens,GeneratedTokens` (others are
  ignored). TIMESTAMP is a date-time such as `2023-11-16 18:15:46.6805900` (any number of fractional digits,
  an optional `+00:00` offset) or plain seconds. Arrival = seconds since the earliest row (rows may come in
  any order); the prompt is ContextTokens random token ids (the trace carries no content, so no two
  prompts share a prefix); max_tokens = GeneratedTokens.
- `mooncake`: the Mooncake traces (kvcache-ai/Mooncake, FAST'25: `mooncake_trace.jsonl`,
  `conversation_trace.jsonl`, ...): one `{"timestamp": ms, "input_length": n, "output_length": m,
  "hash_ids": [...]}` per line. Each hash id names a block of `block_tokens` (Mooncake's 512) prompt
  tokens; equal ids at the same position are the same tokens, so requests that share their leading hash ids
  share that prompt prefix. Block k of a prompt is drawn from a generator seeded by (seed, hash_ids[k]); the
  last block is cut so the prompt is input_length long, and a prompt longer than its blocks cover is
  extended with tokens of its own (seeded by the request's line). Arrival = timestamp / 1000 (the trace's
  timestamps are already offsets from its start); max_tokens = output_length.

For all three: `time_scale` divides the arrival times (2: twice as fast; inf: all at once);
`max_requests` keeps the earliest N requests (None: all); `client_max_tokens=False` hides the output
lengths from admission (max_tokens None, target_len the trace's length), as `--hide-lengths` does for the
synthetic workloads. A row asking for 0 output (or 0 prompt) tokens is refused with its file:line, or
dropped with `skip_empty=True`. Token ids follow the synthetic workloads' rules (3 to min(vocab_size, 256)
- 1: no control bytes, no byte-tokenizer specials). Errors are ValueError (FileNotFoundError for a missing
file) naming the file and line.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chunkwise.bench.workloads import _BYTE_VOCAB, _FIRST_PROMPT_TOKEN, WorkItem, _prompt, load_jsonl

TRACE_FORMATS = ("chunkwise", "azure", "mooncake")
MOONCAKE_BLOCK_TOKENS = 512

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_CHUNKWISE_MARKERS = ("prompt", "prompt_token_ids")

# A date-time with any number of fractional digits (Azure's have 7; datetime parses at most 6) and an
# optional UTC offset: `2023-11-16 18:15:46.6805900`, `2024-05-10 00:00:00.009930+00:00`.
_DATETIME = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:[.,](\d+))?\s*(Z|[+-]\d{2}(?::?\d{2})?)?",
    re.IGNORECASE,
)
_EPOCH_ORDINAL = dt.date(1970, 1, 1).toordinal()


@dataclass(frozen=True)
class _Row:
    line: int
    # Time as whole seconds and a fraction: a 2023 date in float seconds keeps only ~7 fractional digits.
    whole: int
    frac: float
    n_in: int
    n_out: int
    hash_ids: tuple[int, ...] = ()


# -- format guessing -----------------------------------------------------------------------------------


def guess_format(path: str | Path) -> str:
    """`azure` for a .csv file; otherwise the first JSON object decides: `mooncake` if it has hash_ids,
    `chunkwise` if it has a prompt or prompt_token_ids. Anything else is a ValueError."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        return "azure"
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(
                    f"{path}:{lineno}: cannot tell the trace format: not a JSON object and not a .csv file "
                    f"(give --trace-format {'|'.join(TRACE_FORMATS)})"
                ) from None
            if isinstance(obj, dict) and "hash_ids" in obj:
                return "mooncake"
            if isinstance(obj, dict) and any(k in obj for k in _CHUNKWISE_MARKERS):
                return "chunkwise"
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(
                f"{path}:{lineno}: cannot tell the trace format from {keys}: a Mooncake trace has "
                f"{list(MOONCAKE_FIELDS)}, a chunkwise one prompt or prompt_token_ids "
                f"(give --trace-format {'|'.join(TRACE_FORMATS)})"
            )
    raise ValueError(f"{path}: empty trace")


# -- shared ---------------------------------------------------------------------------------------------


def _check_options(vocab_size: int, time_scale: float, max_requests: int | None) -> None:
    if vocab_size <= _FIRST_PROMPT_TOKEN:
        raise ValueError(f"vocab_size must exceed {_FIRST_PROMPT_TOKEN}, got {vocab_size}")
    if not time_scale > 0:
        raise ValueError(f"the time scale must be positive (or inf), got {time_scale}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"the request cap must be at least 1, got {max_requests}")


def _scale(t: float, time_scale: float) -> float:
    return 0.0 if math.isinf(time_scale) else t / time_scale


def _item(prompt: tuple[int, ...], n_out: int, arrival_s: float, client_max_tokens: bool) -> WorkItem:
    if client_max_tokens:
        return WorkItem(prompt, n_out, arrival_s)
    return WorkItem(prompt, None, arrival_s, target_len=n_out)


def _count(value: object, name: str, where: str, *, text: bool = False) -> int:
    """A non-negative token count: a JSON integer, or with `text` a CSV cell holding an integral number
    (`12`, or `12.0`)."""
    if text and isinstance(value, str):
        cell = value.strip()
        try:
            value = int(cell)
        except ValueError:
            try:
                number = float(cell)
            except ValueError:
                raise ValueError(f"{where}{name} must be an integer, got {cell!r}") from None
            if not number.is_integer():
                raise ValueError(f"{where}{name} must be an integer, got {cell!r}") from None
            value = int(number)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}{name} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{where}{name} must be >= 0, got {value}")
    return value


def _keep(row: _Row, where: str, skip_empty: bool, in_name: str, out_name: str) -> bool:
    """False for a row to drop (skip_empty); a ValueError naming the line for one to refuse."""
    for name, value in ((out_name, row.n_out), (in_name, row.n_in)):
        if value == 0:
            if skip_empty:
                return False
            raise ValueError(
                f"{where}{name} is 0: a replayed request needs at least one prompt and one output token "
                f"(--trace-skip-empty drops such rows)"
            )
    return True


def _earliest(rows: list[_Row], max_requests: int | None) -> list[_Row]:
    rows.sort(key=lambda r: (r.whole, r.frac, r.line))
    return rows if max_requests is None else rows[:max_requests]


# -- Azure ----------------------------------------------------------------------------------------------


def parse_timestamp(text: str) -> tuple[int, float]:
    """An Azure TIMESTAMP as (whole seconds since 1970 UTC, fraction): a date-time with any number of
    fractional digits and an optional UTC offset (naive means UTC), or plain seconds. ValueError otherwise."""
    text = text.strip()
    m = _DATETIME.fullmatch(text)
    if m:
        year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
        try:
            days = dt.date(year, month, day).toordinal() - _EPOCH_ORDINAL
        except ValueError as e:
            raise ValueError(f"not a date-time: {text!r} ({e})") from None
        if hour > 23 or minute > 59 or second > 60:
            raise ValueError(f"not a date-time: {text!r}")
        whole = days * 86400 + hour * 3600 + minute * 60 + second
        digits = m.group(7) or ""
        frac = int(digits) / 10 ** len(digits) if digits else 0.0
        zone = m.group(8)
        if zone and zone.upper() != "Z":
            sign = -1 if zone[0] == "-" else 1
            hh_mm = zone[1:].replace(":", "")
            offset = int(hh_mm[:2]) * 3600 + int(hh_mm[2:] or 0) * 60
            whole -= sign * offset
        return whole, frac
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(
            f"not a date-time (YYYY-MM-DD HH:MM:SS[.fraction][+HH:MM]) or seconds: {text!r}"
        ) from None
    if not math.isfinite(seconds):
        raise ValueError(f"not a finite time: {text!r}")
    whole = math.floor(seconds)
    return whole, seconds - whole


def _azure_rows(path: Path, skip_empty: bool) -> list[_Row]:
    rows: list[_Row] = []
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header: list[str] | None = None
        cols: list[int] = []
        for record in reader:
            where = f"{path}:{reader.line_num}: "
            if not record or all(not cell.strip() for cell in record):
                continue
            if header is None:
                header = [cell.strip().lower() for cell in record]
                missing = [c for c in AZURE_COLUMNS if c.lower() not in header]
                if missing:
                    raise ValueError(
                        f"{where}an Azure LLM trace needs the columns {list(AZURE_COLUMNS)}; missing "
                        f"{missing} in the header {record}"
                    )
                cols = [header.index(c.lower()) for c in AZURE_COLUMNS]
                continue
            if len(record) <= max(cols):
                raise ValueError(f"{where}{len(record)} fields, the header has {len(header)}")
            ts, n_in, n_out = (record[i] for i in cols)
            try:
                whole, frac = parse_timestamp(ts)
            except ValueError as e:
                raise ValueError(f"{where}TIMESTAMP {e}") from None
            row = _Row(
                reader.line_num,
                whole,
                frac,
                _count(n_in, "ContextTokens", where, text=True),
                _count(n_out, "GeneratedTokens", where, text=True),
            )
            if _keep(row, where, skip_empty, "ContextTokens", "GeneratedTokens"):
                rows.append(row)
    if header is None:
        raise ValueError(f"{path}: empty trace (no header {','.join(AZURE_COLUMNS)})")
    return rows


def load_azure(
    path: str | Path,
    *,
    vocab_size: int = 258,
    seed: int = 0,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    skip_empty: bool = False,
    client_max_tokens: bool = True,
) -> list[WorkItem]:
    """An Azure LLM inference trace (CSV) as a workload; see the module docstring."""
    _check_options(vocab_size, time_scale, max_requests)
    path = Path(path)
    rows = _earliest(_azure_rows(path, skip_empty), max_requests)
    if not rows:
        return []
    # One generator over the rows in time order: the first N prompts are the same whatever the cap.
    rng = np.random.default_rng(seed)
    whole0, frac0 = rows[0].whole, rows[0].frac
    return [
        _item(
            _prompt(rng, r.n_in, vocab_size),
            r.n_out,
            _scale((r.whole - whole0) + (r.frac - frac0), time_scale),
            client_max_tokens,
        )
        for r in rows
    ]


# -- Mooncake -------------------------------------------------------------------------------------------


def _mooncake_rows(path: Path, skip_empty: bool) -> list[_Row]:
    rows: list[_Row] = []
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}: "
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}not JSON: {e}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}each line must be a JSON object")
            missing = [k for k in MOONCAKE_FIELDS if k not in obj]
            if missing:
                raise ValueError(
                    f"{where}a Mooncake trace line needs {list(MOONCAKE_FIELDS)}; missing {missing}"
                )
            ts = obj["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
                raise ValueError(
                    f"{where}timestamp must be a non-negative number of milliseconds, got {ts!r}"
                )
            ids = obj["hash_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids
            ):
                raise ValueError(f"{where}hash_ids must be a list of non-negative integers")
            # Milliseconds as whole seconds and a fraction, so that the sort sees the trace's exact times.
            whole, rest = divmod(ts, 1000)
            row = _Row(
                lineno,
                int(whole),
                rest / 1000,
                _count(obj["input_length"], "input_length", where),
                _count(obj["output_length"], "output_length", where),
                tuple(ids),
            )
            if _keep(row, where, skip_empty, "input_length", "output_length"):
                rows.append(row)
    return rows


def _seed_words(seed: int) -> int:
    return seed % (1 << 64)  # numpy's SeedSequence takes non-negative integers only


def load_mooncake(
    path: str | Path,
    *,
    vocab_size: int = 258,
    seed: int = 0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    skip_empty: bool = False,
    client_max_tokens: bool = True,
) -> list[WorkItem]:
    """A Mooncake trace (JSONL) as a workload; see the module docstring."""
    _check_options(vocab_size, time_scale, max_requests)
    if block_tokens < 1:
        raise ValueError(f"the trace block size must be at least 1 token, got {block_tokens}")
    path = Path(path)
    rows = _earliest(_mooncake_rows(path, skip_empty), max_requests)
    lo, hi = _FIRST_PROMPT_TOKEN, min(vocab_size, _BYTE_VOCAB)
    s = _seed_words(seed)
    blocks: dict[int, np.ndarray] = {}  # token ids fit a byte (hi <= 256): a block costs block_tokens bytes

    def block(h: int) -> np.ndarray:
        if h not in blocks:
            blocks[h] = np.random.default_rng([s, 0, h]).integers(lo, hi, block_tokens).astype(np.uint8)
        return blocks[h]

    items = []
    for r in rows:
        used = r.hash_ids[: -(-r.n_in // block_tokens)]
        parts: list[np.ndarray] = [block(h) for h in used]
        extra = r.n_in - len(used) * block_tokens
        if extra > 0:
            # More prompt than hash ids: this request's own tokens, shared with no one.
            parts.append(np.random.default_rng([s, 1, r.line]).integers(lo, hi, extra).astype(np.uint8))
        tokens = np.concatenate(parts)[: r.n_in] if parts else np.zeros(0, np.uint8)
        prompt = tuple(int(t) for t in tokens.tolist())
        items.append(_item(prompt, r.n_out, _scale(r.whole + r.frac, time_scale), client_max_tokens))
    return items


# -- chunkwise ------------------------------------------------------------------------------------------


def load_chunkwise(
    path: str | Path,
    *,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    client_max_tokens: bool = True,
) -> list[WorkItem]:
    """chunkwise's own JSONL trace with the time scale, the cap and hidden lengths applied."""
    _check_options(_FIRST_PROMPT_TOKEN + 1, time_scale, max_requests)
    items = load_jsonl(path)  # sorted by arrival, stably
    if max_requests is not None:
        items = items[:max_requests]
    out = []
    for it in items:
        it = dataclasses.replace(it, arrival_s=_scale(it.arrival_s, time_scale))
        if not client_max_tokens and it.max_tokens is not None:
            it = dataclasses.replace(it, max_tokens=None, target_len=it.max_tokens)
        out.append(it)
    return out


def load_trace(
    path: str | Path,
    fmt: str | None = None,
    *,
    vocab_size: int = 258,
    seed: int = 0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    skip_empty: bool = False,
    client_max_tokens: bool = True,
) -> list[WorkItem]:
    """A trace in any of TRACE_FORMATS (None: guess_format) as a workload sorted by arrival."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    fmt = fmt or guess_format(path)
    if fmt == "chunkwise":
        return load_chunkwise(
            path, time_scale=time_scale, max_requests=max_requests, client_max_tokens=client_max_tokens
        )
    if fmt == "azure":
        return load_azure(
            path,
            vocab_size=vocab_size,
            seed=seed,
            time_scale=time_scale,
            max_requests=max_requests,
            skip_empty=skip_empty,
            client_max_tokens=client_max_tokens,
        )
    if fmt == "mooncake":
        return load_mooncake(
            path,
            vocab_size=vocab_size,
            seed=seed,
            block_tokens=block_tokens,
            time_scale=time_scale,
            max_requests=max_requests,
            skip_empty=skip_empty,
            client_max_tokens=client_max_tokens,
        )
    raise ValueError(f"unknown trace format {fmt!r}; known: {list(TRACE_FORMATS)}")
