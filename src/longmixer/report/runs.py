"""List and compare run dirs.

    python -m longmixer.report.runs --runs logs/runs                   # every run: what it is, status, metrics
    python -m longmixer.report.runs --compare <run dir> <run dir> ...   # config keys that differ, metrics side by side
    longmixer-runs ...                                                  # the same, as a console script

A run dir is a dir holding `config_resolved.yaml` (written when training starts) or `results.json` (written when it
finishes). Its status is results.json's ("finished": trained and tested at its best checkpoint; "stopped at
trainer.max_time", "trained, not tested (test=false)", ...), or "unfinished" with how the last attempt ended where
run_info.json records it ("unfinished (failed: ...)"; a run killed outright records nothing).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import yaml

from longmixer.report.tables import (RUN_MARKERS, Group, headline_metric, inside_a_run, load_run, split_overrides,
                                     write_csv)
from longmixer.utils.cli import quiet_on_closed_stdout

log = logging.getLogger(__name__)


def find_run_dirs(root: Path) -> list[Path]:
    if not root.exists():
        raise FileNotFoundError(f"--runs={root} does not exist; pass the dir holding the run dirs (logs/runs)")
    dirs = {p.parent for marker in RUN_MARKERS for p in root.rglob(marker)}
    # a W&B folder inside a run is not a run; the folders above `root` (a project dir named wandb) do not count
    return sorted(d for d in dirs if "wandb" not in d.relative_to(root).parts and not inside_a_run(d, root))


def run_row(run_dir: Path, root: Path, metrics: list[str] | None = None) -> dict:
    """One listing row: the run's name, status, choices, variant overrides and its headline metrics."""
    row = {"run": str(run_dir.relative_to(root)) if run_dir.is_relative_to(root) else str(run_dir)}
    def unfinished(status: str) -> dict:
        # every row has the same columns (the table and the CSV take them from the first row); what the run is
        # comes from the files training writes when it starts
        return {**row, "status": status, **_started_as(run_dir),
                **({m: None for m in metrics} if metrics else {"best": "", "test": ""})}

    if not (run_dir / "results.json").exists():
        return unfinished(_unfinished(run_dir))
    try:
        run = load_run(run_dir / "results.json")
    except (OSError, ValueError) as err:  # one damaged file does not stop the listing
        return unfinished(f"unreadable results.json ({type(err).__name__})")
    row.update(status=run.status, experiment=run.experiment or "", model=run.model or "", data=run.data or "",
               seed=run.seed, overrides=_overrides(run.ablation, run.variant))
    if metrics:
        row.update({m: run.metrics.get(m) for m in metrics})
    else:
        best = next((k for k in sorted(run.metrics) if k.endswith("_best")), None)
        test = headline_metric(Group(run.experiment, run.model, run.data, run.ablation, run.variant, run.family,
                                     [run]))
        row.update(best=f"{best}={run.metrics[best]:.4f}" if best else "",
                   test=f"{test}={run.metrics[test]:.4f}" if test and test.startswith("test/") else "")
    return row


def _overrides(ablation: str | None, variant: str) -> str:
    """A row's overrides column: the ablation and the overrides that change results (`split_overrides`: no
    `paths.*`, `~callbacks.progress`, `trainer.max_time`, ...), the same for finished and unfinished runs."""
    return " ".join(filter(None, [f"+ablation={ablation}" if ablation else "", variant.replace(",", " ")]))


def _unfinished(run_dir: Path) -> str:
    """"unfinished", with how its last attempt ended where run_info.json says (failed, stopped by a signal); a run
    killed outright records no end."""
    try:
        ended = json.loads((run_dir / "run_info.json").read_text())["attempts"][-1].get("ended")
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        ended = None
    return f"unfinished ({ended[:100]})" if isinstance(ended, str) and ended else "unfinished"


def _started_as(run_dir: Path) -> dict:
    """experiment, model, data, seed and overrides of a run without results.json, from the `.hydra/` files and
    `config_resolved.yaml` its start wrote (blank where a file is missing)."""
    def read(path: Path):
        try:
            return yaml.safe_load(path.read_text()) if path.is_file() else None
        except yaml.YAMLError:
            return None

    choices = ((read(run_dir / ".hydra" / "hydra.yaml") or {}).get("hydra", {}).get("runtime", {})
               .get("choices", {})) or {}
    ablation, variant = split_overrides(run_dir)
    seed = (read(run_dir / "config_resolved.yaml") or {}).get("seed", "")
    return {"experiment": choices.get("experiment") or "", "model": choices.get("model") or "",
            "data": choices.get("data") or "", "seed": seed,
            "overrides": _overrides(choices.get("ablation") or ablation, variant)}


def markdown(rows: list[dict]) -> str:
    if not rows:
        return "(no runs)\n"
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = ["–" if row[k] is None else f"{row[k]:.4f}" if isinstance(row[k], float) else str(row[k])
                 for k in header]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def list_runs(root: Path, metrics: list[str] | None = None) -> list[dict]:
    return [run_row(d, root, metrics) for d in find_run_dirs(root)]


def _flatten(node, prefix: str = "") -> dict[str, object]:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): node}


def _config(run_dir: Path) -> dict:
    for name in ("config_resolved.yaml", ".hydra/config.yaml"):
        if (run_dir / name).exists():
            return _flatten(yaml.safe_load((run_dir / name).read_text()) or {})
    raise FileNotFoundError(f"{run_dir} holds neither config_resolved.yaml nor .hydra/config.yaml: not a run dir")


def _metrics(run_dir: Path) -> dict:
    path = run_dir / "results.json"
    return json.loads(path.read_text()).get("metrics", {}) if path.exists() else {}


def compare_runs(run_dirs: list[Path]) -> list[dict]:
    """Rows `{key, <run 1>, <run 2>, ...}`: every config key whose value differs between the runs (paths that
    only name the run dir itself are left out), then every metric any of them recorded."""
    configs = [_config(d) for d in run_dirs]
    names = [str(d) for d in run_dirs]
    # a run dir is named by where it lies now and by where it was trained (its config's paths.output_dir: a moved
    # run's config keeps the old place)
    own = [str(d.resolve()) for d in run_dirs] + [str(c["paths.output_dir"]) for c in configs
                                                   if c.get("paths.output_dir")]
    rows = []
    for key in sorted(set().union(*configs)):
        values = [c.get(key, "(absent)") for c in configs]
        if len({json.dumps(v, sort_keys=True, default=str) for v in values}) == 1:
            continue
        if all(isinstance(v, str) and any(v == o or v.startswith(o + "/") for o in own) for v in values):
            continue
        rows.append({"key": key, **dict(zip(names, values))})
    metrics = [_metrics(d) for d in run_dirs]
    for key in sorted(set().union(*metrics)):
        rows.append({"key": key, **{n: m.get(key) for n, m in zip(names, metrics)}})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="longmixer-runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=Path("logs/runs"), help="dir holding the run dirs")
    parser.add_argument("--metric", action="append", default=None,
                        help="a metric column (repeatable); default: the best monitored value and the test metric")
    parser.add_argument("--compare", type=Path, nargs="+", default=None, metavar="RUN_DIR",
                        help="two or more run dirs: the config keys that differ and the metrics side by side")
    parser.add_argument("--csv", type=Path, default=None, help="also write the table to this CSV file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.compare is not None:
            if len(args.compare) < 2:
                parser.error("--compare needs at least two run dirs")
            rows = compare_runs(args.compare)
        else:
            rows = list_runs(args.runs, args.metric)
    except FileNotFoundError as err:
        parser.exit(2, f"error: {err}\n")
    if args.csv:  # before the listing, which a reader may cut short (`| head`)
        write_csv(args.csv, rows)
    print(markdown(rows))  # the listing is the command's output: stdout, so that it can be piped or redirected
    return rows


@quiet_on_closed_stdout
def cli(argv: list[str] | None = None) -> None:
    """The `longmixer-runs` console script and `python -m`: `main` without its return value, which the script wrapper
    would take for an exit status; a reader that stops early ends it quietly."""
    main(argv)


if __name__ == "__main__":
    cli()
