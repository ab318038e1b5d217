"""`debug=syncs`: host syncs counted per training step in a window, by call site, without printing the warnings."""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace

import pytest
import torch

from longmixer.callbacks.sync_debug import HostSyncCounter


class _Logger:
    def __init__(self):
        self.metrics = []

    def log_metrics(self, metrics, step):
        self.metrics.append((step, metrics))


def _trainer(device: str):
    return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)), global_step=0,
                           is_global_zero=True, loggers=[_Logger()])


def _sync_like_torch():
    """What torch does on a synchronizing call in "warn" mode."""
    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)


def test_counts_the_syncs_of_the_window_by_site(monkeypatch, caplog):
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    counter, trainer = HostSyncCounter(start=2, stop=4), _trainer("cuda")
    shown = []  # the steps whose warnings reached the user
    with caplog.at_level(logging.INFO, logger="longmixer"), warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda *args, **kwargs: shown.append(trainer.global_step)
        for step in range(6):
            trainer.global_step = step
            counter.on_train_batch_start(trainer, None, None, step)
            for _ in range(3 if step == 2 else 1):
                _sync_like_torch()  # counted in steps 2 and 3 only
            trainer.global_step = step + 1
            counter.on_train_batch_end(trainer, None, None, None, step)
    assert modes == ["warn", "default", "warn", "default"]  # on inside the window's steps only
    assert counter.steps == 2 and counter.per_step() == 2.0
    (site,) = counter.sites
    assert "test_sync_debug.py" in site and "_sync_like_torch" in site
    assert trainer.loggers[0].metrics == [(4, {"train/debug/host_syncs_per_step": 2.0})]
    assert "2.00 per step" in caplog.text and "_sync_like_torch" in caplog.text
    # outside the window the warnings reach the user as before; inside they were caught
    assert shown == [0, 1, 4, 5] and warnings.showwarning is not counter._capture


def test_other_warnings_in_the_window_still_show(monkeypatch, recwarn):
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    counter, trainer = HostSyncCounter(start=0, stop=1), _trainer("cuda")
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda *a, **kw: shown.append(str(a[0])))
    counter.on_train_batch_start(trainer, None, None, 0)
    warnings.warn("something else", UserWarning, stacklevel=1)
    counter.on_train_batch_end(trainer, None, None, None, 0)
    assert shown == ["something else"] and not counter.sites


def test_on_a_cpu_it_says_so_and_counts_nothing(caplog):
    counter, trainer = HostSyncCounter(), _trainer("cpu")
    with caplog.at_level(logging.WARNING, logger="longmixer"):
        for step in range(100):
            trainer.global_step = step
            counter.on_train_batch_start(trainer, None, None, step)
            counter.on_train_batch_end(trainer, None, None, None, step)
    assert counter.steps == 0 and caplog.text.count("no CUDA device") == 1


@pytest.mark.parametrize("start, stop", [(5, 5), (-1, 3)])
def test_the_window_is_checked(start, stop):
    with pytest.raises(ValueError, match="callbacks.host_syncs"):
        HostSyncCounter(start=start, stop=stop)


def test_debug_syncs_composes(compose):
    cfg = compose(["debug=syncs"])
    assert cfg.callbacks.host_syncs.start == 20 and cfg.trainer.max_steps == 80
