"""hf://org/name[@revision]: the Hugging Face Hub's HTTP API (or any endpoint speaking it, via HF_ENDPOINT).

The revision is resolved to its commit first and every file is fetched from that commit, so that a branch
moving mid-fetch cannot mix two commits' files; the commit goes into the marker.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import quote

from chunkwise.fetch.download import Checksum, Listing, RemoteFile, safe_relpath, with_retries
from chunkwise.fetch.errors import FetchError
from chunkwise.fetch.httpclient import HttpStatusError, get_json, ranged_body
from chunkwise.fetch.options import FetchOptions
from chunkwise.fetch.uri import HfUri

DEFAULT_ENDPOINT = "https://huggingface.co"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hf_token(options: FetchOptions) -> str | None:
    """--token-file first (the operator mounts a Secret), then the environment, as huggingface_hub reads it."""
    return options.token or os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None


def list_hf(uri: HfUri, options: FetchOptions) -> Listing:
    endpoint = (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    token = hf_token(options)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{endpoint}/api/models/{uri.repo}/revision/{quote(uri.revision, safe='')}?blobs=true"
    try:
        info = with_retries(
            f"resolving {uri.identity}",
            lambda: get_json(url, headers, options.timeout_s),
            options.retries,
            options.backoff_s,
        )
    except HttpStatusError as e:
        raise FetchError(_explain(uri, e.status, bool(token), str(e))) from e
    sha = info.get("sha") if isinstance(info, dict) else None
    if not isinstance(sha, str) or not _COMMIT.match(sha):
        raise FetchError(f"{endpoint} gave no commit for {uri.identity} (sha={sha!r})")
    files = [_remote_file(endpoint, uri.repo, sha, s, headers, options) for s in info.get("siblings") or []]
    if not files:
        raise FetchError(f"{uri.identity} (commit {sha}) holds no files")
    return Listing(sha, files)


def _remote_file(
    endpoint: str,
    repo: str,
    sha: str,
    sibling: dict[str, Any],
    headers: dict[str, str],
    options: FetchOptions,
) -> RemoteFile:
    name = sibling.get("rfilename")
    if not isinstance(name, str):
        raise FetchError(f"the Hub listed a file without a name: {sibling!r}")
    path = safe_relpath(name, "Hub file")
    lfs = sibling.get("lfs") or {}
    size = lfs.get("size", sibling.get("size"))
    if lfs.get("sha256"):
        checksum: Checksum | None = Checksum("sha256", str(lfs["sha256"]).lower())
    elif sibling.get("blobId") and size is not None:
        # Outside LFS the Hub gives the git blob id: sha1 of "blob <size>\0" + the bytes.
        checksum = Checksum("git-sha1", str(sibling["blobId"]).lower())
    else:
        checksum = None
    url = f"{endpoint}/{repo}/resolve/{sha}/{quote(name)}"
    return RemoteFile(
        path=path,
        size=int(size) if size is not None else None,
        checksum=checksum,
        version=checksum.hexdigest if checksum else sha,
        open=lambda offset, validator: ranged_body(url, headers, offset, validator, options.timeout_s),
    )


def _explain(uri: HfUri, status: int, has_token: bool, detail: str) -> str:
    if status in (401, 403):
        hint = (
            "the token was refused, or the repo is gated and its licence not accepted for this account"
            if has_token
            else "the repo is private or gated (or does not exist): set HF_TOKEN or pass --token-file"
        )
        return f"{uri.identity}: access denied (HTTP {status}); {hint}"
    if status == 404:
        return f"{uri.identity}: no such repository or revision (HTTP 404)"
    return f"{uri.identity}: {detail}"
