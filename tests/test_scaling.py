"""Data-parallel scaling at equal global batch: the rank shards of the samplers, the 1-process vs 2-process loss
curves through `scripts/bench/scaling.py` (DDP and ZeRO-1 over gloo), the ZeRO strategy's checkpoints, and the
script's refusal / skip paths."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longmixer.data.base import EpochSampler
from longmixer.data.lm_stream import LMTrainStream
from tests.conftest import TINY_LISTOPS, TINY_TRAINER

ROOT = Path(__file__).resolve().parents[1]
# float32 on CPU: the 2-process gradient is the mean of two half-batch means (all-reduced), the 1-process one a
# single mean, so they agree to rounding; 1e-5 is ~100x the differences seen (<= 3e-7 at loss ~2.3)
LOSS_TOL = 1e-5


def _scaling_module():
    spec = importlib.util.spec_from_file_location("scaling_script", ROOT / "scripts" / "bench" / "scaling.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("size", [48, 53])
def test_rank_batches_of_epoch_sampler_union_to_the_single_rank_batch(size):
    """At per-rank batch b / N, step s of the N ranks covers exactly the examples of step s of one rank at b."""
    batch, world = 8, 2
    single = list(EpochSampler(size, seed=3, shuffle=True))
    ranks = [list(EpochSampler(size, seed=3, shuffle=True, rank=r, world_size=world)) for r in range(world)]
    per_rank = batch // world
    for step in range(size // batch):
        union = [i for shard in ranks for i in shard[step * per_rank:(step + 1) * per_rank]]
        assert sorted(union) == sorted(single[step * batch:(step + 1) * batch]), step


def test_rank_rows_of_lm_stream_stack_to_the_single_rank_rows():
    tokens = torch.arange(10_000)
    single = LMTrainStream(tokens, batch_size=4, chunk=8, k_min=1, k_max=3, seed=5, rank=0, world_size=1)
    shards = [LMTrainStream(tokens, batch_size=2, chunk=8, k_min=1, k_max=3, seed=5, rank=r, world_size=2)
              for r in range(2)]
    for one, *parts in zip(single, *shards):
        assert torch.equal(one["inputs"], torch.cat([p["inputs"] for p in parts]))
        assert torch.equal(one["targets"], torch.cat([p["targets"] for p in parts]))


def test_two_gloo_processes_give_the_one_process_loss_curve(tmp_path):
    """The scaling script's CPU path: 1 process at batch 8 vs 2 processes at batch 4 each (DDP and ZeRO-1)."""
    tiny_data = [o for o in TINY_LISTOPS if not o.startswith(("data.num_", "data.batch_size"))]
    cmd = [sys.executable, str(ROOT / "scripts" / "bench" / "scaling.py"), "--cpu", "1", "2", "--recipes",
           "quickstart", "--strategies", "ddp", "zero", "--steps", "4", "--warmup", "1", "--global-batch", "8",
           "--out", str(tmp_path / "out"), "--", *tiny_data]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "scaling.json").read_text())
    runs = {(r["strategy"], r["world_size"]): r for r in report["runs"]}
    assert set(runs) == {("single", 1), ("ddp", 2), ("zero", 2)}
    base = runs["single", 1]
    assert len(base["loss"]) == 4 and len(set(base["loss"])) == 4  # the steps see different batches
    for key in (("ddp", 2), ("zero", 2)):
        run = runs[key]
        assert run["rows_per_step"] == base["rows_per_step"] == [8] * 4
        assert run["tokens_per_step"] == base["tokens_per_step"]
        assert max(abs(a - b) for a, b in zip(run["loss"], base["loss"])) < LOSS_TOL, key
        assert run["tokens_per_s"] > 0 and run["timed_steps"] == 3
        assert run["clock"] == "host" and len(run["step_ms"]) == 3
        assert run["timed_s"] >= sum(run["step_ms"]) / 1e3 - 1e-5  # the slowest rank's time; step_ms are rank 0's
    assert base["timed_s"] == pytest.approx(sum(base["step_ms"]) / 1e3, abs=1e-5)
    rows = {(r["strategy"], r["devices"]): r for r in report["summary"]}
    assert rows["ddp", 2]["max_abs_loss_diff_vs_1"] < LOSS_TOL
    assert rows["ddp", 2]["efficiency"] == pytest.approx(rows["ddp", 2]["speedup"] / 2)
    assert (tmp_path / "out" / "scaling.csv").read_text().count("\n") == 4  # header + 3 runs
    assert report["meta"]["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                      "NVSHMEM_DISABLE_NVLS": "1"}


def test_zero_checkpoint_holds_the_full_optimizer_state(tmp_path):
    """trainer=zero on 2 gloo processes: fit + test, and last.ckpt holds AdamW state for every parameter (the
    shards consolidated) with the weight-decay groups of plain AdamW."""
    overrides = ["trainer=zero", "trainer.accelerator=cpu", "trainer.devices=2", f"paths.log_dir={tmp_path / 'logs'}",
                 f"paths.data_dir={tmp_path / 'data'}", *TINY_LISTOPS, *TINY_TRAINER]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run([sys.executable, "-m", "longmixer.train", *overrides], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt_path = next((tmp_path / "logs" / "runs").rglob("last.ckpt"))
    ckpt = torch.load(ckpt_path, weights_only=False)
    (optimizer,) = ckpt["optimizer_states"]
    n_params = len(ckpt["state_dict"])
    assert len(optimizer["state"]) == sum(len(g["params"]) for g in optimizer["param_groups"]) == n_params
    assert all(int(s["step"]) == 2 for s in optimizer["state"].values())
    assert {0.0, 0.01} <= {g["weight_decay"] for g in optimizer["param_groups"]}


def test_zero_trainer_config_builds_the_zero_strategy(compose):
    from hydra.utils import instantiate

    from longmixer.utils.config import validate_config
    from longmixer.utils.strategies import ZeroDDPStrategy

    cfg = compose(["trainer=zero", "trainer.accelerator=cpu", "trainer.devices=1"])
    validate_config(cfg)
    assert isinstance(instantiate(cfg.trainer.strategy), ZeroDDPStrategy)


def test_scaling_refuses_more_gpus_than_present(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    scaling = _scaling_module()
    with pytest.raises(SystemExit) as exc:
        scaling.main(["--gpus", "1", "2", "64", "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "asked for 64 GPUs but this machine has 1" in err
    assert not (tmp_path / "out").exists()


def test_scaling_without_two_gpus_notes_and_exits_zero(tmp_path, capsys, monkeypatch):
    """`make bench` runs the script with no arguments; on a 1-GPU box that must pass quickly."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    scaling = _scaling_module()
    assert scaling.main(["--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and out.startswith("scaling: skipped")
    assert not (tmp_path / "out").exists()


def test_scaling_run_past_its_timeout_is_killed_and_reported(tmp_path, capsys):
    scaling = _scaling_module()
    out = tmp_path / "out"
    assert scaling.main(["--cpu", "1", "--recipes", "quickstart", "--steps", "2", "--warmup", "1", "--timeout", "1",
                         "--out", str(out)]) == 1
    (run,) = json.loads((out / "scaling.json").read_text())["runs"]
    assert run["failed"].startswith("exit killed after --timeout 1 s") and run["world_size"] == 1
    assert "FAILED quickstart on 1 (single)" in capsys.readouterr().err


# a stand-in for `python -m longmixer.train`: writes the probe's file as the ScalingProbe does at the end of
# training, then never exits (what DDP runs on H100s did, docs/benchmarks.md "Scaling")
_HANGS_AFTER_TRAINING = """
import json, sys, time
out = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("+callbacks.scaling.out="))
json.dump({"world_size": 1, "steps": 3, "warmup_steps": 1, "loss": [2.3, 2.2, 2.1], "rows_per_step": [8, 8, 8],
           "tokens_per_step": [80, 80, 80], "timed_steps": 2, "timed_s": 0.5, "tokens_per_s": 320.0,
           "peak_mem_gib": [None]}, open(out, "w"))
time.sleep(600)
"""


def test_run_that_hangs_after_training_keeps_its_measurement(tmp_path, capsys, monkeypatch):
    scaling = _scaling_module()
    monkeypatch.setattr(scaling, "train_command", lambda overrides: [sys.executable, "-c", _HANGS_AFTER_TRAINING,
                                                                     *overrides])
    out = tmp_path / "out"
    assert scaling.main(["--cpu", "1", "--recipes", "quickstart", "--steps", "3", "--warmup", "1", "--exit-grace",
                         "1", "--timeout", "300", "--out", str(out)]) == 0
    report = json.loads((out / "scaling.json").read_text())
    (run,) = report["runs"]
    assert "failed" not in run and run["exit"].startswith("killed 1 s after training ended")
    (row,) = report["summary"]
    assert row["tokens_per_s"] == 320.0 and row["exit"] == run["exit"]
    assert "killed 1 s after training ended" in capsys.readouterr().out


def test_scaling_probe_reads_nothing_from_the_device_during_the_steps(tmp_path):
    """Per step the probe keeps the loss and the real-token count as device tensors: on meta tensors, which have no
    values, any host read (`int(mask.sum())`, `.item()`) raises. Such a read waits for the GPU at every step."""
    from types import SimpleNamespace

    from longmixer.callbacks.scaling import ScalingProbe

    probe = ScalingProbe(out=str(tmp_path / "probe.json"), warmup_steps=1)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    batch = {"inputs": torch.empty(4, 16, dtype=torch.long, device="meta"),
             "mask": torch.empty(4, 16, dtype=torch.bool, device="meta"),
             "inputs2": torch.empty(4, 16, dtype=torch.long, device="meta")}
    for step in range(3):
        probe.on_train_batch_start(trainer, None, batch, step)
        probe.on_train_batch_end(trainer, None, {"loss": torch.empty((), device="meta")}, batch, step)
    assert len(probe._tokens) == 3 and all(t.device.type == "meta" for t in probe._tokens)
    assert len(probe._starts) == 2 and probe._end is not None  # the steps after the warm-up one are timed
