"""syncbatchnorm under DDP: 2 gloo processes at half the batch each give the full-batch gradient. The module
imports only torch and the norm, so the spawned ranks start quickly."""

import torch

from longmixer.layers.norms import MaskedBatchNorm


def _bn_problem():
    g = torch.Generator().manual_seed(0)
    x, target = torch.randn(4, 6, 3, generator=g), torch.randn(4, 6, 3, generator=g)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = mask[3, 1:3] = False  # padding the moments must ignore; 10 real positions per rank
    torch.manual_seed(0)
    return torch.nn.Linear(3, 3), x, target, mask


def _bn_grad(norm, rows):
    """Gradient of the per-rank mean loss of linear -> norm on `rows` of the problem batch."""
    linear, x, target, mask = _bn_problem()
    y = norm(linear(x[rows]), mask[rows])
    (((y - target[rows]) ** 2).sum(-1) * mask[rows]).sum().div(mask[rows].sum()).backward()
    return torch.cat([linear.weight.grad.flatten(), linear.bias.grad])


def _bn_rank(rank, store, out):
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    grad = _bn_grad(MaskedBatchNorm(3, sync=True), slice(2 * rank, 2 * rank + 2))
    torch.distributed.all_reduce(grad)  # what DDP does with the per-rank gradients
    if rank == 0:
        torch.save(grad / 2, out)
    torch.distributed.destroy_process_group()


def test_syncbatchnorm_gives_the_full_batch_gradient_under_ddp(tmp_path):
    """Regression: the moments were all-reduced in place (not differentiable), so a rank's inputs missed the other
    ranks' loss terms through the shared mean / variance and the DDP gradient differed from the full-batch one by
    about its own size. Equal token counts per rank, as the averaged per-rank means then equal the global mean."""
    import torch.multiprocessing as mp

    full = _bn_grad(MaskedBatchNorm(3), slice(0, 4))
    mp.spawn(_bn_rank, args=(str(tmp_path / "store"), str(tmp_path / "grad.pt")), nprocs=2)
    ddp = torch.load(tmp_path / "grad.pt", weights_only=True)
    assert (ddp - full).abs().max() < 1e-5 * full.abs().max()
