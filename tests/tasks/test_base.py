"""What every task shares (`tasks/base.py`): the progress handed to scheduled layers, after each optimizer step and
when a checkpoint is loaded."""

from __future__ import annotations

from functools import partial

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from longmixer.data.base import EpochSampler, ResumableLoader
from longmixer.layers.sma import LatentConfigurator, gumbel_temperature
from longmixer.mixers.longvq import LongVQ
from longmixer.mixers.seqboat import SeqBoat
from longmixer.models import SequenceModel
from longmixer.tasks.classification import Classification
from longmixer.utils.optim import Constant


def _longvq_task() -> Classification:
    torch.manual_seed(0)
    model = SequenceModel(mixer=partial(LongVQ, zdim=8, ndim=2, n_codes=8, chunk_size=16, backend="torch"),
                          d_model=16, n_layers=1, vocab_size=20, num_classes=2)
    return Classification(model, partial(torch.optim.AdamW, lr=1e-2), partial(Constant, warmup_steps=0),
                          num_classes=2, compile="none")


def _loader() -> ResumableLoader:
    g = torch.Generator().manual_seed(0)
    inputs, labels = torch.randint(1, 20, (16, 32), generator=g), torch.randint(0, 2, (16,), generator=g)
    rows = [{"inputs": x, "labels": y} for x, y in zip(inputs, labels)]
    return ResumableLoader(rows, EpochSampler(len(rows), seed=0, shuffle=False), batch_size=4)


def _fit(task, max_steps, root, ckpt_path=None, save=False):
    callbacks = [ModelCheckpoint(dirpath=root, save_last=True, save_top_k=0, save_on_train_epoch_end=True)]
    trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, limit_val_batches=0, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                         enable_checkpointing=save, callbacks=callbacks if save else [])
    trainer.fit(task, train_dataloaders=_loader(), ckpt_path=ckpt_path)


def test_a_resumed_longvq_run_keeps_the_codebook_update_of_the_checkpoints_last_step(tmp_path):
    """Bug: LongVQ's codebook EMA of a step's statistics was applied only when the next training batch started, so
    every checkpoint lacked its last step's update, held only in non-persistent pending buffers: a resumed run lost
    it and trained on another codebook than the uninterrupted run. The task now applies it right after each
    optimizer step."""
    full = _longvq_task()
    _fit(full, 6, tmp_path)
    _fit(_longvq_task(), 4, tmp_path, save=True)  # one epoch of 4 batches; last.ckpt at its end
    resumed = _longvq_task()
    _fit(resumed, 6, tmp_path, ckpt_path=str(tmp_path / "last.ckpt"))
    want, got = full.state_dict(), resumed.state_dict()
    for name in ("model.blocks.0.mixer.vq.counts", "model.blocks.0.mixer.vq.sums"):
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def _seqboat_gumbel_task() -> Classification:
    torch.manual_seed(0)
    model = SequenceModel(mixer=partial(SeqBoat, d_qk=8, d_v=16, ndim=2, window=8, max_len=32, router="gumbel",
                                        backend="torch"),
                          d_model=16, n_layers=1, vocab_size=20, num_classes=2)
    return Classification(model, partial(torch.optim.AdamW, lr=1e-2), partial(Constant, warmup_steps=0),
                          num_classes=2, compile="none")


def _gumbel_tau(task) -> float:
    return float(next(m for m in task.modules() if isinstance(m, LatentConfigurator)).gumbel_tau)


def test_a_checkpoint_is_scored_at_the_progress_it_was_trained_to(tmp_path):
    """Bug: the annealed Gumbel temperature of SeqBoat's gumbel router (A.4) is set from the training step and kept
    in no checkpoint, so `evaluate` scored a checkpoint at step 0's temperature (2.0), and the test after fit scored
    the best checkpoint at the last step's: one checkpoint, two test losses. Loading a checkpoint now sets the
    model's progress to the checkpoint's step."""
    trained = _seqboat_gumbel_task()
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(trained, train_dataloaders=_loader())
    path = tmp_path / "step.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["global_step"] = 200_000  # as a long run writes it: the temperature has annealed to 0.74
    torch.save(checkpoint, path)
    after_fit = trainer.test(trained, dataloaders=_loader(), ckpt_path=str(path), verbose=False)[0]
    assert _gumbel_tau(trained) == pytest.approx(gumbel_temperature(200_000), rel=1e-6)
    fresh = _seqboat_gumbel_task()  # what `evaluate` builds
    scored = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path).test(fresh, dataloaders=_loader(), ckpt_path=str(path),
                                                        verbose=False)[0]
    assert _gumbel_tau(fresh) == pytest.approx(gumbel_temperature(200_000), rel=1e-6)
    assert scored["test/loss"] == after_fit["test/loss"]
