"""callbacks=ema: validation, the best checkpoint and the test all use the exponential moving average of the
weights, computed here by hand from the raw weights after each optimizer step."""

from __future__ import annotations

import torch
from pytorch_lightning.callbacks import Callback

from longmixer.train import train
from tests.conftest import TINY_LISTOPS, TINY_TRAINER

DECAY = 0.5


def _weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items() if v.dtype.is_floating_point}


class WeightRecorder(Callback):
    """Listed after the EMA callback, so its hooks see the weights the EMA callback left in the module."""

    raw: list[dict[str, torch.Tensor]] = []
    validated: list[dict[str, torch.Tensor]] = []
    tested: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.raw.append(_weights(pl_module))

    def on_validation_epoch_start(self, trainer, pl_module):
        self.validated.append(_weights(pl_module))

    def on_test_epoch_start(self, trainer, pl_module):
        self.tested.append(_weights(pl_module))


def test_ema_callback_evaluates_and_tests_the_averaged_weights(compose, tmp_path):
    for store in (WeightRecorder.raw, WeightRecorder.validated, WeightRecorder.tested):
        store.clear()
    # 3 steps, one validation at step 3 (the best and only checkpoint), then the test of that checkpoint
    cfg = compose([*TINY_LISTOPS, *TINY_TRAINER, "trainer.max_steps=3", "trainer.val_check_interval=3",
                   "callbacks=ema", f"callbacks.ema.decay={DECAY}",
                   "+callbacks.zz_recorder._target_=tests.callbacks.test_ema.WeightRecorder"])
    train(cfg)
    raw, (validated,), (tested,) = WeightRecorder.raw, WeightRecorder.validated, WeightRecorder.tested
    assert len(raw) == 3
    ema = dict(raw[0])  # torch's AveragedModel: the first update copies, then ema = d * ema + (1 - d) * w
    for step in raw[1:]:
        ema = {k: DECAY * ema[k] + (1 - DECAY) * step[k] for k in ema}
    changed = [k for k in ema if not torch.allclose(ema[k], raw[-1][k])]
    assert changed, "the average equals the last raw weights: the test cannot tell them apart"
    for key in ema:
        torch.testing.assert_close(validated[key], ema[key], msg=key)
        # the test runs the inference form: CHELA's short convolution branches are fused into the long kernel
        # (SequenceTask.on_test_start), so those tensors are the fused EMA weights, checked by the mixer's tests
        if ".conv." not in key:
            torch.testing.assert_close(tested[key], ema[key], msg=key)
    best = next((tmp_path / "run" / "checkpoints").glob("best-*.ckpt"))
    state = torch.load(best, map_location="cpu", weights_only=True)["state_dict"]
    torch.testing.assert_close(state[changed[0]], ema[changed[0]])


def test_before_averaging_starts_validation_and_checkpoints_use_the_trained_weights(compose, tmp_path):
    """update_starting_at_step 10 with validations at steps 2 and 4: there is no average yet, so both validate the
    weights being trained (Lightning's copy still held the initial weights), and so do the checkpoints."""
    for store in (WeightRecorder.raw, WeightRecorder.validated, WeightRecorder.tested):
        store.clear()
    cfg = compose([*TINY_LISTOPS, *TINY_TRAINER, "trainer.max_steps=4", "trainer.val_check_interval=2",
                   "callbacks=ema", "callbacks.ema.update_starting_at_step=10",
                   "+callbacks.zz_recorder._target_=tests.callbacks.test_ema.WeightRecorder"])
    train(cfg)
    raw, validated = WeightRecorder.raw, WeightRecorder.validated
    assert len(raw) == 4 and len(validated) == 2
    for weights, seen in ((raw[1], validated[0]), (raw[3], validated[1])):
        assert any(not torch.equal(raw[0][k], weights[k]) for k in weights)
        for key in weights:
            torch.testing.assert_close(seen[key], weights[key], msg=key)
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    key = next(k for k in raw[3] if ".conv." not in k)
    torch.testing.assert_close(last["state_dict"][key], raw[3][key])
