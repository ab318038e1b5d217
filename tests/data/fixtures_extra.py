"""Small datasets in the real on-disk formats, for the sCIFAR, SC10, MNIST, WikiText-103 and enwik8 loaders.

Each `write_*_fixture(root)` writes the raw files under `root` and returns the data config overrides that point the
datamodule at them (`source_dir`, plus any shape the fixture changes), e.g.
`SCIFAR(data_dir=tmp / "data", **write_scifar_fixture(tmp / "raw"))`.
The files are written independently of the readers (pickle, `wave`, raw idx bytes, plain text), so a reader that
misparses a format fails the tests.
"""

from __future__ import annotations

import gzip
import pickle
import wave
from pathlib import Path

import numpy as np

SC10_WORDS = ("yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go")

CIFAR_PER_BATCH = 12   # images per training batch file (5 files) -> 60 training images
CIFAR_TEST = 10
SC10_PER_WORD = 6      # full-length clips per word; one short clip per word is added and must be dropped
MNIST_TRAIN, MNIST_TEST = 40, 10
ENWIK8_BYTES, ENWIK8_EVAL = 6000, 600
LM_SEQ_LEN = 16

WIKI_TEXT = {
    "train": [" = Valkyria Chronicles III = ", "",
              " Senjō no Valkyria 3 : <unk> Chronicles is a tactical role @-@ playing video game . ",
              " The game began development in 2010 , carrying over a large portion of the work . ",
              " It met with positive sales in Japan , and was praised by both Japanese and western critics . ", "",
              " = = Gameplay = = ", "",
              " As with previous games , the game is a tactical role @-@ playing game where players take control . ",
              " The game 's battle system , the <unk> system , is carried over directly from the first game . "],
    "valid": [" = Homarus gammarus = ", "", " Homarus gammarus is a species of clawed lobster . ",
              " It is closely related to the American lobster , H. americanus . "],
    "test": [" = Robert Boulter = ", "", " Robert Boulter is an English film , television and theatre actor . ",
             " He had a guest @-@ starring role on the television series The Bill in 2000 . "],
}


def cifar_image(i: int) -> np.ndarray:
    """A deterministic uint8 image as CIFAR stores it: 3072 values, the R, G, B planes of 32 x 32 row-major."""
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, size=3 * 1024, dtype=np.uint8)


def write_scifar_fixture(root: Path) -> dict:
    """`cifar-10-batches-py/{data_batch_1..5, test_batch}` as pickled dicts with bytes keys, like the tarball."""
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    names = [(f"data_batch_{b}", CIFAR_PER_BATCH, b * 1000) for b in range(1, 6)] + [("test_batch", CIFAR_TEST, 0)]
    for name, count, start in names:
        data = np.stack([cifar_image(start + i) for i in range(count)])
        batch = {b"batch_label": name.encode(), b"labels": [(start + i) % 10 for i in range(count)],
                 b"data": data, b"filenames": [f"img_{start + i}.png".encode() for i in range(count)]}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
    return {"source_dir": str(folder)}


def sc10_clip(word_index: int, k: int, length: int = 16000) -> np.ndarray:
    """A deterministic int16 tone whose pitch depends on the word, with some noise."""
    t = np.arange(length) / 16000.0
    rng = np.random.default_rng(1000 * word_index + k)
    x = 0.3 * np.sin(2 * np.pi * (200 + 50 * word_index) * t) + 0.05 * rng.standard_normal(length)
    return np.clip(x * 32767, -32768, 32767).astype(np.int16)


def write_wav(path: Path, samples: np.ndarray, rate: int = 16000) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())


def write_sc10_fixture(root: Path) -> dict:
    """`<word>/<speaker>_nohash_<k>.wav` 16-bit PCM mono 16 kHz clips (one short clip per word), plus the official
    `validation_list.txt` / `testing_list.txt` and an unused word folder (`bed`) that SC10 must skip."""
    root = Path(root)
    val, test = [], []
    for w, word in enumerate(SC10_WORDS + ("bed",)):
        (root / word).mkdir(parents=True, exist_ok=True)
        for k in range(SC10_PER_WORD):
            name = f"{word}/{k:08x}_nohash_0.wav"
            write_wav(root / name, sc10_clip(w, k))
            if k == 0:
                val.append(name)
            elif k == 1:
                test.append(name)
        write_wav(root / word / "ffffffff_nohash_0.wav", sc10_clip(w, 99, length=12000))
    (root / "validation_list.txt").write_text("\n".join(val) + "\n")
    (root / "testing_list.txt").write_text("\n".join(test) + "\n")
    return {"source_dir": str(root)}


def mnist_images(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(count, 28, 28), dtype=np.uint8)


def _idx_bytes(array: np.ndarray) -> bytes:
    magic = 0x0800 | array.ndim  # unsigned byte data
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist_fixture(root: Path) -> dict:
    """`{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz` (train gzipped, test plain, as both occur)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for prefix, count, seed, gz in (("train", MNIST_TRAIN, 1, True), ("t10k", MNIST_TEST, 2, False)):
        images = mnist_images(count, seed)
        labels = (np.arange(count) % 10).astype(np.uint8)
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            path = root / f"{prefix}-{kind}-ubyte"
            if gz:
                with gzip.open(str(path) + ".gz", "wb") as f:
                    f.write(_idx_bytes(array))
            else:
                path.write_bytes(_idx_bytes(array))
    return {"source_dir": str(root)}


def wikitext_vocab_size() -> int:
    """`<pad>` + `<eos>` + the distinct words of the training text."""
    words = {w for line in WIKI_TEXT["train"] for w in line.split()}
    return 2 + len(words)


def write_wikitext_fixture(root: Path) -> dict:
    """`wiki.{train,valid,test}.tokens`: lines starting with a space as in the release, empty lines, `@-@`, `<unk>`.
    valid/test use words absent from train, which must map to `<unk>`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for split, lines in WIKI_TEXT.items():
        (root / f"wiki.{split}.tokens").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"source_dir": str(root), "vocab_size": wikitext_vocab_size(), "seq_len": LM_SEQ_LEN}


def enwik8_bytes(n: int = ENWIK8_BYTES) -> bytes:
    """XML-like text with newlines and some multi-byte UTF-8, as enwik8 is."""
    piece = ("<page>\n  <title>Anarchism</title>\n  <text xml:space=\"preserve\">'''Anarchism''' is a "
             "[[political philosophy]] \u2014 caf\u00e9 &amp; na\u00efve.</text>\n</page>\n").encode("utf-8")
    return (piece * (n // len(piece) + 1))[:n]


def write_enwik8_fixture(root: Path) -> dict:
    """An `enwik8` byte file of ENWIK8_BYTES bytes (its `expected_bytes`); valid and test take ENWIK8_EVAL bytes
    each."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "enwik8").write_bytes(enwik8_bytes())
    return {"source_dir": str(root), "expected_bytes": ENWIK8_BYTES, "eval_bytes": ENWIK8_EVAL, "seq_len": LM_SEQ_LEN}
