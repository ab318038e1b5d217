"""Kill a real `python -m longmixer.train` subprocess, run the same command again, and compare with an
uninterrupted run: the final weights, results.json and every metrics.csv row (timing columns aside) must be equal.

The kill point is deterministic: the LONGMIXER_FAULT test hook (longmixer.runs.fault_injection) makes the run
send itself the signal at a given step. The tiny run has 6 steps per epoch, validates at every epoch end (steps
6 and 12) and rewrites last.ckpt every 4 steps and after each validation.
"""

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.runs.helpers import (
    EPOCH_AGGREGATES,
    describe,
    metric_rows,
    run_dir_of,
    run_train,
    weights,
)


def assert_same_run(reference, run_dir, mid_epoch: bool, required=("val/acc", "val/loss", "test/acc")):
    ref_w, got_w = weights(reference / "checkpoints" / "last.ckpt"), weights(run_dir / "checkpoints" / "last.ckpt")
    assert ref_w.keys() == got_w.keys()
    for name in ref_w:
        assert torch.equal(ref_w[name], got_w[name]), name
    ref_results = json.loads((reference / "results.json").read_text())
    got_results = json.loads((run_dir / "results.json").read_text())
    assert got_results["metrics"] == ref_results["metrics"]
    assert set(required) <= set(got_results["metrics"])
    skip = EPOCH_AGGREGATES if mid_epoch else ()
    assert metric_rows(run_dir, skip) == metric_rows(reference, skip)  # complete: no row lost, none duplicated


@pytest.mark.parametrize("fault, exit_code", [
    ("SIGKILL:train:6", -signal.SIGKILL),  # right after the end-of-epoch validation checkpoint of step 6
    ("SIGTERM:train:9", 143),              # mid-epoch: the handler checkpoints step 10 and exits 128 + 15
    ("SIGUSR2:train:9", 140),              # SLURM's pre-timeout warning (hydra/launcher=slurm), as SIGTERM: 128 + 12
    ("SIGINT:val:12", 130),                # during the end-of-epoch validation of step 12: checkpoint at step 13
    ("SIGKILL:val:12", -signal.SIGKILL),   # during validation: back to last.ckpt of step 8
], ids=["sigkill-after-epoch-end", "sigterm-mid-epoch", "sigusr2-mid-epoch", "sigint-in-validation",
        "sigkill-in-validation"])
def test_killed_run_resumes_to_the_uninterrupted_result(reference, tmp_path, fault, exit_code):
    killed = run_train(tmp_path, [], fault=fault)
    assert killed.returncode == exit_code, describe(killed)
    run_dir = run_dir_of(tmp_path)
    assert not (run_dir / "results.json").exists()
    if exit_code > 0:
        ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
        assert ckpt["global_step"] == {"SIGTERM:train:9": 10, "SIGUSR2:train:9": 10, "SIGINT:val:12": 13}[fault]
        assert "run the same command again to resume" in (run_dir / "train.log").read_text()
    resumed = run_train(tmp_path, [])
    assert resumed.returncode == 0, describe(resumed)
    assert_same_run(reference, run_dir, mid_epoch=fault != "SIGKILL:train:6")


def test_sigterm_in_the_last_step_keeps_its_validation(reference, tmp_path):
    """Step 15 (max_steps, mid-epoch) is validated: a SIGTERM in it checkpoints after that validation (a checkpoint
    before it made the resumed run end at max_steps without it, and test another best checkpoint)."""
    killed = run_train(tmp_path, [], fault="SIGTERM:train:14")
    assert killed.returncode == 143, describe(killed)
    run_dir = run_dir_of(tmp_path)
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 15
    resumed = run_train(tmp_path, [])
    assert resumed.returncode == 0, describe(resumed)
    ref_w, got_w = weights(reference / "checkpoints" / "last.ckpt"), weights(run_dir / "checkpoints" / "last.ckpt")
    assert all(torch.equal(ref_w[name], got_w[name]) for name in ref_w)
    ref_results = json.loads((reference / "results.json").read_text())
    assert json.loads((run_dir / "results.json").read_text())["metrics"] == ref_results["metrics"]
    # every row but the last epoch's aggregate of training metrics, which a stop in the last step loses; the test
    # row included, with the epoch and step of the uninterrupted run's (3 and 15: the rerun, which runs no training
    # batch, once stamped it 2 and 14, the loop state of the checkpoint)
    aggregate_only = {"epoch", "step", *EPOCH_AGGREGATES}

    def rows(run, drop_aggregate):
        return [r for r in metric_rows(run, EPOCH_AGGREGATES)
                if not (drop_aggregate and {k for k, _ in r} <= aggregate_only and dict(r)["step"] == 14)]

    assert rows(run_dir, False) == rows(reference, True)
    tested = [dict(r) for r in rows(run_dir, False) if "test/acc" in dict(r)]
    assert [(r["epoch"], r["step"]) for r in tested] == [(3.0, 15.0)]


def test_a_run_trained_with_test_false_is_tested_at_the_uninterrupted_epoch_and_step(reference, tmp_path):
    """The same command with test=true resumes from the last step's checkpoint, where the fit ends at once; its test
    row was stamped with the checkpoint's loop state (epoch 2, step 14), one behind the uninterrupted run's."""
    trained = run_train(tmp_path, ["test=false"])
    assert trained.returncode == 0, describe(trained)
    tested = run_train(tmp_path, [])
    assert tested.returncode == 0, describe(tested)
    run_dir = run_dir_of(tmp_path)
    assert json.loads((run_dir / "results.json").read_text())["metrics"] == \
        json.loads((reference / "results.json").read_text())["metrics"]
    assert metric_rows(run_dir) == metric_rows(reference)


def test_sigterm_to_the_process_group_with_loader_workers_checkpoints_and_resumes(reference, tmp_path):
    """SLURM's scancel, coreutils' `timeout` and Ctrl+C signal the whole process group, DataLoader workers
    included. The workers must leave the signal to the training process, which checkpoints and exits 143; a worker
    killed by it would make the step fail ("DataLoader worker ... killed by signal") and the run exit 1."""
    workers = ["data.num_workers=2", "trainer.num_sanity_val_steps=1"]  # the sanity check forks the val workers first
    killed = run_train(tmp_path, workers, fault="SIGTERM:train:9:group")
    assert killed.returncode == 143, describe(killed)
    run_dir = run_dir_of(tmp_path)
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 10
    resumed = run_train(tmp_path, workers)
    assert resumed.returncode == 0, describe(resumed)
    assert_same_run(reference, run_dir, mid_epoch=True)


@pytest.mark.timeout(600)
def test_ddp_run_stopped_by_sigterm_resumes_to_the_uninterrupted_result(tmp_path):
    ddp = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    ref = run_train(tmp_path / "reference", ddp)
    assert ref.returncode == 0, describe(ref)
    stopped = run_train(tmp_path / "stopped", ddp, fault="SIGTERM:train:2")
    assert stopped.returncode == 143, describe(stopped)
    resumed = run_train(tmp_path / "stopped", ddp)
    assert resumed.returncode == 0, describe(resumed)
    assert_same_run(run_dir_of(tmp_path / "reference"), run_dir_of(tmp_path / "stopped"), mid_epoch=True)


def test_evaluate_cli_writes_only_under_eval(reference):
    before = {p: p.read_bytes() for p in reference.rglob("*") if p.is_file() and "eval" not in p.parts}
    proc = run_train(reference.parent, [f"run_dir={reference}"], entry="longmixer.evaluate", tiny=False)
    assert proc.returncode == 0, describe(proc)
    best = json.loads((reference / "results.json").read_text())["best_ckpt"]
    scored = json.loads((reference / "eval" / Path(best).stem / "results.json").read_text())["metrics"]
    assert scored["test/acc"] == json.loads((reference / "results.json").read_text())["metrics"]["test/acc"]
    assert (reference / "eval" / "evaluate.log").exists()
    assert {p: p.read_bytes() for p in reference.rglob("*") if p.is_file() and "eval" not in p.parts} == before


def test_same_command_again_is_locked_out_then_reported_finished(reference):
    from longmixer.runs.resume import RunLock

    tmp = reference.parents[3]  # <tmp>/logs/runs/<run_name>/<hash>_seed0
    rows = (reference / "csv" / "metrics.csv").read_text()
    holder = RunLock(reference).acquire()
    try:
        locked = run_train(tmp, [])
    finally:
        holder.release()
    assert locked.returncode == 2  # a UserFacingError: one line naming the holder, exit 2
    assert f"{reference / '.lock'} is held by pid {os.getpid()} on host" in locked.stdout + locked.stderr, describe(locked)
    again = run_train(tmp, [])
    assert again.returncode == 0, describe(again)
    log = (reference / "train.log").read_text()
    assert "already finished" in log and "test/acc" in log.split("already finished")[-1]
    assert (reference / "csv" / "metrics.csv").read_text() == rows


PLATEAU = ["scheduler=plateau", "~scheduler.warmup_steps", "scheduler.patience=0", "scheduler.factor=0.5"]


def _uninterrupted(tmp_path_factory, name: str, args: list[str]) -> Path:
    """The run dir of an uninterrupted run of `args`, for a module-scoped fixture: the cases of a parametrized test
    compare with the same run, which their xdist_group keeps on one worker (one run instead of one per case)."""
    tmp = tmp_path_factory.mktemp(name)
    proc = run_train(tmp, args)
    assert proc.returncode == 0, describe(proc)
    return run_dir_of(tmp)


@pytest.fixture(scope="module")
def plateau_reference(tmp_path_factory):
    return _uninterrupted(tmp_path_factory, "plateau_reference", PLATEAU)


@pytest.mark.xdist_group("plateau_reference")
@pytest.mark.parametrize("fault", ["SIGKILL:train:6", "SIGTERM:train:9"], ids=["after-epoch-end-checkpoint", "mid-epoch"])
def test_plateau_schedule_resumes_to_the_uninterrupted_result(plateau_reference, tmp_path, fault):
    """The plateau step of an epoch is taken before the end-of-epoch checkpoint, so a run killed right after it
    resumes with the same lr (a lost or repeated step would change the weights)."""
    killed = run_train(tmp_path / "killed", PLATEAU, fault=fault)
    assert killed.returncode != 0, describe(killed)
    resumed = run_train(tmp_path / "killed", PLATEAU)
    assert resumed.returncode == 0, describe(resumed)
    ref_dir, run_dir = plateau_reference, run_dir_of(tmp_path / "killed")
    sched = [torch.load(d / "checkpoints" / "last.ckpt", weights_only=True)["lr_schedulers"][0] for d in (ref_dir, run_dir)]
    assert sched[0]["last_epoch"] == 2 and sched[1] == sched[0]
    assert_same_run(ref_dir, run_dir, mid_epoch=fault.startswith("SIGTERM"))


ACCUMULATE = ["trainer.accumulate_grad_batches=2"]


@pytest.fixture(scope="module")
def accumulate_reference(tmp_path_factory):
    return _uninterrupted(tmp_path_factory, "accumulate_reference", ACCUMULATE)


@pytest.mark.xdist_group("accumulate_reference")
@pytest.mark.parametrize("fault, exit_code", [("SIGTERM:train:4", 143), ("SIGINT:train:3", 130)],
                         ids=["sigterm", "sigint"])
def test_stop_inside_a_gradient_accumulation_resumes_to_the_uninterrupted_result(accumulate_reference, tmp_path, fault,
                                                                                  exit_code):
    """The signal arrives at the first of an update's two batches: the checkpoint waits for the batch that completes
    the optimizer step (a checkpoint after the first one resumed the update from its second batch alone)."""
    killed = run_train(tmp_path / "killed", ACCUMULATE, fault=fault)
    assert killed.returncode == exit_code, describe(killed)
    run_dir = run_dir_of(tmp_path / "killed")
    step = int(fault.split(":")[2])
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == step + 1
    resumed = run_train(tmp_path / "killed", ACCUMULATE)
    assert resumed.returncode == 0, describe(resumed)
    assert_same_run(accumulate_reference, run_dir, mid_epoch=True)


# a tiny LM run on the synthetic byte stream, with dropout and two loader workers (the GPU default has workers)
LM = ["experiment=mega/enwik8", "model=transformer", "data=synthetic_bytes", "data.train_bytes=20000",
      "data.eval_bytes=2000", "data.seq_len=32", "data.k_min=1", "data.k_max=3", "data.batch_size=2",
      "data.eval_batch_size=2", "data.num_workers=2", "model.d_model=16", "model.n_layers=1", "model.d_ffn=32",
      "model.mixer.n_heads=2", "model.dropout=0.1", "trainer.max_steps=24", "trainer.val_check_interval=12",
      "trainer.limit_val_batches=2", "trainer.limit_test_batches=2", "trainer.enable_progress_bar=false",
      "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1", "callbacks.checkpoint.every_n_train_steps=5",
      "~callbacks.summary", "~callbacks.throughput", "trainer.enable_model_summary=false", "scheduler.warmup_steps=2"]


@pytest.mark.parametrize("accumulate", [1, 2], ids=["one_batch_an_update", "accumulated"])
def test_lm_run_with_loader_workers_killed_mid_epoch_resumes_to_the_uninterrupted_result(tmp_path, accumulate):
    """The LM loader draws its iterator seeds from a private generator: drawn from the global RNG, they moved the
    resumed run's dropout masks (the segments were the same, the weights not). Accumulated: the resumed stream
    starts mid-epoch and must give each batch its update's token count (`update_tokens`) as the first run did."""
    def run(where, fault=None):
        paths = [f"paths.log_dir={tmp_path / where / 'logs'}", f"paths.data_dir={tmp_path / 'data'}"]
        proc = run_train(tmp_path / where, [*paths, *LM, f"trainer.accumulate_grad_batches={accumulate}",
                                            f"trainer.val_check_interval={12 * accumulate}",
                                            f"callbacks.checkpoint.every_n_train_steps={5 if accumulate == 1 else 3}"],
                         fault=fault, tiny=False)
        return proc

    ref = run("reference")
    assert ref.returncode == 0, describe(ref)
    killed = run("killed", fault=f"SIGKILL:train:{7 * accumulate}")
    assert killed.returncode == -signal.SIGKILL, describe(killed)
    resumed = run("killed")
    assert resumed.returncode == 0, describe(resumed)
    assert_same_run(run_dir_of(tmp_path / "reference"), run_dir_of(tmp_path / "killed"), mid_epoch=True,
                    required=("val/loss", "test/bpc"))


def _close_rows(got: list[tuple], ref: list[tuple]) -> bool:
    """metric_rows of two runs: the same rows with the same columns, values within float32 rounding."""
    if len(got) != len(ref):
        return False
    for g, r in zip(got, ref):
        if [k for k, _ in g] != [k for k, _ in r]:
            return False
        if any(a != b and not math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) for (_, a), (_, b) in zip(g, r)):
            return False
    return True


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_step_graph_run_stopped_mid_epoch_resumes_on_a_gpu(tmp_path):
    """`task.compile=step-graph` on a GPU: a run stopped by SIGTERM mid-epoch, after its capture, checkpoints float
    learning rates, and the rerun warms up, captures again and ends where the uninterrupted run ends. GPU kernels may
    add in a varying order, so weights and metrics are compared within float32 rounding, the rows exactly."""
    gpu = ["trainer=gpu", "trainer.precision=32-true", "task.compile=step-graph"]
    ref = run_train(tmp_path / "reference", gpu, timeout=600)
    assert ref.returncode == 0, describe(ref)
    stopped = run_train(tmp_path / "stopped", gpu, fault="SIGTERM:train:9", timeout=600)
    assert stopped.returncode == 143, describe(stopped)
    run_dir = run_dir_of(tmp_path / "stopped")
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 10
    assert all(isinstance(g["lr"], float) for g in ckpt["optimizer_states"][0]["param_groups"])
    resumed = run_train(tmp_path / "stopped", gpu, timeout=600)
    assert resumed.returncode == 0, describe(resumed)
    ref_dir = run_dir_of(tmp_path / "reference")
    ref_w, got_w = (weights(d / "checkpoints" / "last.ckpt") for d in (ref_dir, run_dir))
    assert ref_w.keys() == got_w.keys()
    for name in ref_w:
        torch.testing.assert_close(got_w[name], ref_w[name], rtol=1e-4, atol=1e-6, msg=name)
    got, want = (json.loads((d / "results.json").read_text())["metrics"] for d in (run_dir, ref_dir))
    assert got.keys() == want.keys() and all(math.isclose(got[k], want[k], rel_tol=1e-4, abs_tol=1e-6) for k in want)
    assert _close_rows(metric_rows(run_dir, EPOCH_AGGREGATES), metric_rows(ref_dir, EPOCH_AGGREGATES))


def test_lm_run_under_limit_train_batches_stopped_at_an_epoch_end_resumes_to_the_uninterrupted_result(tmp_path):
    """Each epoch is `limit_train_batches` batches of a fresh pass, also after a resume from the checkpoint of an
    epoch's end: the LM loader restored that epoch's position and continued its cut pass, so the resumed run trained
    on other batches (and its epochs on the uninterrupted run's, one pass late)."""
    cut = [o for o in LM if not o.startswith(("trainer.max_steps", "trainer.val_check_interval"))]
    cut += ["trainer.limit_train_batches=0.05", "trainer.accumulate_grad_batches=2", "trainer.max_steps=9"]

    def run(where, fault=None):  # epochs of 7 of the stream's 156 batches: 4 updates (2 + 2 + 2 + 1), then validation
        paths = [f"paths.log_dir={tmp_path / where / 'logs'}", f"paths.data_dir={tmp_path / 'data'}"]
        return run_train(tmp_path / where, [*paths, *cut], fault=fault, tiny=False)

    ref = run("reference")
    assert ref.returncode == 0, describe(ref)
    killed = run("killed", fault="SIGKILL:train:4")  # right after the first epoch's validation and checkpoint
    assert killed.returncode == -signal.SIGKILL, describe(killed)
    resumed = run("killed")
    assert resumed.returncode == 0, describe(resumed)
    assert_same_run(run_dir_of(tmp_path / "reference"), run_dir_of(tmp_path / "killed"), mid_epoch=False,
                    required=("val/loss", "test/bpc"))
