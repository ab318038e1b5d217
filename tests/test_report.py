"""The report and the results notebook on real tiny runs (two models x two seeds of tiny generated ListOps), and the
reproduce scripts' experiment names."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from longmixer.report import build_report, main
from longmixer.report.tables import collect_runs, group_runs
from tests.conftest import TINY_LISTOPS, TINY_TRAINER, compose_config

ROOT = Path(__file__).resolve().parents[1]
# `~experiment`: without the default experiment (quickstart, whose model keys belong to its own family)
TINY_MODELS = {
    "transformer": ["~experiment", "model=transformer", "model.d_model=16", "model.d_ffn=32", "model.mixer.n_heads=2"],
    "seqboat": ["~experiment", "model=seqboat", "model.d_model=16", "model.n_layers=2", "model.mixer.d_qk=8", "model.mixer.d_v=32",
                "model.mixer.ndim=2", "model.mixer.window=8", "callbacks=activation_stats",
                "callbacks.activation_stats.plot=false"],
}
SEEDS = (0, 1)
# A paper table for the generated-ListOps data the tiny runs use, so the test can check the paper columns.
TINY_PAPER = """
tables:
  - id: tiny
    paper: Tiny
    source: "a test table"
    layout: lra
    metric: test/acc
    scale: 100
    columns: [listops_gen]
    average: true
    rows:
      - {label: Transformer, model: transformer, values: {listops_gen: 50.0, avg: 50.0}}
      - {label: SeqBoat, model: seqboat, values: {listops_gen: 40.0}}
      - {label: Absent, model: chela, values: {listops_gen: 30.0}}
"""


def make_tiny_runs(root: Path) -> Path:
    """Train every TINY_MODELS entry for every seed; each run dir lands under `root/runs/<model>_seed<s>/run`."""
    from longmixer.train import train

    for name, overrides in TINY_MODELS.items():
        for seed in SEEDS:
            # 4 steps with validation every 2: a learning curve of two points, and the best checkpoint is tested
            cfg = compose_config([*TINY_LISTOPS, *TINY_TRAINER, *overrides, f"seed={seed}", "trainer.max_steps=4"],
                                 root / "runs" / f"{name}_seed{seed}", data_dir=root / "data")
            train(cfg)
    return root / "runs"


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    return make_tiny_runs(tmp_path_factory.mktemp("report"))


@pytest.mark.xdist_group("report")
def test_report_groups_seeds_and_compares_with_the_paper(tiny_runs, tmp_path):
    runs = collect_runs(tiny_runs)
    groups = group_runs(runs)
    assert sorted((g.model, tuple(g.seeds)) for g in groups) == [("seqboat", SEEDS), ("transformer", SEEDS)]

    paper = tmp_path / "paper.yaml"
    paper.write_text(TINY_PAPER)
    paths = build_report(tiny_runs, tmp_path / "out", paper_results=paper)
    cells = {(r["row"], r["column"]): r for r in csv.DictReader(paths["tables"].open())}
    accs = [json.loads(p.read_text())["metrics"]["test/acc"] * 100
            for p in sorted(tiny_runs.glob("transformer_seed*/run/results.json"))]
    transformer = cells[("Transformer", "listops_gen")]
    mean = sum(accs) / 2
    assert float(transformer["ours_mean"]) == pytest.approx(mean)
    assert float(transformer["ours_std"]) == pytest.approx(abs(accs[0] - accs[1]) / 2 ** 0.5)
    assert float(transformer["diff"]) == pytest.approx(mean - 50.0)
    assert int(transformer["n_seeds"]) == 2
    assert float(cells[("Transformer", "avg")]["ours_mean"]) == pytest.approx(mean)
    assert cells[("Absent", "listops_gen")]["ours_mean"] == ""  # no chela run: the paper's number stands alone
    md = paths["markdown"].read_text()
    assert f"{mean:.2f}" in md and "(50.00, " in md and "– (30.00)" in md
    assert r"\begin{tabular}" in paths["latex"].read_text()
    # every metric of every group in groups.csv; val/acc_best comes from results.json
    metrics = {(r["model"], r["metric"]) for r in csv.DictReader(paths["groups"].open())}
    assert {("transformer", "test/acc"), ("seqboat", "val/acc_best"), ("seqboat", "test/stats/act_rate/layer_00")} \
        <= metrics


@pytest.mark.xdist_group("report")
def test_report_cli_with_the_packaged_paper_tables(tiny_runs, tmp_path):
    paths = main(["--runs", str(tiny_runs), "--out", str(tmp_path / "out"), "--papers", "seqboat"])
    md = paths["markdown"].read_text()
    assert "SeqBoat Table 1" in md and "CHELA" not in md and "| SeqBoat (`seqboat`) | – (61.70)" in md
    with pytest.raises(SystemExit) as exit_info:  # one line, exit 2: the CLI's errors a user fixes
        main(["--runs", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["--runs", str(tiny_runs), "--out", str(tmp_path / "o"), "--papers", "mega"])
    assert exit_info.value.code == 2


def test_report_cli_errors_name_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--runs", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    assert "error: --runs=" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(["--runs", str(tmp_path / "empty"), "--out", str(tmp_path / "o"), "--papers", "mega", "--no-plots"])
    assert "--papers mega: no table of that paper; choose from chela las longvq seqboat" in capsys.readouterr().err


def test_an_empty_runs_dir_gives_csvs_with_their_headers(tmp_path):
    """The results notebook reads runs.csv and groups.csv with pandas, which refuses an empty file."""
    (tmp_path / "runs").mkdir()
    paths = build_report(tmp_path / "runs", tmp_path / "out", plots=False)
    assert paths["runs"].read_text().startswith("run_dir,experiment,family,model,data,ablation,variant,seed")
    assert paths["groups"].read_text().startswith("experiment,family,model,data,ablation,variant,metric")


@pytest.mark.xdist_group("report")
def test_paper_cells_from_runs_off_the_recipe_are_marked(tiny_runs, tmp_path):
    """The tiny runs start from no paper recipe and change the model's sizes: the paper table still shows them (the
    only runs there are) but marks the cell and says what the runs were, so a debug run cannot pass for a result."""
    paper = tmp_path / "paper.yaml"
    paper.write_text(TINY_PAPER)
    md = build_report(tiny_runs, tmp_path / "out", paper_results=paper, plots=False)["markdown"].read_text()
    line = next(line for line in md.splitlines() if line.startswith("| Transformer"))
    assert "†" in line and "– (30.00)" in md
    assert "† Transformer, " in md and "from runs that are not the paper's recipe as given (no experiment" in md


@pytest.mark.xdist_group("report")
def test_wandb_summary_and_overrides_fill_a_run(tiny_runs, tmp_path):
    src = next(tiny_runs.glob("transformer_seed0/run"))
    run = tmp_path / "runs" / "x" / "abc_seed0"
    shutil.copytree(src, run, ignore=shutil.ignore_patterns("*.ckpt", "checkpoints"))
    results = json.loads((run / "results.json").read_text())
    del results["metrics"]["test/loss"]
    (run / "results.json").write_text(json.dumps(results))
    (run / "csv" / "metrics.csv").unlink()
    (run / "wandb" / "offline-run-1" / "files").mkdir(parents=True)
    (run / "wandb" / "offline-run-1" / "files" / "wandb-summary.json").write_text(json.dumps({"test/loss": 1.5}))
    (run / ".hydra").mkdir(exist_ok=True)
    (run / ".hydra" / "overrides.yaml").write_text("- +ablation=seqboat/gumbel\n- optim.lr=0.01\n- seed=0\n")
    evaluated = run / "eval" / "last"  # `longmixer.evaluate`'s results inside the run: not a run of their own
    evaluated.mkdir(parents=True)
    (evaluated / "results.json").write_text(json.dumps({"ckpt_path": "last.ckpt", "metrics": {"test/acc": 0.1}}))
    (loaded,) = collect_runs(tmp_path / "runs")
    assert loaded.metrics["test/loss"] == 1.5
    (run.parent / "config_resolved.yaml").write_text("seed: 0\n")  # a stray marker above the run hides nothing
    assert [r.run_dir for r in collect_runs(tmp_path / "runs")] == [run]
    assert (loaded.ablation, loaded.variant) == ("seqboat/gumbel", "optim.lr=0.01")
    # a run that is not "finished" (untested, stopped by its budget, a fast_dev_run) is no result of a paper cell
    for status in ("trained, not tested (test=false)", "stopped at trainer.max_time", "fast_dev_run (debug)"):
        (run / "results.json").write_text(json.dumps({**results, "status": status}))
        assert collect_runs(tmp_path / "runs") == []


@pytest.mark.xdist_group("report")
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_notebook_runs_top_to_bottom_on_the_tiny_runs(tiny_runs, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    pytest.importorskip("pandas")
    nb = nbformat.read(ROOT / "notebooks" / "results.ipynb", as_version=4)
    env = {"LONGMIXER_RUNS": str(tiny_runs), "LONGMIXER_REPORT": str(tmp_path / "report"),
           "LONGMIXER_BENCH": str(ROOT / "notebooks" / "example_runs" / "bench.json"), "MPLBACKEND": "Agg"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        nbclient.NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
                                ).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    text = "\n".join(str(o.get("text", "")) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "runs: 4" in text and "activation rows:" in text
    assert "evidence tasks: ['listops', 'pathfinder']" in text  # docs/results, drawn by longmixer.report.evidence
    assert (tmp_path / "report" / "tables.csv").exists()


def _notebook_code(*headings: str) -> list[str]:
    """The source of the notebook's setup cell (its first code cell) and of the code cell under each markdown cell
    that starts with one of `headings`."""
    cells = json.loads((ROOT / "notebooks" / "results.ipynb").read_text())["cells"]
    chosen = [next(i for i, c in enumerate(cells) if c["cell_type"] == "code")]
    for heading in headings:
        chosen.append(1 + next(i for i, c in enumerate(cells)
                               if c["cell_type"] == "markdown" and "".join(c["source"]).startswith(heading)))
    return ["".join(cells[i]["source"]) for i in chosen]


def test_notebook_seqboat_activation_is_averaged_over_the_seeds_of_one_configuration(tmp_path, monkeypatch):
    """Regression: the notebook's SeqBoat cell averaged each layer's last-validation activation rate over every
    `activation_stats.csv` under RUNS, so SeqBoat runs of two recipes (or ablations, or depths) shared one bar per
    layer index, where the learning curves average only the seeds of one configuration. The setup and SeqBoat cells
    run on a synthetic RUNS tree: two recipes of two seeds, a run that is no result, and rows of the test stage."""
    pd = pytest.importorskip("pandas")
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = tmp_path / "runs"

    def seqboat_run(experiment: str, seed: int, rates: list[float], status: str = "finished") -> None:
        run = runs / experiment.replace("/", "-") / f"0123456789_seed{seed}"
        run.mkdir(parents=True)
        (run / "results.json").write_text(json.dumps({
            "experiment": experiment, "model": "seqboat", "data": experiment.split("/")[1], "seed": seed,
            "status": status, "metrics": {"test/acc": 0.5}}))
        rows = [f"2,val,{layer},0.5,1.0" for layer in range(len(rates))]  # an earlier validation
        rows += [f"4,val,{layer},{rate},2.0" for layer, rate in enumerate(rates)]
        rows += [f"4,test,{layer},0.0,0.0" for layer in range(len(rates))]  # callbacks.activation_stats.stage=test
        (run / "activation_stats.csv").write_text("\n".join(["step,stage,layer,act_rate,attn_span", *rows]) + "\n")

    seqboat_run("seqboat/listops", 0, [0.2, 0.3])
    seqboat_run("seqboat/listops", 1, [0.4, 0.5])
    seqboat_run("seqboat/image", 0, [0.8, 0.9, 1.0])
    seqboat_run("seqboat/image", 1, [0.6, 0.7, 0.6])
    seqboat_run("seqboat/text", 0, [0.1], status="trained, not tested (test=false)")  # not in runs.csv: left out
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("LONGMIXER_RUNS", str(runs))
    monkeypatch.setenv("LONGMIXER_REPORT", str(tmp_path / "report"))
    shown = []
    namespace = {"display": shown.append}
    try:
        for code in _notebook_code("## SeqBoat"):
            exec(compile(code, "results.ipynb", "exec"), namespace)
        (table,) = shown
        assert isinstance(table, pd.DataFrame) and table.index.names == ["config", "layer"]
        by_cell = {(config.split()[0], layer): row for (config, layer), row in table.iterrows()}
        assert sorted(by_cell) == [("seqboat/image", 0), ("seqboat/image", 1), ("seqboat/image", 2),
                                   ("seqboat/listops", 0), ("seqboat/listops", 1)]
        for (experiment, layer), mean in {("seqboat/listops", 0): 0.3, ("seqboat/listops", 1): 0.4,
                                          ("seqboat/image", 0): 0.7, ("seqboat/image", 2): 0.8}.items():
            row = by_cell[experiment, layer]
            assert row.seeds == 2 and row.act_rate == pytest.approx(mean) and row.attn_span == pytest.approx(2.0)
        assert by_cell["seqboat/image", 2].act_rate_std == pytest.approx(0.4 / 2 ** 0.5)  # seeds 1.0 and 0.6
        assert len(namespace["fig"].axes) == 4  # a row of two plots per configuration
    finally:
        plt.close("all")


def _commands(script: Path) -> list[list[str]]:
    """The training commands a reproduce script runs, loops expanded: the script run with PY=echo."""
    proc = subprocess.run(["bash", str(script)], env={**os.environ, "PY": "echo"}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [line.split() for line in proc.stdout.splitlines() if "longmixer.train" in line]


@pytest.mark.parametrize("paper", ["chela", "longvq", "las", "seqboat", "mega", "transformer"])
def test_reproduce_scripts_name_existing_experiments(paper):
    script = ROOT / "scripts" / f"reproduce_{paper}.sh"
    commands = _commands(script)
    assert commands, f"{script} runs no training command"
    groups = {"experiment": "experiment", "model": "model", "ablation": "ablation"}
    for command in commands:
        # every line is a multirun but the DDP ones: Hydra's local multirun and DDP do not mix (README, "Multi-GPU")
        ddp = "trainer=ddp" in command
        assert command[:2] == ["-m", "longmixer.train"] and (command[2] == "-m") != ddp, command
        choices = dict(arg.split("=", 1) for arg in command[2:] if "=" in arg)
        assert "experiment" in choices and "seed" in choices, command
        assert "null" not in choices.get("ablation", "").split(","), command  # Hydra cannot choose null for a group
        for key, folder in groups.items():
            for name in choices.get(key, "").split(",") if key in choices else []:
                path = ROOT / "configs" / folder / f"{name}.yaml"
                assert path.exists(), f"{script}: {key}={name} names no config ({path})"


def test_seqboat_speed_section_measures_table_6(monkeypatch):
    """`reproduce_seqboat.sh speed` ran `python -m longmixer.bench` with its defaults: the text and length settings
    came first and its 230-s budget was spent before the table6 setting, so Table 6 came out "skipped". Each setting
    the section names now has its own command and budget, and each command parses as the bench's own."""
    import longmixer.bench

    proc = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce_seqboat.sh"), "speed"],
                          env={**os.environ, "PY": "echo"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    commands = [line.split()[2:] for line in proc.stdout.splitlines()]
    assert commands and all(line.split()[:2] == ["-m", "longmixer.bench"] for line in proc.stdout.splitlines())
    parsed = []

    def measured(args):
        parsed.append(args)
        raise StopIteration

    monkeypatch.setattr(longmixer.bench, "run", measured)
    # the first command writes the JSON that the second merges: nothing is measured here, so nothing is there
    monkeypatch.setattr(longmixer.bench, "merge_problem", lambda *args: None)
    for argv in commands:
        with pytest.raises(StopIteration):
            longmixer.bench.main(argv)
    assert [a.settings for a in parsed] == [["text"], ["table6"]]
    assert all(a.budget_s > 230 for a in parsed)
    assert parsed[1].merge == parsed[0].out == parsed[1].out  # one JSON with both tables


@pytest.mark.parametrize("paper", ["chela", "longvq", "las", "seqboat", "mega", "transformer"])
def test_reproduce_script_refuses_an_unknown_table(paper):
    """The first argument names the table; an override given in its place (`bash reproduce_x.sh trainer.devices=1`)
    once matched no section and the script ran nothing, with exit 0."""
    script = ROOT / "scripts" / f"reproduce_{paper}.sh"
    proc = subprocess.run(["bash", str(script), "trainer.devices=1"], env={**os.environ, "PY": "echo"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and not proc.stdout
    assert "unknown table 'trainer.devices=1'" in proc.stderr and f"reproduce_{paper}.sh all" in proc.stderr


@pytest.mark.parametrize("paper", ["chela", "longvq", "las", "seqboat", "mega", "transformer"])
def test_reproduce_script_commands_compose_and_validate(paper, compose):
    """Every job a reproduce script launches composes as `python -m longmixer.train` would compose it and passes the
    config checks: each value of a swept group (ablation=a,b) with the first seed, so an ablation that no longer
    fits its recipe, or a key a rename left behind, fails here instead of hours into a sweep."""
    import itertools

    from longmixer.utils.config import validate_config

    jobs = set()
    for command in _commands(ROOT / "scripts" / f"reproduce_{paper}.sh"):
        swept = []
        for arg in (a for a in command[2:] if a != "-m"):
            key, _, value = arg.partition("=")
            values = value.split(",") if key in ("ablation", "model") else [value.split(",")[0]]
            swept.append([f"{key}={v}" for v in values])
        jobs.update(itertools.product(*swept))
    assert jobs
    for job in sorted(jobs):
        cfg = compose(list(job))
        validate_config(cfg)


def _fake_run(root: Path, name: str, overrides: list[str], acc: float, seed: int = 0) -> Path:
    """A finished run dir as train.py leaves it: results.json and Hydra's overrides.yaml."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"experiment": "mega/listops", "model": "mega", "data": "listops",
                                                  "seed": seed, "metrics": {"test/acc": acc}}))
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return run


def test_runs_that_differ_in_any_model_data_or_trainer_key_are_separate_groups(tmp_path):
    _fake_run(tmp_path, "full", ["experiment=mega/listops", "seed=0"], 0.5)
    _fake_run(tmp_path, "full_elsewhere", ["experiment=mega/listops", "seed=1", "data.num_workers=8",
                                           "trainer.accelerator=gpu", "paths.data_dir=/x", "~callbacks.progress",
                                           "trainer.enable_progress_bar=false"], 0.6, seed=1)
    # the global batch (data.batch_size is per device) and the tested weights differ: separate groups
    _fake_run(tmp_path, "two_gpus", ["experiment=mega/listops", "seed=0", "trainer.devices=2"], 0.7)
    _fake_run(tmp_path, "ema", ["experiment=mega/listops", "seed=0", "callbacks=ema"], 0.8)
    _fake_run(tmp_path, "debug", ["experiment=mega/listops", "seed=0", "trainer.max_steps=50"], 0.1)
    _fake_run(tmp_path, "wide", ["experiment=mega/listops", "seed=0", "model.d_model=256"], 0.2)
    _fake_run(tmp_path, "short", ["experiment=mega/listops", "seed=0", "data.seq_len=512"], 0.3)
    groups = {g.variant: g for g in group_runs(collect_runs(tmp_path))}
    assert sorted(groups) == ["", "callbacks=ema", "data.seq_len=512", "model.d_model=256", "trainer.devices=2",
                              "trainer.max_steps=50"]
    # the neutral keys (workers, accelerator, data dir, display) still merge: one group of two seeds
    assert groups[""].seeds == [0, 1] and groups[""].stats("test/acc")[0] == pytest.approx(0.55)
    assert groups["trainer.max_steps=50"].stats("test/acc") == (pytest.approx(0.1), None, 1)


def test_a_repeated_override_key_counts_by_its_last_value(tmp_path):
    """`model.d_model=-3 ... model.d_model=32` runs with 32: the report grouped it apart from `model.d_model=32` (and
    the listing showed both values), while the run-dir hash now counts only the last value too."""
    from longmixer.report.runs import list_runs

    _fake_run(tmp_path, "repeated", ["experiment=mega/listops", "seed=0", "model.d_model=-3", "model.d_model=32"], 0.5)
    _fake_run(tmp_path, "once", ["experiment=mega/listops", "seed=1", "model.d_model=32"], 0.7, seed=1)
    _fake_run(tmp_path, "reversed", ["experiment=mega/listops", "seed=0", "model.d_model=32", "model.d_model=64"],
              0.2)
    groups = {g.variant: g for g in group_runs(collect_runs(tmp_path))}
    assert sorted(groups) == ["model.d_model=32", "model.d_model=64"]
    assert groups["model.d_model=32"].seeds == [0, 1]
    unfinished = tmp_path / "unfinished"
    (unfinished / ".hydra").mkdir(parents=True)
    (unfinished / "config_resolved.yaml").write_text("seed: 2\n")
    (unfinished / ".hydra" / "overrides.yaml").write_text("- seed=2\n- optim.lr=1e-3\n- optim.lr=2e-3\n")
    rows = {r["run"]: r["overrides"] for r in list_runs(tmp_path)}
    assert rows == {"once": "model.d_model=32", "repeated": "model.d_model=32", "reversed": "model.d_model=64",
                    "unfinished": "optim.lr=0.002"}  # the value as a finished run's row shows it


def test_seeds_of_one_run_dir_hash_are_one_group_however_the_values_are_written(tmp_path):
    """A sweep records a swept value as Hydra prints it (`optim.lr=1e-3,2e-3` gives jobs `optim.lr=0.001`), and the
    run-dir hash compares values by meaning, so a seed run later as `optim.lr=1e-3` shares its run-dir hash; the
    report grouped by the text and showed two groups of one seed each."""
    _fake_run(tmp_path, "swept", ["experiment=mega/listops", "seed=0", "optim.lr=0.001", "trainer.max_steps=50"], 0.5)
    _fake_run(tmp_path, "single", ["experiment=mega/listops", "seed=1", "optim.lr=1e-3", "trainer.max_steps=50.0"],
              0.7, seed=1)
    _fake_run(tmp_path, "other", ["experiment=mega/listops", "seed=0", "optim.lr=2e-3", "trainer.max_steps=50"], 0.2)
    groups = {g.variant: g for g in group_runs(collect_runs(tmp_path))}
    assert sorted(groups) == ["optim.lr=0.001,trainer.max_steps=50", "optim.lr=0.002,trainer.max_steps=50"]
    assert groups["optim.lr=0.001,trainer.max_steps=50"].seeds == [0, 1]
    assert groups["optim.lr=0.001,trainer.max_steps=50"].stats("test/acc")[0] == pytest.approx(0.6)


def test_a_time_budget_does_not_split_a_group(tmp_path):
    """`trainer.max_time` is left out of the run-dir hash (a budget, which a rerun may raise to continue the run): a
    seed given a budget and one without shared a run-dir hash but were two groups of one seed each."""
    _fake_run(tmp_path, "budget", ["experiment=mega/listops", "seed=0", "+trainer.max_time=00:12:00:00"], 0.5)
    _fake_run(tmp_path, "plain", ["experiment=mega/listops", "seed=1"], 0.7, seed=1)
    (group,) = group_runs(collect_runs(tmp_path))
    assert group.variant == "" and group.seeds == [0, 1]


def test_runs_are_listed_under_a_folder_named_wandb(tmp_path):
    """The listing left out every run whose absolute path had a folder named `wandb` (meant for the W&B folder inside a
    run dir), so `longmixer-runs --runs /data/wandb/logs/runs` printed "(no runs)" while the report found them."""
    from longmixer.report.runs import list_runs

    root = tmp_path / "wandb" / "logs" / "runs"
    run = _fake_run(root, "full", ["experiment=mega/listops", "seed=0"], 0.5)
    (run / "wandb" / "offline-run-1" / "files").mkdir(parents=True)
    (run / "wandb" / "offline-run-1" / "files" / "config_resolved.yaml").write_text("seed: 0\n")
    assert [r["run"] for r in list_runs(root)] == ["full"]


def test_compare_leaves_out_the_paths_of_a_moved_run_dir(tmp_path):
    """A run dir moved after training (another machine, `runs.carry unpack`) keeps the old place in its config:
    `--compare` listed its checkpoint dir, output dir and logger dirs as keys that differ, beside the real ones."""
    from longmixer.report.runs import compare_runs

    def run(path: Path, trained_in: Path, seed: int) -> Path:
        path.mkdir(parents=True)
        (path / "config_resolved.yaml").write_text(
            f"seed: {seed}\npaths:\n  output_dir: {trained_in}\ncallbacks:\n  checkpoint:\n"
            f"    dirpath: {trained_in}/checkpoints\ntrainer:\n  default_root_dir: {trained_in}\n")
        return path

    here = run(tmp_path / "logs" / "runs" / "a_seed0", tmp_path / "logs" / "runs" / "a_seed0", 0)
    moved = run(tmp_path / "moved" / "a_seed1", Path("/elsewhere/logs/runs/a_seed1"), 1)
    assert [r["key"] for r in compare_runs([here, moved])] == ["seed"]


def test_a_damaged_overrides_file_makes_a_group_of_its_own(tmp_path):
    """A finished run whose .hydra/overrides.yaml cannot be parsed (cut short, edited) stopped `longmixer-runs` and
    the report with a YAML traceback; it is listed and reported as a group of its own, merged with no other run."""
    from longmixer.report.runs import list_runs

    _fake_run(tmp_path, "good", ["experiment=mega/listops", "seed=0"], 0.5)
    damaged = _fake_run(tmp_path, "damaged", ["experiment=mega/listops", "seed=1"], 0.7, seed=1)
    (damaged / ".hydra" / "overrides.yaml").write_text("- seed=1\n- optim.lr: [\n")
    rows = {r["run"]: r for r in list_runs(tmp_path)}
    assert rows["damaged"]["status"] == "finished" and rows["damaged"]["test"] == "test/acc=0.7000"
    assert rows["damaged"]["overrides"] == "(unreadable .hydra/overrides.yaml)"
    groups = {g.variant: g.seeds for g in group_runs(collect_runs(tmp_path))}
    assert groups == {"": [0], "(unreadable .hydra/overrides.yaml)": [1]}


def test_a_damaged_wandb_summary_does_not_drop_the_run(tmp_path):
    """A wandb-summary.json cut short (a W&B run killed while writing it) made the report skip the finished run it
    lies in, and the listing call its results.json unreadable."""
    from longmixer.report.runs import list_runs

    run = _fake_run(tmp_path, "full", ["experiment=mega/listops", "seed=0"], 0.5)
    (run / "wandb" / "run-1" / "files").mkdir(parents=True)
    (run / "wandb" / "run-1" / "files" / "wandb-summary.json").write_text('{"test/loss": 1.5, "_st')
    (loaded,) = collect_runs(tmp_path)
    assert loaded.metrics == {"test/acc": 0.5}
    assert [r["status"] for r in list_runs(tmp_path)] == ["finished"]


def _png(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.xdist_group("report")
def test_report_plots_one_figure_per_task_and_curves_per_configuration(tiny_runs, tmp_path):
    pytest.importorskip("matplotlib")
    paper = tmp_path / "paper.yaml"
    paper.write_text(TINY_PAPER)
    paths = build_report(tiny_runs, tmp_path / "out", paper_results=paper)
    plots = tmp_path / "out" / "plots"
    assert sorted(p.name for p in plots.glob("task_*.png")) == ["task_listops_gen.png"]
    assert _png(paths["task_listops_gen"]) and _png(paths["curves_listops_gen"])
    assert not (plots / "bench.png").exists()  # no --bench given


def test_report_plots_every_task_and_the_bench_json_in_either_column_naming(tmp_path):
    pytest.importorskip("matplotlib")
    runs = tmp_path / "runs"
    for i, (data, seed) in enumerate([("listops", 0), ("listops", 1), ("text", 0)]):
        run = _fake_run(runs, f"r{i}", [f"seed={seed}"], 0.4 + i / 10, seed=seed)
        results = json.loads((run / "results.json").read_text())
        (run / "results.json").write_text(json.dumps({**results, "data": data}))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"rows": [
        # the current bench.py names, and the shorter ones a later version may write; failed and one-length rows
        *({"model": "mega", "length": n, "train_ms": n / 100, "peak_mem_mib": n / 10, "status": "ok"}
          for n in (1024, 2048)),
        *({"model": "chela", "seq_len": n, "step_ms": n / 200, "peak_mem_gib": n / 1e4} for n in (1024, 2048)),
        {"model": "las", "length": 4096, "train_ms": 1.0, "status": "oom"},
        {"model": "seqboat", "length": 4096, "train_ms": 1.0}]}))
    paths = build_report(runs, tmp_path / "out", bench=bench)
    plots = tmp_path / "out" / "plots"
    assert sorted(p.name for p in plots.glob("task_*.png")) == ["task_listops.png", "task_text.png"]
    assert all(_png(paths[k]) for k in ("task_listops", "task_text", "bench"))

    from longmixer.report.plots import bench_rows

    rows = bench_rows(bench)
    assert {r["label"] for r in rows} == {"mega", "chela", "seqboat"}
    assert [r["peak_mib"] for r in rows if r["label"] == "chela"] == [pytest.approx(1024 / 1e4 * 1024),
                                                                    pytest.approx(2048 / 1e4 * 1024)]
    bench.write_text(json.dumps({"rows": {"model": "x"}}))
    with pytest.raises(ValueError, match="expected a list of rows"):
        bench_rows(bench)
    with pytest.raises(FileNotFoundError, match="--bench"):
        build_report(runs, tmp_path / "out2", bench=tmp_path / "missing.json")


def test_evidence_curves_and_the_papers_finals(tmp_path):
    from longmixer.report.evidence import paper_finals, plot_task, read_curves

    (tmp_path / "listops_chela.csv").write_text("step,val_acc,val_loss\n249,0.164,2.26\n499,0.35,\n")
    curves = read_curves(tmp_path, "listops", ["chela", "las"])
    assert list(curves) == ["chela"] and curves["chela"][1] == {"step": 499, "val_acc": 0.35, "val_loss": None}
    assert 0.6069 in [round(v, 4) for v in paper_finals("listops", "chela")]  # CHELA Table 1: 60.69
    assert paper_finals("listops", "no_such_family") == []
    pytest.importorskip("matplotlib")
    plot_task("listops", curves, tmp_path / "listops.png")
    assert (tmp_path / "listops.png").stat().st_size > 1000
