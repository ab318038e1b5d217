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


def test_a_failed_job_leaves_no_wandb_run_for_the_next_job(tmp_path, monkeypatch):
    """A sweep runs its jobs in one process. A job that failed after its W&B run started left that run open, and the
    next job's WandbLogger took it over (Lightning reuses an open run): its config and metrics went into the failed
    job's W&B run, and its own run dir got no W&B run at all."""
    wandb = pytest.importorskip("wandb")
    import longmixer.train as entry
    from tests.conftest import compose_config

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    overrides = ["logger=wandb", *TINY_LISTOPS, *TINY_TRAINER]

    def crash(*args, **kwargs):
        raise RuntimeError("a crash in the test phase")

    with monkeypatch.context() as patch:
        patch.setattr(entry, "_test_until_signal", crash)
        with pytest.raises(RuntimeError, match="a crash in the test phase"):
            train(compose_config(overrides, tmp_path / "failed", data_dir=tmp_path / "data"))
    assert wandb.run is None
    train(compose_config(overrides, tmp_path / "next", data_dir=tmp_path / "data"))
    run_dir = tmp_path / "next" / "run"
    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))) == 1
    failed_id = (tmp_path / "failed" / "run" / "wandb_id.txt").read_text().strip()
    assert failed_id != run_id and len(list((tmp_path / "failed" / "run" / "wandb").glob("offline-run-*"))) == 1
