"""The Throughput callback: real-token counts per window, and one host sync per window instead of per step."""

from types import SimpleNamespace

import pytest
import torch

from longmixer.callbacks.throughput import Throughput


class _Logger:
    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step):
        self.rows.append((step, metrics))


def _trainer(device: str):
    return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)), loggers=[_Logger()],
                           global_step=0, sanity_checking=False)


def _batch(lengths, width=6):
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return {"inputs": torch.zeros(len(lengths), width, dtype=torch.long), "mask": mask}


def test_windows_count_real_tokens_and_sync_once_each(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    cb, trainer = Throughput(window=3), _trainer("cuda")
    for step in range(7):
        trainer.global_step = step + 1
        cb.on_train_batch_start(trainer, None, None, step)
        cb.on_train_batch_end(trainer, None, None, _batch([2, 5]), step)
    assert len(syncs) == 2  # steps 3 and 6 closed windows; no sync on the other five steps
    rows = trainer.loggers[0].rows
    assert [step for step, _ in rows] == [2, 5]  # the windows' last batches, stamped as Lightning stamps a step
    for _, metrics in rows:
        elapsed = 3 * metrics["train/speed/step_ms"] / 1000.0
        assert metrics["train/speed/tokens_per_s"] * elapsed == pytest.approx(21)  # 3 steps x (2 + 5) real tokens
        assert metrics["train/speed/samples_per_s"] * elapsed == pytest.approx(6)
        assert metrics["train/speed/peak_mem_gib"] == 1.0
    # a validation closes the open window (one step) so its time is not counted as training
    cb.on_validation_start(trainer, None)
    assert len(syncs) == 3 and len(rows) == 3
    cb.on_validation_start(trainer, None)  # nothing open: no second sync
    assert len(syncs) == 3


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="callbacks.throughput.window"):
        Throughput(window=0)
