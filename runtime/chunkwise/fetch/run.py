"""The fetch: lock DIR, honour (or refuse) what an earlier fetch left there, list, download, write the marker."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from chunkwise.fetch.download import Downloader, Listing, RemoteFile
from chunkwise.fetch.errors import FetchError, UsageError
from chunkwise.fetch.options import FetchOptions
from chunkwise.fetch.progress import Progress, human_bytes
from chunkwise.fetch.select import Selection, select
from chunkwise.fetch.state import (
    FileRecord,
    Journal,
    Marker,
    dir_lock,
    now_iso,
    partial_dir,
    read_journal,
    read_marker,
    remove_fetched_files,
    remove_marker,
    remove_partial_dir,
    write_journal,
    write_marker,
)
from chunkwise.fetch.uri import GcsUri, HfUri, HttpUri, ModelUri, S3Uri, redacted

log = logging.getLogger("chunkwise.fetch")

# What a full fetch must hold at its top for `chunkwise serve` to load it: a model (`--model DIR`) has the
# Hugging Face config.json; a LoRA adapter (`--lora-modules NAME=DIR`, /v1/load_lora_adapter) is in PEFT's
# format, its config and its weights as safetensors (the engine reads no pickled adapter_model.bin).
MODEL_CONFIG = "config.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class FetchOutcome:
    marker: Marker
    already_fetched: bool  # the marker was there: nothing was downloaded


def fetch_model(uri: ModelUri, dest: Path, options: FetchOptions) -> FetchOutcome:
    """Fetches `uri` into `dest` (created if need be). Raises FetchError, or UsageError for options that do
    not apply to the URI."""
    if isinstance(uri, S3Uri) and options.token:
        raise UsageError(
            "--token-file does not apply to s3:// (boto3 reads AWS credentials from the environment)"
        )
    if options.adapter and options.selection.mode != "full":
        raise UsageError(
            "--adapter fetches the whole adapter: it cannot be combined with --tokenizer-only or --include"
        )
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(f"cannot create {dest}: {e}") from e
    with dir_lock(dest, options.progress_interval_s):
        return _fetch_locked(uri, dest, options)


def _fetch_locked(uri: ModelUri, dest: Path, options: FetchOptions) -> FetchOutcome:
    identity = uri.identity
    shown = redacted(identity)
    selection = options.selection
    trusted: dict[str, FileRecord] = {}
    marker = read_marker(dest)
    if marker is not None and marker.uri != identity:
        _replace_or_refuse(dest, identity, options, marker.uri, [f.path for f in marker.files], "holds")
        marker = None
    if marker is not None:
        if Selection(marker.mode == "tokenizer-only", marker.includes).covers(selection):
            log.info(
                "already fetched: %s holds %s at %s (%s, %d files, finished %s)",
                dest,
                shown,
                marker.revision,
                marker.mode,
                len(marker.files),
                marker.finished_at,
            )
            if marker.mode == "full":
                remove_partial_dir(dest)  # leftovers of a crash after the marker was written
            return FetchOutcome(marker, True)
        log.info("%s holds %s's %s files only; fetching the %s", dest, shown, marker.mode, selection.mode)
        trusted = {f.path: f for f in marker.files}
    journal = read_journal(dest)
    if journal is not None and journal.uri != identity:
        _replace_or_refuse(
            dest, identity, options, journal.uri, list(journal.files), "is part-way through fetching"
        )
        journal = None
    if journal is None:
        # Written before the first byte, so that an interrupted fetch is never taken for another URI's.
        journal = Journal(identity)
        write_journal(dest, journal)
    partial = partial_dir(dest)
    revision: str | None

    if isinstance(uri, HttpUri):
        log.info("fetching %s (%s) into %s", shown, selection.mode, dest)
        progress = Progress(options.progress_interval_s, None)
        downloader = _downloader(dest, journal, progress, options, trusted)
        from chunkwise.fetch.http import fetch_archive

        revision, records = fetch_archive(uri, options, downloader, dest, partial)
        if selection.mode == "full":
            try:
                kind = checkpoint_kind([r.path for r in records], shown, options.adapter)
            except FetchError:
                # Nothing `chunkwise serve` can load: leave no half-model behind (there is no marker either).
                remove_fetched_files(dest, [r.path for r in records])
                raise
    else:
        listing = _list(uri, options)
        by_path = {f.path: f for f in listing.files}
        chosen, skipped = select(list(by_path), selection, skip_unused_weights=isinstance(uri, HfUri))
        if skipped:
            skipped_bytes = sum(by_path[p].size or 0 for p in skipped)
            log.info(
                "skipping %d file(s), %s, in weight formats the engine does not load (it reads *.safetensors): "
                "%s; --include them to fetch them anyway",
                len(skipped),
                human_bytes(skipped_bytes),
                ", ".join(skipped[:5]) + (", ..." if len(skipped) > 5 else ""),
            )
        if not chosen:
            raise FetchError(f"{shown} (revision {listing.revision}) holds no files for {selection.mode}")
        if selection.mode == "full":
            # Before a byte is downloaded: a wrong URI fails in a second, not after the whole prefix.
            kind = checkpoint_kind(chosen, shown, options.adapter)
        files = [by_path[p] for p in chosen]
        sizes = [f.size for f in files]
        total = sum(s for s in sizes if s is not None) if None not in sizes else None
        log.info(
            "fetching %d file(s)%s of %s at revision %s (%s) into %s",
            len(files),
            f", {human_bytes(total)}," if total is not None else "",
            shown,
            listing.revision,
            selection.mode,
            dest,
        )
        _check_free_space(dest, files)
        progress = Progress(options.progress_interval_s, total)
        downloader = _downloader(dest, journal, progress, options, trusted)
        revision = listing.revision
        records = [downloader.fetch(f).record for f in files]

    paths = {r.path for r in records}
    if selection.tokenizer_only and not paths & {"tokenizer.json", "tokenizer.model", "vocab.json"}:
        log.warning("%s has no tokenizer.json, tokenizer.model or vocab.json at its top", shown)
    marker = Marker(
        uri=identity,
        mode=selection.mode,
        includes=selection.includes,
        revision=revision,
        files=tuple(sorted(records, key=lambda r: r.path)),
        finished_at=now_iso(),
    )
    write_marker(dest, marker)
    remove_partial_dir(dest)
    what = f" (a {kind})" if selection.mode == "full" else ""
    log.info("fetched %s%s into %s: %s", shown, what, dest, progress.summary())
    return FetchOutcome(marker, False)


def checkpoint_kind(paths: list[str], shown: str, adapter: bool) -> str:
    """ "model" or "LoRA adapter": what the files of a full fetch are, judged by the files at their top.

    `adapter` (--adapter): it must be an adapter. Otherwise a model's config.json wins, and an
    adapter_config.json makes it an adapter. Raises FetchError, naming what is missing, when `chunkwise serve`
    could load it as neither.
    """
    top = {p for p in paths if "/" not in p}
    if not adapter and MODEL_CONFIG in top:
        return "model"
    if ADAPTER_CONFIG in top:
        if ADAPTER_WEIGHTS not in top:
            pickled = (
                " (it has adapter_model.bin: save the adapter with safetensors)"
                if "adapter_model.bin" in top
                else ""
            )
            raise FetchError(
                f"{shown} is a LoRA adapter without {ADAPTER_WEIGHTS} at its top{pickled}; "
                f"the engine loads PEFT adapters as {ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}"
            )
        return "LoRA adapter"
    listed = (", ".join(sorted(top)[:8]) + (", ..." if len(top) > 8 else "")) if top else "no files"
    if adapter:
        raise FetchError(
            f"{shown} is not a PEFT LoRA adapter: it has no {ADAPTER_CONFIG} at its top (it holds {listed})"
            + ("; it looks like a model (config.json): give it as spec.model" if MODEL_CONFIG in top else "")
        )
    raise FetchError(
        f"{shown} holds neither {MODEL_CONFIG} (a model) nor {ADAPTER_CONFIG} (a PEFT LoRA adapter) at its "
        f"top, so `chunkwise serve` can load it as neither (it holds {listed}); point the URI at the "
        "directory that holds them"
    )


def _list(uri: HfUri | S3Uri | GcsUri, options: FetchOptions) -> Listing:
    # Each source imports its client on first use: boto3 only for s3://.
    if isinstance(uri, HfUri):
        from chunkwise.fetch.hf import list_hf

        return list_hf(uri, options)
    if isinstance(uri, S3Uri):
        from chunkwise.fetch.s3 import list_s3

        return list_s3(uri, options)
    from chunkwise.fetch.gcs import list_gcs

    return list_gcs(uri, options)


def _check_free_space(dest: Path, files: list[RemoteFile]) -> None:
    """Fails now rather than with ENOSPC after an hour of downloading."""
    need = 0
    for f in files:
        if f.size is None:
            return
        target, part = dest / f.path, partial_dir(dest) / (f.path + ".part")
        if target.is_file() and target.stat().st_size == f.size:
            continue
        need += f.size - (min(part.stat().st_size, f.size) if part.is_file() else 0)
    free = shutil.disk_usage(dest).free
    if need > free:
        raise FetchError(f"{dest} has {human_bytes(free)} free; the fetch needs {human_bytes(need)} more")


def _downloader(
    dest: Path, journal: Journal, progress: Progress, options: FetchOptions, trusted: dict[str, FileRecord]
) -> Downloader:
    return Downloader(
        dest,
        partial_dir(dest),
        journal,
        progress,
        retries=options.retries,
        backoff_s=options.backoff_s,
        trusted=trusted,
    )


def _replace_or_refuse(
    dest: Path, identity: str, options: FetchOptions, other: str, paths: list[str], verb: str
) -> None:
    if not options.force:
        raise FetchError(
            f"{dest} {verb} {redacted(other)}, not {redacted(identity)}: refusing to mix two models in one directory "
            "(--force deletes the other model's files first)"
        )
    removed = remove_fetched_files(dest, paths)
    remove_marker(dest)
    remove_partial_dir(dest)
    log.warning("--force: removed %d file(s) of %s from %s", removed, redacted(other), dest)
