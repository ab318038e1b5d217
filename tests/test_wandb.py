"""W&B options on a real offline run: checkpoint artifacts (best and last, at the end of fit), gradient
histograms from `watch`, and run names keyed by configuration."""

from __future__ import annotations

import time

import pytest

from longmixer.train import train
from tests.conftest import TINY_LISTOPS, TINY_TRAINER


def _wait_for(path, needles: list[bytes], seconds: float = 60) -> bytes:
    """The W&B service may still be writing the offline log after finish() returns: poll for the records."""
    deadline = time.monotonic() + seconds
    while True:
        data = path.read_bytes()
        if all(n in data for n in needles) or time.monotonic() > deadline:
            return data
        time.sleep(0.5)


def test_wandb_logs_checkpoint_artifacts_and_gradients(compose, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    train(compose(["logger=wandb", "logger.wandb.log_model=true", "logger.wandb.watch=gradients",
                   "logger.wandb.watch_log_freq=1", *TINY_LISTOPS, *TINY_TRAINER]))
    run_dir = tmp_path / "run"
    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    (offline,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}")
    log = next(offline.glob("run-*.wandb"))
    best = next((run_dir / "checkpoints").glob("best-*.ckpt")).name.encode()
    record = _wait_for(log, [f"model-{run_id}".encode(), best, b"gradients/model."])
    assert f"model-{run_id}".encode() in record  # the checkpoint artifact
    assert best in record and b"last.ckpt" in record  # the best and the last checkpoint files in it
    assert b"gradients/model." in record  # watch histograms


def test_wandb_watch_value_is_checked(compose, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    cfg = compose(["logger=wandb", "logger.wandb.watch=weights"])
    with pytest.raises(InstantiationException, match="logger.wandb.watch='weights' is not one of"):
        instantiate(cfg.logger.wandb)
