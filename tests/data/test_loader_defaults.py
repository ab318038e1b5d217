"""DataLoader defaults: workers, pinned memory and persistent workers follow the device unless the config says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from longmixer.data.base import default_num_workers, pad_collate
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


@pytest.mark.parametrize("eval_batch_size", [0, -3])
def test_an_eval_batch_size_below_one_is_refused(eval_batch_size):
    """Bug: `data.eval_batch_size=0` was read as "unset" and evaluated with data.batch_size, and -3 reached the
    DataLoader at the first validation, after training, as torch's ValueError with a traceback."""
    with pytest.raises(ValueError, match=rf"^data.eval_batch_size={eval_batch_size} must be >= 1 \(or null"):
        ListOps(eval_batch_size=eval_batch_size)
    assert ListOps(batch_size=8).eval_batch_size == 8 and ListOps(batch_size=8, eval_batch_size=2).eval_batch_size == 2


@pytest.mark.parametrize("data", ["listops", "text_1k", "pathx_gen", "wikitext103"])
def test_every_data_config_shares_one_loader_default(data):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(overrides=[f"+data={data}", "+paths=default", "+seed=0", "data.num_workers=2"])
    assert cfg.data.num_workers == 2 and cfg.data.pin_memory is None and cfg.data.persistent_workers is None
    for path in (CONFIGS / "data").glob("*.yaml"):
        assert "num_workers" not in path.read_text(), f"{path} repeats the shared loader default"


def test_padded_length_rounds_up_within_the_cap():
    from longmixer.data.base import padded_length

    assert padded_length(700, None, 2000) == 700
    assert padded_length(700, 256, 2000) == 768
    assert padded_length(1990, 256, 2000) == 2000  # the cap (seq_len) wins over the multiple
    assert padded_length(2000, 256, None) == 2048
    assert padded_length(2100, 256, 2000) == 2100  # never below the longest item


def test_pad_multiple_gives_few_shapes_and_masks_the_padding():
    dm = ListOps(pad_multiple=8, seq_len=20)
    items = [{"inputs": torch.arange(1, n + 1), "labels": torch.tensor(0)} for n in (3, 9)]
    batch = dm.collate(items)
    assert batch["inputs"].shape == (2, 16) and batch["mask"].sum(1).tolist() == [3, 9]
    assert batch["inputs"][0, 3:].eq(0).all() and batch["inputs"][1, :9].tolist() == list(range(1, 10))
    assert ListOps(seq_len=20).collate(items)["inputs"].shape == (2, 9)  # default: the batch's longest
    assert ListOps(pad_multiple=8, seq_len=12).collate(items)["inputs"].shape == (2, 12)
    with pytest.raises(ValueError, match="data.pad_multiple=0"):
        ListOps(pad_multiple=0)


@pytest.mark.parametrize("data", ["listops", "listops_gen", "text_1k", "retrieval"])
def test_variable_length_configs_take_pad_multiple(data):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(overrides=[f"+data={data}", "+paths=default", "+seed=0", "data.pad_multiple=256"])
    from hydra.utils import instantiate

    assert instantiate(cfg.data).pad_multiple == 256


@pytest.mark.parametrize("data", ["listops", "listops_gen", "text_1k", "retrieval"])
def test_variable_length_configs_pad_to_few_shapes_by_default(data):
    """The shipped configs pad variable-length batches to a few shapes, so `task.compile=auto` picks CUDA graphs on
    a GPU; `data.pad_multiple=null` (one shape per batch) makes it fall back to plain compilation."""
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(overrides=[f"+data={data}", "+paths=default", "+seed=0"])
        unpadded = compose(overrides=[f"+data={data}", "+paths=default", "+seed=0", "data.pad_multiple=null"])
    dm = instantiate(cfg.data)
    assert dm.variable_length and dm.pad_multiple is not None and dm.few_shapes
    assert not instantiate(unpadded.data).few_shapes


def test_fixed_length_data_has_few_shapes():
    from longmixer.data.pathfinder import Pathfinder

    assert not Pathfinder.variable_length and Pathfinder.few_shapes.fget(Pathfinder.__new__(Pathfinder))


def _as_list(batch: list) -> list:
    return batch


def _worker_survives(worker_init_fn, signum) -> bool:
    """Start a 1-worker loader with `signum` at its default action, send it to the worker, and report whether the
    loader still delivers every batch. Batches are plain lists: a tensor batch travels as a shared-memory file
    descriptor, and a worker killed while the main process fetches one can leave that fetch waiting on a dead
    socket instead of failing (the loader's worker check, every 5 s, finds a dead worker otherwise)."""
    import signal
    import time

    from torch.utils.data import DataLoader

    previous = signal.signal(signum, signal.SIG_DFL)  # what a worker forked before any handler inherits
    try:
        loader = DataLoader(list(range(64)), batch_size=4, num_workers=1, worker_init_fn=worker_init_fn,
                            collate_fn=_as_list)
        it = iter(loader)
        first = next(it)
        os.kill(it._workers[0].pid, signum)
        try:
            time.sleep(0.5)  # torch's SIGCHLD handler may report the worker's death here already
            rest = list(it)
        except RuntimeError:
            return False
        return [x for batch in [first, *rest] for x in batch] == list(range(64))
    finally:
        signal.signal(signum, previous)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR2], ids=["sigterm", "sigusr2"])
def test_loader_workers_leave_stop_signals_to_the_training_process(signum):
    """A scheduler's SIGTERM reaches the workers too (scancel, timeout and Ctrl+C signal the process group; SLURM
    signals every process of the job, its pre-timeout SIGUSR2 included): with the loaders' worker_init_fn they survive
    it and the run checkpoints; without it the next batch fails."""
    from longmixer.data.base import init_worker

    assert not _worker_survives(None, signum)
    assert _worker_survives(init_worker, signum)
    dm = ListOps(num_workers=2)
    dm.datasets = {"train": list(range(8)), "val": list(range(4))}
    assert dm.train_dataloader().worker_init_fn is init_worker
    assert dm.val_dataloader().worker_init_fn is init_worker


def test_fixed_length_batches_carry_no_key_mask():
    """`pad_collate(full_mask=False)` (what fixed-length tasks collate with) leaves a key's mask out where none of its
    sequences was padded, so the models take their unmasked paths; a padded one keeps its mask, and the default
    (variable-length tasks) keeps the mask in every batch, so its presence never changes between batches."""
    same = [{"inputs": torch.arange(1, 6), "inputs2": torch.arange(1, 6), "labels": torch.tensor(0)} for _ in range(3)]
    batch = pad_collate(same, full_mask=False)
    assert batch["inputs"].shape == (3, 5) and "mask" not in batch and "mask2" not in batch
    assert pad_collate(same)["mask"].all() and pad_collate(same)["mask2"].all()
    ragged = [{"inputs": torch.arange(1, n + 1), "inputs2": torch.arange(1, 5), "labels": torch.tensor(0)}
              for n in (3, 5)]
    batch = pad_collate(ragged, full_mask=False)
    assert batch["mask"].sum(1).tolist() == [3, 5] and "mask2" not in batch
    assert pad_collate(same, pad_to=8, full_mask=False)["mask"].sum(1).tolist() == [5, 5, 5]
    assert "mask" in ListOps(seq_len=20).collate([{"inputs": torch.arange(1, 6), "labels": torch.tensor(0)}] * 2)


def _epochs(loader, take):
    """The first example index of each batch, for `take` batches of each of len(take) iterations."""
    out = []
    for n in take:
        it = iter(loader)
        out.append([int(next(it)[0]) for _ in range(n)])
    return out


def test_an_epoch_cut_short_by_limit_train_batches_starts_the_next_pass():
    """Lightning takes `epoch_batches` batches an epoch: the next epoch is a fresh pass, not the pass's rest (which
    made short epochs); a loader restored inside an epoch continues it, one restored at its end starts the next."""
    from longmixer.data.base import EpochSampler, ResumableLoader

    data = list(range(40))

    def loader(limit):
        return ResumableLoader(data, sampler=EpochSampler(40, seed=0, shuffle=True), epoch_batches=limit,
                               batch_size=4)

    whole = _epochs(loader(None), [10, 10])
    limited = _epochs(loader(7), [7, 7, 7])
    assert limited[0] == whole[0][:7] and limited[1] == whole[1][:7]
    restored = loader(7)
    restored.load_state_dict({"epoch": 1, "consumed": 3})
    assert _epochs(restored, [4]) == [whole[1][3:7]]
    restored.load_state_dict({"epoch": 1, "consumed": 7})
    assert _epochs(restored, [7]) == [limited[2]]


_KILLED_PARENT = r'''
import multiprocessing as mp, os, sys, time
from longmixer.data.base import init_worker

out = sys.argv[1]


def orphan():  # a worker whose start-up outlasted its parent (a SIGKILL while the loader starts its workers)
    while os.getppid() == mp.parent_process().pid:
        time.sleep(0.01)
    init_worker(0)
    open(out + ".orphan", "w").write(str(os.getpid()))


def worker():  # a worker set up while its parent lives, which then outlives it
    init_worker(0)
    open(out + ".worker", "w").write(str(os.getpid()))
    time.sleep(120)


if __name__ == "__main__":
    for target in (orphan, worker):
        mp.get_context("fork").Process(target=target).start()
    while not os.path.exists(out + ".worker"):
        time.sleep(0.01)
    os.kill(os.getpid(), 9)
'''


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_loader_workers_end_with_a_killed_training_process(tmp_path):
    """A training process killed outright cannot shut its workers down. A worker set up before the kill is ended by
    the kernel with it, and one whose start-up outlasted it exits in `init_worker`: torch's own watch, which starts
    after it, took pid 1 for the parent, and such workers waited forever holding the run's pipes and log."""
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "killed_parent.py"
    script.write_text(_KILLED_PARENT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root / "src"), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "mark")], env=env, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    pid = int((tmp_path / "mark.worker").read_text())
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert not _running(pid), "the worker outlived its killed parent"
        time.sleep(0.5)  # the orphan's poll of its parent
        assert not (tmp_path / "mark.orphan").exists(), "a worker whose parent was gone went on to load data"
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
