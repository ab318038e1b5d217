"""The run dir's guards, in-process: safe loading, corrupt last.ckpt, drift, finished rerun, lock, divergence,
unreachable validation, progress bar off."""

import csv
import json
import os
import pickle
import re
import time
from pathlib import Path

import pytest
import torch

from longmixer.runs.checkpoints import CheckpointAccessError, CheckpointError, load_checkpoint
from longmixer.runs.resume import ConfigDriftError, RunLock, RunLockedError
from longmixer.train import train
from tests.conftest import TINY_LISTOPS, TINY_TRAINER, compose_config

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
    with pytest.raises(CheckpointError, match="crafted.ckpt") as refused:
        load_checkpoint(crafted)
    assert not marker.exists()
    # what it refused (an opcode here; the global below), without torch's advice to load with weights_only=False
    assert "Unsupported operand" in str(refused.value)
    torch.save({"state_dict": {}, "payload": _WritesAFile(str(marker))}, crafted)
    with pytest.raises(CheckpointError) as refused_global:
        load_checkpoint(crafted)
    assert not marker.exists() and "GLOBAL" in str(refused_global.value) and "open" in str(refused_global.value)
    for err in (refused.value, refused_global.value):
        assert "weights_only" not in str(err) and "\n" not in str(err)


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


def test_a_killed_forced_continuation_is_resumed_not_reported(compose, tmp_path, monkeypatch):
    """`resume=force` on a finished run left its results.json saying "finished" while the continuation trained; when
    that attempt was killed, the same command (its config now the stored one) reported the old results and never
    resumed, and the report took them for the run's. The finished results are kept in history/ instead."""
    import longmixer.train as entry

    train(compose(BASE))
    run = tmp_path / "run"
    old = json.loads((run / "results.json").read_text())
    forced = [*BASE, "optim.lr=0.5", "resume=force", "trainer.max_steps=4", "trainer.val_check_interval=2"]

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the continuation stops after training, before it is tested

    with monkeypatch.context() as patch:
        patch.setattr(entry, "_test_until_signal", killed)
        with pytest.raises(KeyboardInterrupt):
            train(compose(forced))
    assert not (run / "results.json").exists()
    (kept,) = (run / "history").glob("results.*.json")
    assert json.loads(kept.read_text()) == old
    again = train(compose(forced))  # resumes the continuation and tests it
    attempts = json.loads((run / "run_info.json").read_text())["attempts"]
    assert [a["ended"] for a in attempts] == ["finished", "interrupted", "finished"] and attempts[2]["resumed_from"]
    assert json.loads((run / "results.json").read_text())["metrics"] == again["metrics"]


def _hydra_writes(run_dir, overrides):
    """What Hydra does before `train` starts: this command's record written into the run dir's .hydra/."""
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    for name in ("config", "hydra", "overrides"):
        (run_dir / ".hydra" / f"{name}.yaml").write_text(f"# {name}\n" + "".join(f"- {o}\n" for o in overrides))


def _record(run_dir):
    return {p.name: p.read_text() for p in [*(run_dir / ".hydra").glob("*.yaml"), run_dir / "config_tree.txt"]}


def test_a_refused_or_finished_rerun_leaves_the_runs_record(compose, tmp_path):
    run = tmp_path / "run"
    cfg = compose(BASE)
    _hydra_writes(run, ["optim.lr=0.002"])
    train(cfg)
    first = _record(run)
    assert len(first) == 4 and "optim.lr=0.002" in first["overrides.yaml"] and "optim" in first["config_tree.txt"]
    cfg = compose([*BASE, "optim.lr=0.5"])
    _hydra_writes(run, ["optim.lr=0.5"])
    with pytest.raises(ConfigDriftError):
        train(cfg)
    assert _record(run) == first
    cfg = compose([*BASE, "trainer.enable_progress_bar=true"])
    _hydra_writes(run, ["optim.lr=0.002", "trainer.enable_progress_bar=true"])
    train(cfg)  # finished: reported, not trained
    assert _record(run) == first
    cfg = compose([*BASE, "optim.lr=0.5", "resume=force", "trainer.max_steps=4", "trainer.val_check_interval=2"])
    _hydra_writes(run, ["optim.lr=0.5", "resume=force"])
    train(cfg)  # this attempt runs: its record replaces the first's, and is the one a later refusal restores
    forced = _record(run)
    assert "resume=force" in forced["overrides.yaml"] and "0.5" in forced["config_tree.txt"]
    assert (run / ".hydra" / "accepted" / "overrides.yaml").read_text() == forced["overrides.yaml"]
    _hydra_writes(run, ["optim.lr=0.1"])
    lock = RunLock(run).acquire()  # a running attempt holds the dir: the second command is refused
    try:
        with pytest.raises(RunLockedError):
            train(compose([*BASE, "optim.lr=0.1"]))
    finally:
        lock.release()
    assert _record(run) == forced


def test_run_info_keeps_every_attempt_and_warns_of_a_new_commit(tmp_path, monkeypatch, caplog):
    from longmixer.runs import run_info

    commits = iter(["a" * 40, "a" * 40, "b" * 40])
    monkeypatch.setattr(run_info, "git_output", lambda *args, cwd: next(commits) if args[0] == "rev-parse" else "")
    (tmp_path / "run_info.json").write_text(json.dumps({"git_commit": "0" * 40, "git_dirty": True,
                                                        "command": ["old"], "cuda_devices": []}))
    run_info.write_run_info(tmp_path, tmp_path)  # a record from before attempts: kept as the first attempt
    run_info.write_run_info(tmp_path, tmp_path, resumed_from="checkpoints/last.ckpt")
    caplog.clear()
    with caplog.at_level("WARNING", logger="longmixer"):
        info = run_info.write_run_info(tmp_path, tmp_path, resumed_from="checkpoints/last.ckpt")
    assert json.loads((tmp_path / "run_info.json").read_text()) == info and info["git_commit"] == "b" * 40
    attempts = info["attempts"]
    assert [a["git_commit"][0] for a in attempts] == ["0", "a", "a", "b"] and attempts[0]["command"] == ["old"]
    assert [a.get("resumed_from") for a in attempts] == [None, None, "checkpoints/last.ckpt", "checkpoints/last.ckpt"]
    assert all(a["started"].endswith("Z") and a["host"] for a in attempts[1:])
    assert [r.getMessage() for r in caplog.records] == [
        f"this run started on commit {'a' * 10} and continues on {'b' * 10} (run_info.json lists every attempt)"]


def test_run_info_says_how_each_attempt_ended(compose, tmp_path, monkeypatch):
    """A run listed as unfinished says why: each attempt that ran records `ended` (a diverged or crashed attempt
    looked like a killed one). An unreadable run_info.json is kept aside, not overwritten."""
    from longmixer.tasks.classification import Classification

    def diverges(self, batch, batch_idx):
        raise FloatingPointError("the training loss is nan at step 0")

    with monkeypatch.context() as patch:
        patch.setattr(Classification, "training_step", diverges)
        with pytest.raises(FloatingPointError):
            train(compose(BASE))
    info = tmp_path / "run" / "run_info.json"
    (failed,) = json.loads(info.read_text())["attempts"]
    assert failed["ended"] == "failed: FloatingPointError: the training loss is nan at step 0"
    info.write_text(info.read_text()[:-20])  # cut short
    train(compose(BASE))
    assert [a["ended"] for a in json.loads(info.read_text())["attempts"]] == ["finished"]
    (kept,) = info.parent.glob("run_info.json.unreadable.*")
    assert '"ended": "failed: FloatingPointError' in kept.read_text()


def test_resume_force_trains_with_the_changed_optimizer_settings(compose, tmp_path, caplog):
    """A checkpoint restores the optimizer's and the schedule's settings with their state: `resume=force` puts the
    changed config's back (lr, weight decay, and max_steps, the schedule's length), keeping the step and moments."""
    train(compose(BASE))
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    before = torch.load(last, weights_only=True)
    with caplog.at_level("WARNING", logger="longmixer"):
        train(compose([*BASE, "optim.lr=0.5", "optim.weight_decay=0.3", "resume=force", "trainer.max_steps=4",
                       "trainer.val_check_interval=2"]))
    after = torch.load(last, weights_only=True)
    schedule, groups = after["lr_schedulers"][0], after["optimizer_states"][0]["param_groups"]
    assert after["global_step"] == 4 and schedule["last_epoch"] == 4 and schedule["total_steps"] == 4
    old_bases = before["lr_schedulers"][0]["base_lrs"]
    assert schedule["base_lrs"] == pytest.approx([b * 0.5 / 0.002 for b in old_bases])
    assert [g["initial_lr"] for g in groups] == schedule["base_lrs"]
    assert {g["weight_decay"] for g in groups} <= {0.0, 0.3} and any(g["weight_decay"] == 0.3 for g in groups)
    assert "continue with the config's initial_lr, scheduler.base_lrs" in caplog.text
    (kept,) = (tmp_path / "run" / "history").glob("config_resolved.*.yaml")  # what the first steps trained with
    assert "lr: 0.002" in kept.read_text() and "lr: 0.5" in (tmp_path / "run" / "config_resolved.yaml").read_text()
    caplog.clear()
    with caplog.at_level("WARNING", logger="longmixer"):  # a plain resume: the restored settings are the config's
        train(compose([*BASE, "optim.lr=0.5", "optim.weight_decay=0.3", "resume=force", "trainer.max_steps=6",
                       "trainer.val_check_interval=2"]))
    assert "continue with the config's scheduler.total_steps, not" in caplog.text
    assert "initial_lr" not in caplog.text
    assert len(list((tmp_path / "run" / "history").glob("config_resolved.*.yaml"))) == 2


def test_second_process_on_a_run_dir_fails_fast(tmp_path):
    lock = RunLock(tmp_path).acquire()
    try:
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
    finally:
        lock.release()


def test_non_finite_loss_stops_the_run(compose):
    """A user-facing error (one line and exit 2 from the command line; it was a traceback): the fix is a setting."""
    from longmixer.utils.errors import UserFacingError

    with pytest.raises(UserFacingError, match="non-finite loss at step"):
        train(compose([*BASE, "optim.lr=1e30", "trainer.max_steps=6", "trainer.val_check_interval=6",
                       "data.num_train=96"]))


def test_max_steps_before_the_first_scheduled_validation_is_validated_there(compose):
    """max_steps 2 with validation every 4 steps: the last step is validated, so the run has a best checkpoint."""
    results = train(compose([*BASE, "trainer.val_check_interval=4"]))
    assert {"val/acc", "test/acc"} <= set(results["metrics"]) and results["best_ckpt"].endswith("best-000002.ckpt")


def test_max_steps_in_an_epoch_that_never_validates_stops_at_start(compose):
    # validation every second epoch (4 steps each): max_steps 2 ends in the first, which is not validated
    with pytest.raises(ValueError, match="trainer.max_steps"):
        train(compose([*BASE, "trainer.val_check_interval=null", "trainer.check_val_every_n_epoch=2"]))


def test_validation_switched_off_is_refused_with_its_own_fix(compose):
    """`trainer.limit_val_batches=0` leaves no best checkpoint to test: the line names that key, not max_steps."""
    with pytest.raises(ValueError, match=r"trainer.limit_val_batches=0 disables validation: .* Leave "
                                         r"trainer.limit_val_batches out .*; or pass test=false") as err:
        train(compose([*BASE, "trainer.limit_val_batches=0"]))
    assert "Raise trainer.max_steps" not in str(err.value)


def test_max_steps_zero_is_refused_before_training(compose):
    """Bug: `trainer.max_steps=0` passed the schedule check (which takes the step at max_steps to be validated),
    fit ran no step, and the run ended in a RuntimeError ("no best checkpoint was written") after the data was set
    up, naming neither the key nor its fix."""
    with pytest.raises(ValueError, match=r"^trainer.max_steps=0 trains no step: no validation, so no best checkpoint, "
                                         r"before training stops. Set trainer.max_steps"):
        train(compose([*BASE, "trainer.max_steps=0"]))


def test_max_steps_inside_the_first_validating_epoch_is_validated_there(compose):
    # validation every second epoch (4 steps each): max_steps 6 stops inside the second, which validates the stop
    results = train(compose([*BASE, "trainer.val_check_interval=null", "trainer.check_val_every_n_epoch=2",
                             "trainer.max_steps=6"]))
    assert results["best_ckpt"].endswith("best-000006.ckpt") and "val/acc" in results["metrics"]


def test_an_interval_longer_than_the_epoch_with_epoch_counted_validation_is_refused(compose):
    with pytest.raises(ValueError, match=r"val_check_interval=6 batches is longer than an epoch \(4 batches"):
        train(compose([*BASE, "trainer.check_val_every_n_epoch=2", "trainer.val_check_interval=6",
                       "trainer.max_steps=10"]))
    with pytest.raises(ValueError, match=r"val_check_interval=6 batches is longer than an epoch \(4 batches"):
        train(compose([*BASE, "trainer.val_check_interval=6", "trainer.max_steps=10"]))


def test_epochs_cut_by_limit_train_batches_keep_their_length_and_validation(compose):
    # 10 batches a pass, 7 an epoch: validation every second epoch comes at step 14 (the rest of a pass once made
    # a 3-batch second epoch, which never reached its validation)
    results = train(compose([*BASE, "data.num_train=160", "trainer.limit_train_batches=0.7",
                             "trainer.val_check_interval=null", "trainer.check_val_every_n_epoch=2",
                             "trainer.max_steps=17"]))
    assert results["best_ckpt"].endswith(("best-000014.ckpt", "best-000017.ckpt"))
    steps = sorted({int(row["step"]) for row in csv.DictReader(open(Path(results["run_dir"]) / "csv" / "metrics.csv"))
                    if row.get("val/acc")})
    assert steps[0] == 13  # the logger's step column of the validation after optimizer step 14


def test_a_fraction_of_the_epoch_that_validates_inside_an_update_is_refused(compose):
    # 4 batches an epoch, 2 an update: 0.75 validates after batch 3 (inside the second update); 0.5 after batch 2
    with pytest.raises(ValueError, match=r"every 3 of an epoch's 4 batches.*use trainer.val_check_interval=2 "):
        train(compose([*BASE, "trainer.val_check_interval=0.75", "trainer.accumulate_grad_batches=2"]))
    # 5 batches an epoch, 8 an update: no batch inside the epoch ends an update; the suggestion must be one
    # Lightning takes (an int above the epoch's batches is refused there)
    with pytest.raises(ValueError, match=r"use trainer.val_check_interval=null"):
        train(compose([*BASE, "data.num_train=80", "trainer.val_check_interval=0.5",
                       "trainer.accumulate_grad_batches=8"]))
    results = train(compose([*BASE, "trainer.val_check_interval=0.5", "trainer.accumulate_grad_batches=2",
                             "trainer.max_steps=3"]))
    assert "val/acc" in results["metrics"]


class _Data:
    """What `_epoch_batches` reads of a datamodule."""

    def __init__(self, dataset, batch_size=4):
        self.dataset, self.batch_size = dataset, batch_size

    def prepare_data(self):
        pass

    def setup(self, stage):
        pass

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.dataset, batch_size=self.batch_size)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(40))

    def __len__(self):  # one process's length: the ranks' own are set only once they run
        return 40


@pytest.mark.parametrize("trainer, dataset, world, batches", [
    ({}, list(range(40)), 2, 5),
    ({"limit_train_batches": 0.5}, list(range(40)), 2, 2),
    ({"overfit_batches": 6}, list(range(40)), 2, 6),  # Lightning's sequential sampler: the whole set on each rank
    ({"overfit_batches": 0.5}, list(range(40)), 2, 5),
    ({}, _Stream(), 1, 10),
    ({}, _Stream(), 2, None),
])
def test_epoch_batches_per_rank(trainer, dataset, world, batches):
    from omegaconf import OmegaConf

    from longmixer.runs.run import _epoch_batches

    assert _epoch_batches(OmegaConf.create({"trainer": trainer}), _Data(dataset), world) == batches


@pytest.mark.parametrize("trainer, batches, first", [
    ({"check_val_every_n_epoch": 2}, 10, 20),
    ({"check_val_every_n_epoch": 2, "accumulate_grad_batches": 4}, 10, 6),  # an epoch ends with a step: 3 a epoch
    ({"check_val_every_n_epoch": 3, "val_check_interval": 0.5}, 10, 25),
    ({"check_val_every_n_epoch": 2, "val_check_interval": 0.5, "accumulate_grad_batches": 2}, 10, 7),
    ({"check_val_every_n_epoch": 2, "val_check_interval": 4}, 10, 14),
    ({"val_check_interval": 6, "accumulate_grad_batches": 2}, None, 3),
    ({"check_val_every_n_epoch": 2}, None, None),  # an iterable train set: not known
])
def test_first_validation_step_counts_optimizer_steps(trainer, batches, first):
    from omegaconf import OmegaConf

    from longmixer.runs.run import first_validation_step

    cfg = OmegaConf.create({"trainer": {"val_check_interval": None, **trainer}})
    assert first_validation_step(cfg, batches) == first


def test_progress_bar_off_with_the_rich_bar_in_callbacks(compose):
    cfg_overrides = [o for o in BASE if o != "~callbacks.progress"]
    assert train(compose(cfg_overrides))["metrics"]["test/acc"] >= 0


def test_run_dir_hash_normalizes_values_and_covers_trainer_callbacks_data_dir():
    from longmixer.utils.resolvers import _run_hash

    exclude = ["seed", "paths.log_dir", "callbacks.progress", "trainer.enable_progress_bar"]
    assert _run_hash(["optim.lr=2e-3", "trainer.max_steps=10"], exclude) == \
        _run_hash(["trainer.max_steps=10.0", "optim.lr=0.002"], exclude)
    assert _run_hash(["optim.lr=2e-3"], exclude) != _run_hash(["optim.lr=3e-3"], exclude)
    assert _run_hash(["seed=3", "~callbacks.progress", "trainer.enable_progress_bar=false"], exclude) == "default"
    for changes_results in ("trainer=ddp", "trainer.max_steps=50", "callbacks.checkpoint.monitor=val/loss",
                            "paths.data_dir=/elsewhere", "data.batch_size=8"):
        assert _run_hash([changes_results], exclude) != "default", changes_results


def test_second_identical_run_fails_fast_naming_the_lock(compose, tmp_path):
    holder = RunLock(tmp_path / "run").acquire()
    try:
        with pytest.raises(RunLockedError, match=r"\.lock is held by pid \d+ on host"):
            train(compose(BASE))
    finally:
        holder.release()
    assert not (tmp_path / "run" / "results.json").exists()


def test_last_ckpt_follows_the_cadence_not_the_best_score(compose, tmp_path):
    # validation every 2 steps, last.ckpt also every 3 steps: last.ckpt is the final step whatever the score
    train(compose([*BASE, "trainer.max_steps=7", "trainer.val_check_interval=2", "data.num_train=160",
                   "callbacks.checkpoint.every_n_train_steps=3"]))
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 7


def test_non_finite_metric_never_becomes_best(compose, tmp_path):
    from longmixer.callbacks.checkpoint import AtomicModelCheckpoint

    cb = AtomicModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor="val/acc", mode="max")

    class _Trainer:  # the attributes on_validation_end reads
        fast_dev_run, sanity_checking, global_step, current_epoch, is_global_zero = False, False, 3, 0, True
        def __init__(self):
            self.callback_metrics = {"val/acc": torch.tensor(float("nan"))}

        class state:
            fn = "fit"

    saved = []
    cb._save_last = lambda trainer: saved.append("last")
    cb._stop_requested = lambda trainer: None
    cb.on_validation_end(_Trainer(), None)
    assert saved == ["last"] and cb.best_model_path == "" and cb.best_k_models == {}


def test_best_path_from_a_checkpoint_outside_the_run_dir_is_refused(tmp_path):
    from longmixer.runs.checkpoints import trusted_best_path

    (tmp_path / "checkpoints").mkdir()
    elsewhere = tmp_path / "crafted.ckpt"
    elsewhere.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a .ckpt file in"):
        trusted_best_path(str(elsewhere), tmp_path / "checkpoints")


def test_evaluate_refuses_a_crafted_checkpoint(compose, tmp_path):
    from longmixer.evaluate import evaluate

    train(compose(BASE))
    marker = tmp_path / "pwned"
    crafted = tmp_path / "run" / "checkpoints" / "crafted.ckpt"
    torch.save({"state_dict": {}, "payload": _WritesAFile(str(marker))}, crafted)
    with pytest.raises(CheckpointError, match="crafted.ckpt"):
        evaluate(compose([f"run_dir={tmp_path / 'run'}", f"ckpt_path={crafted}"]))
    assert not marker.exists()


def test_resume_skips_a_crafted_last_ckpt_without_running_it(compose, tmp_path, caplog):
    from longmixer.runs.checkpoints import newest_intact

    train(compose(BASE))
    marker = tmp_path / "pwned"
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    torch.save({"state_dict": {}, "global_step": 99, "payload": _WritesAFile(str(marker))}, last)
    assert newest_intact(last.parent).name.startswith("best-")
    assert not marker.exists() and "weights-only allowlist" in caplog.text


def test_config_drift_compares_by_meaning():
    from longmixer.runs.resume import config_drift

    stored = {"optim": {"lr": "2e-3", "betas": [0.9, 0.98]}, "trainer": {"max_steps": 100}, "seed": 0}
    same = {"optim": {"lr": 0.002, "betas": [0.9, 0.98]}, "trainer": {"max_steps": 100.0}, "seed": 0,
            "run_dir": "/x", "new_key": None, "logger": {"csv": {}}, "trainer.enable_progress_bar": False}
    assert config_drift(stored, same) == {}
    changed = {**same, "optim": {"lr": 0.003, "betas": [0.9, 0.98]}, "trainer": {"max_steps": 200}}
    assert config_drift(stored, changed) == {"optim.lr": (0.002, 0.003), "trainer.max_steps": (100.0, 200.0)}


def test_a_longer_time_budget_is_not_drift_but_more_steps_are():
    """A resumed run may be given more wall time (learning_curves.py spreads one budget over several calls);
    max_steps changes the schedule, so it stays drift."""
    from longmixer.runs.resume import config_drift

    stored = {"trainer": {"max_time": "00:00:08:00", "max_steps": 100}}
    assert config_drift(stored, {"trainer": {"max_time": "00:00:16:00", "max_steps": 100}}) == {}
    assert config_drift(stored, {"trainer": {"max_time": "00:00:16:00", "max_steps": 200}}) == {
        "trainer.max_steps": (100.0, 200.0)}


def test_a_last_ckpt_that_cannot_be_read_stops_the_resume_instead_of_going_back(compose, tmp_path, monkeypatch):
    """A permission or I/O error reading last.ckpt was reported as a corrupt file, and the resume went back to an
    older best-*.ckpt, whose training then replaced the unread (possibly intact) last.ckpt at its first save. The
    resume now stops, naming the file and the fix, and leaves it as it was."""
    import errno

    train(compose([*BASE, "test=false"]))  # the same command without test=false resumes from last.ckpt to test
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    real_load = torch.load

    def load(path, *args, **kwargs):  # Lightning's own loads pass an open file
        if Path(str(getattr(path, "path", path))).name == "last.ckpt":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(CheckpointAccessError, match=r"last\.ckpt \(PermissionError: .*not checked.*make it readable"):
        train(compose(BASE))
    assert last.read_bytes() == before
    assert not isinstance(CheckpointAccessError("x"), CheckpointError)  # what resume skips as damaged


@pytest.mark.parametrize("content", [b"hello: world\n", b"", b"\x00" * 64, b"[1, 2, 3]"])
def test_a_file_that_is_no_checkpoint_is_a_checkpoint_error(tmp_path, content):
    """Text, empty or zero files make torch's safe unpickler raise KeyError / IndexError / EOFError...; every one
    is a `CheckpointError` naming the file, so resume skips it and evaluate refuses it in one line."""
    path = tmp_path / "last.ckpt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="last.ckpt"):
        load_checkpoint(path)


def test_resume_skips_a_last_ckpt_that_is_no_checkpoint(compose, tmp_path):
    from longmixer.runs.checkpoints import newest_intact

    train(compose(BASE))
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "last.ckpt").write_text("hello: world\n")
    assert newest_intact(ckpts).name.startswith("best-")
    torch.save([1, 2], ckpts / "last.ckpt")  # loads, but is no Lightning checkpoint
    assert newest_intact(ckpts).name.startswith("best-")


def test_evaluate_refuses_what_it_cannot_use_in_one_line(compose, tmp_path, caplog):
    """Errors a user fixes: a file that is no checkpoint, another model's checkpoint (before Lightning's strict load
    lists every key; a variant with weights of the same shapes, which loaded and scored wrongly, by the model config
    the checkpoint records), a missing ckpt_path or run dir; each a UserFacingError naming the file."""
    from longmixer.evaluate import EvaluateError, evaluate
    from longmixer.utils.errors import UserFacingError

    train(compose(BASE))
    run = tmp_path / "run"
    with pytest.raises(CheckpointError, match="config_resolved.yaml .*not a checkpoint"):
        evaluate(compose([f"run_dir={run}", f"ckpt_path={run / 'config_resolved.yaml'}"]))
    other = tmp_path / "other.ckpt"
    state = load_checkpoint(next((run / "checkpoints").glob("best-*.ckpt")))
    state["state_dict"] = {f"model.other.{i}": torch.zeros(1) for i in range(3)}
    torch.save(state, other)
    with pytest.raises(CheckpointError, match="does not hold this model's weights.*config_resolved.yaml's"):
        evaluate(compose([f"run_dir={run}", f"ckpt_path={other}"]))
    # the same model at another width: the names match, the sizes do not (Lightning listed every mismatch)
    state = load_checkpoint(next((run / "checkpoints").glob("best-*.ckpt")))
    state["state_dict"] = {k: torch.zeros(*(n + 1 for n in v.shape)) for k, v in state["state_dict"].items()}
    torch.save(state, other)
    with pytest.raises(CheckpointError, match=r"weights of another size than this model's: \d+ differ, e\.g\. model"):
        evaluate(compose([f"run_dir={run}", f"ckpt_path={other}"]))
    # a variant with the same weight shapes (the quickstart CHELA's laplace attention scored as its norm attention):
    # the checkpoint's record of its model config tells them apart, naming the key and both values
    state, variant = load_checkpoint(next((run / "checkpoints").glob("best-*.ckpt"))), tmp_path / "variant.ckpt"
    assert state["longmixer"]["model_config"]["mixer"]["attention"] == "laplace"
    state["longmixer"]["model_config"]["mixer"]["attention"] = "norm"
    torch.save(state, variant)
    with pytest.raises(CheckpointError, match=r"another model config than .*config_resolved\.yaml's: model\.mixer\."
                       r"attention=norm in the checkpoint, laplace in the run's; score it with .*run_dir="):
        evaluate(compose([f"run_dir={run}", f"ckpt_path={variant}"]))
    del state["longmixer"]["model_config"]  # an earlier version's checkpoint: scored, with a warning
    torch.save(state, variant)
    caplog.set_level("WARNING", logger="longmixer")
    assert "test/acc" in evaluate(compose([f"run_dir={run}", f"ckpt_path={variant}"]))
    assert "holds no record of the model config" in caplog.text
    # train with ckpt_path= of another size, in a fresh run dir: refused before anything trains
    with pytest.raises(CheckpointError, match="another size.*pass ckpt_path=<a checkpoint of this model>"):
        train(compose([*BASE, f"run_dir={tmp_path / 'fresh'}", f"ckpt_path={other}"]))
    assert not (tmp_path / "fresh" / "checkpoints").exists()
    with pytest.raises(EvaluateError, match="does not exist; the run's checkpoints are in"):
        evaluate(compose([f"run_dir={run}", f"ckpt_path={tmp_path / 'nope.ckpt'}"]))
    with pytest.raises(EvaluateError, match="holds no config_resolved.yaml"):
        evaluate(compose([f"run_dir={tmp_path / 'nope'}"]))
    # an override that the run's stored config would silently replace (it was accepted and ignored)
    with pytest.raises(EvaluateError, match=r"so model\.d_model=64 data\.batch_size=0 would not apply; drop it"):
        evaluate(compose([f"run_dir={run}", "model.d_model=64", "data.batch_size=0", "trainer.accelerator=cpu"]))
    assert issubclass(EvaluateError, UserFacingError) and issubclass(CheckpointError, UserFacingError)


def test_a_ckpt_path_that_is_a_directory_is_named_as_one(compose, tmp_path):
    """`ckpt_path=<run dir>/checkpoints` (the folder, not a file in it) was refused by evaluate and train as a path
    that "does not exist"; both now say it is a directory and name a checkpoint file in it."""
    from longmixer.evaluate import EvaluateError, evaluate
    from longmixer.runs.resume import ResumeRefusedError

    train(compose(BASE))
    ckpts = tmp_path / "run" / "checkpoints"
    named = r"checkpoints is a directory, not a checkpoint file: name one of its \.ckpt files \(e\.g\. last\.ckpt\)"
    with pytest.raises(EvaluateError, match=named):
        evaluate(compose([f"run_dir={tmp_path / 'run'}", f"ckpt_path={ckpts}"]))
    with pytest.raises(ResumeRefusedError, match=named):
        train(compose([*BASE, f"run_dir={tmp_path / 'fresh'}", f"ckpt_path={ckpts}"]))


def test_weights_saved_without_lightnings_keys_are_refused_in_one_line(compose, tmp_path):
    """Weights saved by hand as `{"state_dict": ...}` (converted from another codebase) passed evaluate's and train's
    checks, then stopped in Lightning's load with a bare `KeyError: 'pytorch-lightning_version'` traceback; both now
    refuse the file in one line naming it, the missing key and how to save it."""
    from longmixer.evaluate import evaluate

    train(compose(BASE))
    run = tmp_path / "run"
    state = load_checkpoint(next((run / "checkpoints").glob("best-*.ckpt")))
    converted = tmp_path / "converted.ckpt"
    torch.save({"state_dict": state["state_dict"]}, converted)
    named = r"converted\.ckpt is not a Lightning checkpoint: .*without pytorch-lightning_version; .*save converted"
    with pytest.raises(CheckpointError, match=named):
        evaluate(compose([f"run_dir={run}", f"ckpt_path={converted}"]))
    with pytest.raises(CheckpointError, match=named):
        train(compose([*BASE, f"run_dir={tmp_path / 'fresh'}", f"ckpt_path={converted}"]))
    torch.save(state["state_dict"], converted)  # the bare weights
    with pytest.raises(CheckpointError, match=r"without pytorch-lightning_version, state_dict"):
        evaluate(compose([f"run_dir={run}", f"ckpt_path={converted}"]))


def test_evaluate_refuses_a_sweep_over_run_dirs_in_one_line(tmp_path, monkeypatch, capsys):
    """`evaluate -m run_dir=<a>,<b>` (the seeds of one configuration) was told that the comma-joined list "is not a
    training run dir"; a sweep's logs and summary go under one run dir's eval/, so it says to run one command per run
    dir."""
    import longmixer.evaluate

    runs = [tmp_path / f"run_seed{seed}" for seed in (0, 1)]
    for run in runs:
        run.mkdir()
        (run / "config_resolved.yaml").write_text("seed: 0\n")
    monkeypatch.setattr("sys.argv", ["evaluate", "-m", f"run_dir={runs[0]},{runs[1]}"])
    with pytest.raises(SystemExit) as stop:
        longmixer.evaluate.main()
    assert stop.value.code == 2
    assert "one command per run dir" in capsys.readouterr().err
    assert not any((run / "eval").exists() for run in runs)


def test_evaluate_without_a_recorded_best_names_the_best_checkpoint(compose, tmp_path):
    """A run trained with test=false records no best checkpoint in results.json: evaluate said "the run has not
    finished" and offered last.ckpt, not the best validation checkpoint that the reporting rule scores."""
    from longmixer.evaluate import EvaluateError, evaluate

    train(compose([*BASE, "test=false"]))
    run = tmp_path / "run"
    (best,) = (run / "checkpoints").glob("best-*.ckpt")
    with pytest.raises(EvaluateError, match=r"its status: trained, not tested \(test=false\).*e\.g\. "
                       + re.escape(str(best))):
        evaluate(compose([f"run_dir={run}"]))


def test_evaluate_takes_the_invocations_device_keys(tmp_path):
    """`evaluate run_dir=<a GPU run> trainer=cpu` re-scores it on a CPU: a trainer group chosen on the command line
    replaces the stored device keys, and single `trainer.<key>=` overrides replace theirs; the rest stays."""
    from omegaconf import OmegaConf

    from longmixer.evaluate import _run_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config_resolved.yaml").write_text(
        "trainer: {accelerator: gpu, devices: 1, precision: bf16-mixed, max_steps: 9}\nckpt_path: null\n")
    cfg = OmegaConf.create({"ckpt_path": None, "trainer": {"accelerator": "cpu", "devices": 1,
                                                           "precision": "32-true", "max_steps": 1}})
    moved = _run_config(run, cfg, ["trainer=cpu"]).trainer
    assert (moved.accelerator, moved.precision, moved.max_steps) == ("cpu", "32-true", 9)
    one = _run_config(run, cfg, ["trainer.precision=32-true"]).trainer
    assert (one.accelerator, one.precision) == ("gpu", "32-true")
    assert _run_config(run, cfg, []).trainer.accelerator == "gpu"


def test_evaluate_takes_task_compile_where_the_runs_mode_cannot_compile(compose, tmp_path, monkeypatch):
    """A run that trained compiled (a GPU run's `task.compile=reduce-overhead`), scored where torch.compile fails
    (Inductor on a CPU without a C++ compiler), stopped with CompileFailedError's fix `task.compile=none`, and
    evaluate refused that override as one it would not apply: the checkpoint could not be scored at all. The mode
    changes how the model runs, not what it computes, so evaluate takes it."""
    from omegaconf import OmegaConf

    from longmixer.evaluate import evaluate

    train(compose(BASE))
    run = tmp_path / "run"
    stored = OmegaConf.load(run / "config_resolved.yaml")
    stored.task.compile = "reduce-overhead"
    OmegaConf.save(stored, run / "config_resolved.yaml")
    modes = []
    monkeypatch.setattr("longmixer.tasks.base.compile_blocks", lambda model, mode, **kw: modes.append(mode) or model)
    evaluate(compose([f"run_dir={run}"]))
    assert modes == ["reduce-overhead"]  # the run's own mode unless the command line names another
    assert "test/acc" in evaluate(compose([f"run_dir={run}", "task.compile=none"]))
    assert modes[-1] == "none"


def test_evaluate_reads_the_runs_relative_data_dir_from_where_it_trained(tmp_path, monkeypatch, caplog):
    """A run trained with the default `paths.data_dir=./data` and evaluated from another directory read `./data`
    there (missing, or other data of the task); it is read from Hydra's record of the training's working directory.
    A folder on the evaluate command line stays relative to its own; without a record, a warning names the key."""
    from omegaconf import OmegaConf

    from longmixer.evaluate import _run_config

    run, trained_in = tmp_path / "run", tmp_path / "trained_in"
    (run / ".hydra").mkdir(parents=True)
    trained_in.mkdir()
    (run / "config_resolved.yaml").write_text(
        "paths: {data_dir: ./data, log_dir: /logs}\ndata: {data_dir: ./data, source_dir: src, seq_len: 30}\n"
        "trainer: {accelerator: cpu}\nckpt_path: null\n")
    cfg = OmegaConf.create({"ckpt_path": None, "paths": {"data_dir": "mine"}, "trainer": {}})
    monkeypatch.chdir(tmp_path)
    assert not (run / ".hydra" / "hydra.yaml").exists()
    caplog.set_level("WARNING", logger="longmixer")
    unrecorded = _run_config(run, cfg)
    assert unrecorded.data.data_dir == "./data"
    assert "paths.data_dir=./data" in caplog.text and "pass paths.data_dir=<folder>" in caplog.text
    (run / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    cwd: {trained_in}\n")
    stored = _run_config(run, cfg)
    assert (stored.paths.data_dir, stored.data.data_dir) == (str(trained_in / "data"),) * 2
    assert (stored.data.source_dir, stored.paths.log_dir) == (str(trained_in / "src"), "/logs")
    given = _run_config(run, cfg, ["paths.data_dir=mine"])
    assert (given.paths.data_dir, given.data.data_dir) == ("mine", "mine")


def test_a_fresh_start_drops_the_rows_of_an_attempt_killed_before_its_first_checkpoint(compose, tmp_path):
    """No checkpoint to resume from: the earlier attempt's rows (timings, and on a GPU losses that do not repeat
    bit for bit) would stay beside the new run's; they go, as a resume drops the rows after its checkpoint."""
    csv_dir = tmp_path / "run" / "csv"
    csv_dir.mkdir(parents=True)
    (csv_dir / "metrics.csv").write_text("epoch,step,train/speed/step_ms\n0,2,12345.0\n")
    train(compose(BASE))
    assert "12345" not in (csv_dir / "metrics.csv").read_text()
    # nothing logged is lost: the rows go to metrics.dropped.csv, each with the step the run went back to
    assert (csv_dir / "metrics.dropped.csv").read_text().splitlines() == [
        "epoch,step,train/speed/step_ms,rewound_to", "0,2,12345.0,0"]


def test_a_signal_in_the_last_step_stops_before_the_test_phase(compose, tmp_path, monkeypatch):
    """SIGTERM during the last step of an epoch that ends training: the stop that waits for the next step finds
    none, so it comes at the end of training (exit 143, no test phase); the same command then tests."""
    monkeypatch.setenv("LONGMIXER_FAULT", "SIGTERM:train:3")  # the batch after step 3: the epoch's and run's last
    args = [*BASE, "trainer.max_steps=4"]
    with pytest.raises(SystemExit) as stopped:
        train(compose(args))
    run = tmp_path / "run"
    assert stopped.value.code == 143 and not (run / "results.json").exists()
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    monkeypatch.delenv("LONGMIXER_FAULT")
    results = train(compose(args))
    assert results["status"] == "finished" and "test/acc" in results["metrics"]


def test_rewind_moves_rows_to_the_dropped_file_across_attempts(tmp_path):
    from longmixer.runs.loggers import ResumableCSVLogger

    logger = ResumableCSVLogger(save_dir=str(tmp_path), name="csv", version="")
    metrics = Path(logger.log_dir) / "metrics.csv"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_text("epoch,step,loss\n0,1,0.5\n0,3,0.4\n0,5,0.3\n")
    assert logger.rewind(3) == 2 and metrics.read_text() == "epoch,step,loss\n0,1,0.5\n"
    metrics.write_text("epoch,step,loss,val/acc\n0,1,0.5,\n0,3,0.41,0.2\n")
    assert logger.rewind(2) == 1 and logger.rewind(2) == 0
    assert (metrics.parent / "metrics.dropped.csv").read_text().splitlines() == [
        "epoch,step,loss,rewound_to,val/acc", "0,3,0.4,3,", "0,5,0.3,3,", "0,3,0.41,2,0.2"]


def test_the_test_phase_ends_with_the_signals_exit_status():
    """SIGTERM (a preemption) or Ctrl+C while the test split is scored: exit 143 / 130, as in training, so that a
    scheduler requeues the job; Lightning alone ends it with 0 (SIGTERMException) or 1."""
    import signal

    from pytorch_lightning.utilities.exceptions import SIGTERMException

    from longmixer.train import _test_until_signal

    class _Trainer:
        def __init__(self, action):
            self.action = action

        def test(self, *args, **kwargs):
            self.action()

    def sigterm():
        raise SIGTERMException

    def ctrl_c_as_lightning_handles_it():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            raise SystemExit(1) from None

    before = signal.getsignal(signal.SIGINT)
    for action, status in ((sigterm, 143), (ctrl_c_as_lightning_handles_it, 130)):
        with pytest.raises(SystemExit) as exit_info:
            _test_until_signal(_Trainer(action), None, None, None)
        assert exit_info.value.code == status
    assert signal.getsignal(signal.SIGINT) is before

    def crash():
        raise SystemExit(1)

    with pytest.raises(SystemExit) as exit_info:  # no signal: the status is left as it was
        _test_until_signal(_Trainer(crash), None, None, None)
    assert exit_info.value.code == 1


def test_a_damaged_best_checkpoint_is_named_before_the_test_phase(tmp_path):
    from longmixer.train import _read_best_checkpoint

    best = tmp_path / "best-000006.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}, "global_step": 6}, best)
    best.write_bytes(best.read_bytes()[: best.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"best-000006.ckpt .*truncated.*longmixer.evaluate run_dir="):
        _read_best_checkpoint(str(best), tmp_path)


def test_resume_never_refuses_a_finished_run_dir_too(compose, tmp_path):
    """`resume=never` refuses a run dir that holds checkpoints, as the README says, also when that run finished: a
    report of the old results with exit 0 would look like a run of the command."""
    from longmixer.runs.resume import ResumeRefusedError

    train(compose(BASE))
    with pytest.raises(ResumeRefusedError, match=r"already holds checkpoints .*\(resume=never\)"):
        train(compose([*BASE, "resume=never"]))


def test_a_row_cut_short_is_set_aside_and_the_history_kept(tmp_path):
    """A kill or a full disk during an append leaves a partial last row; the next row appended to it would be glued
    onto it (too many fields), and Lightning's next header rewrite then raised on that row after truncating the
    file, losing every later row. The partial row goes to metrics.dropped.csv, the whole rows stay."""
    from longmixer.runs.loggers import ResumableCSVLogger

    metrics = tmp_path / "csv" / "metrics.csv"
    metrics.parent.mkdir()
    for partial in ("0,5,0.3", "0,5"):  # cut inside the last value, or a field short
        metrics.write_text(f"epoch,loss,step\n0,0.5,1\n0,0.4,3\n{partial}")
        (metrics.parent / "metrics.dropped.csv").unlink(missing_ok=True)
        logger = ResumableCSVLogger(save_dir=str(tmp_path), name="csv", version="")
        logger.log_metrics({"loss": 0.2, "val/acc": 0.5}, step=7)  # a new column: the header is rewritten
        logger.save()
        assert metrics.read_text().splitlines() == [
            "epoch,loss,step,val/acc", "0,0.5,1,", "0,0.4,3,", ",0.2,7,0.5"]
        assert (metrics.parent / "metrics.dropped.csv").read_text().splitlines()[1].endswith(",cut short")


def test_a_row_cut_short_after_the_checkpoint_is_set_aside_by_the_rewind_too(tmp_path):
    """A resume rewinds metrics.csv before its logger reads the file. A last row cut short by a kill that also left
    rows after the checkpoint (a flush between checkpoints) was kept by the rewind, its step being missing or cut,
    and written back as a whole row of blanks and partial values, which then stayed in the history for good."""
    from longmixer.runs.loggers import ResumableCSVLogger

    metrics = tmp_path / "csv" / "metrics.csv"
    metrics.parent.mkdir()
    for partial, set_aside in (("0,0.2", "0,0.2,,cut short"), ("0,0.2,1", "0,0.2,1,cut short")):
        # cut before the step, or inside it ("1" of "17")
        metrics.write_text(f"epoch,loss,step\n0,0.5,1\n0,0.4,3\n0,0.3,5\n{partial}")
        (metrics.parent / "metrics.dropped.csv").unlink(missing_ok=True)
        logger = ResumableCSVLogger(save_dir=str(tmp_path), name="csv", version="")
        assert logger.rewind(3) == 2
        logger.log_metrics({"loss": 0.35}, step=3)  # the resumed run logs the rewound steps again
        logger.save()
        assert metrics.read_text().splitlines() == ["epoch,loss,step", "0,0.5,1", ",0.35,3"]
        dropped = (metrics.parent / "metrics.dropped.csv").read_text().splitlines()
        assert dropped == ["epoch,loss,step,rewound_to", set_aside, "0,0.4,3,3", "0,0.3,5,3"]


def test_the_rows_a_checkpoint_covers_are_on_disk_before_it_is(tmp_path):
    """The rows logged before a checkpoint were flushed only after it was in place: a SIGKILL in between (rank 0
    waiting at the checkpoint's barrier for the other ranks, or during the append itself) lost them for good, since
    the run resumed from that checkpoint does not log them again."""
    from longmixer.callbacks.checkpoint import AtomicModelCheckpoint
    from longmixer.runs.loggers import ResumableCSVLogger

    class _Killed(BaseException):
        pass

    logger = ResumableCSVLogger(save_dir=str(tmp_path), name="csv", version="")

    class _Trainer:
        is_global_zero, global_step, loggers = True, 4, [logger]

        class strategy:
            @staticmethod
            def barrier(name):
                raise _Killed  # the kill, with last.ckpt in place

        @staticmethod
        def save_checkpoint(path, weights_only=False):
            torch.save({"global_step": 4}, path)

    logger.log_metrics({"loss": 0.5}, step=3)  # the row of the step the checkpoint ends
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(_Killed):
        AtomicModelCheckpoint(dirpath=str(tmp_path / "checkpoints"))._save_last(_Trainer())
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "csv" / "metrics.csv").read_text().splitlines() == ["loss,step", "0.5,3"]


@pytest.mark.parametrize("content", ["", "\n"], ids=["zero-byte", "blank"])
def test_a_wandb_id_file_left_empty_gets_an_id(tmp_path, content):
    """A kill while wandb_id.txt was first written leaves it empty: every later attempt passed W&B the empty id and
    stopped in W&B's "Run ID cannot be empty". No W&B run was started with the lost id (the file is written before
    the run starts), so the run dir gets a new one, kept for the next attempts."""
    from longmixer.runs.loggers import WANDB_ID, wandb_run_id

    (tmp_path / WANDB_ID).write_text(content)
    run_id = wandb_run_id(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{12}", run_id)
    assert (tmp_path / WANDB_ID).read_text() == run_id and wandb_run_id(tmp_path) == run_id


def test_a_header_rewrite_cut_short_keeps_the_history(tmp_path, monkeypatch):
    """A new column rewrites metrics.csv with the wider header; Lightning truncates the file first, so a kill
    during the rewrite lost every row. It is written aside and moved into place."""
    import csv

    from longmixer.runs.loggers import ResumableCSVLogger

    metrics = tmp_path / "csv" / "metrics.csv"
    metrics.parent.mkdir()
    metrics.write_text("epoch,loss,step\n0,0.5,1\n0,0.4,3\n")
    logger = ResumableCSVLogger(save_dir=str(tmp_path), name="csv", version="")
    logger.log_metrics({"val/acc": 0.5}, step=4)

    def killed(self, rows):
        raise KeyboardInterrupt

    monkeypatch.setattr(csv.DictWriter, "writerows", killed)
    with pytest.raises(KeyboardInterrupt):
        logger.save()
    assert metrics.read_text() == "epoch,loss,step\n0,0.5,1\n0,0.4,3\n"


def test_an_unwritable_checkpoint_dir_is_refused_before_training(compose, tmp_path, monkeypatch):
    """The checkpoint dir is checked when fitting starts (it was met at the first save, after training up to it,
    as a FileNotFoundError about the temporary file: Lightning's save drops a PermissionError silently)."""
    import pytorch_lightning as pl

    from longmixer.callbacks.checkpoint import CheckpointDirError

    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("a file where the checkpoint dir goes")
    with pytest.raises(CheckpointDirError, match=f"cannot write checkpoints to {run / 'checkpoints'}"):
        train(compose(BASE))
    assert not (run / "csv" / "metrics.csv").exists()  # stopped before the first step
    (run / "checkpoints").unlink()
    monkeypatch.setattr(pl.Trainer, "save_checkpoint", lambda *args, **kwargs: None)  # a write that silently failed
    with pytest.raises(CheckpointDirError, match=r"\.ckpt\.tmp was not written; check the space"):
        train(compose(BASE))


def test_a_log_or_data_folder_under_a_file_is_refused_before_hydra(tmp_path, monkeypatch, capsys):
    from longmixer.runs.resume import refuse_unusable_folders

    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("LONGMIXER_LOGS", str(afile / "logs"))
    with pytest.raises(SystemExit) as stopped:
        refuse_unusable_folders([])
    assert stopped.value.code == 2 and f"{afile} is a file, not a folder" in capsys.readouterr().err
    refuse_unusable_folders([f"paths.log_dir={tmp_path / 'logs'}"])  # the command line wins
    with pytest.raises(SystemExit):
        refuse_unusable_folders([f"paths.data_dir={afile}/a/b"])


def test_a_run_not_tested_is_not_finished(compose, tmp_path):
    """Only a run tested at its best checkpoint is "finished" (the same command then reports it instead of running
    it). A run trained with test=false (a key outside the run-dir hash) is tested by the same command with
    test=true; a fast_dev_run smoke test runs again each time."""
    first = train(compose([*BASE, "test=false"]))
    assert first["status"] == "trained, not tested (test=false)" and "test/acc" not in first["metrics"]
    second = train(compose(BASE))
    assert second["status"] == "finished" and "test/acc" in second["metrics"]
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    smoke = [*TINY_LISTOPS, "trainer.fast_dev_run=true", "trainer.enable_progress_bar=false"]
    assert train(compose_config(smoke, tmp_path / "fdr"))["status"].startswith("fast_dev_run")
    again = train(compose_config(smoke, tmp_path / "fdr"))
    assert again["status"].startswith("fast_dev_run") and "test/acc" in again["metrics"]
    # a results.json of an earlier version, "finished" for a test=false run: tested by the same command
    results = tmp_path / "run" / "results.json"
    untested = {**json.loads(results.read_text()), "status": "finished", "metrics": {"val/acc_best": 0.5}}
    results.write_text(json.dumps(untested))
    assert "test/acc" in train(compose(BASE))["metrics"]


def test_an_unreadable_run_file_is_refused_in_one_line(compose, tmp_path):
    """results.json or config_resolved.yaml cut short or edited: one line naming the file and the way out (they were
    a JSONDecodeError / YAML ParserError traceback), for train and evaluate."""
    from longmixer.evaluate import evaluate
    from longmixer.runs.resume import RunFileError

    train(compose(BASE))
    run = tmp_path / "run"
    results = run / "results.json"
    good = results.read_text()
    results.write_text(good[: len(good) // 2])
    with pytest.raises(RunFileError, match=r"results\.json cannot be read .*move it aside"):
        train(compose(BASE))
    with pytest.raises(RunFileError, match=r"results\.json cannot be read .*pass ckpt_path="):
        evaluate(compose([f"run_dir={run}"]))
    results.write_text(good)
    config = run / "config_resolved.yaml"
    config.write_text("data: {a: [1, 2\n")
    with pytest.raises(RunFileError, match=r"config_resolved\.yaml cannot be read .*restore it"):
        train(compose([*BASE, "trainer.max_steps=3"]))
    config.write_text("cut")
    with pytest.raises(RunFileError, match=r"config_resolved\.yaml holds no mapping \(str\)"):
        evaluate(compose([f"run_dir={run}"]))


def test_evaluate_reads_the_data_from_a_moved_data_dir(compose, tmp_path):
    """paths.data_dir is the one setting besides the device an evaluation takes from its command line: the run's
    stored config names the data folder of the machine it trained on."""
    import shutil

    from longmixer.evaluate import EvaluateError, evaluate

    trained = train(compose(BASE))
    shutil.move(tmp_path / "data", tmp_path / "moved")
    metrics = evaluate(compose([f"run_dir={tmp_path / 'run'}"], data_dir=tmp_path / "moved"))
    assert metrics["test/acc"] == pytest.approx(trained["metrics"]["test/acc"])
    assert not (tmp_path / "data").exists()  # nothing was prepared again at the old place
    shutil.move(tmp_path / "moved", tmp_path / "again")
    metrics = evaluate(compose([f"run_dir={tmp_path / 'run'}", f"data.data_dir={tmp_path / 'again'}"]))
    assert metrics["test/acc"] == pytest.approx(trained["metrics"]["test/acc"])
    with pytest.raises(EvaluateError, match="so logger=tensorboard would not apply"):  # its logger is not used
        evaluate(compose([f"run_dir={tmp_path / 'run'}", "logger=tensorboard"]))


def test_a_best_checkpoint_written_after_the_resume_point_is_set_aside(compose, tmp_path, monkeypatch):
    """A kill between a new best-N.ckpt and the last.ckpt after it: the resumed run's state does not track that
    file, so it stayed in checkpoints/ for good and the step's best came back as best-N-v1.ckpt."""
    import shutil

    args = [*BASE, "trainer.max_steps=4"]
    monkeypatch.setenv("LONGMIXER_FAULT", "SIGTERM:train:2")  # after the step-2 validation: last.ckpt at step 3
    with pytest.raises(SystemExit):
        train(compose(args))
    monkeypatch.delenv("LONGMIXER_FAULT")
    ckpts = tmp_path / "run" / "checkpoints"
    assert torch.load(ckpts / "last.ckpt", weights_only=True)["global_step"] == 3
    shutil.copy(ckpts / "best-000002.ckpt", ckpts / "best-000003.ckpt")  # what the killed attempt left
    train(compose(args))
    names = sorted(p.name for p in ckpts.glob("*.ckpt"))
    assert len(names) == 2 and names[0] in ("best-000002.ckpt", "best-000004.ckpt") and names[1] == "last.ckpt"
    assert [p.name for p in (ckpts / "orphaned").iterdir()] == ["best-000003.ckpt"]


def test_a_resume_without_metrics_history_warns(compose, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LONGMIXER_FAULT", "SIGTERM:train:2")
    args = [*BASE, "trainer.max_steps=4"]
    with pytest.raises(SystemExit):
        train(compose(args))
    monkeypatch.delenv("LONGMIXER_FAULT")
    (tmp_path / "run" / "csv" / "metrics.csv").unlink()
    with caplog.at_level("WARNING", logger="longmixer"):
        train(compose(args))
    assert any("holds no rows, but the run resumes at step 3" in r.getMessage() for r in caplog.records)


def test_a_damaged_source_file_stops_training_in_one_line(compose, tmp_path):
    """The readers' errors about a source file are user-facing in training too (they were a traceback there and
    one line only in scripts/prepare_data.py)."""
    from longmixer.data.integrity import SourceFileError

    source = tmp_path / "listops-1000"
    source.mkdir()
    for split in ("train", "val", "test"):
        (source / f"basic_{split}.tsv").write_text("Source\tTarget\n")
    with pytest.raises(SourceFileError, match=r"basic_train\.tsv has a header but no examples"):
        train(compose(["data=listops", f"data.source_dir={source}", *TINY_TRAINER]))


def test_a_validation_interval_inside_a_gradient_accumulation_is_refused(compose):
    """val_check_interval counts batches: 3 with accumulation 2 validated (and checkpointed) between an update's
    batches, which a resume cannot continue exactly."""
    with pytest.raises(ValueError, match="use a multiple of 2"):
        train(compose([*BASE, "trainer.val_check_interval=3", "trainer.accumulate_grad_batches=2"]))
    assert train(compose([*BASE, "trainer.val_check_interval=4", "trainer.accumulate_grad_batches=2",
                          "trainer.max_steps=2"]))["metrics"]["test/acc"] >= 0
