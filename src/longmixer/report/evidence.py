"""The learning evidence: validation curves of several families trained on one task at an equal GPU budget
(`scripts/learning_curves.py` writes them as `<task>_<family>.csv` under docs/results), drawn one figure per task
with each paper's final test accuracy on that task as a dotted line in the family's colour.

Used by `scripts/learning_curves.py` (its `<task>.png`) and by notebooks/results.ipynb. matplotlib is imported
inside `plot_task` and used through its object API, as in report/plots.py.
"""

from __future__ import annotations

import csv
from pathlib import Path

from longmixer.report.tables import load_paper_tables

FAMILIES = ("chela", "longvq", "las", "seqboat", "mega_chunk", "transformer")


def read_curves(folder: str | Path, task: str, families: tuple[str, ...] | list[str] = FAMILIES) -> dict[str, list[dict]]:
    """`{family: [{"step", "val_acc", "val_loss"}, ...]}` from `<folder>/<task>_<family>.csv`, for the families that
    have a file (in the order given)."""
    curves = {}
    for family in families:
        path = Path(folder) / f"{task}_{family}.csv"
        if path.exists():
            with open(path, newline="") as f:
                curves[family] = [{"step": int(r["step"]), "val_acc": float(r["val_acc"]),
                                   "val_loss": float(r["val_loss"]) if r.get("val_loss") else None}
                                  for r in csv.DictReader(f)]
    return curves


def paper_finals(task: str, family: str, papers: dict | None = None) -> list[float]:
    """Every final test accuracy (in [0, 1]) the papers' LRA-layout tables report for `family` on `task`."""
    papers = papers if papers is not None else load_paper_tables()
    return [row["values"][task] / 100 for table in papers.get("tables", [])
            if table.get("layout") == "lra" and task in table.get("columns", [])
            for row in table.get("rows", []) if row.get("model") == family and task in row.get("values", {})]


def plot_task(task: str, curves: dict[str, list[dict]], out: str | Path | None = None, *, ax=None,
              title: str | None = None, papers: dict | None = None):
    """Draw the curves of one task, each family's best paper number dotted in its colour. Draws on `ax` when given,
    else on a new figure saved to `out`; returns the figure."""
    papers = papers if papers is not None else load_paper_tables()
    fig = None
    if ax is None:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 5), layout="constrained")
        ax = fig.subplots()
    for i, (family, rows) in enumerate(curves.items()):
        color = f"C{i}"
        ax.plot([r["step"] for r in rows], [r["val_acc"] for r in rows], color=color, label=family, marker="o",
                markersize=3)
        claims = paper_finals(task, family, papers)
        if claims:
            ax.axhline(max(claims), color=color, linestyle=":", linewidth=1)
    ax.set_xlabel("training step")
    ax.set_ylabel("validation accuracy")
    ax.set_title(title or f"{task}: equal GPU-minute budget per family (dotted: the papers' final test accuracy)",
                 fontsize=9)
    ax.legend()
    if fig is not None and out is not None:
        fig.savefig(out, dpi=110)
    return fig if fig is not None else ax.figure
