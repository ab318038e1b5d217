"""The run dir's guards, in-process: safe loading, corrupt last.ckpt, drift, finished rerun, lock, divergence,
unreachable validation, progress bar off."""

import json
import os
import pickle

import pytest
import torch

from longmixer.runs.checkpoints import CheckpointError, load_checkpoint
from longmixer.runs.resume import ConfigDriftError, RunLock, RunLockedError
from longmixer.train import train
from tests.conftest import TINY_LISTOPS, TINY_TRAINER

BASE = [*TINY_LISTOPS, *TINY_TRAINER]


class _WritesAFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_crafted_checkpoint_is_refused_without_running_its_payload(tmp_path):
    marker = tmp_path / "pwned"
    crafted = tmp_path / "crafted.ckpt"
    torch.save({"state_dict": {}, "payload": _WritesAFile(str(marker))}, crafted, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(CheckpointError, match="crafted.ckpt"):
        load_checkpoint(crafted)
    assert not marker.exists()


def test_corrupt_last_falls_back_to_newest_intact(compose, tmp_path, caplog):
    train(compose(BASE))
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:100])
    from longmixer.runs.checkpoints import newest_intact

    chosen = newest_intact(last.parent)
    assert chosen is not None and chosen.name.startswith("best-")
    assert "corrupt" in caplog.text


def test_finished_rerun_reports_instead_of_training(compose, tmp_path):
    first = train(compose(BASE))
    rows = (tmp_path / "run" / "csv" / "metrics.csv").read_text()
    again = train(compose(BASE))
    assert again["metrics"] == first["metrics"] and again["status"] == "finished"
    assert (tmp_path / "run" / "csv" / "metrics.csv").read_text() == rows
    assert "val/acc" in json.loads((tmp_path / "run" / "results.json").read_text())["metrics"]


def test_config_drift_is_refused_and_force_continues(compose, tmp_path):
    train(compose(BASE))
    with pytest.raises(ConfigDriftError, match="optim.lr"):
        train(compose([*BASE, "optim.lr=0.5"]))
    train(compose([*BASE, "optim.lr=2e-3"]))  # 2e-3 == the stored 0.002: no drift (finished run reported)
    train(compose([*BASE, "optim.lr=0.5", "resume=force", "trainer.max_steps=4", "trainer.val_check_interval=2"]))


def test_second_process_on_a_run_dir_fails_fast(tmp_path):
    lock = RunLock(tmp_path).acquire()
    try:
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
    finally:
        lock.release()


def test_non_finite_loss_stops_the_run(compose):
    with pytest.raises(FloatingPointError, match="non-finite loss at step"):
        train(compose([*BASE, "optim.lr=1e30", "trainer.max_steps=6", "trainer.val_check_interval=6",
                       "data.num_train=96"]))


def test_max_steps_before_first_validation_stops_at_start(compose):
    with pytest.raises(ValueError, match="trainer.max_steps"):
        train(compose([*BASE, "trainer.val_check_interval=4"]))


def test_progress_bar_off_with_the_rich_bar_in_callbacks(compose):
    cfg_overrides = [o for o in BASE if o != "~callbacks.progress"]
    assert train(compose(cfg_overrides))["metrics"]["test/acc"] >= 0
