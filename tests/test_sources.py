"""Named datasets against a local HTTP server: `pytest tests/test_sources.py`.

The server speaks just enough HTTP/1.1 for the downloader: full GETs and `Range: bytes=N-`
(206), and it records the Range headers it saw so the resume test can check one was sent.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ncfcli.cli import app
from ncfcli.data import sources
from ncfcli.data.sources import RemoteDataset, fetch
from ncfcli.errors import NcfError

U_DATA = "1\t10\t5\t100\n1\t20\t3\t200\n2\t10\t4\t50\n2\t30\t1\t60\n3\t40\t2\t7\n3\t10\t2\t8\n"


def tiny_zip() -> bytes:
    buf = io.BytesIO()
    # Fixed entry times: a name alone stamps the current time, and the MD5 must not change.
    with zipfile.ZipFile(buf, "w") as zf:
        readme = zipfile.ZipInfo("ml-tiny/README", (2020, 1, 1, 0, 0, 0))
        zf.writestr(readme, "x" * 5000)  # some bulk so a resume has something to skip
        zf.writestr(zipfile.ZipInfo("ml-tiny/u.data", (2020, 1, 1, 0, 0, 0)), U_DATA)
    return buf.getvalue()


class _Handler(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    ranges: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (the http.server API)
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        start = 0
        rng = self.headers.get("Range")
        if rng:
            self.ranges.append(rng)
            start = int(rng.split("=")[1].split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        self.wfile.write(body[start:])

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Handler.files = {"/ml-tiny.zip": tiny_zip(), "/other.zip": b"PK\x03\x04 not the real one"}
    _Handler.ranges = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def table(base: str, path: str = "/ml-tiny.zip", md5: str | None = None) -> dict:
    md5 = md5 or hashlib.md5(tiny_zip()).hexdigest()
    return {"ml-tiny": RemoteDataset(base + path, md5, "ml-tiny/u.data")}


def test_download_verifies_and_caches(server: str, tmp_path: Path) -> None:
    got = fetch("ml-tiny", tmp_path, quiet=True, table=table(server))
    assert got == tmp_path / "downloads" / "ml-tiny.zip"
    assert got.read_bytes() == tiny_zip()
    assert not got.with_name("ml-tiny.zip.part").exists()
    # Second call: taken from the cache, no request needed even with the server gone.
    again = fetch("ml-tiny", tmp_path, quiet=True, table=table("http://127.0.0.1:9"))
    assert again == got


def test_download_resumes_from_part_file(server: str, tmp_path: Path) -> None:
    part = tmp_path / "downloads" / "ml-tiny.zip.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(tiny_zip()[:3000])
    got = fetch("ml-tiny", tmp_path, quiet=True, table=table(server))
    assert _Handler.ranges == ["bytes=3000-"]
    assert got.read_bytes() == tiny_zip()


def test_checksum_mismatch_leaves_nothing(server: str, tmp_path: Path) -> None:
    with pytest.raises(NcfError, match="expected 0+; the file was deleted"):
        fetch("ml-tiny", tmp_path, quiet=True, table=table(server, md5="0" * 32))
    assert list((tmp_path / "downloads").iterdir()) == []


def test_bad_zip_in_cache_is_reported(tmp_path: Path) -> None:
    target = tmp_path / "downloads" / "ml-tiny.zip"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"truncated")
    with pytest.raises(NcfError, match="has MD5 .* delete it"):
        fetch("ml-tiny", tmp_path, quiet=True, table=table("http://127.0.0.1:9"))


def test_offline_says_what_to_put_where(tmp_path: Path) -> None:
    spec = table("http://127.0.0.1:9")  # port 9 (discard) is closed: connection refused
    with pytest.raises(NcfError) as e:
        fetch("ml-tiny", tmp_path, quiet=True, table=spec, timeout=2)
    msg = str(e.value)
    assert "http://127.0.0.1:9/ml-tiny.zip" in msg
    assert str(tmp_path / "downloads" / "ml-tiny.zip") in msg and "\n" not in msg


def test_http_404_is_one_line(server: str, tmp_path: Path) -> None:
    with pytest.raises(NcfError, match="HTTP 404"):
        fetch("ml-tiny", tmp_path, quiet=True, table=table(server, path="/missing.zip"))


def test_prepare_by_name_end_to_end(
    server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "DATASETS", table(server))
    monkeypatch.chdir(tmp_path)  # a folder named ml-tiny here would be read as a path
    args = ["prepare", "ml-tiny", "--cache-dir", str(tmp_path / "c"), "--eval-negatives", "1",
            "--device", "cpu", "--json", "-q"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["out"] == str(tmp_path / "c" / "ml-tiny")
    assert (got["n_users"], got["n_items"], got["n_train"]) == (3, 4, 3)
    meta = json.loads((tmp_path / "c" / "ml-tiny" / "meta.json").read_text())
    assert (
        meta["source"]["kind"] == "dataset"
        and meta["source"]["md5"] == table(server)["ml-tiny"].md5
    )
    # Second run reads the extracted file from the cache.
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output


def test_prepare_by_name_bad_checksum(
    server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "DATASETS", table(server, md5="f" * 32))
    res = CliRunner().invoke(app, ["prepare", "ml-tiny", "--cache-dir", str(tmp_path), "-q"])
    assert res.exit_code != 0
    assert res.stderr.startswith("error: ") and "expected ffff" in res.stderr
    assert not (tmp_path / "ml-tiny").exists()
    assert list((tmp_path / "downloads").iterdir()) == []


def test_cache_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NCF_CACHE_DIR", str(tmp_path))
    assert sources.cache_dir() == tmp_path
    assert sources.cache_dir(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("NCF_CACHE_DIR")
    assert "ncfcli" in str(sources.cache_dir())


def test_published_table_is_complete() -> None:
    assert set(sources.DATASETS) == {"ml-100k", "ml-1m", "ml-10m", "ml-20m", "ml-25m"}
    for spec in sources.DATASETS.values():
        assert spec.url.startswith("https://files.grouplens.org/") and len(spec.md5) == 32
