"""The model-level benchmark: the materialized-attention baseline equals the SDPA Transformer, one tiny measurement
through the Hydra-composed model, and the markdown table."""

from __future__ import annotations

import math

import pytest
import torch

from longmixer.bench import MaterializedAttention, compose_model_config, markdown, measure, model_specs, plan
from longmixer.mixers.transformer import Transformer


@pytest.mark.parametrize("causal", [False, True])
def test_materialized_attention_matches_sdpa(causal):
    torch.manual_seed(0)
    sdpa = Transformer(32, n_heads=4, causal=causal).double()
    materialized = MaterializedAttention(32, n_heads=4, causal=causal).double()
    materialized.load_state_dict(sdpa.state_dict())
    x = torch.randn(3, 17, 32, dtype=torch.float64)
    mask = torch.ones(3, 17, dtype=torch.bool)
    mask[1, 11:] = False  # a padded sequence
    y_ref, _ = sdpa(x, mask)
    y, aux = materialized(x, mask)
    assert aux == {}
    torch.testing.assert_close(y[mask], y_ref[mask])


def test_plan_covers_every_family_with_a_text_recipe_and_both_transformers():
    names = [name for name, _ in model_specs("text", quick=True)]
    assert names[:2] == ["transformer_materialized", "transformer_sdpa"]
    assert {"mega", "seqboat", "seqboat_full"} <= set(names)
    jobs = plan(quick=True)
    assert {j["setting"] for j in jobs} == {"text", "length", "table6"}
    assert all(j["batch"] * j["length"] == 256 for j in jobs if j["setting"] != "table6")


def test_measure_a_tiny_composed_model():
    name, overrides = model_specs("text", quick=True)[0]
    cfg = compose_model_config([*overrides, "data.seq_len=16"])
    assert cfg.model.mixer._target_ == "longmixer.bench.MaterializedAttention"
    row = measure(cfg, batch=2, length=16, device=torch.device("cpu"), warmup=1, iters=1)
    assert row["params"] > 0 and row["train_ms"] > 0 and row["eval_tokens_per_s"] > 0
    result = {"environment": {"device": "cpu", "torch": "t", "triton": "t", "cuda": None, "dtype": "d",
                              "command": "c"},
              "rows": [{"setting": "text", "model": name, "length": 16, "batch": 2, "status": "ok", **row},
                       {"setting": "text", "model": "mega", "length": 16, "batch": 2, "status": "OOM"}]}
    table = markdown(result, [{"paper": "P", "model": name, "baseline": "transformer", "speed": 1.5}])
    assert f"| {name} | " in table and "1.00x" in table and "P 1.5x" in table and "| mega | OOM |" in table
    assert math.isnan(row["peak_mem_mib"])  # no CUDA here
