"""`AgreedStop`: the ranks' stop signal, all-reduced at each check and read at the next, so no check waits for the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longmixer.callbacks.checkpoint import AgreedStop


@pytest.fixture
def one_rank_group(tmp_path, request):
    backend, device = request.param
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield torch.device(device)
    finally:
        dist.destroy_process_group()


def _checks(device, signals):
    agreed = AgreedStop()
    return [agreed.exchange(signum, device) for signum in signals]


@pytest.mark.parametrize("one_rank_group", [("gloo", "cpu")], indirect=True)
def test_each_check_reads_the_previous_checks_agreement(one_rank_group):
    # a signal (15) raised before the third check is acted on at the fourth, and stays
    assert _checks(one_rank_group, [0, 0, 15, 15, 15]) == [0, 0, 0, 15, 15]


@pytest.mark.gpu
@pytest.mark.parametrize("one_rank_group", [("nccl", "cuda")], indirect=True)
def test_on_a_gpu_a_check_does_not_wait_for_the_queued_step(one_rank_group):
    torch.cuda.set_device(0)
    assert _checks(one_rank_group, [0, 2, 0, 15, 15]) == [0, 0, 2, 0, 15]
    agreed = AgreedStop()
    agreed.exchange(0, one_rank_group)
    x = torch.randn(8192, 8192, device="cuda")
    for _ in range(10):  # a step's worth of queued work (a fifth of a second or more in float32)
        x = x @ x / 8192 ** 0.5
    assert agreed.exchange(15, one_rank_group) == 0
    assert not torch.cuda.current_stream().query()  # the check returned while the work was still queued
    torch.cuda.synchronize()
    assert agreed.exchange(0, one_rank_group) == 15
