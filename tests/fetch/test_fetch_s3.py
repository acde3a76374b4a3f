"""`chunkwise fetch-model s3://...` against moto's S3 server on loopback (AWS_ENDPOINT_URL): every object
under the prefix, plain ETags verified as MD5, multipart ETags by size, and a resumed part fetched with a
range."""

from __future__ import annotations

import hashlib
import json

import pytest

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

from chunkwise.fetch.state import PARTIAL_DIR  # noqa: E402
from tests.fetch.fetch_servers import fetch, model_files, tree  # noqa: E402

BUCKET = "models"
FILES = {**model_files(), "sub/dir/nested.bin": b"nested" * 1000}
MIB = 1 << 20


@pytest.fixture(scope="module")
def s3_endpoint():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch, tmp_path):
    for k, v in {
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
    }.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    yield client
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=obj["Key"])
    client.delete_bucket(Bucket=BUCKET)


def _upload(client, prefix: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        client.put_object(Bucket=BUCKET, Key=prefix + name, Body=data)


def _get_object_ranges(monkeypatch) -> list[str | None]:
    """The Range header of every GetObject the fetch sends, read from botocore's own request events."""
    ranges: list[str | None] = []
    real_client = boto3.client

    def client(*args, **kwargs):
        c = real_client(*args, **kwargs)
        c.meta.events.register(
            "before-send.s3.GetObject",
            lambda request, **_: ranges.append(_text(request.headers.get("Range"))),
        )
        return c

    monkeypatch.setattr(boto3, "client", client)
    return ranges


def test_every_object_under_the_prefix_is_fetched_and_its_etag_verified(tmp_path, s3, monkeypatch):
    _upload(s3, "llama/tiny/", FILES)
    _upload(s3, "llama/tiny-other/", {"config.json": b"{}"})  # shares the prefix's text, not its directory
    s3.put_object(Bucket=BUCKET, Key="llama/tiny/empty-dir/", Body=b"")  # a console's "folder"
    # A multipart upload: its ETag is no MD5, so only the size can be checked.
    big = hashlib.sha256(b"x").digest() * (6 * MIB // 32)
    mpu = s3.create_multipart_upload(Bucket=BUCKET, Key="llama/tiny/big.safetensors")
    parts = []
    for n, chunk in enumerate((big[: 5 * MIB], big[5 * MIB :]), start=1):
        r = s3.upload_part(
            Bucket=BUCKET,
            Key="llama/tiny/big.safetensors",
            UploadId=mpu["UploadId"],
            PartNumber=n,
            Body=chunk,
        )
        parts.append({"ETag": r["ETag"], "PartNumber": n})
    s3.complete_multipart_upload(
        Bucket=BUCKET,
        Key="llama/tiny/big.safetensors",
        UploadId=mpu["UploadId"],
        MultipartUpload={"Parts": parts},
    )
    ranges = _get_object_ranges(monkeypatch)
    out = fetch(f"s3://{BUCKET}/llama/tiny", tmp_path / "m")
    assert tree(tmp_path / "m") == {**FILES, "big.safetensors": big}
    sums = {f.path: (f.algo, f.digest, f.verified) for f in out.marker.files}
    assert sums["sub/dir/nested.bin"] == ("md5", hashlib.md5(FILES["sub/dir/nested.bin"]).hexdigest(), True)
    assert sums["big.safetensors"][2] is False  # multipart: size only
    assert ranges == [None] * (len(FILES) + 1)
    assert out.marker.revision.startswith("etags-sha256:")


def test_a_partial_object_resumes_with_a_range(tmp_path, s3, monkeypatch):
    _upload(s3, "m/", FILES)
    data = FILES["model.safetensors"]
    etag = hashlib.md5(data).hexdigest()
    # What a fetch killed mid-file leaves behind: the first bytes, and the version they belong to.
    partial = tmp_path / "m" / PARTIAL_DIR
    partial.mkdir(parents=True)
    (partial / "model.safetensors.part").write_bytes(data[:70_000])
    (partial / "model.safetensors.part.json").write_text(json.dumps({"version": etag}))
    (partial / "journal.json").write_text(json.dumps({"uri": f"s3://{BUCKET}/m/", "files": {}}))
    ranges = _get_object_ranges(monkeypatch)
    fetch(f"s3://{BUCKET}/m/", tmp_path / "m", selection=_only("model.safetensors"))
    assert ranges == ["bytes=70000-"]
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == data


def test_a_part_of_an_overwritten_object_is_discarded(tmp_path, s3, monkeypatch):
    _upload(s3, "m/", FILES)
    partial = tmp_path / "m" / PARTIAL_DIR
    partial.mkdir(parents=True)
    (partial / "model.safetensors.part").write_bytes(b"bytes of an older version")
    (partial / "model.safetensors.part.json").write_text(json.dumps({"version": "0" * 32}))
    ranges = _get_object_ranges(monkeypatch)
    fetch(f"s3://{BUCKET}/m", tmp_path / "m", selection=_only("model.safetensors"))
    assert ranges == [None]
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == FILES["model.safetensors"]


def test_a_missing_bucket_is_a_clear_failure(tmp_path, s3):
    from chunkwise.fetch.errors import FetchError

    with pytest.raises(FetchError, match="NoSuchBucket"):
        fetch("s3://no-such-bucket/x", tmp_path / "m")


def _text(value: str | bytes | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _only(*globs: str):
    from chunkwise.fetch.select import Selection

    return Selection(includes=globs)
