"""The model-level benchmark: the job plan, the Transformer baselines' composition, one tiny measurement through the
Hydra-composed model, merging with an earlier run, and the markdown table."""

from __future__ import annotations

import math

import pytest
import torch

from longmixer.bench import (BudgetExceeded, _slot, compile_model, compose_model_config, main, markdown, measure,
                             model_specs, plan)


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


def test_slots_tell_settings_apart():
    text = {"setting": "text", "model": "mega", "length": 4096}
    sweep = {"setting": "length", "model": "mega", "length": 4096}
    t6 = {"setting": "table6", "model": "mega", "task": "text", "length": 4096}
    assert len({_slot(text), _slot(sweep), _slot(t6)}) == 3
    assert _slot(t6) == _slot({"setting": "table6", "model": "mega", "task": "text"})  # a job has no length yet


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
