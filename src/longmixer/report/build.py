"""Collect finished runs into the papers' result tables.

    python -m longmixer.report --runs logs/runs --out reports/

Reads every `<run dir>/results.json` under `--runs` (test metrics at the best-validation checkpoint, as the papers
report), fills metrics it lacks from the W&B offline summary and `csv/metrics.csv`, groups runs by experiment, model,
data, ablation and any other result-changing override, and writes to `--out`:

- `results.md`: the papers' layouts (LRA six tasks + average, sCIFAR, SC10, WikiText-103, enwik8, MNIST, ablations)
  with ours (mean ± std over seeds) beside the paper's number and the difference, then every group we ran;
- `results.tex`: the same tables as LaTeX (booktabs);
- `tables.csv`: one row per table cell; `groups.csv`: one row per group and metric; `runs.csv`: one row per run;
- `plots/task_<task>.png` (ours mean ± std per configuration beside the papers' numbers for every family),
  `plots/curves_<task>.png` (learning curves, one line per configuration) and, with `--bench <json>`,
  `plots/bench.png` (step time and peak memory against length). Needs matplotlib (the `notebook` extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from pathlib import Path

from longmixer.report.plots import write_plots
from longmixer.report.tables import (LAYOUT_TITLES, collect_runs, fill_table, group_rows, group_runs, groups_markdown,
                                    load_paper_tables, table_latex, table_markdown, table_rows, write_csv)

log = logging.getLogger(__name__)
LAYOUT_ORDER = ("lra", "scifar", "sc10", "wikitext103", "enwik8", "mnist", "ablation")
# the CSVs' columns when there is no run to take them from (the notebook reads them with pandas)
RUN_COLUMNS = ["run_dir", "experiment", "family", "model", "data", "ablation", "variant", "seed"]
GROUP_COLUMNS = ["experiment", "family", "model", "data", "ablation", "variant", "metric", "n_seeds", "seeds", "mean",
                 "std", "run_dirs"]


def build_report(runs_dir: Path, out_dir: Path, paper_results: Path | None = None,
                 papers: list[str] | None = None, bench: Path | None = None, plots: bool = True) -> dict[str, Path]:
    """Write the report files (and, with `plots`, the PNGs of report/plots.py); returns {name: path}."""
    if bench is not None and not Path(bench).exists():
        raise FileNotFoundError(f"--bench={bench} does not exist; pass the JSON python -m longmixer.bench wrote")
    runs = collect_runs(Path(runs_dir))
    groups = group_runs(runs)
    spec = load_paper_tables(paper_results)
    known = sorted({t.get("paper", "").lower() for t in spec.get("tables", [])})
    unknown = sorted(set(papers or []) - set(known))
    if unknown:
        raise ValueError(f"--papers {' '.join(unknown)}: no table of that paper; choose from {' '.join(known)}")
    tables = [t for t in spec.get("tables", []) if not papers or t.get("paper", "").lower() in papers]
    order = {name: i for i, name in enumerate(LAYOUT_ORDER)}
    tables.sort(key=lambda t: (order.get(t["layout"], len(order)), t.get("paper", "")))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    md = ["# Results", "",
          f"{len(runs)} finished runs in {len(groups)} groups under `{runs_dir}`. Test metrics are those of the "
          "best-validation checkpoint; accuracy in percent.", ""]
    tex = ["% python -m longmixer.report: needs \\usepackage{booktabs}", ""]
    cells, layout = [], None
    for table in tables:
        filled = fill_table(table, groups)
        if table["layout"] != layout:
            layout = table["layout"]
            md += [f"## {LAYOUT_TITLES.get(layout, layout)}", ""]
        md.append(table_markdown(table, filled))
        tex.append(table_latex(table, filled))
        cells += table_rows(table, filled)
    md += ["## Every group", "", groups_markdown(groups)]

    paths = {"markdown": out_dir / "results.md", "latex": out_dir / "results.tex", "tables": out_dir / "tables.csv",
             "groups": out_dir / "groups.csv", "runs": out_dir / "runs.csv"}
    paths["markdown"].write_text("\n".join(md))
    paths["latex"].write_text("\n".join(tex))
    write_csv(paths["tables"], cells)
    write_csv(paths["groups"], group_rows(groups), columns=None if groups else GROUP_COLUMNS)
    metric_names = sorted({k for r in runs for k in r.metrics})
    write_csv(paths["runs"], [{"run_dir": str(r.run_dir), "experiment": r.experiment or "", "family": r.family,
                               "model": r.model or "", "data": r.data or "", "ablation": r.ablation or "",
                               "variant": r.variant, "seed": r.seed, **{m: r.metrics.get(m) for m in metric_names}}
                              for r in sorted(runs, key=lambda r: (str(r.key), r.seed))],
              columns=None if runs else RUN_COLUMNS)
    if plots:
        paths.update(write_plots(groups, cells, out_dir, bench))
    log.info("report: %d runs, %d groups, %d tables -> %s", len(runs), len(groups), len(tables), out_dir)
    return paths


def cli(argv: list[str] | None = None) -> None:
    """The `longmixer-report` console script: `main` without its return value (the paths), which the script wrapper
    would take for an exit status."""
    main(argv)


def main(argv: list[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(prog="python -m longmixer.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=Path("logs/runs"), help="dir holding the run dirs")
    parser.add_argument("--out", type=Path, default=Path("reports"), help="where the report files go")
    parser.add_argument("--paper-results", type=Path, default=None,
                        help="the papers' numbers (default: the packaged paper_results.yaml)")
    parser.add_argument("--papers", nargs="*", default=None, help="only these papers' tables (chela longvq las seqboat)")
    parser.add_argument("--bench", type=Path, default=None,
                        help="a JSON from python -m longmixer.bench: plots/bench.png (speed, memory vs length)")
    parser.add_argument("--no-plots", action="store_true", help="tables only (the PNGs need matplotlib)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    papers = [p.lower() for p in args.papers] if args.papers else None
    plots = not args.no_plots
    if plots and importlib.util.find_spec("matplotlib") is None:
        log.warning("matplotlib is not installed (pip install 'longmixer[notebook]'): writing tables only; "
                    "--no-plots silences this")
        plots = False
    try:
        paths = build_report(args.runs, args.out, args.paper_results, papers, bench=args.bench, plots=plots)
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f"error: {err}\n")
    for name, path in paths.items():
        log.info("%-8s %s", name, path)
    return paths

