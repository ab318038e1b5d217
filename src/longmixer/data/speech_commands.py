"""Speech Commands SC10: raw 16 kHz waveforms, length 16,000, 10 classes (frameworks.md section 2.8).

Protocol (s4 `dataset=sc10`, after Kidger et al. and CKConv; MEGA, CHELA table 2, LongVQ table 5 and SeqBoat table 2
follow it): the words yes no up down left right on off stop go (labels 0..9 in this order) from Speech Commands
v0.02; only clips of exactly 16,000 samples are kept (34,975 clips); samples are read as floats in [-1, 1) (int16 /
32768, as torchaudio) and normalized with the mean and std of the training split, x -> (x - mean) / (std + 1e-5)
(s4's `normalise_data`).

Splits: `split=stratified` (default) is a per-class 70/15/15 split drawn with `numpy.random.default_rng(split_seed)`.
s4 uses sklearn's `train_test_split` (random_state 0, then 1); sklearn is not a dependency here, so the partition
has the same proportions and stratification but not the same members - a choice, recorded in docs/data.md.
`split=official` uses the dataset's `validation_list.txt` / `testing_list.txt` (train = every other kept clip).

`eval_resolution=2` evaluates (val and test) at half resolution, 8 kHz, by keeping every second sample (s4's
`eval_resolutions` subsampling); the model is unchanged.

WAV files are read with `soundfile` (no torchaudio on the core path).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from longmixer.data.base import SequenceDataModule, label_counts
from longmixer.data.download import Pin, download, extract, extracted
from longmixer.data.integrity import SourceFileError, SourceFileMissingError
from longmixer.data.scifar import check_shapes

log = logging.getLogger(__name__)

SC_URL = "https://storage.googleapis.com/download.tensorflow.org/data/speech_commands_v0.02.tar.gz"
SC_PIN = Pin(sha256="af14739ee7dc311471de98f5f9d2c9191b18aedfe957f4a6ff791c709868ff58")  # as torchaudio pins it
SC10_CLASSES = ("yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go")
SAMPLE_RATE = 16_000
SPLITS = ("stratified", "official")
STRATIFIED_FRACTIONS = (0.70, 0.15)  # train, val; test is the rest


REPLACE_WAV = ("replace it with the archive's copy (delete the folder and prepare again to re-extract it, or correct "
               "data.source_dir)")
STREAMING_SIZES = (0, 0xFFFFFFFF)  # what writers that cannot seek back put in a size field: "unknown", not a length


def wav_data_sizes(path: Path) -> tuple[int, int] | None:
    """(bytes of audio its `data` chunk declares, bytes the file holds after that chunk's header) of a RIFF/WAVE
    file; None where the file is not one or has no `data` chunk (soundfile then names the fault)."""
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:] != b"WAVE":
            return None
        size = Path(path).stat().st_size
        while header := f.read(8):
            if len(header) < 8:
                return None
            length = int.from_bytes(header[4:], "little")
            if header[:4] == b"data":
                return length, size - f.tell()
            f.seek(length + (length & 1), 1)  # chunks are padded to an even length
    return None


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    """A WAV file -> (int16 samples [T] of the first channel, sample rate).

    Raises:
        SourceFileError: the file is not a readable audio file, or it is cut short (its `data` chunk declares more
            audio than it holds), naming it and the fix.
    """
    import soundfile  # the `data` extra; imported here so that importing this module needs nothing

    try:
        samples, rate = soundfile.read(str(path), dtype="int16", always_2d=True)
    except (soundfile.SoundFileError, RuntimeError) as err:
        raise SourceFileError(f"{path} is not a readable WAV file ({' '.join(str(err).split())}); "
                              f"{REPLACE_WAV}") from None
    # libsndfile reads a cut file's remaining samples without an error; the clip would then pass for one of the
    # dataset's genuinely short clips and be dropped with them, so a cut copy is told by its header
    sizes = wav_data_sizes(path)
    if sizes is not None and sizes[0] not in STREAMING_SIZES and sizes[0] > sizes[1]:
        raise SourceFileError(f"{path} is cut short: its header declares {sizes[0]} bytes of audio, the file holds "
                              f"{sizes[1]}; {REPLACE_WAV}")
    return samples[:, 0], int(rate)


def stratified_split(labels: np.ndarray, seed: int, fractions=STRATIFIED_FRACTIONS) -> dict[str, np.ndarray]:
    """Per class: shuffle, then the first round(f_train n) to train, the next round(f_val n) to val, the rest to
    test. Returns sorted index arrays."""
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_train, n_val = int(round(fractions[0] * len(idx))), int(round(fractions[1] * len(idx)))
        parts["train"].append(idx[:n_train])
        parts["val"].append(idx[n_train:n_train + n_val])
        parts["test"].append(idx[n_train + n_val:])
    return {k: np.sort(np.concatenate(v)) for k, v in parts.items()}


def official_split(files: list[str], raw: Path) -> dict[str, np.ndarray]:
    """Indices of `files` (paths like "yes/0a7c2a8d_nohash_0.wav") by the dataset's validation / testing lists."""
    lists = {}
    for split, name in (("val", "validation_list.txt"), ("test", "testing_list.txt")):
        path = raw / name
        if not path.exists():
            raise SourceFileMissingError(f"data.split=official needs {path} (part of the Speech Commands archive): "
                                         "point data.source_dir at a complete copy, or use data.split=stratified")
        lists[split] = set(path.read_text().split())
    where = np.array(["val" if f in lists["val"] else "test" if f in lists["test"] else "train" for f in files])
    return {s: np.flatnonzero(where == s) for s in ("train", "val", "test")}


class WaveformDataset(Dataset):
    """Items `{"inputs": float [T / stride, 1], "labels": long}` from int16 clips, normalized by (mean, std)."""

    def __init__(self, audio: np.ndarray, labels: np.ndarray, index: np.ndarray, mean: float, std: float,
                 stride: int = 1):
        self.audio, self.labels, self.index = audio, labels, index
        self.mean, self.std, self.stride = mean, std, stride

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = int(self.index[i])
        x = np.asarray(self.audio[row, ::self.stride], dtype=np.float32) / 32768.0
        x = (x - self.mean) / (self.std + 1e-5)
        return {"inputs": torch.from_numpy(x).unsqueeze(-1), "labels": torch.tensor(int(self.labels[row]))}


def waveform_stats(audio: np.ndarray, index: np.ndarray, block: int = 1024) -> tuple[float, float]:
    """Mean and (unbiased) std of the float samples (int16 / 32768) of the rows `index`, in float64 blocks."""
    total, total_sq, count = 0.0, 0.0, 0
    for i in range(0, len(index), block):
        x = np.asarray(audio[np.sort(index[i:i + block])], dtype=np.float64) / 32768.0
        total += float(x.sum())
        total_sq += float((x * x).sum())
        count += x.size
    mean = total / count
    var = (total_sq - count * mean * mean) / max(count - 1, 1)
    return mean, float(np.sqrt(max(var, 0.0)))


class SpeechCommands(SequenceDataModule):
    """SC10 raw-waveform classification: batches `inputs` float [B, 16000, 1] (8000 at `eval_resolution=2` in
    val/test), `mask`, `labels`.

    Args:
        seq_len, d_input, num_classes: 16000, 1, 10 (checked against the prepared data).
        split: "stratified" (70/15/15, seeded by `split_seed`) | "official" (the dataset's lists).
        eval_resolution: 1 (16 kHz) | 2 (val and test at 8 kHz, every second sample).
        source_dir: a folder holding the word folders (`yes/*.wav`, ...) and the split lists (skips the download);
            None: download into `<data_dir>/sc10/raw`.
        data_dir, batch_size, eval_batch_size, num_workers, seed, split_seed, pin_memory: see `SequenceDataModule`.
    """

    name = "sc10"

    def __init__(self, seq_len: int = SAMPLE_RATE, d_input: int = 1, num_classes: int = 10,
                 split: str = "stratified", eval_resolution: int = 1, source_dir: str | Path | None = None,
                 data_dir: str | Path | None = None,
                 batch_size: int = 20, eval_batch_size: int | None = None, num_workers: int | None = None,
                 seed: int = 0, split_seed: int = 0, pin_memory: bool | None = None,
                 persistent_workers: bool | None = None):
        super().__init__(data_dir=data_dir, batch_size=batch_size, eval_batch_size=eval_batch_size,
                         num_workers=num_workers, seed=seed, split_seed=split_seed, pin_memory=pin_memory,
                         persistent_workers=persistent_workers)
        if split not in SPLITS:
            raise ValueError(f"data.split={split!r} is not one of {SPLITS}")
        if eval_resolution not in (1, 2):
            raise ValueError(f"data.eval_resolution={eval_resolution} must be 1 (16 kHz) or 2 (8 kHz)")
        self.seq_len, self.d_input, self.num_classes = seq_len, d_input, num_classes
        self.split, self.eval_resolution = split, eval_resolution
        self.source_dir = None if source_dir is None else Path(source_dir)

    def _prepare(self, root: Path) -> tuple[dict, dict]:
        raw = self.source_dir or root / "raw"
        if self.source_dir is None and not extracted(raw, "speech_commands_v0.02.tar.gz"):
            extract(download(SC_URL, raw / "speech_commands_v0.02.tar.gz", SC_PIN), raw)
        files, labels, clips, dropped = [], [], [], 0
        for label, word in enumerate(SC10_CLASSES):
            for path in sorted((raw / word).glob("*.wav")):
                samples, rate = read_wav(path)
                if rate != SAMPLE_RATE:
                    raise ValueError(f"{path}: sample rate {rate}, expected {SAMPLE_RATE}")
                if samples.shape[0] != SAMPLE_RATE:  # only full-length clips (s4 / Kidger et al.)
                    dropped += 1
                    continue
                files.append(f"{word}/{path.name}")
                labels.append(label)
                clips.append(samples)
        if not clips:
            raise SourceFileMissingError(f"no full-length 16 kHz clips of {SC10_CLASSES} under {raw}: point "
                                         "data.source_dir at the extracted Speech Commands v0.02 folders")
        # a missing word would be prepared as a 10-class task with a class that never occurs
        absent = [word for label, word in enumerate(SC10_CLASSES) if label not in set(labels)]
        if absent:
            raise SourceFileMissingError(f"{raw / absent[0]} holds no full-length 16 kHz clip (SC10 needs all of "
                                         f"{SC10_CLASSES}; without clips: {absent}): point data.source_dir at "
                                         "complete Speech Commands v0.02 folders, or delete the folder and prepare "
                                         "again to re-extract it")
        np.save(root / "audio.npy", np.stack(clips).astype(np.int16))  # [N, 16000]
        np.save(root / "labels.npy", np.asarray(labels, dtype=np.int64))
        (root / "files.txt").write_text("\n".join(files) + "\n")
        for name in ("validation_list.txt", "testing_list.txt"):
            if (raw / name).exists():
                (root / name).write_text((raw / name).read_text())
        if dropped:
            log.warning("SC10: kept %d full-length clips, dropped %d shorter ones (s4 keeps only 1 s clips)",
                        len(files), dropped)
        splits = {"all": {"count": len(files), "labels": label_counts(labels), "dropped_short": dropped}}
        return splits, {"seq_len": SAMPLE_RATE, "d_input": 1, "num_classes": len(SC10_CLASSES)}

    def split_indices(self, root: Path, labels: np.ndarray) -> dict[str, np.ndarray]:
        if self.split == "official":
            return official_split((root / "files.txt").read_text().split(), root)
        return stratified_split(labels, self.split_seed)

    def _load(self, root: Path, manifest: dict) -> dict[str, Dataset]:
        check_shapes(self.name, manifest, seq_len=self.seq_len, d_input=self.d_input, num_classes=self.num_classes)
        audio = np.load(root / "audio.npy", mmap_mode="r")
        labels = np.load(root / "labels.npy")
        parts = self.split_indices(root, labels)
        mean, std = waveform_stats(audio, parts["train"])
        return {split: WaveformDataset(audio, labels, idx, mean, std,
                                       stride=1 if split == "train" else self.eval_resolution)
                for split, idx in parts.items()}
