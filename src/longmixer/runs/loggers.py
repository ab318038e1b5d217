"""Logger factories: a CSV logger that keeps its history across resumes, and W&B (offline by default) resumable
under the same run id."""

from __future__ import annotations

import csv
import logging
import os
import sys
import uuid
from pathlib import Path

from lightning_fabric.loggers.csv_logs import _ExperimentWriter
from lightning_fabric.loggers.logger import rank_zero_experiment
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter

from longmixer.runs.resume import write_atomically

log = logging.getLogger(__name__)


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer deletes an existing metrics.csv when it starts; this one keeps it and appends (the
    header grows when new columns appear)."""

    def _check_log_dir_exists(self) -> None:
        self._written: set[tuple] = set()
        path = Path(self.metrics_file_path)
        if path.is_file():
            fields, rows = _whole_rows(path)
            self.metrics_keys = sorted(fields)
            self._written = {_row_key(row) for row in rows}

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        # Lightning's version truncates metrics.csv and writes it again; a kill in between loses the history
        path = Path(self.metrics_file_path)
        _write_csv(path, fieldnames, _read_csv(path)[1])

    def save(self) -> None:
        # a row identical to one already written (a once-per-fit value such as the parameter count, logged
        # again by the resumed run) is not repeated
        fresh = []
        for row in self.metrics:
            key = _row_key(row)
            if key not in self._written:
                self._written.add(key)
                fresh.append(row)
        self.metrics = fresh
        super().save()


def _row_key(row: dict) -> tuple:
    return tuple(sorted((k, float(v)) for k, v in row.items() if v not in ("", None)))


class ResumableCSVLogger(CSVLogger):
    """`CSVLogger` for a run dir that may be resumed: the history is kept, rows are flushed whenever a checkpoint
    is written (before it, by `AtomicModelCheckpoint`, so a killed run loses no row its checkpoint covers), and
    `rewind(step)` moves the rows a killed run logged after its checkpoint to metrics.dropped.csv (the resumed run
    logs them again)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> _ExperimentWriter:
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment

    DROPPED = "metrics.dropped.csv"

    def rewind(self, step: int) -> int:
        """Keep only the rows with `step` below `step` in metrics.csv; the others are appended to
        metrics.dropped.csv (with the step rewound to, `rewound_to`), so no logged row is lost. Returns how many rows
        were dropped."""
        path = Path(self.log_dir) / _ExperimentWriter.NAME_METRICS_FILE
        if not path.is_file():
            return 0
        # the rewind runs before the writer reads the file: a row cut short must not be taken for a whole row
        # (its step missing or cut) and written back whole
        fields, rows = _whole_rows(path)
        kept = [r for r in rows if r.get("step") in (None, "") or int(float(r["step"])) < step]
        if len(kept) != len(rows):
            # the dropped rows first: a kill between the two writes loses nothing
            _append_dropped(path, fields, [{**r, "rewound_to": step} for r in rows if r not in kept])
            _write_csv(path, fields, kept)
        return len(rows) - len(kept)

    def after_save_checkpoint(self, checkpoint_callback) -> None:
        self.save()


def _read_csv(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _whole_rows(path: Path) -> tuple[list[str], list[dict]]:
    """metrics.csv's header and whole rows. A row cut short (a kill or a full disk during an append) would have the
    next row glued onto it: it goes to metrics.dropped.csv (`rewound_to` = `cut short`), and the whole rows are
    rewritten atomically."""
    fields, rows = _read_csv(path)
    good = [r for r in rows if None not in r and None not in r.values()]
    if len(good) != len(rows) or not _ends_a_line(path):
        cut = [{k: v for k, v in r.items() if k is not None} for r in rows if r not in good]
        if good and not _ends_a_line(path) and rows and rows[-1] in good:
            cut.append(good.pop())
        _append_dropped(path, fields, [{**r, "rewound_to": "cut short"} for r in cut])
        _write_csv(path, fields, good)
    return fields, good


def _ends_a_line(path: Path) -> bool:
    """Whether the file is empty or its last byte ends a line (an append cut short leaves a partial last row)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _append_dropped(path: Path, fields: list[str], rows: list[dict]) -> None:
    """Add `rows` (each with its `rewound_to`) to the metrics.dropped.csv beside `path`."""
    if not rows:
        return
    dropped_path = path.with_name(ResumableCSVLogger.DROPPED)
    old_fields, old_rows = _read_csv(dropped_path) if dropped_path.is_file() else ([], [])
    _write_csv(dropped_path, list(dict.fromkeys([*old_fields, *fields, "rewound_to"])), [*old_rows, *rows])


def _write_csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


WANDB_ID = "wandb_id.txt"  # the run dir's W&B run id (`wandb_run_id`)


def wandb_run_id(save_dir: str | Path) -> str:
    """The run dir's W&B id: read from `<save_dir>/wandb_id.txt`, or made and stored there, so a resumed run
    (same run dir) continues the same W&B run. An empty file (a kill while it was first written) gets a new id: the
    file is written before the W&B run starts, so no run was started with the lost one."""
    path = Path(save_dir) / WANDB_ID
    run_id = path.read_text().strip() if path.exists() else ""
    if run_id:
        return run_id
    path.parent.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:12]
    write_atomically(path, run_id)
    return run_id


def end_wandb_run(run_dir: str | Path, exit_code: int) -> None:
    """End the run dir's W&B run (the id in `<run dir>/wandb_id.txt`) if a failed attempt left it open, with the
    attempt's exit status. A sweep runs its jobs in one process, and Lightning's WandbLogger takes over a W&B run that
    is still open instead of starting its own: the next job would log its config and metrics into this one."""
    wandb = sys.modules.get("wandb")  # not imported: no W&B run was started
    run = getattr(wandb, "run", None)
    path = Path(run_dir) / WANDB_ID
    if run is None or not path.is_file() or run.id != path.read_text().strip():
        return
    try:
        run.finish(exit_code=exit_code)
    except Exception as err:  # noqa: BLE001 - the error that ended the attempt stays the one reported
        log.warning("could not end the W&B run %s: %s", run.id, err)


def wandb_logger(project: str, save_dir: str, run_name: str, seed: int, tags=(), group: str | None = None,
                 entity: str | None = None, model_name: str | None = None, data_name: str | None = None,
                 log_model: bool | str = False, watch: str | None = None, watch_log_freq: int = 100):
    """A `WandbLogger` named `<run_name>-seed<seed>`, grouped by run name, tagged; offline unless the user set
    `WANDB_MODE` or an API key (`WANDB_API_KEY`). The full resolved config is sent by the entry point.
    `log_model` (checkpoints as artifacts) and `watch` (gradient / parameter histograms): configs/logger/wandb.yaml."""
    from longmixer.runs.wandb_watch import WatchingWandbLogger

    online = "WANDB_MODE" in os.environ or "WANDB_API_KEY" in os.environ
    mode = os.environ.get("WANDB_MODE", "online") if online else "offline"
    return WatchingWandbLogger(project=project, entity=entity, save_dir=save_dir, name=f"{run_name}-seed{seed}",
                               group=group, tags=[*tags, *(t for t in (model_name, data_name) if t), f"seed{seed}"],
                               id=wandb_run_id(save_dir), resume="allow", mode=mode, log_model=log_model,
                               watch=watch, watch_log_freq=watch_log_freq)
