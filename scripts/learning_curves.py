"""Learning evidence: train several families on one task's paper recipe for the same GPU-minute budget and keep
their validation curves.

    python scripts/learning_curves.py --task listops --families chela longvq las seqboat mega_chunk transformer \
        --minutes 9 --out docs/results

Each family runs `python -m longmixer.train experiment=<recipe> data=<task>_gen trainer=gpu` (the generated data,
so no download is needed) with `trainer.max_time`, validating every `--val-every` steps. Runs start together (the
default: one GPU shared by all, equal wall time each) or one after another (`--sequential`); `--gpus 0 1` spreads
them round-robin over those GPUs (indices as this process sees them, so within a scheduler's
`CUDA_VISIBLE_DEVICES`; each run gets its one device). The runs are compared at equal
GPU-minutes: a run's wall-clock minutes over the number of runs that share its GPU. `--gpu-minutes 8` sets that
budget directly (a run sharing its GPU with another gets 16 wall-clock minutes, a run alone 8); `--minutes` gives
every run the same wall-clock budget instead. The summary records both per run, and what this call gave each
(`run_minutes_this_call`, process time including start-up, and `gpu_minutes_this_call`). While they run,
`nvidia-smi` samples the GPUs in use once a second. Written under --out, and rewritten every 30 s while the runs go
on:
- `<task>_<family>.csv`: step, val_acc, val_loss, one row per validation;
- `<task>_gpu_util.csv`: the utilization samples (call, t_s, gpu, util_pct, mem_mib; t_s from the call's start);
- `<task>_summary.json`: command, GPUs, budgets and minutes given, best val acc; `calls` holds one record per call
  of the same runs and `gpu_minutes_total` sums them;
- `<task>.png`: the curves with each paper's final test accuracy marked (paper_results.yaml), when matplotlib is
  installed (`--plot-only` redraws it from the CSVs elsewhere).
Re-running the same command resumes each run from its last checkpoint (resume=auto), so a budget can be spread
over several calls or sessions. `--minutes` is each run's total training time over all of them: Lightning's timer
state travels in the checkpoint, so a resumed run stops at the same cumulative budget. `--no-test` skips the final
test of a slice that a later call continues. A call that resumes runs (a `last.ckpt` under --logs) keeps the earlier
calls' records and utilization samples in its outputs; a call that starts them afresh first renames the earlier
summary and utilization CSV with their call's start time (`<task>_summary.<UTC time>.json`), so no history is
overwritten. The call exits 0 when every run exited 0, else with the status of a run that did not (one that
failed before one stopped by a signal: 143 / 130, which the same command resumes), each such run named on stderr
with its log.

A machine that is given back between calls takes the run dirs with it. `--state-out DIR` packs the `--logs` folder
(checkpoints, metrics, logs; and the outputs when `--out` lies inside it) into parts of at most 15 MiB in DIR after
the runs stop (`longmixer.runs.carry`); unpacking them where the next call runs resumes every run there:

    python scripts/learning_curves.py ... --out logs/learning_curves/results --state-out $OUT/state   # GPU machine
    python -m longmixer.runs.carry unpack <returned state folder> --into logs/learning_curves          # here
    # the next call carries logs/learning_curves and runs the same command
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from longmixer.runs.carry import CarryError, pack
from longmixer.utils.compose import CONFIG_DIR
from longmixer.utils.gpu_monitor import GpuSampler, device_ids, gpu_name, summarize

ROOT = Path(__file__).resolve().parents[1]
# Which recipe a family trains on: the variants are model swaps on their paper family's recipe.
RECIPES = {"mega_chunk": ("mega", ["model=mega_chunk"]), "las_chunk": ("las", ["model=las_chunk"]),
           "seqboat_full": ("seqboat", ["model=seqboat_full"])}


def overrides(family: str, task: str, minutes: float, val_every: int, run_dir: Path, trainer: str, compile_mode: str,
              extra: list[str]) -> list[str]:
    recipe, swap = RECIPES.get(family, (family, []))
    return [f"experiment={recipe}/{task}", *swap, f"data={task}_gen", f"trainer={trainer}", f"hydra.run.dir={run_dir}",
            f"+trainer.max_time=00:{int(minutes) // 60:02d}:{int(minutes) % 60:02d}:{int(minutes % 1 * 60):02d}",
            f"trainer.val_check_interval={val_every}", "trainer.check_val_every_n_epoch=null", "trainer.enable_progress_bar=false",
            f"task.compile={compile_mode}", *extra]


def check_recipes(families: list[str], task: str) -> None:
    """Refuse a family without a recipe for the task (`experiment=<family>/<task>`) before any data is prepared or
    run started: its run would fail only in its log, after the summary under --out was rewritten."""
    def has_recipe(family: str) -> bool:
        return (Path(CONFIG_DIR) / "experiment" / RECIPES.get(family, (family,))[0] / f"{task}.yaml").exists()

    missing = [f for f in families if not has_recipe(f)]
    if missing:
        known = sorted(f for f in {p.name for p in (Path(CONFIG_DIR) / "experiment").iterdir()} | set(RECIPES)
                       if has_recipe(f))
        if not known:
            tasks = sorted({p.stem for p in (Path(CONFIG_DIR) / "experiment").glob("*/*.yaml")})
            raise SystemExit(f"error: --task {task}: no family has a recipe for it; the tasks: {', '.join(tasks)}")
        raise SystemExit(f"error: --families {' '.join(missing)}: no recipe experiment=<family>/{task} "
                         f"(configs/experiment/); the families with one: {', '.join(known) or 'none'}")


def run_dir_of(args, family: str) -> Path:
    """Where a family's run lives under --logs: the same dir on every call, so that a call resumes it."""
    return Path(args.logs).resolve() / f"{args.task}_{family}"


def curve(run_dir: Path) -> list[dict]:
    """(step, val_acc, val_loss) rows of the run's CSV logger files."""
    files = sorted(run_dir.glob("**/metrics.csv"))
    rows = []
    for path in files:
        with open(path) as f:
            for r in csv.DictReader(f):
                if r.get("val/acc"):
                    rows.append({"step": int(float(r["step"])), "val_acc": float(r["val/acc"]),
                                 "val_loss": float(r["val/loss"]) if r.get("val/loss") else None})
    return sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="listops")
    parser.add_argument("--families", nargs="+", default=["chela", "longvq", "las", "seqboat", "mega_chunk",
                                                          "transformer"])
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, default=None, help="wall-clock budget of each run (default 9)")
    budget.add_argument("--gpu-minutes", type=float, default=None,
                        help="GPU-minute budget of each run: its wall-clock budget is this times the runs sharing "
                             "its GPU")
    parser.add_argument("--val-every", type=int, default=250, help="validate every N training steps")
    parser.add_argument("--trainer", default="gpu", help="trainer config (cpu for a smoke test)")
    parser.add_argument("--compile", default="none",
                        help="task.compile of the runs (none: eager, as the recorded curves ran; auto picks CUDA "
                             "graphs where the batches come in few shapes)")
    parser.add_argument("--sequential", action="store_true", help="one run after another instead of together")
    parser.add_argument("--gpus", nargs="+", type=int, default=None,
                        help="GPU indices to spread the runs over, round-robin in --families order (default: all on "
                             "the first visible GPU)")
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--logs", default="logs/learning_curves", help="run dirs (carry them to resume)")
    parser.add_argument("--no-test", action="store_true",
                        help="skip each run's final test (test=false): for a slice of a budget that a later call resumes")
    parser.add_argument("--state-out", default=None,
                        help="after the runs stop, pack --logs into parts under this folder to carry to the next machine")
    parser.add_argument("--state-max-parts", type=int, default=4,
                        help="most 15-MiB parts the channel takes back (the device tool: 64 MB in all); over it, the "
                             "best checkpoints are left out, then nothing is packed")
    parser.add_argument("--plot-only", action="store_true", help="only redraw <task>.png from the CSVs under --out")
    parser.add_argument("--title", default=None, help="the plot's title (with --plot-only)")
    parser.add_argument("extra", nargs="*", help="more overrides for every run, e.g. data.num_train=20000")
    args = parser.parse_args(argv)
    if args.minutes is None and args.gpu_minutes is None:
        args.minutes = 9.0
    if args.plot_only:
        plot_only(args)
        return {}
    check_recipes(args.families, args.task)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "LONGMIXER_LOGS": str(Path(args.logs).resolve()), "PYTHONUNBUFFERED": "1"}

    prep = [sys.executable, str(ROOT / "scripts/prepare_data.py"), f"{args.task}_gen",
            *[o for o in args.extra if o.startswith(("data.", "paths."))]]
    # once, before the runs, so they do not race to generate it; its error is one line (`error: ...`) on stderr
    prepared = subprocess.run(prep, env=env, cwd=ROOT)
    if prepared.returncode != 0:
        raise SystemExit(prepared.returncode)
    extra = [*args.extra, *(["test=false"] if args.no_test else [])]
    history = earlier_calls(args, out)
    procs, start = {}, time.time()
    started, ended = {}, {}  # per run: when its process started / ended

    def stop_runs(signum, frame):
        # a SIGTERM (a `timeout`, a scheduler) reaches the runs: each writes last.ckpt and exits 143, and the curves
        # below are still written; the same command later resumes them
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop_runs)
    placement, minutes = gpu_placement(args.families, args.gpus), wall_minutes(args)
    with GpuSampler(interval_s=1.0, gpus=args.gpus) as sampler:
        for family in args.families:
            run_dir = run_dir_of(args, family)
            cmd = [sys.executable, "-m", "longmixer.train",
                   *overrides(family, args.task, minutes[family], args.val_every, run_dir, args.trainer, args.compile,
                              extra)]
            log_path = Path(args.logs) / f"{args.task}_{family}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            run_env = env if args.gpus is None else {**env, "CUDA_VISIBLE_DEVICES": device_ids([placement[family]])[0]}
            with open(log_path, "a") as f:
                started[family] = time.time()
                procs[family] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=run_env, cwd=ROOT)
            if args.sequential:
                procs[family].wait()
                ended[family] = time.time()
        # the curves are rewritten every half minute, so a call cut short keeps what the runs have validated so far
        last_write = time.time()
        while not all(p.poll() is not None for p in procs.values()):
            time.sleep(1)
            ended.update({f: time.time() for f, p in procs.items() if p.poll() is not None and f not in ended})
            if time.time() - last_write >= 30:
                write_outputs(args, out, sampler.by_gpu, start, procs, (started, ended), history, final=False)
                last_write = time.time()
        for f, p in procs.items():
            p.wait()
            ended.setdefault(f, time.time())
    summary = write_outputs(args, out, sampler.by_gpu, start, procs, (started, ended), history, final=True)
    print(json.dumps(summary, indent=1))
    if args.state_out:
        carry_state(Path(args.logs), Path(args.state_out), args.state_max_parts)
    for family, code in summary["exit_codes"].items():
        if code != 0:
            print(f"run {family} exited with status {code}; its log: {Path(args.logs) / f'{args.task}_{family}.log'}",
                  file=sys.stderr)
    return summary


def exit_status(exit_codes: dict[str, int | None]) -> int:
    """The call's exit status from its runs': 0 when every run exited 0; else the first failed run's, or, when every
    run that did not exit 0 was stopped by SIGTERM / SIGINT (143 / 130: the same command resumes it), that one."""
    codes = [c for c in exit_codes.values() if c != 0]
    failed = [c for c in codes if c not in (128 + signal.SIGTERM, 128 + signal.SIGINT)]
    status = (failed or codes or [0])[0]
    return status if isinstance(status, int) and 0 <= status < 256 else 1


def run_minutes(started: dict[str, float], ended: dict[str, float], now: float) -> dict[str, float]:
    """Minutes each run's process has run in this call (start-up included, about half a minute): with the
    budget's sharing, what a call that was cut short actually gave each run."""
    return {f: round((ended.get(f, now) - t0) / 60, 2) for f, t0 in started.items()}


def gpu_placement(families: list[str], gpus: list[int] | None) -> dict[str, int]:
    """Which GPU index each run trains on: round-robin over `gpus`, or all on the first GPU."""
    if gpus is not None and (not gpus or len(set(gpus)) != len(gpus) or min(gpus) < 0):
        raise SystemExit(f"--gpus {gpus}: give distinct non-negative GPU indices, e.g. --gpus 0 1")
    if gpus is not None:
        try:
            device_ids(gpus)
        except ValueError as e:
            raise SystemExit(f"--gpus {' '.join(map(str, gpus))}: {e}") from None
    return {f: (gpus[i % len(gpus)] if gpus else 0) for i, f in enumerate(families)}


def sharing(args) -> dict[str, int]:
    """How many runs train on each run's GPU at the same time (1 for every run with --sequential)."""
    placement = gpu_placement(args.families, args.gpus)
    if args.sequential:
        return {f: 1 for f in placement}
    return {f: list(placement.values()).count(g) for f, g in placement.items()}


def wall_minutes(args) -> dict[str, float]:
    """Each run's wall-clock budget (its trainer.max_time): --minutes, or --gpu-minutes times its GPU's sharing."""
    if args.gpu_minutes is not None:
        return {f: args.gpu_minutes * n for f, n in sharing(args).items()}
    return {f: args.minutes for f in args.families}


def gpu_minutes(args) -> dict[str, float]:
    """Each run's budget in GPU-minutes: its wall-clock budget over the runs that share its GPU."""
    return {f: round(wall_minutes(args)[f] / n, 2) for f, n in sharing(args).items()}


def carry_state(logs: Path, dest: Path, max_parts: int) -> None:
    """Pack the run dirs for the next machine; when the full pack exceeds the channel, leave out the best
    checkpoints (a later slice still resumes from last.ckpt; the final test then needs a run that kept them)."""
    try:
        parts = pack(logs, dest, name="runs", max_parts=max_parts)
    except CarryError as e:
        print(f"state: {e}; retrying with last.ckpt only", file=sys.stderr)
        try:
            parts = pack(logs, dest, name="runs", max_parts=max_parts, last_only=True)
        except CarryError as e2:
            print(f"state: not packed: {e2}", file=sys.stderr)
            return
    print(f"state: {len(parts)} part(s), {sum(p.stat().st_size for p in parts) / 2**20:.1f} MiB in {dest}")


@contextlib.contextmanager
def replacing(path: Path):
    """A text file written beside `path` and moved over it when complete: the outputs are rewritten every 30 s,
    and a call killed mid-write must leave the previous version, which the next call reads back, not half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        yield f
    os.replace(tmp, path)


UTIL_COLUMNS = ("call", "t_s", "gpu", "util_pct", "mem_mib")
CALL_KEYS = ("command", "gpu", "host_cpus", "started_utc", "wall_min_this_call", "gpu_of_family",
             "run_minutes_this_call", "gpu_minutes_this_call", "exit_codes", "gpu_util", "steps")


def earlier_calls(args, out: Path) -> dict:
    """What the earlier calls of these runs left under --out: `{"calls": [records], "util": [rows]}`. When no run
    resumes (no last.ckpt under --logs for these families), the runs start afresh: the earlier summary and
    utilization CSV are renamed with their call's start time, not overwritten, and the history starts empty."""
    summary_path, util_path = out / f"{args.task}_summary.json", out / f"{args.task}_gpu_util.csv"
    previous = None
    if summary_path.exists():
        try:
            previous = json.loads(summary_path.read_text())
        except json.JSONDecodeError as e:
            aside = summary_path.with_name(f"{summary_path.stem}.unreadable{summary_path.suffix}")
            summary_path.rename(aside)
            print(f"{summary_path}: not valid JSON ({e}); moved to {aside.name}, this call starts a new history",
                  file=sys.stderr)
    resuming = any(any(run_dir_of(args, f).rglob("last.ckpt")) for f in args.families)
    if previous is None or not resuming:
        kept = [path for path in (summary_path, util_path) if path.exists()]
        if kept:
            started = (previous or {}).get("started_utc") or time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                           time.gmtime(kept[0].stat().st_mtime))
            stamp = started.replace("-", "").replace(":", "")
            for path in kept:
                path.rename(path.with_name(f"{path.stem}.{stamp}{path.suffix}"))
        return {"calls": [], "util": []}
    # a summary written before calls were recorded is the record of one call
    calls = previous.get("calls") or [{"call": 1, **{k: previous.get(k) for k in CALL_KEYS}}]
    util = []
    if util_path.exists():
        with open(util_path, newline="") as f:
            util = [(int(r.get("call") or calls[-1]["call"]), r["t_s"], r["gpu"], r["util_pct"], r["mem_mib"])
                    for r in csv.DictReader(f)]
    return {"calls": calls, "util": util}


def write_outputs(args, out: Path, samples: dict[int, list], start: float, procs: dict,
                  times: tuple[dict, dict], history: dict, final: bool) -> dict:
    """The per-family CSVs, the utilization CSV and the summary (and, at the end, the plot when matplotlib is
    installed: the GPU machine may lack it; `--plot-only` redraws it from the CSVs)."""
    curves = {}
    for family in args.families:
        rows = curves[family] = curve(run_dir_of(args, family))
        with replacing(out / f"{args.task}_{family}.csv") as f:
            writer = csv.DictWriter(f, fieldnames=["step", "val_acc", "val_loss"])
            writer.writeheader()
            writer.writerows(rows)
    call = len(history["calls"]) + 1
    with replacing(out / f"{args.task}_gpu_util.csv") as f:
        csv.writer(f).writerows([UTIL_COLUMNS, *history["util"],
                                 *[(call, t, g, u, m) for g, rows in samples.items() for t, u, m in rows]])
    shared = sharing(args)
    summary = {"command": " ".join(sys.argv), "gpu": gpu_name(), "host_cpus": os.cpu_count(), "call": call,
               "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
               "wall_min_this_call": round((time.time() - start) / 60, 2), "wall_minute_budget_per_run": wall_minutes(args),
               "parallel": not args.sequential, "finished": final,
               "gpu_of_family": gpu_placement(args.families, args.gpus), "gpu_minute_budget_per_run": gpu_minutes(args),
               "run_minutes_this_call": (ran := run_minutes(*times, time.time())),
               "gpu_minutes_this_call": {f: round(m / shared[f], 2) for f, m in ran.items()},
               "exit_codes": {f: p.poll() for f, p in procs.items()},
               "gpu_util": {str(g): summarize(rows) for g, rows in samples.items()},
               "best_val_acc": {f: max((r["val_acc"] for r in rows), default=None) for f, rows in curves.items()},
               "steps": {f: (rows[-1]["step"] if rows else 0) for f, rows in curves.items()}}
    calls = [*history["calls"], {"call": call, **{k: summary[k] for k in CALL_KEYS}}]
    summary["gpu_minutes_total"] = {f: round(sum((c.get("gpu_minutes_this_call") or {}).get(f, 0) for c in calls), 2)
                                    for f in args.families}
    summary["calls"] = calls
    with replacing(out / f"{args.task}_summary.json") as f:
        f.write(json.dumps(summary, indent=1))
    if final and any(curves.values()) and importlib.util.find_spec("matplotlib"):
        from longmixer.report.evidence import plot_task

        plot_task(args.task, curves, out / f"{args.task}.png")
    return summary


def plot_only(args) -> None:
    """Redraw `<task>.png` from the CSVs under --out (for curves measured where matplotlib is missing)."""
    from longmixer.report.evidence import plot_task, read_curves

    plot_task(args.task, read_curves(args.out, args.task, args.families), Path(args.out) / f"{args.task}.png",
              title=args.title)


if __name__ == "__main__":
    sys.exit(exit_status(main().get("exit_codes", {})))
