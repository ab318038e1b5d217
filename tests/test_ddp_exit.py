"""A DDP run whose CUDA graphs captured NCCL collectives must still end: `release_cuda_graphs` frees the graphs
before the process group is destroyed. Without it, Lightning's exit handler waited forever in `ncclCommFinalize`
(DDP with SyncBatchNorm compiled with `reduce-overhead` on H100s, docs/benchmarks.md "Scaling")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import longmixer.evaluate
import longmixer.train
from longmixer.utils import compile as compile_utils
from tests.conftest import TINY_LISTOPS, TINY_TRAINER

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def resets(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.compiler, "reset", lambda: calls.append("reset"))
    return calls


def test_release_frees_compiled_graphs_only_in_a_process_group_on_a_gpu(tmp_path, monkeypatch, resets):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    compile_utils.release_cuda_graphs()
    assert resets == []  # no process group: nothing to protect, compiled code stays for the next run in the process
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        compile_utils.release_cuda_graphs()
        assert resets == ["reset"]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        compile_utils.release_cuda_graphs()
        assert resets == ["reset"]
    finally:
        dist.destroy_process_group()


def test_a_failed_release_is_a_warning_not_an_error(tmp_path, monkeypatch, caplog):
    """It runs in `finally`: an error there would replace the one that ended the run."""
    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.compiler, "reset", broken)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with caplog.at_level("WARNING"):
            compile_utils.release_cuda_graphs()
    finally:
        dist.destroy_process_group()
    assert "could not free the compiled CUDA graphs (RuntimeError: CUDA error" in caplog.text


@pytest.mark.parametrize("fails", [False, True], ids=["finished", "failed"])
def test_train_releases_the_graphs_however_it_ends(compose, monkeypatch, fails):
    released = []
    monkeypatch.setattr(longmixer.train, "release_cuda_graphs", lambda: released.append(True))
    cfg = compose([*TINY_LISTOPS, *TINY_TRAINER])
    if fails:
        def broken(*args, **kwargs):
            raise RuntimeError("a bug in the run")
        monkeypatch.setattr(longmixer.train, "_train", broken)
        with pytest.raises(RuntimeError, match="a bug in the run"):
            longmixer.train.train(cfg)
    else:
        longmixer.train.train(cfg)
    assert released == [True]


def test_evaluate_releases_the_graphs(compose, monkeypatch):
    released = []
    monkeypatch.setattr(longmixer.evaluate, "release_cuda_graphs", lambda: released.append(True))
    monkeypatch.setattr(longmixer.evaluate, "evaluate", lambda cfg: {"val/acc": 1.0})
    assert longmixer.evaluate._main.__wrapped__(compose([])) == {"val/acc": 1.0}
    assert released == [True]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_ddp_run_with_syncbatchnorm_compiled_with_reduce_overhead_ends(tmp_path):
    """The run that hung: 2 DDP ranks, SyncBatchNorm, `reduce-overhead` (its graphs capture the all-reduces)."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "offline", "NCCL_NVLS_ENABLE": "0"}
    overrides = [f"paths.log_dir={tmp_path / 'logs'}", f"paths.data_dir={tmp_path / 'data'}", "data.num_train=128",
                 "data.num_val=32", "data.num_test=32", "trainer.max_steps=4", "trainer=ddp",
                 "trainer.accelerator=gpu", "trainer.devices=2", "trainer.enable_progress_bar=false",
                 "model.norm=syncbatchnorm", "task.compile=reduce-overhead"]
    proc = subprocess.Popen([sys.executable, "-m", "longmixer.train", *overrides], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = proc.communicate(timeout=400)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0]
        results = list((tmp_path / "logs").rglob("results.json"))
        pytest.fail(f"the ranks did not end in 400 s (results.json written: {bool(results)}):\n{output[-3000:]}")
    assert proc.returncode == 0, output[-3000:]
    assert len(list((tmp_path / "logs").rglob("results.json"))) == 1
