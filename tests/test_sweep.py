"""The sweep summary (a Hydra callback) after a real grid and a real Optuna study, and the runs CLI on their runs."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from longmixer.report import runs as runs_cli
from tests.conftest import TINY_LISTOPS, TINY_TRAINER

ROOT = Path(__file__).resolve().parents[1]


def _multirun(args: list[str], tmp_path: Path, status: int = 0,
              full_error: bool = True) -> tuple[Path, list[dict], str]:
    """Run `python -m longmixer.train -m` on tiny ListOps; returns (sweep dir, summary.csv rows, stdout+stderr)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    if full_error:
        env["HYDRA_FULL_ERROR"] = "1"
    cmd = [sys.executable, "-m", "longmixer.train", "-m", f"paths.log_dir={tmp_path / 'logs'}",
           f"paths.data_dir={tmp_path / 'data'}", *TINY_LISTOPS, *TINY_TRAINER, *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == status, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "logs" / "multiruns").iterdir()
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    return sweep_dir, rows, proc.stdout + proc.stderr


def test_grid_sweep_writes_a_summary_of_every_job_and_links_their_run_dirs(tmp_path):
    sweep_dir, rows, output = _multirun(["optim.lr=0.001,0.003"], tmp_path)
    assert [(r["job"], r["status"], r["optim.lr"], r["metric"]) for r in rows] == [
        ("0", "COMPLETED", "0.001", "val/acc_best"), ("1", "COMPLETED", "0.003", "val/acc_best")]
    for row in rows:
        run_dir = Path(row["run_dir"])
        assert (sweep_dir / "jobs" / row["job"]).resolve() == run_dir.resolve()
        best = json.loads((run_dir / "results.json").read_text())["metrics"]["val/acc_best"]
        assert float(row["value"]) == pytest.approx(best)
    values = [float(r["value"]) for r in rows]
    assert [r["best"] for r in rows] == [str(v == max(values)) for v in values]
    markdown = (sweep_dir / "summary.md").read_text()
    assert markdown.splitlines()[0] == "| job | status | val/acc_best | optim.lr | run_dir |"
    assert "sweep summary (2 jobs" in output and markdown.splitlines()[2] in output

    # the runs CLI lists both runs and compares them: the lr is the config key that differs
    listed = runs_cli.main(["--runs", str(tmp_path / "logs" / "runs")])
    assert sorted(r["status"] for r in listed) == ["finished", "finished"]
    assert all(r["best"].startswith("val/acc_best=") and r["test"].startswith("test/acc=") for r in listed)
    compared = runs_cli.main(["--compare", *(r["run_dir"] for r in rows)])
    keys = {r["key"]: r for r in compared}
    assert "optim.lr" in keys and "seed" not in keys and "val/acc_best" in keys
    assert [keys["optim.lr"][r["run_dir"]] for r in rows] == [0.001, 0.003]


def test_a_sweep_with_a_failed_job_still_prints_its_summary(tmp_path):
    """Hydra ends a grid sweep whose job failed by re-raising that failure before its end hook: every job still
    ran, the sweep exits 1, and the summary table with the failed row is printed at exit. A refused setting is
    reported in one line, when the job stops and when the sweep ends, without a traceback."""
    _, rows, output = _multirun(["optim.lr=0.001,-1"], tmp_path, status=1, full_error=False)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "COMPLETED"), ("1", "FAILED")]
    assert "sweep summary (" in output and "FAILED (ConfigError: optim.lr=-1 must be > 0)" in output
    assert "Traceback" not in output, output[-3000:]
    assert output.count("job 1 stopped: optim.lr=-1 must be > 0") == 2, output[-3000:]


def test_optuna_study_summary_has_every_trial(tmp_path):
    sweep_dir, rows, _ = _multirun(["hparams_search=optuna", "hydra.sweeper.n_trials=2",
                                    "hydra.sweeper.sampler.seed=0"], tmp_path)
    assert [r["job"] for r in rows] == ["0", "1"] and {r["status"] for r in rows} == {"COMPLETED"}
    assert all(r["optim.lr"] and r["optim.weight_decay"] for r in rows)  # each trial's sampled params
    assert (sweep_dir / "optimization_results.yaml").exists()  # the sweeper's own best-trial file stays
    top = max(float(r["value"]) for r in rows)
    assert [r["best"] for r in rows] == [str(float(r["value"]) == top) for r in rows]  # ties are all marked
    assert yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())["best_value"] == pytest.approx(top)


def test_optuna_study_in_a_database_continues(tmp_path):
    """The README's resumable study (`hydra.sweeper.storage=sqlite:///...`): a second call adds to the first's
    trials. (Optuna 2.10, which hydra-optuna-sweeper holds, fails on SQLAlchemy 2; the sweep extra pins it.)"""
    import optuna

    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    for call in ("first", "second"):
        (tmp_path / call).mkdir()
        _multirun(["hparams_search=optuna", "hydra.sweeper.n_trials=1", f"hydra.sweeper.storage={storage}",
                   "hydra.sweeper.study_name=study", f"hydra.sweeper.sampler.seed={len(call)}"], tmp_path / call)
    trials = optuna.load_study(study_name="study", storage=storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]


def test_an_optuna_trial_without_its_objective_fails_alone_and_the_study_goes_on(tmp_path):
    """A trial that finished without the study's objective (here the one monitoring val/loss, which logs
    val/loss_best and no val/acc_best) returned NaN: Optuna refused it, hydra-optuna-sweeper's fallback told the trial
    FAIL with the same NaN, Optuna refused that too ("Values were told"), and the whole study ended, exit 1, at that
    trial. It is now a failed trial, with the metrics the run has, and the study goes on (README "Sweeps")."""
    _, rows, output = _multirun(["hparams_search=optuna", "hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=0",
                                 "hydra.sweeper.n_trials=2",
                                 "optim.lr=choice(0.001)", "optim.weight_decay=choice(0.01)", "model.dropout=choice(0.0)",
                                 "task.monitor=choice(val/acc,val/loss)", "optimized_metric=val/acc_best"],
                                tmp_path, full_error=False)
    by_monitor = {r["task.monitor"]: r for r in rows}
    assert by_monitor["val/acc"]["status"] == "COMPLETED" and by_monitor["val/acc"]["value"]
    assert by_monitor["val/loss"]["status"] == "FAILED"
    assert by_monitor["val/loss"]["error"].startswith("ConfigError: optimized_metric=val/acc_best is not among this "
                                                      "run's metrics")
    assert "val/loss_best" in output and "Values were told" not in output


def test_optuna_direction_follows_the_task_mode(tmp_path):
    """A study on a metric to minimize (a language model's val/loss) minimizes it without a direction override:
    hydra.sweeper.direction follows task.mode."""
    sweep_dir, rows, _ = _multirun(["hparams_search=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=0",
                                    "task.monitor=val/loss", "task.mode=min"], tmp_path)
    values = [float(r["value"]) for r in rows]
    assert [r["metric"] for r in rows] == ["val/loss_best"] * 3 and len(set(values)) > 1
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())["best_value"]
    assert best == pytest.approx(min(values)) and [r["best"] for r in rows] == [str(v == min(values)) for v in values]


def test_runs_cli_marks_unfinished_runs_and_refuses_a_missing_dir(tmp_path, capsys):
    """An unfinished run (killed: no results.json) is listed with what it is, read from the files its start wrote,
    and with the same columns as a finished one, whichever sorts first (the table and the CSV take the columns of
    the first row)."""
    killed = tmp_path / "runs" / "a"
    (killed / ".hydra").mkdir(parents=True)
    (killed / "config_resolved.yaml").write_text("seed: 5\n")
    (killed / ".hydra" / "overrides.yaml").write_text("- experiment=quickstart\n- seed=5\n- optim.lr=0.003\n")
    (killed / ".hydra" / "hydra.yaml").write_text(
        "hydra:\n  runtime:\n    choices: {experiment: quickstart, model: chela, data: listops_quick}\n")
    finished = tmp_path / "runs" / "b"
    finished.mkdir()
    (finished / "results.json").write_text(json.dumps({"metrics": {"val/acc_best": 0.5, "test/acc": 0.4},
                                                       "choices": {"model": "chela", "data": "listops_quick"},
                                                       "seed": 0}))
    evaluated = finished / "eval" / "epoch=1-step=2"  # `longmixer.evaluate`'s output inside the run: not a run
    evaluated.mkdir(parents=True)
    (evaluated / "results.json").write_text(json.dumps({"ckpt_path": "x.ckpt", "metrics": {"test/acc": 0.4}}))
    rows = runs_cli.main(["--runs", str(tmp_path / "runs"), "--csv", str(tmp_path / "runs.csv")])
    assert [(r["run"], r["status"]) for r in rows] == [("a", "unfinished"), ("b", "finished")]
    assert rows[0] | {"run": "a"} == {"run": "a", "status": "unfinished", "experiment": "quickstart",
                                      "model": "chela", "data": "listops_quick", "seed": 5,
                                      "overrides": "optim.lr=0.003", "best": "", "test": ""}
    assert list(rows[0]) == list(rows[1])
    assert (tmp_path / "runs.csv").read_text().startswith("run,status,experiment,model,data,seed,overrides,best,test")
    # how a run's last attempt ended (run_info.json), a results.json that is not "finished", one that is damaged
    (killed / "run_info.json").write_text(json.dumps({"attempts": [{"ended": "failed: TrainingDivergedError: x"}]}))
    untested = tmp_path / "runs" / "c"
    untested.mkdir()
    (untested / "results.json").write_text(json.dumps({"metrics": {}, "seed": 0, "status": "trained, not tested"}))
    damaged = tmp_path / "runs" / "d"
    damaged.mkdir()
    (damaged / "results.json").write_text('{"metrics": ')
    rows = runs_cli.main(["--runs", str(tmp_path / "runs")])
    assert [r["status"] for r in rows] == ["unfinished (failed: TrainingDivergedError: x)", "finished",
                                           "trained, not tested", "unreadable results.json (JSONDecodeError)"]
    with pytest.raises(SystemExit) as exit_info:
        runs_cli.main(["--runs", str(tmp_path / "missing")])
    assert exit_info.value.code == 2 and "error: --runs=" in capsys.readouterr().err


def test_optuna_direction_refuses_a_mode_it_cannot_follow():
    from longmixer.utils.resolvers import _direction

    assert (_direction("max"), _direction("min")) == ("maximize", "minimize")
    with pytest.raises(ValueError, match="hydra.sweeper.direction=maximize"):
        _direction("best")


@pytest.mark.parametrize("direction, mode, best", [(None, "max", "max"), (None, "min", "min"),
                                                   ("minimize", "max", "min"), ("maximize", "min", "max")])
def test_the_summary_marks_the_best_job_the_way_the_study_optimizes(direction, mode, best):
    """An Optuna direction given on the command line (hydra.sweeper.direction) decides which job is best in the
    summary, as it decides the study's; without a sweeper direction, the task's mode does."""
    from omegaconf import OmegaConf

    from longmixer.report.sweep import _mode

    hydra = {"sweeper": {"direction": direction}} if direction else {"sweeper": {}}
    assert _mode(OmegaConf.create({"hydra": hydra, "task": {"mode": mode}})) == best


def test_a_failed_jobs_error_stays_in_its_table_row():
    """An error message with newlines (Hydra's instantiation errors) or a pipe split the markdown row."""
    from longmixer.report.sweep import summary_markdown, summary_rows

    error = "InstantiationException: Error in call to target 'M':\nRuntimeError('a | b')" + " x" * 80
    record = {"job": 0, "status": "FAILED", "metric": "val/acc_best", "value": None, "mode": "max",
              "overrides": ["model.d_ffn=-3"], "error": error, "run_dir": "r"}
    markdown = summary_markdown(*summary_rows([record]))
    (row,) = markdown.splitlines()[2:]
    assert row.startswith("| 0 | FAILED (InstantiationException: Error in call to target 'M': RuntimeError('a \\| b')")
    assert row.endswith("…) | – | r |")


def test_a_failed_job_has_no_value_even_where_its_run_dir_holds_results(tmp_path):
    """A job refused for config drift (a yaml edited, the same sweep run again) finds the run that the old config
    finished: the summary showed that run's value beside FAILED, and starred it as the best job."""
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from longmixer.report.sweep import job_record
    from longmixer.runs.resume import ConfigDriftError

    (tmp_path / "results.json").write_text(json.dumps({"metrics": {"val/acc_best": 0.9}}))
    config = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(tmp_path)}, "job": {"num": 0},
                                         "overrides": {"task": ["seed=0"]}, "sweeper": {}},
                               "task": {"monitor": "val/acc", "mode": "max"}})
    failed = JobReturn(status=JobStatus.FAILED, _return_value=ConfigDriftError("the config differs"))
    record = job_record(config, failed)
    assert (record["status"], record["value"]) == ("FAILED", None)
    assert job_record(config, JobReturn(status=JobStatus.COMPLETED, _return_value=None))["value"] == 0.9


def test_sweeps_started_in_one_second_get_their_own_dirs():
    """Two sweeps started together (one per GPU from a script) fell in the same second and shared one sweep dir:
    each overwrote the other's job records, multirun.yaml and summary, and printed a summary mixing both."""
    import datetime
    import re

    from longmixer.utils.compose import CONFIG_DIR

    sweep_dir = yaml.safe_load((Path(CONFIG_DIR) / "hydra" / "default.yaml").read_text())["sweep"]["dir"]
    evaluate_dir = re.search(r"hydra\.sweep\.dir=.*now:.*", (ROOT / "src" / "longmixer" / "evaluate.py").read_text())[0]
    first = datetime.datetime(2026, 11, 28, 10, 57, 52, 120000)
    for configured in (sweep_dir, evaluate_dir):
        (pattern,) = re.findall(r"\$\{+now:([^}]+)\}", configured)
        assert first.strftime(pattern) != first.replace(microsecond=870000).strftime(pattern)


def test_an_unfinished_run_lists_the_overrides_a_finished_one_would(tmp_path):
    """Regression: an unfinished run's row showed its raw overrides (`paths.data_dir=...`, `~callbacks.progress`,
    `trainer.max_time=...`), while a finished run's showed only those that change results, so the same command
    read differently before and after its run finished. Both rows now show the finished form."""
    overrides = ["experiment=quickstart", "seed=5", "paths.data_dir=/scratch/data", "~callbacks.progress",
                 "optim.lr=1e-3", "trainer.max_time=00:01:00:00", "+ablation=chela/ema"]
    for name in ("killed", "finished"):
        (tmp_path / "runs" / name / ".hydra").mkdir(parents=True)
        (tmp_path / "runs" / name / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        (tmp_path / "runs" / name / "config_resolved.yaml").write_text("seed: 5\n")
    (tmp_path / "runs" / "finished" / "results.json").write_text(json.dumps({"metrics": {"test/acc": 0.4}, "seed": 5}))
    finished, killed = runs_cli.main(["--runs", str(tmp_path / "runs")])
    assert (finished["status"], killed["status"]) == ("finished", "unfinished")
    assert killed["overrides"] == finished["overrides"] == "+ablation=chela/ema optim.lr=0.001"
