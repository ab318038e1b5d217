"""Result tables for `python -m longmixer.report`: collecting finished runs, seed statistics, and the papers' table
layouts (LRA six tasks + average, sCIFAR, SC10, WikiText-103, enwik8, MNIST, ablations) as markdown, LaTeX and CSV.

Everything here is plain Python (json, csv, yaml; Hydra's override parser): the report runs wherever the run
directories are, without torch.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from longmixer.utils.resolvers import parse_override

log = logging.getLogger(__name__)

PAPER_RESULTS = Path(__file__).resolve().parents[1] / "paper_results.yaml"
COLUMN_TITLES = {"listops": "ListOps", "text": "Text", "retrieval": "Retrieval", "image": "Image",
                 "pathfinder": "Pathfinder", "pathx": "Path-X", "scifar": "sCIFAR", "sc10": "SC10",
                 "wikitext103": "WikiText-103", "enwik8": "enwik8", "smnist": "sMNIST", "pmnist": "pMNIST",
                 "avg": "Avg."}
LAYOUT_TITLES = {"lra": "Long Range Arena", "scifar": "sCIFAR", "sc10": "Speech Commands (SC10, raw)",
                 "wikitext103": "WikiText-103 (perplexity)", "enwik8": "enwik8 (bits per byte)",
                 "mnist": "Sequential MNIST", "ablation": "Ablations"}
# Overrides that do not change what a run computes (the run-dir hash ignores the first line's keys,
# configs/hydra/default.yaml), the ones a run is already grouped by, and display-only settings. Matched as whole
# keys: `model` (the group choice) is neutral, while `model.d_model`, `data.seq_len` or `trainer.max_steps` make a
# separate group. Only logger, paths and hydra settings are neutral as a whole subtree.
# `trainer.devices` is not neutral (data.batch_size is per device, so it sets the global batch), nor is the
# `callbacks` group (callbacks=ema tests the averaged weights). `trainer.max_time` is a budget, left out of the
# run-dir hash: a run dir is continued with or without it, so it is neutral here too.
_NEUTRAL_KEYS = frozenset(("seed", "experiment", "model", "data", "ablation", "resume", "ckpt_path", "logger",
                           "trainer.accelerator", "trainer.max_time", "hparams_search", "data.num_workers",
                           "train", "test", "run_tag", "tags", "callbacks.progress", "callbacks.summary",
                           "callbacks.lr_monitor", "callbacks.throughput", "callbacks.throughput.window",
                           "callbacks.params", "trainer.enable_progress_bar", "trainer.enable_model_summary",
                           "trainer.log_every_n_steps"))
_NEUTRAL_SUBTREES = ("logger.", "paths.", "hydra.")


@dataclass
class Run:
    """One finished run: its choices (what it is) and its final metrics (results.json, W&B summary, metrics.csv)."""

    run_dir: Path
    experiment: str | None
    model: str | None
    data: str | None
    seed: int
    ablation: str | None = None
    variant: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    status: str = "finished"  # results.json's: also "stopped at trainer.max_time", "trained, not tested ...", ...

    @property
    def family(self) -> str:
        """The model family: the folder of the experiment (`chela/text` -> chela), else the model choice."""
        if self.experiment and "/" in self.experiment:
            return self.experiment.split("/")[0]
        return str(self.model)

    @property
    def key(self) -> tuple:
        return (self.experiment, self.model, self.data, self.ablation, self.variant)


def _numbers(items) -> dict[str, float]:
    out = {}
    for key, value in items:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    return out


def _csv_final_metrics(path: Path) -> dict[str, float]:
    """The last logged value of each val/ and test/ column of a Lightning CSVLogger metrics.csv."""
    last: dict[str, float] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key and key.startswith(("val/", "test/")) and value not in ("", None):
                    last[key] = float(value)
    return last


def override_key(item: str) -> str:
    """The key an override sets (`+model.mixer.truncation=8` -> `model.mixer.truncation`, `model@foo=bar` ->
    `model@foo`)."""
    return str(item).lstrip("+~").partition("=")[0]


def effective_overrides(items) -> list[str]:
    """The overrides that decide a run's config: of a key given more than once (`model.d_model=-3 ...
    model.d_model=32`), only the last, which Hydra applies last, so the run is listed and grouped by the value it ran
    with (as the run-dir hash counts it: utils/resolvers.py). Order otherwise kept."""
    last = {override_key(item): i for i, item in enumerate(items)}
    return [str(item) for i, item in enumerate(items) if last[override_key(item)] == i]


def canonical_override(item: str) -> str:
    """`item` with its value written as the run-dir hash compares it (utils/resolvers.py): `optim.lr=1e-3` and the
    `optim.lr=0.001` that a sweep records for the same value are one text, and `1000.0` reads `1000`. An override
    Hydra's grammar does not parse is kept as it is."""
    try:
        _, slot, prefix, value = parse_override(str(item))
    except Exception:  # noqa: BLE001 - a hand-edited overrides.yaml: group by its text
        return str(item)
    if prefix == "~" and value is None:
        return f"~{slot}"
    return f"{prefix}{slot}={_value_text(value)}"


def _value_text(value) -> str:
    """A canonical override value (`_canonical`) as override text: numbers in their shortest form."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    if isinstance(value, list):
        return "[" + ",".join(_value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_value_text(v)}" for k, v in sorted(value.items())) + "}"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


UNREADABLE_OVERRIDES = "(unreadable .hydra/overrides.yaml)"  # the variant of a run whose overrides cannot be read


def split_overrides(run_dir: Path) -> tuple[str | None, str]:
    """(ablation choice, the other result-changing overrides joined) from `<run dir>/.hydra/overrides.yaml`, each
    written as the run-dir hash reads it, so that the seeds of one run-dir hash are one group."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return None, ""
    try:
        items = yaml.safe_load(path.read_text()) or []
    except yaml.YAMLError as err:  # cut short or edited: the run is listed and reported, merged with no other
        log.warning("%s cannot be read (%s): the run is a group of its own", path, " ".join(str(err).split())[:160])
        return None, UNREADABLE_OVERRIDES
    ablation, rest = None, []
    for item in effective_overrides(items):
        key, _, value = str(item).lstrip("+~").partition("=")
        if key == "ablation":
            ablation = value
        elif key not in _NEUTRAL_KEYS and not key.startswith(_NEUTRAL_SUBTREES):
            rest.append(canonical_override(str(item)))
    return ablation, ",".join(sorted(rest))


def load_run(results_path: Path) -> Run:
    """A Run from `<run dir>/results.json`, with metrics it lacks filled from the W&B offline summary and
    `csv/metrics.csv` of the same run dir."""
    results = json.loads(results_path.read_text())
    run_dir = results_path.parent
    metrics = _numbers(results.get("metrics", {}).items())
    # a run tested at a checkpoint that kept no val/* of its own left the last validation's out of results.json:
    # the logs' last values belong to another checkpoint than the test metrics, so they are not filled in
    unpaired = (lambda key: key.startswith("val/") and not key.endswith("_best")) if results.get("val_left_out") \
        else (lambda key: False)
    for summary in sorted(run_dir.glob("wandb/*/files/wandb-summary.json")):
        try:
            values = json.loads(summary.read_text())
        except (OSError, ValueError) as err:  # a W&B run killed while writing it: the run's own files still count
            log.warning("skipping %s: %s", summary, err)
            continue
        for key, value in _numbers(values.items()).items():
            if key.startswith(("val/", "test/")) and not unpaired(key):
                metrics.setdefault(key, value)
    if (run_dir / "csv" / "metrics.csv").exists():
        for key, value in _csv_final_metrics(run_dir / "csv" / "metrics.csv").items():
            if not unpaired(key):
                metrics.setdefault(key, value)
    ablation, variant = split_overrides(run_dir)
    ablation = (results.get("choices") or {}).get("ablation", ablation)
    return Run(run_dir=run_dir, experiment=results.get("experiment"), model=results.get("model"),
               data=results.get("data"), seed=int(results.get("seed", 0)), ablation=ablation, variant=variant,
               metrics=metrics, status=_status(results, metrics))


def _status(results: dict, metrics: dict[str, float]) -> str:
    """results.json's status; "not tested" for a "finished" without test metrics (an earlier version wrote that for
    runs trained with test=false and for fast_dev_runs)."""
    status = str(results.get("status", "finished"))
    return "not tested" if status == "finished" and not any(k.startswith("test/") for k in metrics) else status


RUN_MARKERS = ("results.json", "config_resolved.yaml")  # what training writes into a run dir (start, end)


def inside_a_run(path: Path, root: Path) -> bool:
    """Whether dir `path` is `evaluate`'s output inside a run dir under (or at) `root`: <run>/eval/<checkpoint>/
    holds a results.json of its own, which is that run's evaluation, not another run. Only that layout is
    skipped, so a stray marker file higher up hides nothing."""
    return any(p.name == "eval" and p.parent.is_relative_to(root) and any((p.parent / m).is_file() for m in RUN_MARKERS)
               for p in (path, *path.parents))


def collect_runs(root: Path) -> list[Run]:
    """Every finished run under `root` (results.json with the status "finished": trained and tested at its best
    checkpoint; runs stopped by a budget, trained with test=false or fast_dev_runs are left out); one run per seed
    and group (the newest)."""
    if not root.exists():
        raise FileNotFoundError(f"--runs={root} does not exist; pass the dir holding the run dirs (logs/runs)")
    newest: dict[tuple, tuple[float, Run]] = {}
    for path in sorted(root.rglob("results.json")):
        if inside_a_run(path.parent, root):
            continue
        try:
            run = load_run(path)
        except (json.JSONDecodeError, OSError, ValueError) as err:
            log.warning("skipping %s: %s", path, err)
            continue
        if run.status != "finished":
            log.info("skipping %s: %s", path.parent, run.status)
            continue
        mtime = path.stat().st_mtime
        slot = (*run.key, run.seed)
        if slot not in newest or newest[slot][0] < mtime:
            newest[slot] = (mtime, run)
    return [run for _, run in newest.values()]


@dataclass
class Group:
    """The runs of one setting over seeds."""

    experiment: str | None
    model: str | None
    data: str | None
    ablation: str | None
    variant: str
    family: str
    runs: list[Run]

    def stats(self, metric: str) -> tuple[float, float | None, int] | None:
        """(mean, sample std or None for one seed, number of seeds) of `metric`, or None if no run logged it."""
        values = [r.metrics[metric] for r in self.runs if metric in r.metrics]
        if not values:
            return None
        return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None), len(values)

    @property
    def seeds(self) -> list[int]:
        return sorted(r.seed for r in self.runs)


def group_runs(runs: list[Run]) -> list[Group]:
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.key, []).append(run)
    return [Group(*key, family=members[0].family, runs=sorted(members, key=lambda r: r.seed))
            for key, members in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0]))]


def load_paper_tables(path: Path | None = None) -> dict:
    """The papers' numbers (`paper_results.yaml`): {"tables": [...], "efficiency": [...]}."""
    path = Path(path or PAPER_RESULTS)
    if not path.exists():
        raise FileNotFoundError(f"--paper-results={path} does not exist")
    data = yaml.safe_load(path.read_text())
    for table in data.get("tables", []):
        missing = {"id", "layout", "metric", "columns", "rows"} - set(table)
        if missing:
            raise ValueError(f"paper table {table.get('id', '?')} in {path} lacks {sorted(missing)}")
    return data


@dataclass
class Cell:
    mean: float | None = None          # ours, in the paper's unit
    std: float | None = None
    n: int = 0
    paper: float | None = None
    variant: str = ""
    recipe: str = ""                  # the experiment the runs were started from
    off_recipe: bool = False          # not a paper recipe as given: another experiment, or extra overrides

    @property
    def diff(self) -> float | None:
        return None if self.mean is None or self.paper is None else self.mean - self.paper


def _pick(groups: list[Group], model: str, data: str, ablation: str | None, metric: str) -> Group | None:
    """The group for one cell: same model, data and ablation; without extra overrides if there is one, else the
    one with the most seeds."""
    matches = [g for g in groups if g.model == model and g.data == data and g.ablation == ablation
               and g.stats(metric) is not None]
    if not matches:
        return None
    return sorted(matches, key=lambda g: (_off_recipe(g), -len(g.runs), g.variant))[0]


def _off_recipe(g: Group) -> bool:
    """Whether a group's runs are not a paper recipe as given: started from no `<family>/<task>` experiment (the
    quickstart, a bare model= data= command) or with overrides that change results (a debug run's max_steps)."""
    return bool(g.variant) or "/" not in (g.experiment or "")


def fill_table(table: dict, groups: list[Group]) -> list[tuple[dict, dict[str, Cell]]]:
    """For each paper row, a Cell per column (plus "avg" when the table has an average column)."""
    scale = float(table.get("scale", 1))
    filled = []
    for row in table["rows"]:
        cells: dict[str, Cell] = {}
        for column in table["columns"]:
            cell = Cell(paper=row.get("values", {}).get(column))
            group = _pick(groups, row.get("model"), column, row.get("ablation"), table["metric"])
            if group is not None:
                mean, std, n = group.stats(table["metric"])
                cell.mean, cell.std, cell.n, cell.variant = mean * scale, None if std is None else std * scale, n, \
                    group.variant
                cell.recipe, cell.off_recipe = group.experiment or "", _off_recipe(group)
            cells[column] = cell
        if table.get("average"):
            # the papers average over the tasks a model ran (a cross counts as absent): so do we, over the same set
            counted = [c for c in table["columns"] if cells[c].paper is not None] or table["columns"]
            ours = [cells[c].mean for c in counted]
            avg = Cell(paper=row.get("values", {}).get("avg"))
            if all(v is not None for v in ours):
                avg.mean, avg.n = statistics.fmean(ours), min(cells[c].n for c in counted)
            cells["avg"] = avg
        filled.append((row, cells))
    return filled


def _fmt(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def cell_text(cell: Cell, digits: int, latex: bool = False) -> str:
    """`ours ± std (paper, Δ)`; `– (paper)` when we have no run; `ours ± std` when the paper has no number."""
    pm = r"$\pm$" if latex else "±"
    ours = _fmt(cell.mean, digits) + (f" {pm} {cell.std:.{digits}f}" if cell.std is not None else "")
    ours += OFF_RECIPE_MARK if cell.off_recipe else ""
    if cell.paper is None:
        return ours
    if cell.mean is None:
        return f"– ({cell.paper:.{digits}f})"
    return f"{ours} ({cell.paper:.{digits}f}, {cell.diff:+.{digits}f})"


OFF_RECIPE_MARK = "†"


def _off_recipe_notes(table: dict, filled) -> list[str]:
    """One line per cell filled from runs that are not the paper's recipe as given, naming what they were."""
    notes = []
    for row, cells in filled:
        for column, cell in cells.items():
            if cell.off_recipe:
                what = " ".join(filter(None, [f"experiment={cell.recipe}" if cell.recipe else "no experiment",
                                              cell.variant.replace(",", " ")]))
                notes.append(f"{OFF_RECIPE_MARK} {row['label']}, {COLUMN_TITLES.get(column, column)}: from runs "
                             f"that are not the paper's recipe as given ({what})")
    return notes


def _digits(table: dict) -> int:
    return 3 if table["metric"].endswith("bpc") else 2


def table_markdown(table: dict, filled) -> str:
    columns = table["columns"] + (["avg"] if table.get("average") else [])
    better = "lower" if table.get("lower_is_better") else "higher"
    lines = [f"#### {table.get('paper', '')}: {table.get('source', table['id'])}", "",
             f"Ours `{table['metric']}` mean ± std over seeds (the paper's number, ours − paper); {better} is better.",
             "", "| Model | " + " | ".join(COLUMN_TITLES.get(c, c) for c in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for row, cells in filled:
        label = row["label"] + (f" (`{row['model']}`" + (f", `ablation={row['ablation']}`" if row.get("ablation")
                                                          else "") + ")" if row.get("model") else "")
        lines.append(f"| {label} | " + " | ".join(cell_text(cells[c], _digits(table)) for c in columns) + " |")
    notes = _off_recipe_notes(table, filled)
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def _tex_escape(text: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"),
                 ("{", r"\{"), ("}", r"\}"), ("−", "-"), ("–", "--")):
        text = text.replace(a, b)
    return text


def table_latex(table: dict, filled) -> str:
    columns = table["columns"] + (["avg"] if table.get("average") else [])
    lines = [r"\begin{table}[t]", r"\centering", r"\small",
             r"\begin{tabular}{l" + "c" * len(columns) + "}", r"\toprule",
             "Model & " + " & ".join(_tex_escape(COLUMN_TITLES.get(c, c)) for c in columns) + r" \\", r"\midrule"]
    for row, cells in filled:
        texts = [cell_text(cells[c], _digits(table), latex=True).replace("–", "--").replace(OFF_RECIPE_MARK,
                                                                                          r"$^\dagger$")
                 for c in columns]
        lines.append(_tex_escape(row["label"]) + " & " + " & ".join(texts) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}",
              r"\caption{" + _tex_escape(f"{table.get('source', table['id'])}: ours (paper, ours - paper).") + "}",
              r"\label{tab:" + table["id"] + "}", r"\end{table}"]
    return "\n".join(lines) + "\n"


def table_rows(table: dict, filled) -> list[dict]:
    """Flat CSV rows, one per cell."""
    rows = []
    for row, cells in filled:
        for column, cell in cells.items():
            rows.append({"table": table["id"], "paper": table.get("paper", ""), "layout": table["layout"],
                         "source": table.get("source", ""), "row": row["label"], "model": row.get("model") or "",
                         "ablation": row.get("ablation") or "", "column": column, "metric": table["metric"],
                         "n_seeds": cell.n, "ours_mean": cell.mean, "ours_std": cell.std, "paper_value": cell.paper,
                         "diff": cell.diff, "variant": cell.variant})
    return rows


def group_rows(groups: list[Group]) -> list[dict]:
    """Flat CSV rows, one per group and metric (every val/ and test/ metric any of its runs logged)."""
    rows = []
    for g in groups:
        metrics = sorted({k for r in g.runs for k in r.metrics})
        for metric in metrics:
            mean, std, n = g.stats(metric)
            rows.append({"experiment": g.experiment or "", "family": g.family, "model": g.model or "",
                         "data": g.data or "", "ablation": g.ablation or "", "variant": g.variant, "metric": metric,
                         "n_seeds": n, "seeds": " ".join(map(str, g.seeds)), "mean": mean, "std": std,
                         "run_dirs": " ".join(str(r.run_dir) for r in g.runs)})
    return rows


def headline_metric(g: Group) -> str | None:
    """The metric the papers report for this group's task: test accuracy, perplexity or bpc."""
    for metric in ("test/acc", "test/ppl", "test/bpc", "val/acc_best", "test/loss"):
        if g.stats(metric) is not None:
            return metric
    return None


def groups_markdown(groups: list[Group]) -> str:
    lines = ["| Experiment | Model | Data | Ablation | Overrides | Seeds | Metric | Mean ± std |",
             "|---|---|---|---|---|---|---|---|"]
    for g in groups:
        metric = headline_metric(g)
        if metric is None:
            continue
        mean, std, n = g.stats(metric)
        scale = 100 if metric.endswith("/acc") or metric.endswith("acc_best") else 1
        text = f"{mean * scale:.3f}" + (f" ± {std * scale:.3f}" if std is not None else "")
        lines.append(f"| {g.experiment or '–'} | {g.model} | {g.data} | {g.ablation or ''} | {g.variant} | "
                     f"{' '.join(map(str, g.seeds))} | {metric}{' (%)' if scale == 100 else ''} | {text} |")
    return "\n".join(lines) + "\n"


def write_csv(path: Path, rows: list[dict], columns: list[str] | None = None) -> None:
    """`rows` as CSV, the columns those of the first row (or `columns`, which an empty table still gets as its
    header, so that readers such as pandas see a table with no rows rather than an empty file)."""
    if not rows and not columns:
        path.write_text("")
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns or list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
