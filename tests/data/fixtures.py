"""Small LRA datasets in the real on-disk formats, for the text, retrieval, image and Pathfinder loaders.

Each `write_*_fixture(root)` writes raw files under `root` and returns the data config overrides that point the
datamodule at them, e.g. `AAN(data_dir=tmp / "data", **write_retrieval_fixture(tmp / "raw"))`. The files are
written with independent tools (pyarrow parquet, plain text, pickle via `fixtures_extra`, PIL PNGs), never with the
readers under test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from tests.data.fixtures_extra import write_scifar_fixture

# Reviews with multi-byte UTF-8, a long one (truncation) and quotes; labels alternate.
REVIEWS = {
    "train": ["A wonderful film.", "Terrible \"acting\" throughout!", "Café scenes were lovely 🎬",
              "Boring. " * 40, "I laughed, I cried.", "Not worth the ticket", "Great score, weak plot", "Meh"],
    "test": ["Brilliant", "Awful, just awful", "Naïve but charming", "Two hours I won't get back"],
}

# AAN rows: label written as float, literal (unbalanced) quotes, commas; ids are arbitrary strings.
AAN_ROWS = {
    "train": [("1.0", "P01-1001", "P02-1002", 'We extend the "parser of Smith', "A parser, \"fast\" and simple."),
              ("0.0", "P03-1003", "P04-1004", "Statistical MT ' with quotes", 'Speech "recognition"" systems'),
              ("1.0", "P05-1005", "P06-1006", "Dependency parsing" * 30, "Graph-based parsing"),
              ("0.0", "P07-1007", "P08-1008", "Topic models", "Café corpora — ünïcode"),
              *[(f"{i % 2}.0", f"Q{i}", f"R{i}", f"Paper {i} on \"parsing", f"Paper {i + 1}, cited")
                for i in range(4)]],
    "eval": [("1.0", "E01", "E02", 'Word "sense', "Disambiguation"),
             ("0.0", "E03", "E04", "Coreference", "Summarization \"")],
    "test": [("0.0", "T01", "T02", "Tagging", "Chunking"),
             ("1.0", "T03", "T04", "\"Semantic\" roles", "Role labeling")],
}

PATHFINDER_BATCHES, PATHFINDER_PER_BATCH = 2, 10
EMPTY_PNG = ("imgs/0", "sample_10.png")  # a zero-byte file listed in the metadata, as in the release


def write_text_fixture(root: Path) -> dict:
    """IMDB as the hub's parquet files (`plain_text/{train,test}-00000-of-00001.parquet`, columns text, label)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(root) / "imdb" / "plain_text"
    folder.mkdir(parents=True, exist_ok=True)
    for split, texts in REVIEWS.items():
        table = pa.table({"text": texts, "label": [i % 2 for i in range(len(texts))]})
        pq.write_table(table, folder / f"{split}-00000-of-00001.parquet")
    return {"source_dir": str(folder.parent)}


def write_retrieval_fixture(root: Path) -> dict:
    """`new_aan_pairs.{train,eval,test}.tsv`: no header, 5 tab-separated columns, quotes literal."""
    folder = Path(root) / "tsv_data"
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in AAN_ROWS.items():
        lines = ["\t".join(row) for row in rows]
        (folder / f"new_aan_pairs.{split}.tsv").write_bytes(("\n".join(lines) + "\n").encode("utf-8"))
    return {"source_dir": str(folder)}


def write_image_fixture(root: Path) -> dict:
    """CIFAR-10 python batches (60 training, 10 test images); 10 training images are held out."""
    out = write_scifar_fixture(root)
    return {**out, "val_size": 10}


def pathfinder_image(index: int, resolution: int) -> np.ndarray:
    """A deterministic uint8 image with a bright stroke whose row depends on `index`."""
    img = np.random.default_rng(index).integers(0, 40, size=(resolution, resolution), dtype=np.uint8)
    img[index % resolution, :] = 255
    return img


def write_pathfinder_fixture(root: Path, resolution: int = 32, difficulty: str = "curv_contour_length_14") -> dict:
    """`pathfinder<R>/<difficulty>/imgs/<b>/sample_<k>.png` + text `metadata/<b>.npy` (11 columns, label in
    column 3), 20 images in 2 batches plus one zero-byte PNG listed in batch 0's metadata."""
    folder = Path(root) / f"pathfinder{resolution}" / difficulty
    (folder / "metadata").mkdir(parents=True, exist_ok=True)
    for b in range(PATHFINDER_BATCHES):
        (folder / "imgs" / str(b)).mkdir(parents=True, exist_ok=True)
        rows = []
        for k in range(PATHFINDER_PER_BATCH):
            index = b * PATHFINDER_PER_BATCH + k
            Image.fromarray(pathfinder_image(index, resolution), mode="L").save(folder / "imgs" / str(b) /
                                                                               f"sample_{k}.png")
            rows.append(f"imgs/{b} sample_{k}.png {k} {pathfinder_label(index)} 1.0 14 4 2 0.5 1 1")
        if b == 0:
            (folder / EMPTY_PNG[0] / EMPTY_PNG[1]).write_bytes(b"")
            rows.append(f"{EMPTY_PNG[0]} {EMPTY_PNG[1]} 10 1 1.0 14 4 2 0.5 1 1")
        (folder / "metadata" / f"{b}.npy").write_text("\n".join(rows) + "\n")
    return {"source_dir": str(folder.parent), "resolution": resolution, "seq_len": resolution * resolution}


def pathfinder_label(index: int) -> int:
    return (index * 7 + 3) % 2


def pathfinder_gen_overrides() -> dict:
    """Tiny generated Pathfinder (the generator runs for real: about 2 s on one core)."""
    return {"num_images": 20, "images_per_batch": 10, "generator_workers": 1}


def orphaned_workers_end(script: str, args: list[str], timeout_s: float = 5.0) -> tuple[list[int], list[int]]:
    """Run `script` (python -c) until it prints its first line (its workers are at work), SIGKILL it, and wait up
    to `timeout_s` for the processes it started to end. Returns (the processes it had started, those still
    running). Linux: reads /proc; a zombie (ended, not yet reaped by init) counts as ended."""
    import os
    import signal
    import subprocess
    import sys
    import time

    def table() -> dict[int, tuple[int, str]]:
        out = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                out[int(entry.name)] = (int(fields[1]), fields[0])  # (parent pid, state)
        return out

    def descendants(root: int) -> list[int]:
        procs, found, frontier = table(), [], [root]
        while frontier:
            children = [pid for pid, (ppid, _) in procs.items() if ppid in frontier]
            found += children
            frontier = children
        return found

    parent = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline(), "the generator ended before its workers started"
        started = descendants(parent.pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + timeout_s
        while True:
            procs = table()
            running = [pid for pid in started if pid in procs and procs[pid][1] != "Z"]
            if not running or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        if parent.poll() is None:
            parent.kill()
    for pid in running:  # leave no process behind, whatever the assertion says
        os.kill(pid, signal.SIGKILL)
    return started, running
