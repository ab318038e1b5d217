"""End to end: 2-step fits, resume round trip, multirun, Optuna, DDP on CPU."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from longmixer.train import train
from tests.conftest import TINY_LISTOPS, TINY_TRAINER

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_two_steps(compose, tmp_path, caplog):
    cfg = compose([*TINY_LISTOPS, *TINY_TRAINER])
    with caplog.at_level("INFO", logger="longmixer"):
        results = train(cfg)
    assert {"test/acc", "test/loss", "val/acc"} <= set(results["metrics"])
    run_dir = tmp_path / "run"
    assert json.loads((run_dir / "results.json").read_text())["metrics"]["test/acc"] == results["metrics"]["test/acc"]
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["packages"]["torch"] and "git_dirty" in info
    assert (run_dir / "config_resolved.yaml").exists()
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    # the composed config: one line per group in the log (quiet), the whole tree in the run dir
    (printed,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("composed config")]
    assert "model: " in printed and "longmixer.models.SequenceModel" in printed and len(printed.splitlines()) < 25
    full = (run_dir / "config_tree.txt").read_text()
    assert "d_model:" in full and "max_steps: 2" in full and len(full.splitlines()) > 100


def test_a_triton_backend_the_device_cannot_run_stops_before_training(compose, tmp_path, monkeypatch):
    """Bug: `ops.backend=triton` on a CPU run (no Triton interpreter) built everything and failed at the first
    forward, inside Lightning's fit, with a traceback and exit status 1; it is a setting, refused in one line."""
    from longmixer.utils.config import ConfigError

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match=r"^ops.backend=triton runs the Triton kernels on CUDA tensors, and this run "
                                          r"is on the cpu \(trainer.accelerator=auto\): set ops.backend=auto"):
        train(compose([*TINY_LISTOPS, *TINY_TRAINER, "ops.backend=triton"]))
    assert not (tmp_path / "run" / "checkpoints").exists()


def _crash_callback(step):
    """Simulates a killed process after `step` optimizer steps."""
    from pytorch_lightning.callbacks import Callback

    class _Crash(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step >= step:
                raise KeyboardInterrupt("simulated kill")  # Lightning stops without saving a checkpoint

    return _Crash()


@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted(compose, tmp_path, monkeypatch):
    """Regression guard: a run killed mid-epoch and resumed must see the same batches and RNG stream."""
    common = [*TINY_LISTOPS, "data.num_train=96", "trainer.max_steps=14", "trainer.val_check_interval=4",
              "trainer.limit_val_batches=2", "trainer.limit_test_batches=2", "trainer.enable_progress_bar=false",
              "~callbacks.progress", "~callbacks.summary", "trainer.num_sanity_val_steps=0", "model.dropout=0.1"]
    full = train(compose(common))["metrics"]

    import longmixer.train as entry

    crashed_dir = tmp_path / "second"
    crashed_dir.mkdir()
    original = entry.instantiate_group

    def with_crash(group, what):
        objects = original(group, what)
        return objects + [_crash_callback(10)] if what == "callbacks" else objects

    from tests.conftest import compose_config

    monkeypatch.setattr(entry, "instantiate_group", with_crash)
    cfg = compose_config(common, crashed_dir)
    try:
        train(cfg)
    except (KeyboardInterrupt, SystemExit):
        pass
    ckpt = torch.load(crashed_dir / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    # validation (and so the checkpoint) runs after every 4th batch of an epoch of 6: steps 4, 10, 16; the kill
    # comes at step 10 before its validation, so the run resumes mid-epoch from step 4
    assert ckpt["global_step"] == 4
    monkeypatch.setattr(entry, "instantiate_group", original)
    resumed = train(compose_config(common, crashed_dir))["metrics"]
    for key in ("val/acc", "val/loss", "test/acc", "test/loss"):
        assert resumed[key] == pytest.approx(full[key], abs=1e-6), key


def _run_cli(args, tmp_path, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1"}
    flags = [a for a in args if a.startswith("-")]
    overrides = [f"paths.log_dir={tmp_path / 'logs'}", f"paths.data_dir={tmp_path / 'data'}", *TINY_LISTOPS,
                 *TINY_TRAINER, *(a for a in args if not a.startswith("-"))]
    cmd = [sys.executable, "-m", "longmixer.train", *flags, *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_multirun_two_jobs(tmp_path):
    _run_cli(["-m", "seed=0,1"], tmp_path)
    results = sorted((tmp_path / "logs" / "runs" / "quickstart").glob("*/results.json"))
    assert next((tmp_path / "logs" / "multiruns").rglob("multirun.yaml"))
    assert [json.loads(p.read_text())["seed"] for p in results] == [0, 1]


FAILING_SEARCH = """# @package _global_
defaults:
  - override /hydra/sweeper: optuna
  - override /hydra/sweeper/sampler: tpe
optimized_metric: ${task.monitor}_best
hydra:
  mode: MULTIRUN
  sweeper:
    direction: maximize
    n_trials: 2
    max_failure_rate: 1.0
    sampler:
      seed: 0      # TPE's random start-up draws 0.002, then -1.0
    params:
      optim.lr: choice(-1.0, 0.002)
"""


@pytest.mark.slow
def test_optuna_two_trials_survives_a_failed_trial(tmp_path):
    """One trial gets an invalid lr and fails at compose-time validation; the study must still finish."""
    search_dir = tmp_path / "search" / "hparams_search"
    search_dir.mkdir(parents=True)
    (search_dir / "failing.yaml").write_text(FAILING_SEARCH)
    # max_failure_rate: 1.0 is the setting of hparams_search/optuna
    _run_cli(["-m", "hparams_search=failing", f"hydra.searchpath=[file://{tmp_path / 'search'}]"], tmp_path)
    optimum = next((tmp_path / "logs" / "multiruns").rglob("optimization_results.yaml")).read_text()
    assert "optim.lr: 0.002" in optimum and "best_value" in optimum
    assert len(list((tmp_path / "logs" / "runs").rglob("results.json"))) == 1  # the lr=-1 trial failed


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ddp_two_cpu_processes_share_one_run_dir(tmp_path):
    """Two ranks with the progress bar on, past an end-of-epoch validation: rank 0's bar computes the epoch's
    accuracy, summed across ranks by a collective, so the other rank must compute it at the same hook (it once
    went on to the checkpoint's divergence check instead, and the run hung there). The epoch's training loss is
    every rank's too."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1"}
    # the quickstart at 128 examples (batch 32): 2 steps an epoch on each rank, validation at every epoch end
    overrides = [f"paths.log_dir={tmp_path / 'logs'}", f"paths.data_dir={tmp_path / 'data'}", "data.num_train=128",
                 "data.num_val=32", "data.num_test=32", "trainer.max_steps=4", "trainer=ddp", "trainer.accelerator=cpu",
                 "trainer.devices=2"]
    proc = subprocess.run([sys.executable, "-m", "longmixer.train", *overrides], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dirs = [p.parent for p in (tmp_path / "logs" / "runs").rglob("results.json")]
    assert len(run_dirs) == 1
    assert torch.load(run_dirs[0] / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    # every epoch-level value is summed across the ranks (Lightning warns of one that is only rank 0's)
    assert "when logging on epoch level in distributed setting" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_multirun_refuses_ddp_ranks_that_would_rerun_the_sweep(tmp_path):
    """Lightning starts DDP ranks by re-running the command line, so under a local multirun every rank ran the whole
    sweep (README, "Multi-GPU": they do not mix). The job stops before training, naming the two ways that work."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "WANDB_MODE": "offline"}
    overrides = [f"paths.log_dir={tmp_path / 'logs'}", f"paths.data_dir={tmp_path / 'data'}", *TINY_LISTOPS,
                 *TINY_TRAINER, "seed=0,1", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    proc = subprocess.run([sys.executable, "-m", "longmixer.train", "-m", *overrides], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "Hydra's local multirun and DDP do not mix" in proc.stdout + proc.stderr
    assert "hydra/launcher=slurm" in proc.stdout + proc.stderr
    assert not list((tmp_path / "logs").rglob("results.json")) and not list((tmp_path / "logs").rglob("*.ckpt"))


def test_wandb_offline_run_keeps_its_id_across_resume(compose, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    overrides = ["logger=wandb", *TINY_LISTOPS, *TINY_TRAINER]
    train(compose(overrides))
    run_dir = tmp_path / "run"
    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    offline = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 1
    log = next(offline[0].glob("run-*.wandb"))  # offline runs keep the config in this log
    # the W&B service may still be flushing it after finish() returns (seen on a loaded 2-core CI box): poll
    deadline = time.monotonic() + 60
    while b"GeneratedListOps" not in log.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.5)
    record = log.read_bytes()
    assert b"warmup_init_lr" in record and b"GeneratedListOps" in record  # the full resolved config is the run config
    train(compose([*overrides, "trainer.max_steps=4", "resume=force"]))  # same run dir, longer: resumes, same W&B id
    assert (run_dir / "wandb_id.txt").read_text().strip() == run_id
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))) == 2


def test_evaluate_rescores_the_best_checkpoint(compose, tmp_path):
    """Also: a checkpoint of the same name from another folder (two runs' last.ckpt) wrote the same
    eval/<name>/results.json as the run's own, and scoring a file again overwrote its earlier results."""
    import shutil

    from longmixer.evaluate import evaluate

    results = train(compose([*TINY_LISTOPS, *TINY_TRAINER]))
    run_dir = tmp_path / "run"
    before = (run_dir / "csv" / "metrics.csv").read_text()
    metrics = evaluate(compose([f"run_dir={run_dir}"]))
    assert metrics["test/acc"] == pytest.approx(results["metrics"]["test/acc"])
    stem = Path(results["best_ckpt"]).stem
    assert "val/acc" in metrics and (run_dir / "eval" / stem / "results.json").exists()
    assert (run_dir / "csv" / "metrics.csv").read_text() == before  # training history untouched
    elsewhere = tmp_path / "elsewhere" / Path(results["best_ckpt"]).name
    elsewhere.parent.mkdir()
    shutil.copy(results["best_ckpt"], elsewhere)
    evaluate(compose([f"run_dir={run_dir}", f"ckpt_path={elsewhere}"]))
    (copied,) = (run_dir / "eval").glob(f"{stem}-*/results.json")
    assert json.loads(copied.read_text())["ckpt_path"] == str(elsewhere)
    assert json.loads((run_dir / "eval" / stem / "results.json").read_text())["ckpt_path"] == results["best_ckpt"]
    evaluate(compose([f"run_dir={run_dir}"]))  # scored again: the earlier results are kept
    assert len(list((run_dir / "eval" / stem / "history").glob("results.*.json"))) == 1


def test_throughput_and_params_are_logged(compose, tmp_path):
    import csv

    train(compose([*TINY_LISTOPS, *TINY_TRAINER, "callbacks.throughput.window=1"]))
    rows = list(csv.DictReader(open(tmp_path / "run" / "csv" / "metrics.csv")))
    speeds = [float(r["train/speed/tokens_per_s"]) for r in rows if r.get("train/speed/tokens_per_s")]
    assert len(speeds) == 2 and all(s > 0 for s in speeds)
    assert any(r.get("model/params/total") for r in rows)


def test_a_run_stopped_by_its_time_budget_continues_with_a_larger_one(compose, tmp_path, monkeypatch):
    """trainer.max_time ends the first call after one step: recorded as stopped, not finished, so the same run
    given more time resumes from last.ckpt (the Timer's spent time travels in the checkpoint) and finishes."""
    from longmixer.tasks.classification import Classification

    step = Classification.training_step

    def slow_first_step(self, batch, batch_idx):
        if self.global_step == 0:
            time.sleep(1.2)  # past the 1 s budget: the Timer stops the fit after this step
        return step(self, batch, batch_idx)

    monkeypatch.setattr(Classification, "training_step", slow_first_step)
    first = train(compose([*TINY_LISTOPS, *TINY_TRAINER, "+trainer.max_time=00:00:00:01", "test=false"]))
    run_dir = tmp_path / "run"
    assert first["status"] == "stopped at trainer.max_time"
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 1
    # the dict form of the budget (Lightning's Timer accepts a string, a timedelta or a dict)
    second = train(compose([*TINY_LISTOPS, *TINY_TRAINER, "+trainer.max_time={hours:1}"]))
    assert second["status"] == "finished" and "test/acc" in second["metrics"]
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 2
    assert ckpt["callbacks"]["Timer"]["time_elapsed"]["train"] > 0


def test_a_budget_stop_stays_stopped_through_the_test_phase(compose, tmp_path, monkeypatch):
    """The test phase loads the best checkpoint, and with it that checkpoint's Timer state: the status is read
    before it, so the same command (the same budget) reports the run stopped again instead of finished."""
    from longmixer.tasks.classification import Classification

    step = Classification.training_step

    def slow_second_step(self, batch, batch_idx):
        if self.global_step == 1:
            time.sleep(1.2)  # the best checkpoint (step 1) holds a Timer well within the budget
        return step(self, batch, batch_idx)

    monkeypatch.setattr(Classification, "training_step", slow_second_step)
    args = [*TINY_LISTOPS, *TINY_TRAINER, "trainer.max_steps=3", "trainer.val_check_interval=1",
            "+trainer.max_time=00:00:00:01"]
    first = train(compose(args))
    assert first["status"] == "stopped at trainer.max_time" and "test/acc" in first["metrics"]
    assert Path(first["best_ckpt"]).name == "best-000001.ckpt"
    again = train(compose(args))
    assert again["status"] == "stopped at trainer.max_time"
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 2
    more = train(compose([*args[:-1], "+trainer.max_time=00:01:00:00"]))
    assert more["status"] == "finished" and torch.load(last, weights_only=True)["global_step"] == 3


def test_stopped_by_time_budget_reads_the_timer():
    from datetime import timedelta
    from types import SimpleNamespace

    from pytorch_lightning.callbacks import Timer

    from longmixer.train import stopped_by_time_budget

    spent, fresh = Timer(duration=timedelta(seconds=1)), Timer(duration=timedelta(hours=1))
    spent.load_state_dict({"time_elapsed": {"train": 5.0}})
    assert stopped_by_time_budget(SimpleNamespace(callbacks=[spent]))
    assert not stopped_by_time_budget(SimpleNamespace(callbacks=[fresh]))
    assert not stopped_by_time_budget(SimpleNamespace(callbacks=[]))


def test_plateau_schedule_steps_once_per_epoch_on_the_monitor_and_travels_in_the_checkpoint(compose, tmp_path):
    """`scheduler=plateau` (the LaS recipes): Lightning steps it at each epoch end with val/acc; 64 examples / 16 =
    4 steps per epoch, so 12 steps are 3 epochs, each validated at its end."""
    cfg = compose([*TINY_LISTOPS, *TINY_TRAINER, "scheduler=plateau", "~scheduler.warmup_steps", "scheduler.patience=0", "scheduler.factor=0.5",
                   "trainer.max_steps=12", "trainer.val_check_interval=null", "trainer.limit_val_batches=2"])
    train(cfg)
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    (state,) = ckpt["lr_schedulers"]
    assert state["last_epoch"] == 3 and state["mode"] == "max"
    with open(tmp_path / "run" / "csv" / "metrics.csv") as f:
        import csv

        val = [float(r["val/acc"]) for r in csv.DictReader(f) if r.get("val/acc")]
    assert len(val) == 3 and state["best"] == pytest.approx(max(val))
    # patience 0: every epoch that did not beat the best so far halved the lr
    cuts = sum(1 for i, v in enumerate(val) if i > 0 and v <= max(val[:i]))
    lr = ckpt["optimizer_states"][0]["param_groups"][0]["lr"]
    assert lr == pytest.approx(cfg.optim.lr * 0.5 ** cuts)


def test_a_plateau_mode_that_contradicts_the_task_names_both_keys(compose):
    cfg = compose([*TINY_LISTOPS, *TINY_TRAINER, "scheduler=plateau", "~scheduler.warmup_steps", "scheduler.mode=min"])
    with pytest.raises(ValueError, match=r"scheduler.mode='min' but task.mode='max'"):
        train(cfg)


def test_debug_overfit_trains_on_its_batches_with_the_resumable_loader(compose, tmp_path):
    """`debug=overfit`: Lightning re-creates the train loader with a sequential sampler of its own, which the
    resumable loader once refused (its sampler passed twice); an epoch is then the overfit batches."""
    results = train(compose([*TINY_LISTOPS, *TINY_TRAINER, "debug=overfit", "trainer.max_steps=4"]))
    assert results["status"] == "finished" and "test/acc" in results["metrics"]
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 4 and ckpt["epoch"] >= 1  # two batches an epoch


def test_the_last_step_is_validated_when_max_steps_ends_mid_epoch(compose, tmp_path):
    """4 batches an epoch, validation at epoch ends, max_steps 6: step 6 is validated too (it used to be trained and
    never scored, and the test took the step-4 checkpoint)."""
    import csv

    trainer = [o for o in TINY_TRAINER if not o.startswith(("trainer.max_steps", "trainer.val_check_interval"))]
    train(compose([*TINY_LISTOPS, *trainer, "trainer.max_steps=6", "trainer.val_check_interval=null"]))
    rows = list(csv.DictReader(open(tmp_path / "run" / "csv" / "metrics.csv")))
    # the csv's step of a validation is the index of the last step trained (0-based)
    val_rows = {int(r["step"]) + 1: r for r in rows if r.get("val/loss")}
    assert sorted(val_rows) == [4, 6]
    # results.json pairs the test of the best checkpoint with that checkpoint's own validation
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    best_step = int(Path(results["best_ckpt"]).stem.split("-")[1])
    assert results["metrics"]["val/loss"] == pytest.approx(float(val_rows[best_step]["val/loss"]))


def test_a_best_checkpoint_without_its_validation_metrics_leaves_val_out_of_results(compose, tmp_path, caplog):
    """A checkpoint of an earlier version keeps no val/* of its own: results.json then leaves out the last
    validation's val/* (which belong to another checkpoint) rather than pair them with this one's test."""
    trainer = [o for o in TINY_TRAINER if not o.startswith(("trainer.max_steps", "trainer.val_check_interval"))]
    overrides = [*TINY_LISTOPS, *trainer, "trainer.max_steps=6", "trainer.val_check_interval=null"]
    train(compose([*overrides, "test=false"]))
    for path in (tmp_path / "run" / "checkpoints").glob("*.ckpt"):
        checkpoint = torch.load(path, weights_only=True)
        for state in checkpoint["callbacks"].values():
            if isinstance(state, dict):
                state.pop("val_metrics", None)
        torch.save(checkpoint, path)
    with caplog.at_level("WARNING", logger="longmixer"):
        train(compose(overrides))
    metrics = json.loads((tmp_path / "run" / "results.json").read_text())["metrics"]
    assert "test/acc" in metrics and "val/acc_best" in metrics
    assert not [k for k in metrics if k.startswith("val/") and not k.endswith("_best")], metrics
    assert any("holds no validation metrics" in r.getMessage() for r in caplog.records)
    # nor does `longmixer-report` fill them in from metrics.csv, which holds the last validation's
    from longmixer.report.tables import load_run

    reported = load_run(tmp_path / "run" / "results.json").metrics
    assert "test/acc" in reported and not [k for k in reported if k.startswith("val/") and not k.endswith("_best")]
