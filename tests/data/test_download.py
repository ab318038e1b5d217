"""Downloads: pinned sizes and digests, cut transfers without Content-Length, re-checked files on reuse, https only,
one-line errors, and progress that logs when stderr is not a terminal."""

from __future__ import annotations

import hashlib
import http.server
import logging
import os
import threading

import pytest

from longmixer.data import download as dl
from longmixer.data.download import DataDownloadError, Pin

PAYLOAD = bytes(hashlib.sha256(str(i).encode()).digest()[0] for i in range(20_000))


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves PAYLOAD (416 for a range past its end); `cut` < 1 sends only that fraction of it with no
    Content-Length, then closes."""

    cut = 1.0
    requests: list = []

    def do_GET(self):  # noqa: N802 (http.server API)
        rng = self.headers.get("Range")
        type(self).requests.append(rng)
        start = int(rng.split("=")[1].split("-")[0]) if rng else 0
        if start >= len(PAYLOAD):  # what servers (GCS among them) answer a range past the end
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(PAYLOAD)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = PAYLOAD[start:]
        self.send_response(206 if rng else 200)
        if self.cut < 1.0:
            body = body[:int(len(PAYLOAD) * self.cut)]
            self.send_header("Connection", "close")
        else:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _Handler.cut, _Handler.requests = 1.0, []
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/file.bin"
    httpd.shutdown()


def test_cut_transfer_without_content_length_is_not_accepted(tmp_path, server):
    _Handler.cut = 0.4
    with pytest.raises(DataDownloadError, match="sends no Content-Length and no size is pinned"):
        dl.download(server, tmp_path / "file.bin")
    assert not (tmp_path / "file.bin").exists()


def test_cut_transfer_with_a_pinned_size_resumes(tmp_path, server):
    _Handler.cut = 0.4
    pin = Pin(size=len(PAYLOAD), sha256=hashlib.sha256(PAYLOAD).hexdigest())
    with pytest.raises(DataDownloadError, match=f"stopped at 8000 of {len(PAYLOAD)} bytes; run the same command"):
        dl.download(server, tmp_path / "file.bin", pin)
    assert (tmp_path / "file.bin.part").stat().st_size == 8000 and not (tmp_path / "file.bin").exists()
    _Handler.cut = 1.0
    assert dl.download(server, tmp_path / "file.bin", pin).read_bytes() == PAYLOAD
    assert _Handler.requests[-1] == "bytes=8000-"


@pytest.mark.parametrize("pinned", ["sha256", "nothing"])
def test_a_whole_partial_file_is_checked_and_kept_not_deleted(tmp_path, server, pinned):
    """Regression: a run stopped after the last byte arrived but before the file took its name (Speech Commands'
    2.3 GB archive is hashed against its sha256 pin in between) left a whole `.part`; the rerun's range request
    got 416 and the error said the server "states no size" (it sends `bytes */<size>`) and told the user to delete
    the download. The whole partial file is now checked like a fresh one and takes its name, with no transfer."""
    pin = Pin(sha256=hashlib.sha256(PAYLOAD).hexdigest()) if pinned == "sha256" else Pin()
    (tmp_path / "file.bin.part").write_bytes(PAYLOAD)
    assert dl.download(server, tmp_path / "file.bin", pin).read_bytes() == PAYLOAD
    assert _Handler.requests == [f"bytes={len(PAYLOAD)}-"] and not (tmp_path / "file.bin.part").exists()
    assert (tmp_path / "file.bin.sha256").read_text().split()[0] == hashlib.sha256(PAYLOAD).hexdigest()
    (tmp_path / "bad.bin.part").write_bytes(PAYLOAD[:-1] + b"\x00")  # whole in size, damaged: named, not taken
    if pinned == "sha256":
        with pytest.raises(DataDownloadError, match=f"{tmp_path / 'bad.bin.part'} has sha256 .*; delete"):
            dl.download(server, tmp_path / "bad.bin", pin)
        assert not (tmp_path / "bad.bin").exists()


@pytest.mark.parametrize("pin", [Pin(size=len(PAYLOAD)), Pin()], ids=["size-pinned", "unpinned"])
def test_a_partial_file_longer_than_the_file_names_it_and_the_fix(tmp_path, server, pin):
    """Regression: a `.part` longer than the file (not a prefix of it) got, with a pinned size, the server's 416 as
    a network fault: "check the network ... run the same command again (partial downloads resume)", which failed
    the same way every time. It is one line naming the partial file and the fix, and the file is left to the user."""
    part = tmp_path / "file.bin.part"
    part.write_bytes(PAYLOAD + b"junk")
    with pytest.raises(DataDownloadError) as caught:
        dl.download(server, tmp_path / "file.bin", pin)
    message = str(caught.value)
    assert f"delete {part} and run the same command again" in message and "check the network" not in message
    assert "\n" not in message and part.stat().st_size == len(PAYLOAD) + 4 and not (tmp_path / "file.bin").exists()


def test_pinned_digest_mismatch_is_refused(tmp_path, server):
    with pytest.raises(DataDownloadError, match="has sha256 .* expected 00"):
        dl.download(server, tmp_path / "file.bin", Pin(sha256="00" * 32))
    with pytest.raises(DataDownloadError, match="has md5 .* expected ff"):
        dl.download(server, tmp_path / "other.bin", Pin(md5="ff" * 16))
    assert not (tmp_path / "file.bin").exists() and not (tmp_path / "other.bin").exists()
    md5 = hashlib.md5(PAYLOAD).hexdigest()  # noqa: S324 (the digest upstream publishes)
    assert dl.download(server, tmp_path / "ok.bin", Pin(size=len(PAYLOAD), md5=md5)).read_bytes() == PAYLOAD


def test_an_existing_file_is_checked_before_reuse(tmp_path, server):
    path = dl.download(server, tmp_path / "file.bin")  # no pin: the sha256 is recorded beside it
    assert (tmp_path / "file.bin.sha256").read_text().split()[0] == hashlib.sha256(PAYLOAD).hexdigest()
    path.write_bytes(PAYLOAD[:-1] + b"\x00")
    n = len(_Handler.requests)
    with pytest.raises(DataDownloadError, match="no longer matches the sha256 recorded at its download"):
        dl.download(server, path)
    with pytest.raises(DataDownloadError, match="expected 1"):
        dl.download(server, path, Pin(size=1))
    assert len(_Handler.requests) == n  # nothing was fetched again behind the user's back


def test_only_https_and_every_task_url_is_https(tmp_path):
    with pytest.raises(ValueError, match="is not https"):
        dl.download("http://example.org/x.zip", tmp_path / "x.zip")
    from longmixer.data import enwik8, lra_release, mnist, scifar, speech_commands, wikitext103

    for url in (enwik8.ENWIK8_URL, lra_release.LRA_URL, mnist.MNIST_URL, scifar.CIFAR10_URL, speech_commands.SC_URL,
                wikitext103.WT103_URL):
        assert url.startswith("https://"), url
    assert scifar.CIFAR10_PIN.md5 and speech_commands.SC_PIN.sha256 and len(mnist.MNIST_MD5) == 4


def test_unreachable_server_gives_one_line(tmp_path):
    with pytest.raises(DataDownloadError) as caught:
        dl.download("http://127.0.0.1:9/none.zip", tmp_path / "none.zip")
    assert "\n" not in str(caught.value) and "data.source_dir=<folder>" in str(caught.value)
    assert f"put it at {tmp_path / 'none.zip'}" in str(caught.value)  # where a copy fetched by hand is picked up
    assert caught.value.__suppress_context__


def test_progress_logs_at_deciles_without_a_terminal(caplog):
    with caplog.at_level(logging.INFO, logger="longmixer.data.download"):
        with dl.progress("generating x", 200, unit="images") as advance:
            for _ in range(200):
                advance(1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "generating x: 20/200 images" and lines[-1] == "generating x: 200/200 images"
    assert len(lines) == 10


def _zip(path, members: dict[str, bytes]):
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_extract_is_all_or_nothing_and_a_killed_one_is_redone(tmp_path):
    """A killed extraction leaves files under their final names in a naive unpack, which a rerun's "does it exist"
    test takes for complete ones. `extract` unpacks into a scratch folder, moves the members into place and writes
    its marker last; `extracted` is False until then, and a rerun replaces what an interrupted attempt left."""
    archive = _zip(tmp_path / "corpus.zip", {"corpus/train.txt": b"x" * 1000, "corpus/test.txt": b"y" * 10,
                                             "top.txt": b"z"})
    dest = tmp_path / "raw"
    # what an interrupted attempt leaves: a cut file under its final name, a half-filled scratch folder
    (dest / "corpus").mkdir(parents=True)
    (dest / "corpus" / "train.txt").write_bytes(b"x" * 300)
    (dest / ".extracting-corpus.zip" / "corpus").mkdir(parents=True)
    assert not dl.extracted(dest, "corpus.zip")
    dl.extract(archive, dest)
    assert dl.extracted(dest, "corpus.zip")
    assert (dest / "corpus" / "train.txt").read_bytes() == b"x" * 1000
    assert (dest / "corpus" / "test.txt").read_bytes() == b"y" * 10 and (dest / "top.txt").read_bytes() == b"z"
    assert sorted(p.name for p in dest.iterdir()) == [".extracted-corpus.zip", "corpus", "top.txt"]


def test_a_cut_archive_stops_with_one_line_and_leaves_nothing(tmp_path):
    import tarfile

    good = tmp_path / "data.tar.gz"
    payload = tmp_path / "payload.bin"
    payload.write_bytes(os.urandom(200_000))
    with tarfile.open(good, "w:gz") as t:
        t.add(payload, arcname="data/payload.bin")
    cut = tmp_path / "cut" / "data.tar.gz"
    cut.parent.mkdir()
    cut.write_bytes(good.read_bytes()[:len(good.read_bytes()) // 2])
    dest = tmp_path / "raw"
    with pytest.raises(DataDownloadError, match=r"could not be unpacked .*delete .*data.tar.gz and run the same"):
        dl.extract(cut, dest)
    assert not dl.extracted(dest, "data.tar.gz") and list(dest.iterdir()) == []


def test_a_full_disk_is_not_reported_as_a_network_fault_and_unpacks_nothing(tmp_path, server, monkeypatch):
    """Regression: a disk that filled during a download was reported as "could not download ...: check the network
    (or a proxy)", and one that filled during an extraction left the part unpacked so far in the scratch folder,
    holding the room the user had to free. The error goes up as the OSError it is (the datamodule turns it into one
    line naming the folder and the fix), and the scratch folder is removed."""
    import errno
    import zipfile

    (tmp_path / "file.bin.part").symlink_to("/dev/full")  # every write there fails with ENOSPC
    with pytest.raises(OSError) as caught:
        dl.download(server, tmp_path / "file.bin", Pin(size=len(PAYLOAD)))
    assert caught.value.errno == errno.ENOSPC and not isinstance(caught.value, DataDownloadError)

    archive = _zip(tmp_path / "corpus.zip", {"corpus/train.txt": b"x" * 1000})

    def fills_the_disk(self, path, *args, **kwargs):
        (tmp_path / "raw" / ".extracting-corpus.zip" / "corpus").mkdir(parents=True)
        (tmp_path / "raw" / ".extracting-corpus.zip" / "corpus" / "train.txt").write_bytes(b"x" * 300)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(zipfile.ZipFile, "extractall", fills_the_disk)
    with pytest.raises(OSError, match="No space left"):
        dl.extract(archive, tmp_path / "raw")
    assert list((tmp_path / "raw").iterdir()) == []


@pytest.mark.parametrize("content", [b"", b"\xff\xfe\n", b"not-a-digest  file.bin\n"],
                         ids=["empty", "not-utf8", "garbled"])
def test_a_record_without_a_sha256_names_it_and_the_ways_out(tmp_path, server, content):
    """Regression: an empty `<file>.sha256` (a kill while it was written) stopped every later run with an IndexError
    traceback, one that is not UTF-8 with a UnicodeDecodeError, and a garbled one blamed the download ("no longer
    matches"). Each is now one line naming the record and the ways out, and deleting the record records the file
    as it is, without fetching anything."""
    path = dl.download(server, tmp_path / "file.bin")
    record = tmp_path / "file.bin.sha256"
    record.write_bytes(content)
    n = len(_Handler.requests)
    with pytest.raises(DataDownloadError, match=f"{record} holds no sha256") as caught:
        dl.download(server, path)
    assert "\n" not in str(caught.value) and f"delete {record} and run the same command again" in str(caught.value)
    record.unlink()
    assert dl.download(server, path) == path and len(_Handler.requests) == n
    assert record.read_text().split()[0] == hashlib.sha256(PAYLOAD).hexdigest()


def test_a_file_without_a_record_is_recorded_and_checked_from_then_on(tmp_path, server):
    """A file put in place by hand (as the download error offers) got no record, so it was never checked again."""
    path = tmp_path / "file.bin"
    path.write_bytes(PAYLOAD)
    assert dl.download(server, path) == path and _Handler.requests == []
    path.write_bytes(PAYLOAD[:-1] + b"\x00")
    with pytest.raises(DataDownloadError, match="no longer matches the sha256 recorded at its download"):
        dl.download(server, path)


def test_a_download_fetched_again_that_differs_from_the_kept_record_is_named(tmp_path, server, caplog):
    """The download deleted and its record kept: the new download is used and recorded (a changed file on the server
    must not stop every run), with a warning that it differs from the one earlier runs used."""
    path = dl.download(server, tmp_path / "file.bin")
    record = tmp_path / "file.bin.sha256"
    record.write_text(f"{'0' * 64}  file.bin\n")  # an earlier download of other bytes
    path.unlink()
    with caplog.at_level(logging.WARNING):
        assert dl.download(server, path).read_bytes() == PAYLOAD
    assert f"{path} differs from the sha256 recorded at an earlier download ({record})" in caplog.text
    assert record.read_text().split()[0] == hashlib.sha256(PAYLOAD).hexdigest()
    caplog.clear()
    path.unlink()
    with caplog.at_level(logging.WARNING):
        dl.download(server, path)
    assert "differs" not in caplog.text


def test_a_python_without_tarfiles_extraction_filters_is_one_line_and_unpacks_nothing(tmp_path, monkeypatch):
    """Regression: every tar (CIFAR, Speech Commands, the LRA release) is unpacked with `filter="data"`, which keeps
    members with absolute paths, `..` or links from landing outside the folder; `requires-python = ">=3.10"`
    admits 3.10.0-3.10.11 and 3.11.0-3.11.3, whose tarfile lacks the filters (PEP 706), and there the argument
    stopped the prepare step with `TypeError: ... unexpected keyword argument 'filter'`. It is one line naming the
    Python, the archive and the ways out, before anything is unpacked. (Such a tarfile is simulated.)"""
    import io
    import tarfile

    from longmixer.data import lra_release as lra
    from longmixer.utils.errors import UserFacingError

    # the signatures of 3.11.3's TarFile methods: called with filter=, they raise the TypeError users met
    def old_extractall(self, path=".", members=None, *, numeric_owner=False):
        raise AssertionError("unpacked without the extraction filter")

    def old_extract(self, member, path="", set_attrs=True, *, numeric_owner=False):
        raise AssertionError("unpacked without the extraction filter")

    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("listops-1000/basic_train.tsv")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    monkeypatch.delattr(tarfile, "data_filter")
    monkeypatch.setattr(tarfile.TarFile, "extractall", old_extractall)
    monkeypatch.setattr(tarfile.TarFile, "extract", old_extract)
    for unpack in (lambda: dl.extract(archive, tmp_path / "raw"),
                   lambda: lra.extract(archive, tmp_path / "release", ["listops-1000"])):
        with pytest.raises(UserFacingError) as caught:
            unpack()
        message = str(caught.value)
        assert "\n" not in message and f"cannot unpack {archive} safely" in message
        assert "use a newer Python" in message and "data.source_dir=<folder>" in message
    assert not (tmp_path / "raw").exists() and not (tmp_path / "release").exists()
