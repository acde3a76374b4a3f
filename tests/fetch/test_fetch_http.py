"""`chunkwise fetch-model` with http(s):// archives, against a real HTTP server on loopback; and what every
source shares: resume, the marker, the lock, exit codes."""

from __future__ import annotations

import hashlib
import io
import json
import signal
import tarfile
import time
import zipfile

import pytest

from chunkwise.fetch.errors import FetchError, UsageError
from chunkwise.fetch.select import Selection
from chunkwise.fetch.state import MARKER_NAME, PARTIAL_DIR
from chunkwise.fetch.uri import GcsUri, HfUri, HttpUri, S3Uri, parse_uri
from tests.fetch.fetch_servers import (
    Loopback,
    cli,
    cli_popen,
    fetch,
    model_files,
    serving,
    tar_gz,
    tree,
    zip_bytes,
)

FILES = model_files()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_archive_is_extracted_verified_and_its_top_directory_stripped(tmp_path, kind):
    data = tar_gz(FILES) if kind == "tar.gz" else zip_bytes(FILES)
    with serving(Loopback(files={f"/m/model.{kind}": data})) as srv:
        out = fetch(f"{srv.url}/m/model.{kind}#sha256={_sha(data)}", tmp_path / "m")
    assert tree(tmp_path / "m") == FILES  # config.json directly in DIR
    marker = json.loads((tmp_path / "m" / MARKER_NAME).read_text())
    assert marker["uri"] == f"{srv.url}/m/model.{kind}" and marker["mode"] == "full"
    assert marker["revision"] == _sha(data)
    assert {f["path"]: f["digest"] for f in marker["files"]} == {p: _sha(d) for p, d in FILES.items()}
    assert not out.already_fetched and not (tmp_path / "m" / PARTIAL_DIR).exists()


def test_archive_kind_comes_from_the_content_type_or_the_bytes(tmp_path):
    data = tar_gz(FILES)
    with serving(Loopback(files={"/dl": data}, content_types={"/dl": "application/gzip"})) as srv:
        fetch(f"{srv.url}/dl", tmp_path / "a")
    assert tree(tmp_path / "a") == FILES
    with serving(Loopback(files={"/download": zip_bytes(FILES, top="")})) as srv:
        fetch(f"{srv.url}/download", tmp_path / "b")
    assert tree(tmp_path / "b") == FILES  # no top directory to strip


def test_a_wrong_sha256_fails_loudly_and_leaves_no_file(tmp_path):
    data = tar_gz(FILES)
    with serving(Loopback(files={"/model.tgz": data})) as srv:
        out = cli(f"{srv.url}/model.tgz", str(tmp_path / "m"), "--sha256", "0" * 64)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert "sha256 mismatch" in last and _sha(data) in last and "0" * 64 in last
    left = [p for p in (tmp_path / "m").rglob("*") if p.is_file() and p.name != ".chunkwise-fetch.lock"]
    assert [p.name for p in left] == ["journal.json"]  # no archive, no part, no extracted file, no marker


def _tar_with(member: tarfile.TarInfo) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        ok = tarfile.TarInfo("config.json")
        ok.size = 2
        tf.addfile(ok, io.BytesIO(b"{}"))
        tf.addfile(member, io.BytesIO(b"evil") if member.isfile() else None)
    return buf.getvalue()


def _member(name: str, type_: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.size = type_, link, 4 if type_ == tarfile.REGTYPE else 0
    return ti


@pytest.mark.parametrize(
    ("member", "reason"),
    [
        (_member("../evil"), "outside"),
        (_member("/tmp/evil-abs"), "outside"),
        (_member("a/../../evil"), "outside"),
        (_member("link", tarfile.SYMTYPE, "../../etc/passwd"), "outside"),
        (_member("link", tarfile.SYMTYPE, "/etc/passwd"), "absolute"),
        (_member("hard", tarfile.LNKTYPE, "../evil"), "outside"),
        (_member("dev", tarfile.CHRTYPE), "device"),
    ],
)
def test_an_archive_member_escaping_dir_refuses_the_archive(tmp_path, member, reason):
    with serving(Loopback(files={"/bad.tar.gz": _tar_with(member)})) as srv, pytest.raises(FetchError) as e:
        fetch(f"{srv.url}/bad.tar.gz", tmp_path / "d" / "m")
    assert "refusing" in str(e.value) and reason in str(e.value)
    assert not (tmp_path / "d" / "evil").exists() and not (tmp_path / "d" / "m" / "config.json").exists()
    assert not (tmp_path / "d" / "m" / MARKER_NAME).exists()


def test_a_zip_member_escaping_dir_is_refused(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("config.json", "{}")
        zf.writestr("../evil", "x")
    with (
        serving(Loopback(files={"/bad.zip": buf.getvalue()})) as srv,
        pytest.raises(FetchError, match="outside"),
    ):
        fetch(f"{srv.url}/bad.zip", tmp_path / "m")
    assert not (tmp_path / "evil").exists() and not (tmp_path / "m" / "config.json").exists()


def test_links_inside_the_archive_become_copies(tmp_path):
    link = _member("tiny-model/tokenizer.model", tarfile.SYMTYPE, "extra/notes.txt")
    with serving(Loopback(files={"/m.tgz": tar_gz(FILES, extra=[link])})) as srv:
        fetch(f"{srv.url}/m.tgz", tmp_path / "m")
    got = tmp_path / "m" / "tokenizer.model"
    assert not got.is_symlink() and got.read_bytes() == FILES["extra/notes.txt"]


def test_tokenizer_only_extracts_only_the_tokenizer_files(tmp_path):
    with serving(Loopback(files={"/m.tgz": tar_gz(FILES)})) as srv:
        out = fetch(f"{srv.url}/m.tgz", tmp_path / "m", selection=Selection(tokenizer_only=True))
    assert set(tree(tmp_path / "m")) == {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    assert out.marker.mode == "tokenizer-only"


def test_a_dropped_download_resumes_on_the_next_run_with_a_range(tmp_path):
    data = tar_gz(model_files(weights_bytes=600_000))
    cut = 150_000
    with serving(Loopback(files={"/m.tgz": data}, drop_after={"/m.tgz": cut})) as srv:
        with pytest.raises(FetchError, match="giving up after 0 retries"):
            fetch(f"{srv.url}/m.tgz#sha256={_sha(data)}", tmp_path / "m", retries=0)
        part = tmp_path / "m" / PARTIAL_DIR / "m.tgz.part"
        assert part.stat().st_size == cut
        fetch(f"{srv.url}/m.tgz#sha256={_sha(data)}", tmp_path / "m")
    assert [r.range for r in srv.gets("/m.tgz")] == [None, f"bytes={cut}-"]
    assert tree(tmp_path / "m") == model_files(weights_bytes=600_000)


def test_a_dropped_connection_is_retried_within_the_run(tmp_path):
    data = tar_gz(FILES)
    with serving(Loopback(files={"/m.tgz": data}, drop_after={"/m.tgz": 50_000})) as srv:
        fetch(f"{srv.url}/m.tgz#sha256={_sha(data)}", tmp_path / "m", retries=2)
    assert [r.range for r in srv.gets("/m.tgz")] == [None, "bytes=50000-"]
    assert tree(tmp_path / "m") == FILES


def test_a_server_ignoring_range_is_restarted_from_zero(tmp_path):
    data = tar_gz(FILES)
    with serving(Loopback(files={"/m.tgz": data}, drop_after={"/m.tgz": 40_000})) as srv:
        with pytest.raises(FetchError):
            fetch(f"{srv.url}/m.tgz", tmp_path / "m")
        srv.ignore_range = True
        fetch(f"{srv.url}/m.tgz#sha256={_sha(data)}", tmp_path / "m")
    assert srv.gets("/m.tgz")[-1].range == "bytes=40000-"  # asked, got a 200 from byte 0
    assert tree(tmp_path / "m") == FILES


def test_a_killed_fetch_resumes_from_the_bytes_on_disk(tmp_path):
    files = model_files(weights_bytes=3_000_000)
    data = tar_gz(files)
    dest = tmp_path / "m"
    part = dest / PARTIAL_DIR / "m.tgz.part"
    with serving(Loopback(files={"/m.tgz": data}, bytes_per_second=4_000_000)) as srv:
        proc = cli_popen(f"{srv.url}/m.tgz", str(dest))
        deadline = time.monotonic() + 20
        while not (part.exists() and part.stat().st_size > 200_000):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        on_disk = part.stat().st_size
        assert 0 < on_disk < len(data)
        srv.bytes_per_second = None
        fetch(f"{srv.url}/m.tgz#sha256={_sha(data)}", dest)
    assert srv.gets("/m.tgz")[-1].range == f"bytes={on_disk}-"
    assert tree(dest) == files


def test_a_second_run_is_a_no_op_and_another_uri_is_refused_unless_forced(tmp_path):
    other = model_files(seed=1)
    with serving(Loopback(files={"/a.tgz": tar_gz(FILES), "/b.tgz": tar_gz(other)})) as srv:
        fetch(f"{srv.url}/a.tgz", tmp_path / "m")
        again = cli(f"{srv.url}/a.tgz", str(tmp_path / "m"))
        assert again.returncode == 0 and "already fetched" in again.stderr
        assert len(srv.gets("/a.tgz")) == 1
        # A full model also serves a tokenizer-only request.
        assert fetch(
            f"{srv.url}/a.tgz", tmp_path / "m", selection=Selection(tokenizer_only=True)
        ).already_fetched
        with pytest.raises(FetchError, match="refusing to mix two models"):
            fetch(f"{srv.url}/b.tgz", tmp_path / "m")
        assert tree(tmp_path / "m") == FILES
        fetch(f"{srv.url}/b.tgz", tmp_path / "m", force=True)
    assert tree(tmp_path / "m") == other
    assert len(srv.gets("/a.tgz")) == 1


def test_a_tokenizer_only_dir_is_not_taken_for_the_full_model(tmp_path):
    with serving(Loopback(files={"/a.tgz": tar_gz(FILES)})) as srv:
        fetch(f"{srv.url}/a.tgz", tmp_path / "m", selection=Selection(tokenizer_only=True))
        out = fetch(f"{srv.url}/a.tgz", tmp_path / "m")
    assert not out.already_fetched and out.marker.mode == "full"
    assert tree(tmp_path / "m") == FILES


def test_concurrent_fetches_into_one_dir_download_once(tmp_path):
    import fcntl
    import os
    import subprocess
    import sys

    files = model_files(weights_bytes=1_000_000)
    dest = tmp_path / "m"
    dest.mkdir()
    logs = [tmp_path / f"fetch{i}.log" for i in range(2)]
    with serving(Loopback(files={"/m.tgz": tar_gz(files)}, bytes_per_second=5_000_000)) as srv:
        # Hold the lock as a third replica would, until both fetches say they wait: no race on start-up.
        with open(dest / ".chunkwise-fetch.lock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            procs = []
            for log in logs:
                with open(log, "w") as err:
                    cmd = [
                        sys.executable,
                        "-m",
                        "chunkwise.cli",
                        "fetch-model",
                        f"{srv.url}/m.tgz",
                        str(dest),
                    ]
                    procs.append(subprocess.Popen(cmd, stderr=err, env=os.environ.copy()))
            deadline = time.monotonic() + 30
            while not all("waiting for it" in log.read_text() for log in logs):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
                time.sleep(0.05)
        codes = [p.wait(timeout=60) for p in procs]
    stderrs = [log.read_text() for log in logs]
    assert codes == [0, 0], stderrs
    assert len(srv.gets("/m.tgz")) == 1
    assert sum("already fetched" in err for err in stderrs) == 1
    assert tree(dest) == files


@pytest.mark.parametrize(
    ("uri", "reason"),
    [
        ("ftp://x", "unsupported scheme 'ftp'"),
        ("hf://onlyorg", "org/name"),
        ("s3://", "names no bucket"),
        ("pvc://c/p", "mounted into the pod by the operator"),
        ("just-a-name", "no scheme"),
        ("https://example.com/m.tgz#md5=abc", "#sha256=HEX"),
    ],
)
def test_a_bad_uri_exits_2_naming_the_problem(tmp_path, uri, reason):
    out = cli(uri, str(tmp_path / "m"))
    assert out.returncode == 2
    assert reason in out.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "m").exists()


def test_uri_parsing():
    assert parse_uri("hf://Qwen/Qwen3-0.6B") == HfUri("Qwen/Qwen3-0.6B", "main")
    assert parse_uri("hf://org/name@refs/pr/1").identity == "hf://org/name@refs/pr/1"
    assert parse_uri("s3://bucket/models/llama") == S3Uri("bucket", "models/llama/")
    assert parse_uri("s3://bucket") == S3Uri("bucket", "")
    assert parse_uri("gs://my_bucket/a//b/") == GcsUri("my_bucket", "a/b/")
    u = parse_uri("https://user:pw@host:8443/x/m.tgz?sig=1#sha256=" + "A" * 64)
    assert u == HttpUri("https://user:pw@host:8443/x/m.tgz?sig=1", "a" * 64)
    assert isinstance(u, HttpUri) and u.identity == "https://host:8443/x/m.tgz?sig=1"
    assert u.display == "https://host:8443/x/m.tgz?…" and u.filename == "m.tgz"
    for bad in (
        "hf://a/b/c",
        "hf://org/na me",
        "hf://org/name@",
        "s3://Bad_Bucket/x",
        "s3://b/../x",
        "https://host/",
    ):
        with pytest.raises(UsageError):
            parse_uri(bad)
    with pytest.raises(UsageError, match="--sha256 applies to http"):
        parse_uri("s3://bucket/x", sha256="0" * 64)
    with pytest.raises(UsageError, match="contradicts"):
        parse_uri("https://h/m.tgz#sha256=" + "a" * 64, sha256="b" * 64)


def test_the_failure_reaches_the_termination_log(tmp_path, monkeypatch):
    from chunkwise.cli import main
    from chunkwise.fetch import args as fetch_args

    log_path = tmp_path / "termination-log"
    log_path.write_text("")
    monkeypatch.setattr(fetch_args, "TERMINATION_LOG", log_path)
    with serving(Loopback()) as srv:
        code = main(["fetch-model", f"{srv.url}/missing.tgz", str(tmp_path / "m"), "--retries", "0"])
    assert code == 1
    message = log_path.read_text()
    assert message.startswith("fetch-model failed:") and "HTTP 404" in message and "\n" not in message


def test_the_command_imports_neither_torch_nor_boto3_for_an_archive(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from chunkwise.cli import main; rc = main(sys.argv[1:]); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'boto3', 'botocore'))); "
        "sys.exit(rc)"
    )
    with serving(Loopback(files={"/m.tgz": tar_gz(FILES)})) as srv:
        out = subprocess.run(
            [sys.executable, "-c", code, "fetch-model", f"{srv.url}/m.tgz", str(tmp_path / "m")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_fetched_checkpoint_is_what_the_engine_loads(tmp_path):
    from chunkwise import LLM, SamplingParams
    from tests.hf_models import save_random_llama

    src = save_random_llama(tmp_path / "src", "gqa")
    files = {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    with serving(Loopback(files={"/llama.tar.gz": tar_gz(files, top="llama-gqa")})) as srv:
        fetch(f"{srv.url}/llama.tar.gz", tmp_path / "m")
    # The fetch's own state (marker, lock) beside the checkpoint does not disturb the loader.
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = LLM(model=str(tmp_path / "m"), dtype="float32").generate([[5, 6, 7, 8]], params)
    assert len(out[0].outputs[0].token_ids) == 4
