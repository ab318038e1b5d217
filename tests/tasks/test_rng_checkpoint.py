"""Checkpointed RNG states under DDP: each rank resumes from its own state, not from rank 0's (the rank that writes
the file). Two gloo processes, no Trainer: the task's checkpoint hooks run as Lightning calls them."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch
from pytorch_lightning.trainer.states import TrainerFn
from torch import nn

from longmixer.tasks.base import SequenceTask


def _draws() -> list[float]:
    return [*torch.rand(3).tolist(), *np.random.rand(3).tolist(), random.random()]


def _rank(rank: int, store: str, ckpt: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    task = SequenceTask(nn.Linear(2, 2), torch.optim.SGD, None)
    task.trainer = SimpleNamespace(global_rank=rank, world_size=2, state=SimpleNamespace(fn=TrainerFn.FITTING))
    torch.manual_seed(0), np.random.seed(0), random.seed(0)  # seeded alike, as seed_everything seeds every rank
    for _ in range(rank + 1):  # then the ranks draw different amounts (dropout on batches of different shapes)
        _draws()
    checkpoint: dict = {}
    task.on_save_checkpoint(checkpoint)  # every rank calls it; rank 0 writes the file
    expected = _draws()
    if rank == 0:
        torch.save(checkpoint, ckpt)
    torch.distributed.barrier()
    torch.manual_seed(1), np.random.seed(1), random.seed(1)  # a fresh process of the resumed run
    task.on_load_checkpoint(torch.load(ckpt, weights_only=True))
    torch.save({"expected": expected, "got": _draws()}, f"{out}.{rank}")
    torch.distributed.destroy_process_group()


def test_every_ddp_rank_resumes_its_own_rng_state(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "draws")
    # forked, not spawned: the ranks start with Lightning already imported
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path / "last.ckpt"), out), nprocs=2,
                       start_method="fork")
    draws = [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(2)]
    assert draws[0]["expected"] != draws[1]["expected"]  # the ranks' states did differ
    for rank, d in enumerate(draws):
        assert d["got"] == d["expected"], f"rank {rank} did not resume its own RNG state"
