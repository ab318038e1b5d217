"""scripts/learning_curves.py without training: where each run goes, the budget it gets, what the summary says."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("learning_curves", ROOT / "scripts" / "learning_curves.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _FinishedRun:
    def __init__(self, cmd, env):
        self.cmd, self.env = cmd, env

    def poll(self):
        return 0

    def wait(self):
        return 0


@pytest.fixture
def launched(tmp_path, monkeypatch):
    """Run main() with the data preparation and the training runs replaced by records of their commands, and an
    `nvidia-smi` that reports two GPUs."""
    lc = _load()
    runs = {}

    def popen(cmd, stdout, stderr, env, cwd):
        family = next(a for a in cmd if a.startswith("hydra.run.dir=")).rsplit("_", 1)[-1]
        runs[family] = _FinishedRun(cmd, env)
        return runs[family]

    # only the script's own subprocess calls are replaced; the GPU sampler still runs the fake nvidia-smi
    monkeypatch.setattr(lc, "subprocess", SimpleNamespace(run=lambda *a, **k: SimpleNamespace(returncode=0), Popen=popen,
                                                          STDOUT=subprocess.STDOUT))
    monkeypatch.setattr(lc, "check_recipes", lambda families, task: None)  # the families here are stand-ins
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text('#!/bin/sh\ncase "$*" in *name*) echo "Fake GPU";; *"-i 2,3"*|*"-i 6,7"*) printf "40, 100\\n90, 200\\n";; '
                    '*) echo "bad";; esac\n')
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return lc, runs


def _max_time(cmd) -> str:
    return next(a for a in cmd if a.startswith("+trainer.max_time=")).split("=", 1)[1]


def test_gpu_minutes_spread_runs_round_robin_and_scale_each_wall_budget(launched, tmp_path):
    lc, runs = launched
    out = tmp_path / "out"
    summary = lc.main(["--task", "listops", "--families", "a", "b", "c", "--gpus", "2", "3", "--gpu-minutes", "8",
                       "--no-test", "--out", str(out), "--logs", str(tmp_path / "logs")])
    assert {f: r.env["CUDA_VISIBLE_DEVICES"] for f, r in runs.items()} == {"a": "2", "b": "3", "c": "2"}
    # a and c share GPU 2: 16 wall-clock minutes each; b has GPU 3 alone: 8
    assert {f: _max_time(r.cmd) for f, r in runs.items()} == {"a": "00:00:16:00", "b": "00:00:08:00",
                                                               "c": "00:00:16:00"}
    assert summary["gpu_minute_budget_per_run"] == {"a": 8.0, "b": 8.0, "c": 8.0}
    assert summary["wall_minute_budget_per_run"] == {"a": 16.0, "b": 8.0, "c": 16.0}
    assert summary["gpu_of_family"] == {"a": 2, "b": 3, "c": 2}
    # the fake runs end at once: this call gave each almost nothing, whatever the budget
    assert set(summary["gpu_minutes_this_call"]) == {"a", "b", "c"}
    assert all(0 <= m < 0.5 for m in summary["gpu_minutes_this_call"].values())
    assert set(summary["gpu_util"]) == {"2", "3"}
    written = json.loads((out / "listops_summary.json").read_text())
    assert written["gpu_of_family"] == summary["gpu_of_family"]
    with open(out / "listops_gpu_util.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["call", "t_s", "gpu", "util_pct", "mem_mib"]
    assert {r["call"] for r in rows} == {"1"}
    assert {r["gpu"] for r in rows} == {"2", "3"}  # nvidia-smi asked for those two, one line each


def test_minutes_keep_one_wall_budget_and_the_first_gpu(launched, tmp_path):
    lc, runs = launched
    summary = lc.main(["--task", "listops", "--families", "a", "b", "--minutes", "6", "--out", str(tmp_path / "o"),
                       "--logs", str(tmp_path / "logs")])
    assert all(r.env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES") for r in runs.values())
    assert {_max_time(r.cmd) for r in runs.values()} == {"00:00:06:00"}
    assert summary["gpu_minute_budget_per_run"] == {"a": 3.0, "b": 3.0}  # one GPU, two runs


def test_bad_gpu_lists_and_two_budgets_are_refused(launched, tmp_path):
    lc, _ = launched
    with pytest.raises(SystemExit, match="distinct non-negative"):
        lc.main(["--families", "a", "b", "--gpus", "1", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        lc.main(["--minutes", "5", "--gpu-minutes", "5", "--out", str(tmp_path)])


def test_a_family_or_task_without_a_recipe_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """A family with no recipe for the task (a typo, or LaS on SC10) prepared the data, started a run that failed in
    its log and rewrote the summary under --out (docs/results by default); an unknown task ended in a
    CalledProcessError traceback. Both now stop in one line before the data is prepared."""
    lc = _load()
    monkeypatch.setattr(lc, "subprocess", None)  # nothing may be prepared or started
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"--families chella: no recipe experiment=<family>/listops .*mega_chunk"):
        lc.main(["--task", "listops", "--families", "chela", "chella", "--out", str(out)])
    with pytest.raises(SystemExit, match=r"--families las_chunk: no recipe experiment=<family>/sc10"):
        lc.main(["--task", "sc10", "--families", "las_chunk", "--out", str(out)])
    with pytest.raises(SystemExit, match=r"--task listop: no family has a recipe for it; the tasks: .*listops"):
        lc.main(["--task", "listop", "--families", "chela", "--out", str(out)])
    assert not out.exists()


def test_a_refused_data_setting_ends_in_prepares_one_line(tmp_path):
    """The data preparation ran with check=True: its one-line error (a refused data.* value, a download that
    failed) was followed by a CalledProcessError traceback and exit status 1. The call now exits with the
    preparation's status, its line alone on stderr, and starts no run."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "learning_curves.py"), "--task", "listops",
                           "--families", "chela", "--out", str(tmp_path / "out"), "--logs", str(tmp_path / "logs"),
                           f"paths.data_dir={tmp_path / 'data'}", "data.num_val=0"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and "data.num_val=0" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "logs").exists()


def test_gpu_indices_go_through_the_schedulers_visible_devices(launched, tmp_path, monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=4,5,6,7 (a scheduler's share of the host), --gpus 2 3 means GPUs 6 and 7: each run
    gets that one device and nvidia-smi is asked about those two; an index past the share is refused."""
    lc, runs = launched
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    summary = lc.main(["--task", "listops", "--families", "a", "b", "--gpus", "2", "3", "--gpu-minutes", "1",
                       "--out", str(tmp_path / "o"), "--logs", str(tmp_path / "logs")])
    assert {f: r.env["CUDA_VISIBLE_DEVICES"] for f, r in runs.items()} == {"a": "6", "b": "7"}
    assert summary["gpu_util"]["2"]["samples"] > 0  # the fake nvidia-smi answers only `-i 6,7`
    with pytest.raises(SystemExit, match="past the 4 visible"):
        lc.main(["--families", "a", "--gpus", "4", "--out", str(tmp_path / "o")])


def _util_calls(out: Path) -> list[str]:
    with open(out / "listops_gpu_util.csv") as f:
        return [r["call"] for r in csv.DictReader(f)]


def test_a_resuming_call_keeps_the_earlier_calls(launched, tmp_path):
    """The second call of runs that resume (a last.ckpt under --logs) appends its record and its utilization samples
    to the first call's instead of overwriting them, and sums the GPU-minutes of both."""
    lc, _ = launched
    out, logs = tmp_path / "out", tmp_path / "logs"
    argv = ["--task", "listops", "--families", "a", "b", "--gpus", "2", "3", "--gpu-minutes", "8", "--no-test",
            "--out", str(out), "--logs", str(logs)]
    first = lc.main(argv)
    first_samples = len(_util_calls(out))
    assert first["call"] == 1 and [c["call"] for c in first["calls"]] == [1]
    ckpt = logs / "listops_a" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"")
    second = lc.main(argv)
    assert second["call"] == 2 and [c["call"] for c in second["calls"]] == [1, 2]
    assert second["calls"][0] == first["calls"][0]
    calls = _util_calls(out)
    assert calls[:first_samples] == ["1"] * first_samples and set(calls[first_samples:]) == {"2"}
    totals = {f: round(first["gpu_minutes_this_call"][f] + second["gpu_minutes_this_call"][f], 2) for f in "ab"}
    assert second["gpu_minutes_total"] == totals
    assert json.loads((out / "listops_summary.json").read_text())["calls"] == second["calls"]


def test_a_fresh_start_renames_the_earlier_outputs(launched, tmp_path):
    """Runs that start afresh (no checkpoint under --logs) begin a new history; the earlier summary and utilization
    CSV stay beside it under their call's start time."""
    lc, _ = launched
    out = tmp_path / "out"
    argv = ["--task", "listops", "--families", "a", "--minutes", "1", "--no-test", "--out", str(out),
            "--logs", str(tmp_path / "logs")]
    first = lc.main(argv)
    second = lc.main(argv)
    assert second["call"] == 1
    stamp = first["started_utc"].replace("-", "").replace(":", "")
    kept = json.loads((out / f"listops_summary.{stamp}.json").read_text())
    assert kept["calls"] == first["calls"]
    assert (out / f"listops_gpu_util.{stamp}.csv").exists()


def test_a_summary_from_before_call_records_becomes_call_one(launched, tmp_path):
    """Outputs written before the script recorded calls (no `calls`, a utilization CSV without a call column) are
    read as the first call when the runs resume."""
    lc, _ = launched
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    (out / "listops_summary.json").write_text(json.dumps({"command": "old", "gpu_minutes_this_call": {"a": 4.0},
                                                          "steps": {"a": 100}}))
    (out / "listops_gpu_util.csv").write_text("t_s,gpu,util_pct,mem_mib\n0.5,0,97,1000\n")
    (logs / "listops_a").mkdir(parents=True)
    (logs / "listops_a" / "last.ckpt").write_bytes(b"")
    summary = lc.main(["--task", "listops", "--families", "a", "--minutes", "1", "--no-test", "--out", str(out),
                       "--logs", str(logs)])
    assert summary["call"] == 2 and summary["calls"][0]["command"] == "old"
    assert summary["gpu_minutes_total"]["a"] == round(4.0 + summary["gpu_minutes_this_call"]["a"], 2)
    assert _util_calls(out)[0] == "1"


def test_an_unreadable_summary_is_moved_aside_not_fatal(launched, tmp_path, capsys):
    """A summary that is not JSON (written by hand, or cut off) is kept under another name with a message that
    says so, and the call goes on with a new history."""
    lc, _ = launched
    out = tmp_path / "out"
    out.mkdir()
    (out / "listops_summary.json").write_text('{"calls": [')
    (out / "listops_gpu_util.csv").write_text("call,t_s,gpu,util_pct,mem_mib\n1,0.5,0,97,1000\n")
    summary = lc.main(["--task", "listops", "--families", "a", "--minutes", "1", "--no-test", "--out", str(out),
                       "--logs", str(tmp_path / "logs")])
    assert summary["call"] == 1
    assert (out / "listops_summary.unreadable.json").read_text() == '{"calls": ['
    assert "not valid JSON" in capsys.readouterr().err
    kept = list(out.glob("listops_gpu_util.*.csv"))  # the samples of that history are kept beside the new ones
    assert len(kept) == 1 and kept[0].read_text().endswith("1,0.5,0,97,1000\n")
    assert not list(out.glob(".*.tmp"))  # every output was moved into place


def test_a_call_whose_run_failed_exits_with_its_status(tmp_path):
    """The script exited 0 when its runs had failed (a refused setting, a crash): a scheduler or a chained command
    took the call for a success, and only `exit_codes` in the summary said otherwise. It now exits with the failed
    run's status and names the run and its log on stderr."""
    from tests.conftest import TINY_LISTOPS

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "WANDB_MODE": "offline"}
    logs = tmp_path / "logs"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "learning_curves.py"), "--task", "listops",
                           "--families", "chela", "--trainer", "cpu", "--minutes", "1", "--val-every", "2",
                           "--no-test", "--out", str(tmp_path / "out"), "--logs", str(logs), *TINY_LISTOPS,
                           f"paths.data_dir={tmp_path / 'data'}", "optim.lr=-1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert json.loads((tmp_path / "out" / "listops_summary.json").read_text())["exit_codes"] == {"chela": 2}
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"run chela exited with status 2; its log: {logs / 'listops_chela.log'}" in proc.stderr


@pytest.mark.parametrize("codes, status", [({"a": 0, "b": 0}, 0), ({"a": 143, "b": 0}, 143),
                                           ({"a": 143, "b": 1}, 1), ({"a": -9}, 1)],
                         ids=["all-ok", "stopped-by-sigterm", "failed-beats-stopped", "killed"])
def test_exit_status_prefers_a_failed_run(codes, status):
    assert _load().exit_status(codes) == status
