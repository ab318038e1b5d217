"""DataLoader defaults: workers, pinned memory and persistent workers follow the device unless the config says."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from longmixer.data.base import default_num_workers
from longmixer.data.listops import ListOps

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_defaults_follow_the_device(monkeypatch):
    assert default_num_workers(gpu=False) == 0
    assert default_num_workers(gpu=True) == min(8, os.cpu_count() or 1)
    dm = ListOps()
    assert (dm.num_workers, dm.pin_memory, dm.persistent_workers) == (0, False, False)  # this CPU machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    dm = ListOps()
    assert dm.num_workers == min(8, os.cpu_count() or 1) and dm.pin_memory
    assert dm.persistent_workers == (dm.num_workers > 0)


def test_explicit_values_win_and_are_checked():
    dm = ListOps(num_workers=3, pin_memory=True, persistent_workers=False)
    assert (dm.num_workers, dm.pin_memory, dm.persistent_workers) == (3, True, False)
    with pytest.raises(ValueError, match="data.num_workers=-1"):
        ListOps(num_workers=-1)


@pytest.mark.parametrize("data", ["listops", "text_1k", "pathx_gen", "wikitext103"])
def test_every_data_config_shares_one_loader_default(data):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(overrides=[f"+data={data}", "+paths=default", "+seed=0", "data.num_workers=2"])
    assert cfg.data.num_workers == 2 and cfg.data.pin_memory is None and cfg.data.persistent_workers is None
    for path in (CONFIGS / "data").glob("*.yaml"):
        assert "num_workers" not in path.read_text(), f"{path} repeats the shared loader default"
