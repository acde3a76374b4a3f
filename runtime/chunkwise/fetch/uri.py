"""Model URIs: parsed once into a typed value, so that every later step matches on a class, not on text.

Each value has an `identity`: the canonical text the completion marker records, compared on the next run
to tell "the same model again" (a no-op) from "a different model into the same directory" (refused).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit

from chunkwise.fetch.errors import UsageError

SUPPORTED = "hf://org/name[@revision], s3://bucket/prefix, gs://bucket/prefix, http(s)://host/archive"
HF_DEFAULT_REVISION = "main"
# The Hub's own rule for repo ids: letters, digits, '.', '_' and '-', neither starting with those marks.
_HF_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
# S3's bucket naming rules (lower case, digits, '.', '-'; 3-63 characters); GCS also allows '_'.
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_GCS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class HfUri:
    repo: str  # "org/name"
    revision: str  # a branch, tag or commit; "main" when the URI names none

    @property
    def identity(self) -> str:
        return f"hf://{self.repo}@{self.revision}"


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    prefix: str  # "" (the whole bucket) or ending in "/": a directory, never a partial name

    @property
    def identity(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


@dataclass(frozen=True)
class GcsUri:
    bucket: str
    prefix: str  # as S3Uri.prefix

    @property
    def identity(self) -> str:
        return f"gs://{self.bucket}/{self.prefix}"


@dataclass(frozen=True)
class HttpUri:
    url: str  # without the fragment
    sha256: str | None  # lower-case hex, from --sha256 or the URI's #sha256=HEX

    @property
    def identity(self) -> str:
        # Credentials in the URL stay out of the marker (and the logs); the query stays in, since it may
        # select what the server returns.
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))

    @property
    def display(self) -> str:
        return redacted(self.identity)

    @property
    def filename(self) -> str:
        name = unquote(urlsplit(self.url).path.rstrip("/").rsplit("/", 1)[-1])
        return name if name and name not in (".", "..") else "archive"


ModelUri = HfUri | S3Uri | GcsUri | HttpUri


def redacted(identity: str) -> str:
    """An identity as logs and errors show it: an http(s) URL loses its query string (a presigned URL's
    query is a credential)."""
    parts = urlsplit(identity)
    if parts.scheme not in ("http", "https") or not parts.query:
        return identity
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "…", ""))


def parse_uri(text: str, *, sha256: str | None = None) -> ModelUri:
    """The URI as a typed value; a UsageError says what is wrong with it. `sha256` is the --sha256 flag,
    which only http(s) archives take."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        raise UsageError(f"model URI {text!r} has no scheme; expected one of {SUPPORTED}")
    scheme = scheme.lower()
    if scheme == "pvc":
        raise UsageError(
            f"{text!r}: pvc:// models are mounted into the pod by the operator, not fetched; "
            "serve the mounted path with `chunkwise serve --model <mount path>`"
        )
    if sha256 is not None and scheme not in ("http", "https"):
        raise UsageError(f"--sha256 applies to http(s):// archives, not to {scheme}:// URIs")
    if scheme == "hf":
        return _parse_hf(text, rest)
    if scheme == "s3":
        bucket, prefix = _bucket_and_prefix(text, rest, _S3_BUCKET, "S3")
        return S3Uri(bucket, prefix)
    if scheme == "gs":
        bucket, prefix = _bucket_and_prefix(text, rest, _GCS_BUCKET, "GCS")
        return GcsUri(bucket, prefix)
    if scheme in ("http", "https"):
        return _parse_http(text, sha256)
    raise UsageError(f"unsupported scheme {scheme!r} in {text!r}; expected one of {SUPPORTED}")


def _parse_hf(text: str, rest: str) -> HfUri:
    repo, at, revision = rest.partition("@")
    repo = repo.strip("/")
    parts = repo.split("/")
    if len(parts) != 2:
        raise UsageError(f"{text!r}: a Hugging Face URI names a repo as org/name, e.g. hf://Qwen/Qwen3-0.6B")
    for part in parts:
        if not _HF_PART.match(part) or ".." in part or "--" in part:
            raise UsageError(f"{text!r}: {part!r} is not a valid Hugging Face org or repo name")
    if at and not revision:
        raise UsageError(f"{text!r}: empty revision after '@'")
    if revision and (revision.startswith("/") or ".." in revision or any(c.isspace() for c in revision)):
        raise UsageError(f"{text!r}: {revision!r} is not a valid revision (a branch, tag or commit)")
    return HfUri(repo, revision or HF_DEFAULT_REVISION)


def _bucket_and_prefix(text: str, rest: str, rule: re.Pattern[str], kind: str) -> tuple[str, str]:
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise UsageError(f"{text!r} names no bucket; expected {text.split(':', 1)[0]}://bucket/prefix")
    if not rule.match(bucket) or ".." in bucket:
        raise UsageError(f"{text!r}: {bucket!r} is not a valid {kind} bucket name")
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise UsageError(f"{text!r}: the prefix may not contain '.' or '..' components")
    # A prefix is a directory: "models/llama" must not also pick up "models/llama-70b/...".
    return bucket, "".join(f"{p}/" for p in parts)


def _parse_http(text: str, sha256: str | None) -> HttpUri:
    parts = urlsplit(text)
    if not parts.hostname:
        raise UsageError(f"{text!r} names no host")
    if not parts.path.strip("/"):
        raise UsageError(f"{text!r} names no archive (.tar, .tar.gz, .tgz, .tar.xz or .zip) to fetch")
    fragment_sum = None
    if parts.fragment:
        key, eq, value = parts.fragment.partition("=")
        if key != "sha256" or not eq:
            raise UsageError(f"{text!r}: the only fragment understood is #sha256=HEX, not #{parts.fragment}")
        fragment_sum = _checked_sha256(value, f"{text!r}'s #sha256")
    flag_sum = _checked_sha256(sha256, "--sha256") if sha256 is not None else None
    if fragment_sum and flag_sum and fragment_sum != flag_sum:
        raise UsageError(f"--sha256 {flag_sum} contradicts the URI's #sha256={fragment_sum}")
    url = urlunsplit((parts.scheme.lower(), parts.netloc, parts.path, parts.query, ""))
    return HttpUri(url, flag_sum or fragment_sum)


def _checked_sha256(value: str, what: str) -> str:
    value = value.strip().lower()
    if not _SHA256.match(value):
        raise UsageError(f"{what} must be 64 hexadecimal digits, got {value!r}")
    return value
