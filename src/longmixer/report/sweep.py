"""The sweep summary: after `python -m longmixer.train -m ...` (a grid or an Optuna study), one table of every job.

A Hydra callback (configured in `configs/hydra/default.yaml`). Each job, when it ends, leaves a record in
`<sweep dir>/jobs/<num>.json` and a link `<sweep dir>/jobs/<num>` to its run dir; records are files rather than
state in this object so that launchers running jobs in other processes (joblib, submitit) are summarized as well.
After every job the records become `<sweep dir>/summary.csv` and `summary.md` (logged when the sweep ends):

| job | status    | val/acc_best | optim.lr | run_dir                                    |
|-----|-----------|--------------|----------|--------------------------------------------|
| 0   | COMPLETED | 0.3125 *     | 0.002    | logs/runs/quickstart/1b2c3d4e_seed0        |

`*` marks the best jobs by the task's mode (every job that ties for best); the markdown shows only the overrides that differ between jobs, the CSV
has every override of every job.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from longmixer.report.tables import write_csv
from longmixer.utils.errors import UserFacingError

log = logging.getLogger("longmixer")
RECORDS = "jobs"


def _metric_name(config: DictConfig) -> str:
    """The sweep's objective (`optimized_metric`, set by hparams_search) or the best value of the task's monitor; in
    an `evaluate -m` sweep (its jobs have a `run_dir`), the monitor's value at the checkpoint scored."""
    metric = OmegaConf.select(config, "optimized_metric", default=None)
    if metric:
        return str(metric)
    monitor = OmegaConf.select(config, "task.monitor", default=None)
    if monitor and OmegaConf.select(config, "run_dir", default=None):
        return str(monitor)
    return f"{monitor}_best" if monitor else "val/loss"


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def job_record(config: DictConfig, job_return: Any) -> dict:
    """What one job leaves for the summary: its number, overrides, status, metric value and run dir."""
    run_dir = Path(config.hydra.runtime.output_dir)
    metric = _metric_name(config)
    status = getattr(getattr(job_return, "status", None), "name", "UNKNOWN")
    returned = _returned(job_return)
    value = None
    if status == "COMPLETED":
        # a failed job scored nothing: a results.json in its run dir is an earlier attempt's (a job refused for
        # config drift finds the run that the old config finished)
        results_path = run_dir / "results.json"
        results = json.loads(results_path.read_text()) if results_path.exists() else {}
        value = _number((results.get("metrics") or {}).get(metric))
    if value is None and status == "COMPLETED":  # train returns the objective, evaluate its metrics
        value = _number(returned.get(metric) if isinstance(returned, dict) else returned)
    return {"job": int(config.hydra.job.num), "status": status, "metric": metric, "value": value,
            "mode": _mode(config),
            "overrides": [str(o) for o in config.hydra.overrides.task],
            "error": f"{type(returned).__name__}: {returned}" if isinstance(returned, BaseException) else "",
            "run_dir": str(run_dir)}


def _returned(job_return: Any) -> Any:
    """A job's return value, or the exception a failed job raised. Read from the attribute behind Hydra's
    `return_value` property, which raises that exception again and prints an "Error executing job" line when read."""
    if hasattr(job_return, "_return_value"):
        return job_return._return_value
    try:
        return job_return.return_value
    except Exception as err:  # noqa: BLE001 - another JobReturn: a failed job re-raises its error here
        return err


class RefusedSweepJob(CompactHydraException):
    """A sweep job stopped by one of our user-facing errors (a refused setting, a run dir in use, ...). Hydra ends the
    sweep with the first failed job's exception; for this type it prints the message alone, as a single run does,
    instead of a traceback through Hydra's and our frames."""


def _mode(config: DictConfig) -> str:
    """Which way is best: the Optuna sweeper's direction where one is set (it may be given on the command line
    apart from task.mode), else the task's mode."""
    direction = OmegaConf.select(config, "hydra.sweeper.direction", default=None, throw_on_resolution_failure=False)
    if isinstance(direction, str) and direction in ("minimize", "maximize"):
        return "min" if direction == "minimize" else "max"
    return OmegaConf.select(config, "task.mode", default="max")


def _split(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key, value


def summary_rows(records: list[dict]) -> tuple[list[dict], list[str]]:
    """One row per job (sorted by job number), and the override keys whose values differ between jobs."""
    records = sorted(records, key=lambda r: r["job"])
    values: dict[str, set[str]] = {}
    for record in records:
        for key, value in map(_split, record["overrides"]):
            values.setdefault(key, set()).add(value)
    varying = [k for k, v in values.items() if len(v) > 1 or any(k not in dict(map(_split, r["overrides"]))
                                                                   for r in records)]
    scored = [r for r in records if r["value"] is not None]
    best = None  # the best value: every job that reaches it is marked (ties are common on small validation sets)
    if scored:
        pick = min if records[0]["mode"] == "min" else max
        best = pick(r["value"] for r in scored)
    rows = []
    for record in records:
        overrides = dict(map(_split, record["overrides"]))
        rows.append({"job": record["job"], "status": record["status"], "metric": record["metric"],
                     "value": record["value"], "best": best is not None and record["value"] == best,
                     **{k: overrides.get(k, "") for k in varying},
                     "overrides": " ".join(record["overrides"]), "error": record["error"],
                     "run_dir": record["run_dir"]})
    return rows, varying


def summary_markdown(rows: list[dict], varying: list[str]) -> str:
    metric = rows[0]["metric"] if rows else "metric"
    header = ["job", "status", metric, *varying, "run_dir"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        value = "–" if row["value"] is None else f"{row['value']:.4f}" + (" *" if row["best"] else "")
        error = " ".join(row["error"].split()).replace("|", "\\|")  # one table row, whatever the message holds
        error = error if len(error) <= 120 else error[:119] + "…"
        status = row["status"] + (f" ({error})" if error else "")
        lines.append("| " + " | ".join([str(row["job"]), status, value, *(str(row[k]) for k in varying),
                                        row["run_dir"]]) + " |")
    return "\n".join(lines) + "\n"


def write_summary(sweep_dir: Path, announce: bool = True) -> dict[str, Path] | None:
    """`summary.csv` and `summary.md` in `sweep_dir` from the job records (logged when `announce`); None when no
    job left one."""
    records = [json.loads(p.read_text()) for p in sorted((sweep_dir / RECORDS).glob("*.json"))]
    if not records:
        return None
    rows, varying = summary_rows(records)
    paths = {"csv": sweep_dir / "summary.csv", "markdown": sweep_dir / "summary.md"}
    write_csv(paths["csv"], rows)
    markdown = summary_markdown(rows, varying)
    paths["markdown"].write_text(markdown)
    if announce:
        log.info("sweep summary (%d jobs, %s):\n%s", len(rows), paths["csv"], markdown)
    return paths


# the sweep that this process's jobs belong to, and whether its end was announced: Hydra skips `on_multirun_end`
# when a job failed (its sweeper re-raises the failure first), so an exit hook announces it then
# (`announce_unfinished_sweep`, registered by the first job's end)
_SWEEP = {"dir": None, "announced": False, "hooked": False}


def announce_unfinished_sweep() -> None:
    """Print the summary of a sweep whose end Hydra did not reach (a failed job), once; nothing otherwise."""
    if _SWEEP["dir"] is None or _SWEEP["announced"]:
        return
    _SWEEP["announced"] = True
    paths = write_summary(Path(_SWEEP["dir"]), announce=False)
    if paths is not None:
        print(f"sweep summary ({paths['csv']}):\n{paths['markdown'].read_text()}", file=sys.stderr)


class SweepSummary(Callback):
    """Hydra callback: a record per job at its end, the summary table after every job (so a sweep that stops
    at a failed grid job or is killed still has one) and logged at the end of the multirun (or, when a job failed,
    printed when the process exits: `announce_unfinished_sweep`)."""

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        _SWEEP.update(dir=str(config.hydra.sweep.dir), announced=False)
        if not _SWEEP["hooked"]:
            atexit.register(announce_unfinished_sweep)
            _SWEEP["hooked"] = True
        record = job_record(config, job_return)
        returned = _returned(job_return)
        if isinstance(returned, UserFacingError):  # one line now, and one line when Hydra ends the sweep with it
            log.error("job %d stopped: %s", record["job"], returned)
            job_return.return_value = RefusedSweepJob(f"job {record['job']} stopped: {returned}")
        records = Path(config.hydra.sweep.dir) / RECORDS
        records.mkdir(parents=True, exist_ok=True)
        (records / f"{record['job']}.json").write_text(json.dumps(record, indent=1))
        link = records / str(record["job"])
        if not link.exists() and not link.is_symlink() and Path(record["run_dir"]).is_dir():
            os.symlink(os.path.abspath(record["run_dir"]), link, target_is_directory=True)
        write_summary(records.parent, announce=False)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        _SWEEP["announced"] = True
        write_summary(Path(config.hydra.sweep.dir))
