"""Train one configuration: compose -> instantiate data, model, task, trainer -> fit -> test the best checkpoint.

    python -m longmixer.train experiment=chela/listops trainer=gpu seed=3
    python -m longmixer.train -m experiment=quickstart seed=0,1,2

The same command continues its run (README "Resume"): a lock keeps a second process out of the run dir, a finished
run is reported instead of trained again, a changed config is refused unless `resume=force`, and SIGTERM / SIGUSR2
(SLURM's warning before the time limit) / SIGINT write a checkpoint and exit with 128 + the signal number
(143 / 140 / 130).
"""

from __future__ import annotations

import logging
import math
import signal
import sys
from pathlib import Path

import hydra
import pytorch_lightning as pl
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ProgressBar
from pytorch_lightning.utilities import rank_zero_only
from pytorch_lightning.utilities.exceptions import SIGTERMException

from longmixer.runs.checkpoints import CheckpointError, check_weights_fit, load_checkpoint, trusted_best_path
from longmixer.runs.fault_injection import fault_callbacks
from longmixer.runs.loggers import ResumableCSVLogger, end_wandb_run
from longmixer.runs.resume import (
    STORED_CONFIG,
    HydraRecord,
    RunLock,
    check_config_drift,
    finished_results,
    keep_finished_results,
    keep_replaced_config,
    refuse_unusable_folders,
    select_resume_checkpoint,
    write_atomically,
)
from longmixer.runs.run import (
    check_validation_schedule,
    config_tree,
    instantiate_group,
    instantiate_node,
    majority_rates,
    resolved_config,
    result_table,
    to_number,
    write_results,
)
from longmixer.runs.run_info import record_attempt_end, write_run_info
from longmixer.utils.cli import quiet_on_closed_stdout
from longmixer.utils.compose import (CONFIG_DIR, CONFIG_SEARCH_PATH, apply_mixer_blocks, refuse_before_hydra,
                                     run_explaining_refusals)
from longmixer.utils.errors import UserFacingError
from longmixer.utils.compile import release_cuda_graphs
from longmixer.utils.config import ConfigError, check_backend_on_device, check_task_and_data, validate_config
from longmixer.utils.resolvers import register_resolvers
from longmixer.utils.signals import STOP_SIGNALS

log = logging.getLogger("longmixer")


def train(cfg: DictConfig) -> dict:
    """Fit and test one composed config; returns the results dict written to `<run dir>/results.json`."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    # rank 0 owns the run dir; DDP ranks started by Lightning re-enter here while rank 0 holds the lock
    owner = rank_zero_only.rank == 0
    record = HydraRecord(run_dir / hydra_cfg.output_subdir if owner and hydra_cfg.output_subdir else None)
    lock = None
    try:
        apply_mixer_blocks(cfg, dict(hydra_cfg.runtime.choices), hydra_cfg.overrides.task)
        validate_config(cfg)
        check_task_and_data(cfg)
        lock = RunLock(run_dir).acquire() if owner else None
        results = _train(cfg, run_dir, record)
        if record.accepted and owner:
            record_attempt_end(run_dir, results.get("status", "finished"))
        return results
    except BaseException as err:
        record.restore()  # an attempt refused before it ran leaves the run's .hydra record as it was
        if record.accepted and owner:  # an attempt that ran: run_info.json says how it ended
            record_attempt_end(run_dir, _outcome(err))
        # a sweep's next job would otherwise log into this attempt's W&B run (runs/loggers.py)
        end_wandb_run(run_dir, err.code if isinstance(err, SystemExit) and isinstance(err.code, int) else 1)
        raise
    finally:
        release_cuda_graphs()  # before Lightning's exit handler destroys the process group
        if lock is not None:
            lock.release()


def _outcome(err: BaseException) -> str:
    """How an attempt that raised ended, in one line for run_info.json."""
    if isinstance(err, SystemExit):
        return {128 + s: f"stopped by {s.name} (exit {128 + s})" for s in STOP_SIGNALS}.get(
            err.code, f"exited with status {err.code}")
    if isinstance(err, KeyboardInterrupt):
        return "interrupted"
    return "failed: " + " ".join(f"{type(err).__name__}: {err}".split())[:300]


def check_not_launching_ranks_in_a_sweep(trainer: pl.Trainer) -> None:
    """Refuse a Hydra multirun job whose trainer would start its DDP ranks itself (Lightning's subprocess launcher
    re-runs this command line, sweep included, in each new rank: every rank then runs the whole sweep, in step with
    rank 0 only while the sweep is a grid run in order, and an Optuna sweep's ranks can train different trials
    against each other). Ranks started outside (SLURM tasks, torchrun) and spawned ranks (`ddp_spawn`) pass."""
    from pytorch_lightning.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if (HydraConfig.get().mode == RunMode.MULTIRUN and isinstance(launcher, _SubprocessScriptLauncher)
            and getattr(trainer.strategy, "num_processes", 1) > 1
            and environment is not None and not environment.creates_processes_externally):
        raise UserFacingError(
            f"a multirun (-m) job with {type(trainer.strategy).__name__} on "
            f"{trainer.num_devices} devices: Hydra's local multirun and DDP do not mix (each rank Lightning starts "
            "re-runs the whole sweep). Run DDP jobs as single runs, one command per job (a shell loop over seeds), "
            "or sweep with hydra/launcher=slurm, whose tasks start the ranks")


def _train(cfg: DictConfig, run_dir: Path, record: HydraRecord) -> dict:
    choices = dict(HydraConfig.get().runtime.choices)
    if rank_zero_only.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        log.info("composed config (full tree: %s once the run starts)\n%s", run_dir / "config_tree.txt",
                 config_tree(cfg, choices, compact=True))
    drift = check_config_drift(cfg, run_dir)
    finished = finished_results(run_dir)
    if finished is not None and not drift and cfg.ckpt_path is None and cfg.resume != "never":
        log.info("%s already finished (results.json); nothing to train. Pass run_tag=<name> for a new run.%s",
                 run_dir, result_table(finished))
        record.restore()
        return finished
    ckpt_path = select_resume_checkpoint(cfg, run_dir)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)

    log.info("instantiating data <%s>", cfg.data._target_)
    datamodule = instantiate_node(cfg.data)
    log.info("instantiating task <%s> with model <%s>", cfg.task._target_, cfg.model._target_)
    task = instantiate_node(cfg.task)
    task.model_config = OmegaConf.to_container(cfg.model, resolve=True)  # the checkpoints' record (tasks/base.py)
    if ckpt_path is not None:
        fix = ("pass ckpt_path=<a checkpoint of this model>" if cfg.ckpt_path is not None else
               f"its config ({run_dir / STORED_CONFIG}) built another model; resume=force cannot continue these "
               "weights: start a separate run with run_tag=<name>")
        check_weights_fit(task, load_checkpoint(ckpt_path, mmap=True), ckpt_path, fix)
    callbacks = [*instantiate_group(cfg.get("callbacks"), "callbacks"), *fault_callbacks()]
    if not cfg.trainer.get("enable_progress_bar", True) and any(isinstance(cb, ProgressBar) for cb in callbacks):
        callbacks = [cb for cb in callbacks if not isinstance(cb, ProgressBar)]
        log.info("callbacks: the progress bar left out (trainer.enable_progress_bar=false)")
    loggers = instantiate_group(cfg.get("logger"), "logger")
    log.info("instantiating trainer <%s>", cfg.trainer._target_)
    # "partial": nested values reach the Trainer as plain dicts / lists (Lightning's Timer takes
    # `trainer.max_time={hours: 1}` only as a dict, not as an OmegaConf DictConfig)
    trainer: pl.Trainer = instantiate_node(cfg.trainer, callbacks=callbacks, logger=loggers, _convert_="partial")
    check_not_launching_ranks_in_a_sweep(trainer)
    check_backend_on_device(cfg, trainer.strategy.root_device.type)
    if cfg.train:
        check_validation_schedule(cfg, datamodule, trainer.world_size)

    if trainer.is_global_zero:
        # the attempt runs: from here its config is the run's record (a refused one above left the last record)
        record.accept()
        (run_dir / "config_tree.txt").write_text(config_tree(cfg) + "\n")
        write_run_info(run_dir, Path(CONFIG_DIR).parent, resumed_from=ckpt_path)
        if drift or not (run_dir / STORED_CONFIG).exists():
            keep_replaced_config(run_dir)
            write_atomically(run_dir / STORED_CONFIG, OmegaConf.to_yaml(cfg, resolve=True))
        if finished is not None:
            keep_finished_results(run_dir)
    if ckpt_path is not None:
        _rewind_loggers(trainer, ckpt_path)
    elif cfg.train:
        _rewind_loggers(trainer, None)  # a fresh start: the rows of an attempt killed before its first checkpoint
    for logger in trainer.loggers:
        logger.log_hyperparams(resolved_config(cfg))

    if cfg.train:
        try:
            trainer.fit(task, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        except SIGTERMException:
            # SIGTERM before training started (setup, sanity check), where Lightning's own handler is active:
            # nothing to checkpoint, but the exit status must still say "terminated" for a requeue
            raise SystemExit(128 + signal.SIGTERM) from None
    # read before the test phase: loading the best checkpoint there restores its Timer state (the time spent up to
    # that checkpoint), after which a run stopped by its budget would look finished
    stopped = cfg.train and stopped_by_time_budget(trainer)
    checkpointer = trainer.checkpoint_callback
    metrics = dict(getattr(checkpointer, "val_metrics", {}))
    metrics.update({k: to_number(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")})

    best_ckpt, unpaired = None, None
    if cfg.test:
        if trainer.fast_dev_run:
            log.info("fast_dev_run writes no checkpoints: testing the current weights (debug only)")
        else:
            best = checkpointer.best_model_path if checkpointer else ""
            best_ckpt = trusted_best_path(best, Path(checkpointer.dirpath)) if best else None
            if not best_ckpt:
                raise RuntimeError("no best checkpoint was written, so the papers' reporting rule (test at the "
                                   "best validation checkpoint) cannot be applied; check callbacks.checkpoint and "
                                   "that validation ran (trainer.limit_val_batches, check_val_every_n_epoch)")
        if best_ckpt:
            # the tested weights' own validation: results.json pairs test/* with the val/* of the same checkpoint
            # (the last validation's stay in metrics.csv)
            own = _read_best_checkpoint(best_ckpt, run_dir)
            if not own:  # a checkpoint of an earlier version, which kept no val/*: leave the others' out
                unpaired = _unpaired_val
                metrics = {k: v for k, v in metrics.items() if not unpaired(k)}
                log.warning("%s holds no validation metrics (an earlier version's checkpoint): results.json leaves "
                            "out val/* other than the best score; `python -m longmixer.evaluate run_dir=%s` scores "
                            "that checkpoint on the validation split", best_ckpt, run_dir)
            metrics.update(own)
        for result in _test_until_signal(trainer, task, datamodule, best_ckpt):
            metrics.update({k: to_number(v) for k, v in result.items()})

    majority = majority_rates(getattr(datamodule, "manifest", None))
    # "finished" makes the same command report the run instead of running it: only a run tested at its best
    # checkpoint is. A fast_dev_run (a smoke test, no checkpoint) runs again; a run trained with test=false is
    # tested by the same command with test=true (it resumes from its last checkpoint, which ends the fit at once)
    if stopped:
        status = "stopped at trainer.max_time"
    elif trainer.fast_dev_run:
        status = "fast_dev_run (debug; not a result)"
    elif cfg.train and not cfg.test:
        status = "trained, not tested (test=false)"
    else:
        status = "finished"
    results = (write_results(run_dir, cfg, choices, metrics, best_ckpt, majority, status=status, drop=unpaired)
               if trainer.is_global_zero else {})
    if trainer.is_global_zero:
        log.info("results%s", result_table(results))
    for logger in trainer.loggers:
        if isinstance(logger, pl.loggers.WandbLogger):  # subclasses too (runs/wandb_watch.py)
            logger.experiment.finish()
    return {"metrics": metrics, **results}


def stopped_by_time_budget(trainer: pl.Trainer) -> bool:
    """Whether `trainer.max_time` (Lightning's Timer) ended the fit. Such a run is not recorded as finished: the
    same command with a larger `trainer.max_time` continues it from `last.ckpt` (the Timer's spent time is in the
    checkpoint), which is how one training budget is spread over several sessions."""
    from pytorch_lightning.callbacks import Timer
    from pytorch_lightning.trainer.states import RunningStage

    timers = [cb for cb in trainer.callbacks if isinstance(cb, Timer)]
    return any((t.time_remaining(RunningStage.TRAINING) or 0.0) <= 0.0 for t in timers)


def _rewind_loggers(trainer: pl.Trainer, ckpt_path: str | None) -> None:
    """Drop the CSV rows a killed run logged after `ckpt_path` was written (their step column, the optimizer step
    count before the logged batch, is at least the checkpoint's global step); the resumed run logs them again.
    None: a fresh start, so every row of an earlier attempt (one killed before it wrote a checkpoint) goes."""
    step = 0 if ckpt_path is None else int(load_checkpoint(ckpt_path, mmap=True)["global_step"])
    for logger in trainer.loggers:
        if isinstance(logger, ResumableCSVLogger) and trainer.is_global_zero:
            dropped = logger.rewind(step)
            if dropped and ckpt_path is None:
                log.warning("metrics.csv holds %d rows of an earlier attempt, but there is no checkpoint to resume "
                            "from: the run starts again at step 0, and the rows are moved to %s", dropped,
                            ResumableCSVLogger.DROPPED)
            elif dropped:
                log.info("metrics.csv: %d rows logged after the checkpoint (step >= %d) moved to %s; the resumed run "
                         "logs them again", dropped, step, ResumableCSVLogger.DROPPED)
            metrics = Path(logger.log_dir) / "metrics.csv"
            if step > 0 and (not metrics.is_file() or len(metrics.read_text().splitlines()) < 2):
                log.warning("%s holds no rows, but the run resumes at step %d: the history before it is missing "
                            "(deleted or emptied); the rows from here on are appended", metrics, step)


def _unpaired_val(key: str) -> bool:
    """val/* metrics that belong to one validation (not the run's best score, `val/<metric>_best`)."""
    return key.startswith("val/") and not key.endswith("_best")


def _read_best_checkpoint(best_ckpt: str, run_dir: Path) -> dict[str, float]:
    """Read the best checkpoint before the test phase loads it: a damaged one is named with the way out, not
    reported as the bare OSError of Lightning's load. Returns the val/* metrics of the validation that wrote it (the
    checkpoint callback's state; empty for a checkpoint without them)."""
    try:
        checkpoint = load_checkpoint(best_ckpt)
    except CheckpointError as err:
        raise CheckpointError(f"{err}. The test split is scored at the best validation checkpoint, so this run cannot "
                              f"report test metrics from it: train it again in a new run dir (run_tag=<name>), or "
                              f"score another of its checkpoints with `python -m longmixer.evaluate "
                              f"run_dir={run_dir} ckpt_path=<file>`") from None
    for state in (checkpoint.get("callbacks") or {}).values():
        if isinstance(state, dict) and isinstance(state.get("val_metrics"), dict):
            return {k: float(v) for k, v in state["val_metrics"].items()}
    return {}


def _test_until_signal(trainer: pl.Trainer, task, datamodule, ckpt_path: str | None) -> list[dict]:
    """`trainer.test`, ended by SIGTERM or SIGINT with the exit status a scheduler reads (143 / 130): there is
    nothing to checkpoint, no results.json is written, and a rerun scores the test split again. (Lightning's own
    SIGTERM handler ends the test with a `SIGTERMException` whose exit status is 0, and its Ctrl+C handling with
    1, so a preempted job would look finished or crashed.)"""
    interrupted = []

    def on_sigint(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        return trainer.test(task, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True, verbose=False)
    except SIGTERMException:
        raise SystemExit(128 + signal.SIGTERM) from None
    except (SystemExit, KeyboardInterrupt):
        if interrupted:
            raise SystemExit(128 + signal.SIGINT) from None
        raise
    finally:
        signal.signal(signal.SIGINT, previous)


@hydra.main(version_base="1.3", config_path=CONFIG_SEARCH_PATH, config_name="train")
def _main(cfg: DictConfig) -> float | None:
    try:
        results = train(cfg)  # SIGTERM / SIGUSR2 / SIGINT end it with SystemExit(143 / 140 / 130) after a checkpoint
        return _objective(cfg.get("optimized_metric"), results["metrics"])
    except UserFacingError as err:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # the sweep records the failed job and goes on
        log.error("%s", err)
        sys.exit(2)


def _objective(metric: str | None, metrics: dict) -> float | None:
    """The value a sweeper optimizes (`optimized_metric`, set by hparams_search), None without one. A missing or
    non-finite value fails the job with the metrics the run has: returned as NaN, Optuna's `tell` refuses it for a
    completed trial, and hydra-optuna-sweeper's fallback then tells the trial FAIL with that same NaN, which Optuna
    refuses again, ending the whole study; a job that raises is told FAIL without a value and the study goes on."""
    if metric is None:
        return None
    value = metrics.get(metric)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        state = "is not among" if value is None else f"is {value!r} in"
        raise ConfigError(f"optimized_metric={metric} {state} this run's metrics ({', '.join(sorted(metrics))}): "
                          "the trial counts as failed; the sweep's objective is usually ${task.monitor}_best")
    return value


@quiet_on_closed_stdout
def main() -> None:
    refuse_before_hydra(sys.argv[1:])
    refuse_unusable_folders(sys.argv[1:])
    register_resolvers()
    run_explaining_refusals(_main, sys.argv[1:])


if __name__ == "__main__":
    main()
