"""The progress bar's epoch count for step-bounded runs."""

from __future__ import annotations

from types import SimpleNamespace

from longmixer.callbacks.progress import RichProgress


def _description(max_epochs):
    bar = RichProgress()
    bar._trainer = SimpleNamespace(max_epochs=max_epochs)
    return bar._get_train_description(10).strip()


def test_a_step_bounded_run_shows_no_negative_last_epoch():
    assert _description(-1) == "Epoch 10"  # Lightning's own bar: "Epoch 10/-2"
    assert _description(20) == "Epoch 10/19"
