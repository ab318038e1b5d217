"""GPU utilization sampling (utils/gpu_monitor.py) and the training-run utilization script, against a fake
`nvidia-smi` on PATH (no GPU here)."""

import importlib.util
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from longmixer.utils import gpu_monitor
from longmixer.utils.gpu_monitor import GpuSampler, device_ids, parse_sample, parse_samples, summarize

ROOT = Path(__file__).resolve().parents[2]


def test_parse_sample_reads_the_first_gpu_and_rejects_the_rest():
    assert parse_sample("87, 1234\n12, 99\n") == (87, 1234)
    assert parse_sample("[N/A], 1234") is None
    assert parse_sample("NVIDIA-SMI has failed because it couldn't communicate with the driver") is None
    assert parse_sample("") is None


def test_parse_samples_reads_every_gpu_or_drops_the_whole_answer():
    assert parse_samples("87, 1234\n12, 99\n") == [(87, 1234), (12, 99)]
    assert parse_samples("87, 1234\n[N/A], 99\n") is None  # the GPUs' rows stay aligned in time
    assert parse_samples("") is None


def test_summarize_leaves_out_start_up_and_tear_down():
    rows = [(0.0, 0, 10), (1.0, 0, 10), (2.0, 40, 500),  # start-up: the first kernels at t=2
            (3.0, 50, 500), (4.0, 90, 500), (5.0, 100, 500), (6.0, 80, 500),
            (7.0, 0, 10)]  # tear-down
    s = summarize(rows, settle_s=2.0)
    assert s["samples"] == 8
    assert s["mean_util_pct"] == pytest.approx(sum(r[1] for r in rows) / 8, abs=0.05)
    assert s["steady_util_pct"] == pytest.approx((90 + 100 + 80) / 3, abs=0.05)  # t in [4, 6]
    assert s["steady_s"] == 2.0 and s["max_mem_mib"] == 500


def test_summarize_without_samples_or_kernels():
    assert summarize([])["steady_util_pct"] is None
    assert summarize([(0.0, 0, 1), (1.0, 0, 1)])["steady_util_pct"] is None


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    """An `nvidia-smi` that answers the utilization query with 73% / 2048 MiB and the name query with a name."""
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text('#!/bin/sh\ncase "$*" in *name*) echo "Fake GPU";; *) echo "73, 2048";; esac\n')
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    return tool


def test_sampler_records_while_the_block_runs(fake_nvidia_smi):
    import time

    with GpuSampler(interval_s=0.05) as sampler:
        time.sleep(0.4)
    assert len(sampler.rows) >= 2
    assert all(util == 73 and mem == 2048 for _, util, mem in sampler.rows)
    assert gpu_monitor.gpu_name() == "Fake GPU"


def test_sampler_without_nvidia_smi_records_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with GpuSampler(interval_s=0.01) as sampler:
        pass
    assert sampler.rows == [] and gpu_monitor.gpu_name() == "none"


def _train_util():
    spec = importlib.util.spec_from_file_location("train_util", ROOT / "scripts" / "bench" / "train_util.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_util_without_a_gpu_measures_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    assert _train_util().main(["--out", str(tmp_path)]) == {}
    assert "no nvidia-smi" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_train_util_runs_the_training_command_and_writes_its_figures(fake_nvidia_smi, tmp_path, monkeypatch):
    monkeypatch.setenv("LONGMIXER_LOGS", str(tmp_path / "logs"))
    summary = _train_util().main(["--out", str(tmp_path / "out"), "--interval-s", "0.1", "--settle-s", "0",
                                  "experiment=quickstart", "trainer=cpu", "debug=fdr", "logger=csv"])
    assert summary["exit_code"] == 0 and summary["gpu"] == "Fake GPU"
    assert summary["steady_util_pct"] == 73.0
    written = json.loads((tmp_path / "out" / "train_util_quickstart.json").read_text())
    assert written["command"].startswith("python -m longmixer.train experiment=quickstart")
    assert (tmp_path / "out" / "train_util_quickstart.csv").read_text().startswith("t_s,util_pct,mem_mib")


def test_device_ids_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_ids([0, 2]) == ["0", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, GPU-abc")
    assert device_ids([1, 0]) == ["GPU-abc", "4"]
    with pytest.raises(ValueError, match="GPU index 2 is past the 2 visible device"):
        device_ids([2])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert device_ids([0]) == ["0"]
