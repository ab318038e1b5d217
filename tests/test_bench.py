"""The model-level benchmark: the job plan, the Transformer baselines' composition, one tiny measurement through the
Hydra-composed model, merging with an earlier run, and the markdown table."""

from __future__ import annotations

import json
import math

import pytest
import torch

from longmixer.bench import (NEEDS_CUDA, BudgetExceeded, _slot, compile_model, compose_model_config, main, markdown,
                             measure, model_specs, plan)


def test_plan_covers_every_family_with_a_text_recipe_and_both_transformers():
    names = [name for name, _ in model_specs("text", quick=True)]
    assert names[:2] == ["transformer_materialized", "transformer_sdpa"]
    assert {"mega", "mega_chunk", "las_chunk", "seqboat", "seqboat_full"} <= set(names)
    jobs = plan(quick=True)
    assert {j["setting"] for j in jobs} == {"text", "length", "table6"}
    assert all(j["batch"] * j["length"] == 256 for j in jobs if j["setting"] != "table6")


def test_measure_a_tiny_composed_model():
    name, overrides = model_specs("text", quick=True)[0]
    cfg = compose_model_config([*overrides, "data.seq_len=16"])
    # the default experiment (quickstart, another family's mixer keys) must not leak into the baselines
    assert cfg.model.mixer._target_ == "longmixer.mixers.transformer.Transformer"
    assert cfg.model.mixer.implementation == "materialized" and "attention" not in cfg.model.mixer
    assert cfg.model.d_model == 32 and cfg.model.n_layers == 1  # quick mode shrinks the LRA Text Transformer
    row = measure(cfg, batch=2, length=16, device=torch.device("cpu"), warmup=1, iters=1)
    assert row["params"] > 0 and row["train_ms"] > 0 and row["eval_tokens_per_s"] > 0
    assert row["compile"] == "none" and "gpu_busy" not in row  # the profiler runs on CUDA only
    sdpa = {**row, "train_tokens_per_s": row["train_tokens_per_s"] * 2}
    result = {"environment": {"device": "cpu", "torch": "t", "triton": "t", "cuda": None, "dtype": "d",
                              "command": "c"},
              "rows": [{"setting": "text", "model": name, "length": 16, "batch": 2, "status": "ok", **row},
                       {"setting": "text", "model": "transformer_sdpa", "length": 16, "batch": 2, "status": "ok",
                        **sdpa},
                       {"setting": "text", "model": "mega", "length": 16, "batch": 2, "status": "OOM"}]}
    table = markdown(result, [{"paper": "P", "model": name, "baseline": "transformer", "speed": 1.5}])
    assert f"| {name} | none | " in table and "| mega | none | OOM |" in table and "P 1.5x" in table
    assert "| 0.50x | 1.00x |" in table  # speed vs SDPA, then vs materialized
    assert "Toy models" not in table
    assert math.isnan(row["peak_mem_mib"])  # no CUDA here


def test_length_rows_are_listed_with_their_own_baseline():
    """A length-sweep run's rows get the per-row table too (step time, GPU busy, kernels per step), each compared
    with the SDPA Transformer of its own setting and length, not with the Text setting's at the same length."""
    def row(setting, model, length, batch, tok_s):
        return {"setting": setting, "model": model, "length": length, "batch": batch, "compile": "step-graph",
                "status": "ok", "params": 1e6, "train_ms": 1e3 * length * batch / tok_s, "train_tokens_per_s": tok_s,
                "peak_mem_mib": math.nan, "gpu_busy": 0.9, "kernels_per_step": 500.0, "eval_tokens_per_s": 1.0}

    result = {"environment": {"device": "cpu", "torch": "t", "triton": "t", "cuda": None, "dtype": "d",
                              "command": "c"},
              "rows": [row("text", "transformer_sdpa", 4096, 8, 1000.0), row("text", "mega", 4096, 8, 4000.0),
                       row("length", "transformer_sdpa", 4096, 8, 2000.0), row("length", "mega", 4096, 8, 3000.0),
                       row("length", "transformer_sdpa", 16384, 2, 500.0), row("length", "mega", 16384, 2, 750.0)]}
    table = markdown(result)
    assert "| text 4K B8 | mega | step-graph | 1.00M | 8192.0 | 4,000 | – | 90% | 500 | 4.00x |" in table
    assert "| length 4K B8 | mega | step-graph | 1.00M | 10922.7 | 3,000 | – | 90% | 500 | 1.50x |" in table
    assert "| length 16K B2 | mega | step-graph | 1.00M | 43690.7 | 750 | – | 90% | 500 | 1.50x |" in table
    assert "32768 tokens per step:" in table


def test_each_job_starts_from_its_seed(monkeypatch):
    """A row's model and batch come from `seed`, not from whatever the jobs before it drew: the same seed gives the
    same initial weights and batch after other random draws, another seed other ones."""
    from longmixer import bench

    drawn = []
    real_make_batch = bench.make_batch

    def make_batch(*args, **kwargs):  # after the model is built, before it is compiled
        x, mask, y = real_make_batch(*args, **kwargs)
        drawn.append([x.clone(), y.clone()])
        return x, mask, y

    def compile_model(model, mode):
        drawn[-1] += [p.detach().clone() for p in model.parameters()]
        return model

    monkeypatch.setattr(bench, "compile_model", compile_model)
    monkeypatch.setattr(bench, "make_batch", make_batch)
    _, overrides = model_specs("text", quick=True)[1]
    cfg = compose_model_config([*overrides, "data.seq_len=16"])
    for seed in (0, 0, 1):
        torch.rand(7)  # another job's draws
        row = measure(cfg, batch=2, length=16, device=torch.device("cpu"), warmup=1, iters=1, seed=seed)
        assert row["seed"] == seed
    same, other = zip(drawn[0], drawn[1], strict=True), zip(drawn[0], drawn[2], strict=True)
    assert all(torch.equal(a, b) for a, b in same)
    assert not all(torch.equal(a, b) for a, b in other)


def test_rows_carry_the_router_s_activation_rate():
    """SeqBoat's step time follows the share of tokens its router activates, so its rows record that share per
    layer (from one untimed training step) and the markdown lists its mean; models without statistics get none."""
    specs = dict(model_specs("text", quick=True))
    rows = []
    for name in ("seqboat", "transformer_sdpa"):
        cfg = compose_model_config([*specs[name], "data.seq_len=16", "model.n_layers=2"])
        row = measure(cfg, batch=2, length=16, device=torch.device("cpu"), warmup=1, iters=1)
        rows.append({"setting": "text", "model": name, "length": 16, "batch": 2, "status": "ok", **row})
    routed, plain = rows
    assert "stats" not in plain
    rates = [routed["stats"][f"act_rate/layer_{i:02d}"] for i in range(2)]
    assert all(0.0 < r < 1.0 for r in rates)  # a share per layer (at initialization neither all nor none)
    result = {"environment": {"device": "cpu", "torch": "t", "triton": "t", "cuda": None, "dtype": "d",
                              "command": "c"}, "rows": rows}
    table = markdown(result)
    assert f"| seqboat | text | 16 | none | {sum(rates) / 2:.1%} |" in table
    assert "| transformer_sdpa | text | 16 | none |" not in table


def test_mean_stat_averages_one_statistic_over_layers():
    from longmixer.bench import _mean_stat

    row = {"stats": {"act_rate/layer_00": 0.2, "act_rate/layer_01": 0.4, "act_rate_ffn/layer_00": 0.9,
                     "attn_span/layer_00": 7.0}}
    assert _mean_stat(row, "act_rate") == pytest.approx(0.3)  # not the FFN's rate, nor another statistic
    assert _mean_stat(row, "act_rate_ffn") == pytest.approx(0.9)
    assert _mean_stat({}, "act_rate") is None and _mean_stat(row, "vq_perplexity") is None


@pytest.mark.gpu
def test_step_graph_rows_time_replays_of_training_s_step(monkeypatch):
    """On a GPU, `--compile step-graph` runs training's `TrainStepGraph`: its eager warm-up steps, the capture, the
    untimed replays, then every timed and profiled step is a replay; the rows get the profiler's figures."""
    from longmixer import bench
    from longmixer.utils.compile import TrainStepGraph

    seen = {"calls": 0}

    class Recording(TrainStepGraph):
        def __call__(self, batch):
            seen["calls"] += 1
            out = super().__call__(batch)
            seen["replays"] = self.replays
            return out

    monkeypatch.setattr(bench, "TrainStepGraph", Recording)
    _, overrides = model_specs("text", quick=True)[1]
    cfg = compose_model_config([*overrides, "data.seq_len=16"])
    row = measure(cfg, batch=2, length=16, device=torch.device("cuda"), warmup=1, iters=2, compile_mode="step-graph",
                  profile_steps=2)
    eager = max(1, bench.STEP_GRAPH_WARMUP)
    # warm-up, capture, 1 untimed replay, 2 timed, 2 profiled, the statistics' step
    assert seen["calls"] == eager + 1 + 1 + 2 + 2 + 1
    assert seen["replays"] == seen["calls"] - eager  # the capture's own step is a replay too
    assert row["kernels_per_step"] > 0 and 0 < row["gpu_busy"] <= 1


def test_slots_tell_settings_apart():
    text = {"setting": "text", "model": "mega", "length": 4096}
    sweep = {"setting": "length", "model": "mega", "length": 4096}
    t6 = {"setting": "table6", "model": "mega", "task": "text", "length": 4096}
    assert len({_slot(text), _slot(sweep), _slot(t6)}) == 3
    assert _slot(t6) == _slot({"setting": "table6", "model": "mega", "task": "text"})  # a job has no length yet


def test_key_mask_none_or_all_true(monkeypatch, tmp_path):
    """The bench's batches are full-length: `--mask none` (the default) gives the models no mask, `--mask full` an
    all-true one; rows record which, rows from before the option count as "full" when merging, and a bad value
    names the choices."""
    from longmixer import bench

    _, overrides = model_specs("text", quick=True)[1]
    cfg = compose_model_config([*overrides, "data.seq_len=16"])
    x, mask, y = bench.make_batch(cfg, 2, 16, torch.device("cpu"))
    assert mask is None and x.shape == (2, 16) and y.shape == (2,)
    _, mask, _ = bench.make_batch(cfg, 2, 16, torch.device("cpu"), "full")
    assert mask.dtype == torch.bool and mask.shape == (2, 16) and bool(mask.all())
    with pytest.raises(ValueError, match="'none', 'full'"):
        bench.make_batch(cfg, 2, 16, torch.device("cpu"), "all")
    seen = []
    monkeypatch.setattr(bench, "_forward", lambda model, cfg, x, mask, f=bench._forward: seen.append(mask) or
                        f(model, cfg, x, mask))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for key_mask in ("none", "full"):
        seen.clear()
        result = main(["--budget-s", "8", "--models", "chela", "--settings", "text", "--mask", key_mask,
                       "--out", str(tmp_path / f"{key_mask}.json")])
        assert [r["mask"] for r in result["rows"]] == [key_mask]
        assert seen and all((m is None) == (key_mask == "none") for m in seen)
        assert f"(`--mask`): {key_mask}." in (tmp_path / f"{key_mask}.md").read_text()
    old = {"setting": "text", "model": "chela", "length": 16, "compile": "none"}
    assert _slot(old) == _slot({**old, "mask": "full"}) != _slot({**old, "mask": "none"})


def test_bad_compile_mode_names_the_choices():
    with pytest.raises(ValueError, match="reduce-overhead"):
        compile_model(torch.nn.Linear(2, 2), "fast")


def test_the_time_budget_is_enforced_inside_a_job():
    name, overrides = model_specs("text", quick=True)[1]
    cfg = compose_model_config([*overrides, "data.seq_len=16"])
    with pytest.raises(BudgetExceeded):
        measure(cfg, batch=2, length=16, device=torch.device("cpu"), warmup=1, iters=1, deadline=0.0)


def test_without_a_gpu_the_benchmark_runs_labelled_toy_models(tmp_path, monkeypatch):
    """Regression: `python -m longmixer.bench` on a CPU printed nothing for minutes (the papers' settings at full
    size); it now switches to --quick, labels the rows as toy models and keeps to its budget."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = main(["--budget-s", "8", "--models", "transformer_sdpa", "chela", "--settings", "text",
                   "--out", str(tmp_path / "b.json")])
    assert result["quick"] is True
    assert {r["model"] for r in result["rows"]} == {"transformer_sdpa", "chela"}
    assert "Toy models" in (tmp_path / "b.md").read_text()
    assert f"Code: {result['environment']['code'] or 'not recorded'};" in (tmp_path / "b.md").read_text()


def test_the_environment_names_the_commit_it_measured(tmp_path):
    """The JSON's environment (and the markdown's header) carry the checkout's commit, `-dirty` where tracked files
    differ from it, so a table names the code it measured; outside the checkout the module lives in, nothing."""
    import subprocess
    from pathlib import Path

    import longmixer.bench as bench

    repo = Path(bench.__file__).resolve().parents[2]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("longmixer is not imported from a git checkout")
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True,
                           text=True).stdout.strip()
    assert bench.code_version() == head.stdout.strip() + ("-dirty" if dirty else "")
    assert bench.environment(torch.device("cpu"))["code"] == bench.code_version()
    assert bench.code_version(tmp_path) is None  # another folder is not the module's checkout


def test_step_graph_compiles_the_blocks_as_default(monkeypatch):
    """The bench's and training's step-graph mode: the blocks compiled by Inductor's "default" mode (no CUDA graphs
    of their own: the whole step is captured in one)."""
    options = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: options.append(kw))
    compile_model(torch.nn.Linear(2, 2), "step-graph")
    assert options == [{"mode": "default", "backend": "inductor"}]


def test_step_graph_rows_say_they_need_a_gpu(tmp_path, monkeypatch):
    """On a CPU the step-graph mode is accepted and its rows are recorded as skipped with the reason (no crash, and
    nothing is built); `--lengths` keeps only that point of the length sweep."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = main(["--budget-s", "8", "--settings", "length", "--lengths", "32", "--compile", "step-graph",
                   "--models", "transformer_sdpa", "chela", "--out", str(tmp_path / "b.json")])
    assert [(r["model"], r["length"], r["compile"]) for r in result["rows"]] == [
        ("transformer_sdpa", 32, "step-graph"), ("chela", 32, "step-graph")]
    assert {r["status"] for r in result["rows"]} == {NEEDS_CUDA} and "needs a CUDA GPU" in NEEDS_CUDA
    assert f"| {NEEDS_CUDA} |" in (tmp_path / "b.md").read_text()
    name, overrides = model_specs("text", quick=True)[1]
    cfg = compose_model_config([*overrides, "data.seq_len=16"])
    with pytest.raises(ValueError, match="step-graph needs a CUDA GPU"):
        measure(cfg, batch=2, length=16, device=torch.device("cpu"), warmup=1, iters=1, compile_mode="step-graph")


def test_lengths_keep_only_those_points_of_the_length_sweep():
    full = plan(quick=False)
    only = plan(quick=False, lengths=[16384])
    assert {(j["length"], j["batch"]) for j in only if j["setting"] == "length"} == {(16384, 2)}
    assert [j for j in only if j["setting"] != "length"] == [j for j in full if j["setting"] != "length"]
    both = plan(quick=False, lengths=[1024, 8192])
    assert {j["length"] for j in both if j["setting"] == "length"} == {1024, 8192}


@pytest.mark.parametrize("quick,lengths,allowed", [
    pytest.param(False, [4096], "1024, 2048, 8192, 16384; 4096 is measured by --settings text", id="text-length"),
    pytest.param(False, [16384, 3000], "--lengths 3000: the length sweep measures 1024", id="unknown"),
    pytest.param(True, [16384], "--quick length sweep measures 32, 64", id="quick")])
def test_unknown_lengths_name_the_sweep(quick, lengths, allowed):
    with pytest.raises(ValueError, match=allowed):
        plan(quick=quick, lengths=lengths)


@pytest.mark.parametrize("args, message", [
    pytest.param(["--settings", "length", "--lengths", "99"], "--lengths 99: the --quick length sweep measures 32, 64",
                 id="not-a-point"),
    pytest.param(["--settings", "text", "--lengths", "64"], "--lengths picks points of the length sweep, which "
                 "--settings text does not measure; add length to --settings", id="without-length")])
def test_lengths_the_run_would_not_measure_are_refused_in_one_line(tmp_path, capsys, monkeypatch, args, message):
    """Bug: `--settings length --lengths 99` ended in plan()'s ValueError traceback with exit status 1, and
    `--settings text --lengths 64` measured the Text setting as if --lengths had not been given."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "b.json"
    with pytest.raises(SystemExit) as info:
        main(["--models", "chela", *args, "--out", str(out)])
    assert info.value.code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_after_forward_hook_runs_after_each_training_forward(monkeypatch):
    """A model's callable `after_forward` (LongVQ's eager codebook statistics) runs once after every forward, as
    in the tasks: once per training step (gradients on), and after each evaluation forward, where it has nothing
    to do."""
    cfg, calls = _count_after_forward(monkeypatch)
    measure(cfg, batch=2, length=16, device=torch.device("cpu"), warmup=1, iters=2)
    assert calls[:4] == [True] * 4  # 1 warm-up + 2 timed training steps + the statistics' step
    assert calls[4:] == [False] * 3  # the evaluation forwards (no_grad)


def test_compiled_modes_warm_up_past_a_recompile(monkeypatch):
    """A compiled model gets at least COMPILED_WARMUP untimed steps (a recompile after the first step, as LongVQ's
    codebook init causes, and its CUDA-graph recording stay out of the timed window); eager keeps --warmup."""
    from longmixer import bench

    cfg, calls = _count_after_forward(monkeypatch)
    monkeypatch.setattr(bench, "compile_model", lambda model, mode: model)  # no Inductor on the CPU
    for mode, warm in (("default", bench.COMPILED_WARMUP), ("none", 1)):
        calls.clear()
        measure(cfg, batch=2, length=16, device=torch.device("cpu"), warmup=1, iters=2, compile_mode=mode)
        assert calls.count(True) == warm + 2 + 1, mode  # + the statistics' step


def _count_after_forward(monkeypatch):
    """A tiny Transformer config and a list that records, for each `after_forward` call of the model `measure`
    instantiates, whether gradients were on."""
    from hydra.utils import instantiate as real_instantiate

    _, overrides = model_specs("text", quick=True)[1]
    cfg = compose_model_config([*overrides, "data.seq_len=16"])
    calls = []

    def instantiate(config):
        model = real_instantiate(config)
        model.after_forward = lambda: calls.append(torch.is_grad_enabled())
        return model

    monkeypatch.setattr("hydra.utils.instantiate", instantiate)
    return cfg, calls


def test_out_naming_a_directory_is_refused_with_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--quick", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "is a directory" in err and str(tmp_path / "model_bench.json") in err


def test_an_unknown_model_is_refused_before_anything_is_written(tmp_path, capsys):
    """Bug: `--models chelaa` matched no job, so the bench measured nothing, exited 0 and wrote an empty table over
    --out (and its .md)."""
    out = tmp_path / "b.json"
    with pytest.raises(SystemExit) as info:
        main(["--quick", "--models", "chelaa", "--out", str(out)])
    assert info.value.code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "--models chelaa: no such model (did you mean chela?)" in err and "transformer_sdpa" in err


@pytest.mark.parametrize("flag, value", [("--iters", "0"), ("--iters", "-2"), ("--warmup", "-1")])
def test_a_step_count_below_its_least_is_refused(tmp_path, capsys, flag, value):
    """Bug: `--iters 0` timed no step, exited 0 and put "error: ZeroDivisionError: float division by zero" in every
    row of the table it wrote over --out."""
    out = tmp_path / "b.json"
    with pytest.raises(SystemExit) as info:
        main(["--quick", "--models", "chela", "--settings", "text", flag, value, "--out", str(out)])
    assert info.value.code == 2 and not out.exists()
    assert f"argument {flag}: {value} must be >= {1 if flag == '--iters' else 0}" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, message", [
    ("--budget-s", "0", "0 must be a number of seconds > 0"), ("--budget-s", "-5", "-5 must be a number of seconds > 0"),
    ("--budget-s", "nan", "nan must be a number of seconds > 0"), ("--budget-s", "soon", "'soon' is not a number"),
    ("--profile-steps", "-1", "-1 must be >= 0"), ("--top-kernels", "-3", "-3 must be >= 0")])
def test_a_budget_or_count_out_of_range_is_refused(tmp_path, capsys, flag, value, message):
    """Bug: `--budget-s 0` (or a negative budget) skipped every row and wrote that table over --out with exit status
    0, `--budget-s nan` meant no budget, and a negative `--profile-steps` profiled no step and divided by it (a GPU
    row's kernels per step, -0) while a negative `--top-kernels` cut the list from its end."""
    out = tmp_path / "b.json"
    with pytest.raises(SystemExit) as info:
        main(["--quick", "--models", "chela", "--settings", "text", flag, value, "--out", str(out)])
    assert info.value.code == 2 and not out.exists()
    assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_a_model_that_fails_keeps_the_table_and_the_exit_status_says_so(tmp_path, monkeypatch, capsys):
    """Bug: a model that raised mid-bench was recorded as an "error: ..." row and the rest of the table was kept,
    but the command exited 0, so `make bench` (and any script) went on as if every row had been measured. Rows an
    earlier run's JSON brings in through --merge do not count: this run did not measure them."""
    from longmixer import bench

    measure = bench.measure

    def failing(cfg, *args, **kwargs):
        if "chela" in str(cfg.model.mixer):
            raise RuntimeError("injected failure")
        return measure(cfg, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "measure", failing)
    out = tmp_path / "b.json"
    with pytest.raises(SystemExit) as info:
        main(["--models", "chela", "transformer_sdpa", "--settings", "text", "--out", str(out)])
    assert "1 of the 2 rows measured failed" in str(info.value.code) and "text 128 B2 chela none" in str(info.value.code)
    rows = {r["model"]: r["status"] for r in json.loads(out.read_text())["rows"]}
    assert rows == {"transformer_sdpa": "ok", "chela": "error: RuntimeError: injected failure"}
    assert "| chela | none | error: RuntimeError: injected failure |" in out.with_suffix(".md").read_text()
    result = main(["--models", "transformer_sdpa", "--settings", "text", "--merge", str(out),
                   "--out", str(tmp_path / "again.json")])  # the earlier error row is kept, not measured again
    assert {r["model"]: r["status"] for r in result["rows"]} == rows


def test_out_and_its_markdown_are_replaced_whole_after_each_row(tmp_path, monkeypatch):
    """Bug: --out was rewritten in place after each row (a kill during the write left a cut JSON, the earlier run's
    table lost), and its .md only once at the end, so a run killed after some rows left the new JSON beside the
    markdown of the run before it."""
    from pathlib import Path

    from longmixer import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "b.json"
    out.write_text('{"rows": []}')
    out.with_suffix(".md").write_text("the earlier run's table\n")
    measure, calls = bench.measure, []

    def killed_at_the_second_row(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a kill does between two rows
        return measure(*args, **kwargs)

    monkeypatch.setattr(bench, "measure", killed_at_the_second_row)
    argv = ["--models", "transformer_sdpa", "chela", "--settings", "text", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    first = out.read_text()
    assert [r["model"] for r in json.loads(first)["rows"]] == ["transformer_sdpa"]
    table = out.with_suffix(".md").read_text()
    assert "| transformer_sdpa | none |" in table and "earlier run" not in table

    write_text = Path.write_text

    def cut_short(self, text, *args, **kwargs):  # a kill in the middle of writing a file
        write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(Path, "write_text", cut_short)
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    monkeypatch.setattr(Path, "write_text", write_text)
    assert out.read_text() == first and out.with_suffix(".md").read_text() == table


def test_merge_refuses_rows_of_another_device_or_a_file_it_cannot_read(tmp_path, monkeypatch, capsys):
    """Bug: `--merge` of a GPU's JSON on a CPU kept the H200's rows under the header "Device: cpu ... Toy models"
    (and a CPU's toy rows merged on a GPU would read as that GPU's numbers); a --merge file that does not exist ended
    in a FileNotFoundError traceback with exit status 1."""
    import platform
    from pathlib import Path

    from longmixer import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu_json = Path(bench.__file__).resolve().parents[2] / "notebooks" / "example_runs" / "bench.json"
    cpu = platform.processor() or "cpu"  # what the JSON's environment calls a CPU
    out = tmp_path / "b.json"
    for merge, message in [
            (gpu_json, f"its rows were measured on NVIDIA H200, this run measures on {cpu} (--quick toy models); "
                       "a table has one device"),
            (tmp_path / "missing.json", "not a readable bench JSON (FileNotFoundError")]:
        with pytest.raises(SystemExit) as info:
            main(["--models", "chela", "--settings", "text", "--merge", str(merge), "--out", str(out)])
        assert info.value.code == 2 and not out.exists()
        assert f"--merge {merge}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("cuda, modes", [(True, ["none", "step-graph"]), (False, ["none"])])
def test_default_compile_modes_are_eager_and_what_training_picks(monkeypatch, tmp_path, cuda, modes):
    """Without --compile, a GPU measures eager and `step-graph` (what task.compile=auto trains fixed-shape data with
    on one GPU, and what docs/benchmarks.md's table has), a CPU eager only."""
    from longmixer import bench

    seen = {}

    def stop(args):
        seen.update(compile=args.compile)
        raise SystemExit(0)

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(bench, "run", stop)
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path / "b.json")])
    assert seen["compile"] == modes

