"""What every task shares (`tasks/base.py`): the progress handed to scheduled layers around optimizer steps."""

from __future__ import annotations

from functools import partial

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from longmixer.data.base import EpochSampler, ResumableLoader
from longmixer.mixers.longvq import LongVQ
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
