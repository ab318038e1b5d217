"""LRA release: resumable download over HTTP (Range), selective extraction, locating each task's folder."""

from __future__ import annotations

import hashlib
import http.server
import io
import tarfile
import threading
import time
from pathlib import Path

import pytest
from filelock import FileLock

from longmixer.data import lra_release as lra
from longmixer.data.download import DataDownloadError, Pin


def _release_tar() -> bytes:
    """A tiny lra_release.gz with the real nesting `lra_release/lra_release/<part>/...`."""
    files = {"listops-1000/basic_train.tsv": b"Source\tTarget\n( [MAX 2 9 ] )\t9\n",
             "tsv_data/new_aan_pairs.train.tsv": b"1.0\ta\tb\tx\ty\n",
             "pathfinder32/curv_contour_length_14/metadata/0.npy": b"imgs/0 sample_0.png 0 1\n"}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"lra_release/lra_release/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        # incompressible padding so the archive spans several download chunks
        pad = tarfile.TarInfo("lra_release/lra_release/pathfinder32/noise.bin")
        noise = bytes(hashlib.sha256(str(i).encode()).digest()[0] for i in range(50_000))
        pad.size = len(noise)
        tar.addfile(pad, io.BytesIO(noise))
    return buf.getvalue()


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    payload = b""
    requests: list = []

    def do_GET(self):  # noqa: N802 (http.server API)
        rng = self.headers.get("Range")
        type(self).requests.append(rng)
        start = int(rng.split("=")[1].split("-")[0]) if rng else 0
        body = self.payload[start:]
        self.send_response(206 if rng else 200)
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{len(self.payload) - 1}/{len(self.payload)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _RangeHandler.payload = _release_tar()
    _RangeHandler.requests = []
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _RangeHandler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/lra_release.gz", _RangeHandler
    httpd.shutdown()


def test_download_resumes_a_partial_file(tmp_path, server):
    url, handler = server
    dest = tmp_path / "lra_release.gz"
    (tmp_path / "lra_release.gz.part").write_bytes(handler.payload[:1000])
    lra.download(url, dest, chunk=4096)
    assert dest.read_bytes() == handler.payload
    assert handler.requests == ["bytes=1000-"]
    assert (tmp_path / "lra_release.gz.sha256").read_text().split()[0] == hashlib.sha256(handler.payload).hexdigest()
    assert not (tmp_path / "lra_release.gz.part").exists()


def test_download_with_wrong_size_keeps_the_partial_file(tmp_path, server):
    url, handler = server
    with pytest.raises(DataDownloadError, match=f"expected {len(handler.payload) + 10}"):
        lra.download(url, tmp_path / "x.gz", Pin(size=len(handler.payload) + 10))
    assert (tmp_path / "x.gz.part").exists() and not (tmp_path / "x.gz").exists()


def test_ensure_extracts_requested_parts_and_locates_tasks(tmp_path, server):
    url, handler = server
    found = lra.ensure_lra_release(tmp_path, parts=["listops-1000", "tsv_data"], url=url)
    release = tmp_path / "lra_release" / "lra_release"
    assert found == {"listops-1000": release, "tsv_data": release}
    assert (lra.listops_dir(release) / "basic_train.tsv").read_bytes().startswith(b"Source\tTarget")
    assert (lra.aan_dir(release) / "new_aan_pairs.train.tsv").exists()
    assert not (release / "pathfinder32").exists()  # not requested, not extracted
    with pytest.raises(FileNotFoundError, match="pathfinder32"):
        lra.pathfinder_dir(release, 32, "curv_contour_length_14")
    # a second call finds the extracted parts and downloads nothing
    n_requests = len(handler.requests)
    assert lra.ensure_lra_release(tmp_path, parts=["tsv_data"], url=url) == {"tsv_data": release}
    assert len(handler.requests) == n_requests
    # a new part is extracted from the archive already on disk
    lra.ensure_lra_release(tmp_path, parts=["pathfinder32"], url=url)
    assert len(handler.requests) == n_requests
    assert lra.pathfinder_dir(release, 32, "curv_contour_length_14").is_dir()


def test_a_release_extracted_by_hand_is_used_as_is(tmp_path):
    (tmp_path / "mine" / "listops-1000").mkdir(parents=True)
    assert lra.ensure_lra_release(tmp_path, parts=["listops-1000"], url="http://127.0.0.1:9/none") == \
        {"listops-1000": tmp_path / "mine"}


def test_unknown_part_is_rejected(tmp_path, server):
    url, _ = server
    with pytest.raises(ValueError, match="pathfinder512"):
        lra.ensure_lra_release(tmp_path, parts=["pathfinder512"], url=url)


def test_listops_official_mode_reads_the_release(tmp_path, server):
    """ListOps calls `ensure_lra_release(data_dir / "lra_release", ["listops-1000"])["listops-1000"]`."""
    url, _ = server
    release = lra.ensure_lra_release(tmp_path / "lra_release", ["listops-1000"], url=url)["listops-1000"]
    assert Path(release / "listops-1000" / "basic_train.tsv").exists()


def test_an_extraction_cut_short_is_redone(tmp_path, server):
    """A killed extraction leaves the part's folders (and a cut file) without its `.extracted-<part>` marker and
    with `.extracting-<part>`: the next call unpacks the part again instead of taking the folders as a release
    unpacked by hand."""
    url, _ = server
    release = lra.ensure_lra_release(tmp_path, parts=["listops-1000"], url=url)["listops-1000"]
    train = lra.listops_dir(release) / "basic_train.tsv"
    whole = train.read_bytes()
    train.write_bytes(whole[: len(whole) // 3])  # what the kill left
    (tmp_path / ".extracted-listops-1000").unlink()
    (tmp_path / ".extracting-listops-1000").touch()
    assert lra.ensure_lra_release(tmp_path, parts=["listops-1000"], url=url) == {"listops-1000": release}
    assert train.read_bytes() == whole
    assert (tmp_path / ".extracted-listops-1000").exists() and not (tmp_path / ".extracting-listops-1000").exists()


def test_a_run_waits_for_another_runs_extraction(tmp_path):
    """Two settings sharing `lra_release/` (pathfinder at difficulties 9 and 14, or listops beside retrieval) each
    unpacked into it at once: one deleted the other's `.extracting-<part>` marker ("No such file or directory") or
    read its half-written files. A run now waits on `lra_release/.lock` while another extracts, then uses its
    result without downloading or unpacking anything itself (the address below answers nothing)."""
    marker = tmp_path / ".extracting-listops-1000"
    marker.touch()  # another run is extracting the part, and holds the lock
    other = FileLock(str(tmp_path / ".lock"))
    other.acquire()
    outcome = {}

    def run():
        try:
            outcome["found"] = lra.ensure_lra_release(tmp_path, ["listops-1000"], url="http://127.0.0.1:9/none")
        except Exception as err:  # noqa: BLE001 (reported by the assertion below)
            outcome["error"] = err

    waiting = threading.Thread(target=run)
    waiting.start()
    time.sleep(0.5)
    assert waiting.is_alive() and marker.exists() and not outcome
    (tmp_path / "lra_release" / "listops-1000").mkdir(parents=True)  # the other run finishes its extraction
    (tmp_path / ".extracted-listops-1000").write_text("lra_release\n")
    marker.unlink()
    other.release()
    waiting.join(10)
    assert outcome == {"found": {"listops-1000": tmp_path / "lra_release"}}


def test_parts_at_different_nestings_are_each_found(tmp_path, server):
    """`tsv_data/` unpacked by hand directly in `lra_release/` while the archive put `listops-1000/` two levels
    down: the first folder holding any part was taken for the whole release, so listops was looked for beside
    tsv_data (and never found) on every run. Each part is now looked up on its own."""
    url, handler = server
    (tmp_path / "tsv_data").mkdir()
    assert lra.ensure_lra_release(tmp_path, ["tsv_data"], url=url) == {"tsv_data": tmp_path}
    assert handler.requests == []
    deep = tmp_path / "lra_release" / "lra_release"
    assert lra.ensure_lra_release(tmp_path, ["listops-1000"], url=url) == {"listops-1000": deep}
    assert (lra.listops_dir(deep) / "basic_train.tsv").exists()
    n_requests = len(handler.requests)
    assert lra.ensure_lra_release(tmp_path, ["listops-1000", "tsv_data"], url=url) == \
        {"listops-1000": deep, "tsv_data": tmp_path}
    assert len(handler.requests) == n_requests


def test_a_byte_flipped_inside_a_member_stops_the_extraction(tmp_path):
    """Regression: tar stops reading at its end-of-archive blocks, short of the gzip trailer, so gzip's CRC32 check
    never ran, and a byte flipped in the first download (no checksum is published: the sha256 recorded beside it is
    the damaged file's) was unpacked as if it were the release's. The stream is now read to its end: the flip stops
    the extraction with one line naming the archive, its record and the fix, and the part is redone next time."""
    data = b"( [MAX 2 9 ] )\t9\n" * 100
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=0) as tar:  # stored blocks: the member's bytes as is
        info = tarfile.TarInfo("lra_release/listops-1000/basic_train.tsv")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    flipped = bytearray(buf.getvalue())
    flipped[flipped.index(b"MAX", 800)] ^= 0x20  # one "MAX" -> "mAX", inside the compressed payload
    archive = tmp_path / "release" / "lra_release.gz"
    archive.parent.mkdir()
    archive.write_bytes(flipped)
    record = archive.with_name("lra_release.gz.sha256")
    record.write_text(f"{hashlib.sha256(flipped).hexdigest()}  lra_release.gz\n")  # taken at the first download
    with tarfile.open(archive) as plain:  # tar alone takes it for a good archive
        plain.extractall(tmp_path / "plain", filter="data")
    assert (tmp_path / "plain" / "lra_release" / "listops-1000" / "basic_train.tsv").read_bytes().count(b"mAX") == 1
    with pytest.raises(DataDownloadError, match="CRC check failed") as caught:
        lra.ensure_lra_release(archive.parent, ["listops-1000"], url="http://127.0.0.1:9/none")
    assert "\n" not in str(caught.value)
    assert f"delete {archive} and its sha256 record {record} and run the same command again" in str(caught.value)
    assert (archive.parent / ".extracting-listops-1000").exists()
