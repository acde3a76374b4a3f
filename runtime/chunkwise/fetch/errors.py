"""The two ways a fetch fails, so that the command can map them to exit codes (2 and 1)."""

from __future__ import annotations


class UsageError(Exception):
    """A bad URI, flag or flag combination: nothing was fetched (exit code 2)."""


class FetchError(Exception):
    """The fetch itself failed: unreachable source, refused credentials, checksum mismatch (exit code 1)."""


class TransientError(FetchError):
    """A failure worth retrying: a dropped connection, a timeout, HTTP 5xx/429. The retry loop resumes from
    the bytes already on disk; when retries run out it surfaces as the FetchError it is."""
