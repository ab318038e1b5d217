"""callbacks/activation_stats: per-layer statistics are read from the logged metrics and written as CSV and plot."""

import csv
import logging
import sys
from types import SimpleNamespace

import pytest
import torch

from longmixer.callbacks.activation_stats import ActivationStats, collect_layer_stats

METRICS = {
    "val/stats/act_rate/layer_00": torch.tensor(0.5), "val/stats/act_rate/layer_01": torch.tensor(0.25),
    "val/stats/attn_span/layer_00": torch.tensor(12.0), "val/stats/attn_span/layer_01": torch.tensor(40.0),
    "train/stats/act_rate/layer_00": torch.tensor(0.9), "val/acc": torch.tensor(0.7),
}


def _trainer(tmp_path, step=7):
    return SimpleNamespace(callback_metrics=METRICS, global_step=step, sanity_checking=False, is_global_zero=True,
                           default_root_dir=str(tmp_path))


def test_collect_layer_stats():
    stats = collect_layer_stats(METRICS, "val")
    assert stats == {0: {"act_rate": 0.5, "attn_span": 12.0}, 1: {"act_rate": 0.25, "attn_span": 40.0}}
    assert collect_layer_stats(METRICS, "train") == {0: {"act_rate": pytest.approx(0.9)}}


def test_writes_csv_history_and_plot(tmp_path):
    cb = ActivationStats(output_dir=str(tmp_path / "run"))
    cb.on_validation_end(_trainer(tmp_path, step=7), None)
    cb.on_validation_end(_trainer(tmp_path, step=9), None)
    rows = list(csv.DictReader((tmp_path / "run" / "activation_stats.csv").open()))
    assert [(r["step"], r["layer"], float(r["act_rate"])) for r in rows] == [
        ("7", "0", 0.5), ("7", "1", 0.25), ("9", "0", 0.5), ("9", "1", 0.25)]
    assert (tmp_path / "run" / "activation_stats.png").stat().st_size > 0


def test_sanity_check_is_skipped(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.sanity_checking = True
    ActivationStats().on_validation_end(trainer, None)
    assert not (tmp_path / "activation_stats.csv").exists()


def test_missing_matplotlib_skips_plot_with_a_log_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with caplog.at_level(logging.INFO, logger="longmixer.callbacks.activation_stats"):
        ActivationStats().on_validation_end(_trainer(tmp_path), None)
    assert (tmp_path / "activation_stats.csv").exists() and not (tmp_path / "activation_stats.png").exists()
    assert "matplotlib is not installed" in caplog.text


def test_bad_stage():
    with pytest.raises(ValueError, match="stage"):
        ActivationStats(stage="train")
