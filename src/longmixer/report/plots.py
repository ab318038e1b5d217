"""The report's figures (PNG): per task, ours beside the papers' numbers; learning curves per configuration; speed
and memory against sequence length from the bench JSON.

matplotlib is imported inside the functions (it is in the `notebook` extra, not the core install) and used through
its object API (`Figure`), so nothing here changes the pyplot backend of a notebook that calls the report.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
from pathlib import Path

from longmixer.report.tables import Group, headline_metric

log = logging.getLogger(__name__)
# bench JSON columns under the names a version of bench.py may use; memory scaled to MiB
LENGTH_KEYS = ("seq_len", "length")
STEP_KEYS = ("step_ms", "train_ms")
MEMORY_KEYS = {"peak_mem_mib": 1.0, "peak_memory_mib": 1.0, "peak_mem_mb": 1.0, "peak_mem_gib": 1024.0,
               "peak_memory_gib": 1024.0}


def _figure(width: float = 7.0, height: float = 3.6, ncols: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "none"


def group_label(g: Group) -> str:
    """A configuration's name in legends: family, ablation and extra overrides (never blended with another)."""
    parts = [g.experiment or f"{g.model}"]
    if g.ablation:
        parts.append(f"+{g.ablation}")
    if g.variant:
        parts.append(g.variant)
    return " ".join(parts)


def family_key(model: str | None, ablation: str | None) -> str:
    return f"{model}" + (f" +{ablation}" if ablation else "")


def _scale(metric: str) -> float:
    return 100.0 if metric.endswith("acc") or metric.endswith("acc_best") else 1.0


def plot_task(task: str, groups: list[Group], cells: list[dict], path: Path) -> Path:
    """Bars of ours (mean ± std over seeds) per configuration run on `task`, and a marker per paper number for
    every family a paper table reports on that task (families we have not run show the paper's number alone)."""
    runs = [(g, headline_metric(g)) for g in groups if g.data == task]
    runs = [(g, m) for g, m in runs if m is not None]
    # a configuration without extra overrides sits at its family's position, beside the papers' markers
    names = [family_key(g.model, g.ablation) + (f" {g.variant}" if g.variant else "") for g, _ in runs]
    if len(set(names)) < len(names):
        names = [f"{g.experiment} {n}" for (g, _), n in zip(runs, names)]
    ours = [(name, g, m) for name, (g, m) in zip(names, runs)]
    metric = ours[0][2] if ours else "test/acc"
    papers = [c for c in cells if c["column"] == task and c["metric"] == metric and c["paper_value"] is not None]
    labels = list(dict.fromkeys(names + [family_key(c["model"] or c["row"], c["ablation"]) for c in papers]))
    fig, (ax,) = _figure(width=max(5.0, 0.9 * len(labels) + 2))
    x = {label: i for i, label in enumerate(labels)}
    for label, g, m in ours:
        mean, std, n = g.stats(m)
        ax.bar(x[label], mean * _scale(m), yerr=0.0 if std is None else std * _scale(m), capsize=4, color="C0",
               alpha=0.8, label="ours (mean ± std)" if label == ours[0][0] else None)
        ax.annotate(f"n={n}", (x[label], mean * _scale(m)), ha="center", va="bottom", fontsize=7)
    for i, paper in enumerate(sorted({c["paper"] for c in papers})):
        rows = [c for c in papers if c["paper"] == paper]
        xs = [x[family_key(c["model"] or c["row"], c["ablation"])] for c in rows]
        ax.scatter(xs, [c["paper_value"] for c in rows], marker="D", color=f"C{i + 1}", zorder=3,
                   label=f"{paper} (paper)")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"{metric}{' (%)' if _scale(metric) == 100 else ''}")
    ax.set_title(f"{task}: ours vs the papers")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120)
    return path


def _curve(run_dir: Path, key: str) -> dict[int, float]:
    path = run_dir / "csv" / "metrics.csv"
    points: dict[int, float] = {}
    if not path.exists():
        return points
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            if row.get(key) not in (None, "") and row.get("step") not in (None, ""):
                points[int(float(row["step"]))] = float(row[key])
    return points


def plot_curves(task: str, groups: list[Group], path: Path) -> Path | None:
    """Validation (and training loss) curves of every configuration run on `task`: one line per configuration,
    the mean over its seeds at each step, shaded ± std where two or more seeds logged that step."""
    members = [g for g in groups if g.data == task]
    fig, axes = _figure(width=11.0, ncols=2)
    drew = False
    for i, g in enumerate(members):
        for ax, keys in ((axes[0], ("train/loss_epoch", "train/loss_step", "train/loss")),
                         (axes[1], ("val/acc", "val/ppl", "val/bpc", "val/loss"))):
            for key in keys:
                curves = [c for c in (_curve(r.run_dir, key) for r in g.runs) if c]
                if curves:
                    break
            else:
                continue
            steps = sorted(set().union(*curves))
            values = [[c[s] for c in curves if s in c] for s in steps]
            mean = [sum(v) / len(v) for v in values]
            std = [math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
                   for v, m in zip(values, mean)]
            ax.plot(steps, mean, marker="o", markersize=3, color=f"C{i}", label=f"{group_label(g)} ({len(g.runs)})")
            ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                            color=f"C{i}", alpha=0.2)
            ax.set_ylabel(key)
            drew = True
    if not drew:
        return None
    for ax in axes:
        ax.set_xlabel("step")
        if ax.get_lines():
            ax.legend(fontsize=7)
    fig.suptitle(f"{task}: learning curves per configuration (mean ± std over seeds)")
    fig.savefig(path, dpi=120)
    return path


def _first(row: dict, keys) -> float | None:
    for key in keys:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


def bench_rows(path: Path) -> list[dict]:
    """Rows {label, length, step_ms, peak_mib} from a bench JSON (`{"rows": [...]}` or a list of rows); rows that
    failed (`status` other than ok) or lack a length or a step time are left out."""
    data = json.loads(Path(path).read_text())
    rows = data.get("rows", []) if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ValueError(f"--bench={path}: expected a list of rows or {{'rows': [...]}}, got {type(rows).__name__}")
    out = []
    for row in rows:
        if not isinstance(row, dict) or row.get("status", "ok") != "ok" or "model" not in row:
            continue
        length, step = _first(row, LENGTH_KEYS), _first(row, STEP_KEYS)
        if length is None or step is None:
            continue
        memory = next((row[k] * f for k, f in MEMORY_KEYS.items() if _first(row, (k,)) is not None), None)
        tags = [str(row[k]) for k in ("setting", "task") if row.get(k)]
        label = str(row["model"]) + (f" ({', '.join(tags)})" if tags else "")
        out.append({"label": label, "length": length, "step_ms": step, "peak_mib": memory})
    return out


def plot_bench(path: Path, out: Path) -> Path | None:
    """Step time and peak memory against sequence length, one line per model (and bench setting and task); a
    model measured at one length only has no line against length and is left out."""
    rows = bench_rows(path)
    labels = sorted(label for label in {r["label"] for r in rows}
                    if len({r["length"] for r in rows if r["label"] == label}) > 1)
    if not labels:
        log.warning("--bench=%s has no model measured at two or more lengths: no speed plot", path)
        return None
    fig, (speed, memory) = _figure(width=12.0, ncols=2)
    for label in labels:
        line = sorted((r for r in rows if r["label"] == label), key=lambda r: r["length"])
        speed.plot([r["length"] for r in line], [r["step_ms"] for r in line], marker="o", label=label)
        mem = [r for r in line if r["peak_mib"] is not None and r["peak_mib"] > 0]
        if mem:
            memory.plot([r["length"] for r in mem], [r["peak_mib"] for r in mem], marker="o", label=label)
    for ax, ylabel in ((speed, "training step (ms)"), (memory, "peak memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
    fig.legend(*speed.get_legend_handles_labels(), loc="outside right upper", fontsize=7)
    fig.suptitle(f"speed and memory against length ({path.name})")
    fig.savefig(out, dpi=120)
    return out


def write_plots(groups: list[Group], cells: list[dict], out_dir: Path, bench: Path | None = None) -> dict[str, Path]:
    """Every figure into `out_dir/plots/`: `task_<task>.png` and `curves_<task>.png` per task we ran, and
    `bench.png` from `bench`; returns {name: path}."""
    plots = Path(out_dir) / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for task in sorted({g.data for g in groups if g.data}):
        paths[f"task_{task}"] = plot_task(task, groups, cells, plots / f"task_{_slug(task)}.png")
        curve = plot_curves(task, groups, plots / f"curves_{_slug(task)}.png")
        if curve is not None:
            paths[f"curves_{task}"] = curve
    if bench is not None:
        if not Path(bench).exists():
            raise FileNotFoundError(f"--bench={bench} does not exist; pass the JSON python -m longmixer.bench wrote")
        figure = plot_bench(Path(bench), plots / "bench.png")
        if figure is not None:
            paths["bench"] = figure
    return paths
