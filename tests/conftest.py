"""Shared test setup: Triton's CPU interpreter (unless TRITON_INTERPRET=0), one torch thread per xdist worker, torch's
generator seeded before each test, and a `compose` fixture that builds a run config pointing at temporary data and
log dirs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Must be set before any module applies @triton.jit: kernels then run on CPU tensors, which is what the op tests
# build, on any machine. The `gpu` tier needs compiled kernels: `make test-gpu` (TRITON_INTERPRET=0 -m gpu).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `import tests.data.fixtures` works from any cwd
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_torch():
    """Every test starts from the same generator state, so its unseeded draws (an upstream gradient, a batch) do not
    depend on which xdist worker runs it or on the tests that ran there before it."""
    torch.manual_seed(0)


def compose_config(overrides: list[str], tmp_path: Path, data_dir: Path | None = None):
    """Compose `configs/train.yaml` like `python -m longmixer.train` would, with logs and data under tmp_path,
    and register the HydraConfig so `train()` can run in-process."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from longmixer.utils.compose import compose

    data_dir = data_dir or tmp_path / "data"
    cfg = compose([f"paths.log_dir={tmp_path / 'logs'}", f"paths.data_dir={data_dir}", *overrides], hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(tmp_path / "run")
        cfg.hydra.job.override_dirname = ""
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


OPS_DIR = Path(__file__).resolve().parent / "ops"


def pytest_collection_modifyitems(config, items):
    """Tiers: every op test is an interpreter parity sweep on a CPU (marked `slow`, out of `make test-fast`);
    `gpu` tests skip where no CUDA device is present, and under the interpreter (they launch compiled kernels and
    capture CUDA graphs): `make test` runs everything else everywhere, `make test-gpu` the `gpu` tier."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    interpreted = pytest.mark.skip(reason="needs compiled Triton kernels: run `make test-gpu` "
                                          "(TRITON_INTERPRET=0 python -m pytest -m gpu) on a CUDA machine")
    interpreter_on = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    for item in items:
        if OPS_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") is not None:
            if not torch.cuda.is_available():
                item.add_marker(no_gpu)
            elif interpreter_on:
                item.add_marker(interpreted)


@pytest.fixture
def compose(tmp_path):
    return lambda overrides, **kw: compose_config(overrides, tmp_path, **kw)


TINY_LISTOPS = ["data.num_train=64", "data.num_val=32", "data.num_test=32", "data.max_depth=3", "data.max_args=3",
                "data.min_length=3", "data.max_length=30", "data.seq_len=30", "data.batch_size=16"]
TINY_TRAINER = ["trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
                "trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0", "~callbacks.summary",
                "~callbacks.progress", "trainer.enable_model_summary=false", "trainer.log_every_n_steps=1"]
