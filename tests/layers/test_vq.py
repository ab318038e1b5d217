"""Tests of the EMA-codebook vector quantizer: the EMA formula, one step per optimizer step under accumulation,
padding, the data init (deferred past an all-padding batch, under DDP too), DDP all-reduce, straight-through and
commitment gradients, usage statistics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from longmixer.layers.vq import VectorQuantizer


def quantizer(S=4, E=3, decay=0.9, **kw):
    vq = VectorQuantizer(E, S, decay=decay, backend="torch", **kw)
    vq.initialized.fill_(True)  # keep the hand-set codebook below
    vq.sums.copy_(torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [-1, -1, -1]]) * 2.0)
    vq.counts.fill_(2.0)  # codebook = unit vectors and (-1, -1, -1)
    return vq


KEYS = torch.tensor([[[0.9, 0.1, 0.0], [0.0, 1.2, 0.1], [1.1, 0.0, 0.2], [-1.0, -0.8, -1.1]]])  # codes 0 1 0 3


def test_ema_update_matches_formula():
    vq = quantizer()
    vq.set_progress(0, 10)
    _, codes, _, _ = vq(KEYS)
    assert codes.tolist() == [[0, 1, 0, 3]]
    counts0, sums0 = vq.counts.clone(), vq.sums.clone()
    vq.set_progress(1, 10)  # a new optimizer step applies the statistics of step 0
    n_batch = torch.tensor([2.0, 1.0, 0.0, 1.0])
    m_batch = torch.stack([KEYS[0, 0] + KEYS[0, 2], KEYS[0, 1], torch.zeros(3), KEYS[0, 3]])
    torch.testing.assert_close(vq.counts, 0.9 * counts0 + 0.1 * n_batch)
    torch.testing.assert_close(vq.sums, 0.9 * sums0 + 0.1 * m_batch)
    torch.testing.assert_close(vq.codebook, vq.sums / vq.counts[:, None])


def test_a_replayed_step_leaves_its_statistics_pending():
    """Under `task.compile=step-graph` a replay adds the step's statistics to the pending buffers on the GPU without
    the Python that records it; `after_replay` records it, so the next step applies them (and without it they would
    sit there unapplied). Here the replay's addition is written by hand."""
    vq = quantizer()
    vq.set_progress(0, 10)
    vq(KEYS)
    vq.set_progress(1, 10)  # applies step 0's statistics; nothing is pending
    n_batch = torch.tensor([2.0, 1.0, 0.0, 1.0])
    for replayed in (False, True):
        counts = vq.counts.clone()
        vq.pending_counts += n_batch  # what a replay's captured `absorb_stats` does
        if replayed:
            vq.after_replay()
        vq.set_progress(2 + replayed, 10)
        if replayed:
            torch.testing.assert_close(vq.counts, 0.9 * counts + 0.1 * (2 * n_batch))  # both steps' statistics
        else:
            torch.testing.assert_close(vq.counts, counts)


def test_accumulated_micro_batches_make_one_ema_step():
    """Gradient accumulation: two micro-batches of one optimizer step = one EMA step on their summed stats."""
    acc, whole = quantizer(), quantizer()
    acc.set_progress(0, 10)
    acc(KEYS[:, :2])
    acc(KEYS[:, 2:])
    acc.set_progress(0, 10)  # same step: nothing applied yet
    torch.testing.assert_close(acc.counts, torch.full((4,), 2.0))
    acc.set_progress(1, 10)
    whole.set_progress(0, 10)
    whole(KEYS)
    whole.set_progress(1, 10)
    torch.testing.assert_close(acc.counts, whole.counts)
    torch.testing.assert_close(acc.sums, whole.sums)


def test_without_progress_each_forward_updates_and_eval_never():
    vq = quantizer()
    vq(KEYS)
    assert vq.counts[0].item() == pytest.approx(0.9 * 2 + 0.1 * 2)
    vq.eval()
    before = vq.counts.clone()
    vq(KEYS)
    torch.testing.assert_close(vq.counts, before)


def test_padding_is_excluded():
    vq = quantizer()
    mask = torch.tensor([[True, True, False, False]])
    _, _, _, aux = vq(KEYS, mask)
    torch.testing.assert_close(vq.counts, 0.9 * torch.full((4,), 2.0) + 0.1 * torch.tensor([1.0, 1, 0, 0]))
    assert aux["stats/vq_used_codes"].item() == 2
    assert aux["stats/vq_perplexity"].item() == pytest.approx(2.0)


def test_straight_through_and_commit_gradient_reach_k_only():
    vq = quantizer(commit_coef=0.5).eval()
    k = KEYS.clone().requires_grad_(True)
    k_hat, codes, codebook, aux = vq(k)
    torch.testing.assert_close(k_hat, codebook[codes])  # value: the codeword (eq. 6)
    (g_st,) = torch.autograd.grad((k_hat * torch.arange(3.0)).sum(), k)
    torch.testing.assert_close(g_st, torch.arange(3.0).expand_as(k))  # identity gradient (eq. 8)
    (g_commit,) = torch.autograd.grad(aux["loss/vq_commit"], k)
    torch.testing.assert_close(g_commit, 0.5 * 2 * (k - codebook[codes]) / k.numel())  # d MSE(K, sg(C)) / dK
    assert not any(p.requires_grad for p in (vq.counts, vq.sums))
    assert len(list(vq.parameters())) == 0  # the codebook never reaches the optimizer


def test_usage_statistics():
    _, _, _, aux = quantizer().eval()(KEYS)
    probs = torch.tensor([0.5, 0.25, 0.25])
    assert aux["stats/vq_used_codes"].item() == 3
    assert aux["stats/vq_perplexity"].item() == pytest.approx(math.exp(-(probs * probs.log()).sum().item()))


def test_first_training_batch_initializes_codebook_from_real_keys():
    torch.manual_seed(0)
    vq = VectorQuantizer(3, 4, backend="torch")
    mask = torch.tensor([[True, True, False, False]])
    vq(KEYS, mask)
    assert bool(vq.initialized)
    for row in vq.sums / vq.counts[:, None]:  # EMA mixes the init keys with the batch keys: stays in their span
        assert min((row - KEYS[0, i]).norm() for i in range(2)) < 0.5


def _is_a_real_key(row: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> bool:
    return any(torch.equal(row, key) for key in keys[mask])


def test_an_all_padding_first_batch_defers_the_codebook_init():
    """Bug: a first training batch whose mask marks every token as padding marked the codebook initialized without
    replacing a codeword, so the data init never ran and the run kept the random N(0, 1/E) codebook (whose codes
    mostly stay dead at MEGA's key scale). The init now waits for the first batch with a real key, and takes its
    codewords from real keys only."""
    torch.manual_seed(0)
    vq = VectorQuantizer(4, 8, backend="torch")
    vq.set_progress(0, 10)  # the EMA steps wait for the optimizer steps: the codewords stay the drawn keys
    random_sums = vq.sums.clone()
    keys = torch.randn(2, 6, 4)
    vq(keys, torch.zeros(2, 6, dtype=torch.bool))
    assert not bool(vq.initialized)
    assert torch.equal(vq.sums, random_sums)
    vq.set_progress(1, 10)
    keys = torch.randn(2, 6, 4)
    mask = torch.tensor([[True] * 6, [True] * 2 + [False] * 4])
    keys[~mask] = 100.0  # padded keys: never a codeword
    vq(keys, mask)
    assert bool(vq.initialized)
    assert all(_is_a_real_key(row, keys, mask) for row in vq.sums)
    torch.testing.assert_close(vq.counts, torch.ones(8))


def _deferred_init_rank(rank, store, out):
    """Rank 0's first batch is all padding and rank 1's is not; the second batch of rank 0 has real keys."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)  # the same random codebook on both ranks
    vq = VectorQuantizer(4, 8, backend="torch")
    vq.set_progress(0, 10)  # one optimizer step: the statistics stay pending
    g = torch.Generator().manual_seed(1 + rank)
    first = torch.randn(1, 6, 4, generator=g)
    vq(first, torch.full((1, 6), rank == 1))
    after_first = (bool(vq.initialized), vq.sums.clone())
    second = torch.randn(1, 6, 4, generator=g)
    vq(second, torch.ones(1, 6, dtype=torch.bool))
    torch.save({"after_first": after_first, "sums": vq.sums.clone(), "initialized": bool(vq.initialized),
                "pending": vq.pending_counts.sum().item(), "second": second}, f"{out}{rank}.pt")
    dist.destroy_process_group()


def test_ddp_codebook_init_waits_for_rank_0_s_real_keys(tmp_path):
    """Under DDP rank 0's keys become every rank's codewords (broadcast): a first batch that is all padding on rank 0
    leaves the codebook and `initialized` as they were on every rank (rank 1's real keys included), and rank 0's
    next batch with real keys initializes the same codebook on both, dropping the statistics rank 1 gathered
    against the codewords the init replaced."""
    import torch.multiprocessing as mp

    torch.manual_seed(0)
    random_sums = VectorQuantizer(4, 8, backend="torch").sums
    mp.spawn(_deferred_init_rank, args=(str(tmp_path / "store"), str(tmp_path / "rank")), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for rank in ranks:
        assert rank["after_first"][0] is False
        assert torch.equal(rank["after_first"][1], random_sums)
        assert rank["initialized"]
        assert torch.equal(rank["sums"], ranks[0]["sums"])
        assert rank["pending"] == 6  # the second batch's tokens alone
    second = ranks[0]["second"]
    assert all(_is_a_real_key(row, second, torch.ones(1, 6, dtype=torch.bool)) for row in ranks[0]["sums"])


def test_ddp_statistics_are_all_reduced(tmp_path):
    """With torch.distributed initialized the pending statistics go through all_reduce (1-rank gloo group)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        vq = quantizer()
        calls = []
        real = dist.all_reduce
        dist.all_reduce = lambda t, *a, **kw: (calls.append(t.shape), real(t, *a, **kw))[1]
        try:
            vq.set_progress(0, 1)
            vq(KEYS)
            vq.set_progress(1, 1)
        finally:
            dist.all_reduce = real
        assert calls == [torch.Size([4]), torch.Size([4, 3])]
        assert vq.counts[0].item() == pytest.approx(0.9 * 2 + 0.1 * 2)
    finally:
        dist.destroy_process_group()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="n_codes"):
        VectorQuantizer(4, 0)
    with pytest.raises(ValueError, match="decay"):
        VectorQuantizer(4, 8, decay=1.0)
    with pytest.raises(ValueError, match=r"commit_coef=-1.0 must be >= 0"):
        VectorQuantizer(4, 8, commit_coef=-1.0)
    assert VectorQuantizer(4, 8, commit_coef=0.0).commit_coef == 0.0  # no commitment loss


def test_compiled_forward_leaves_statistics_for_absorb():
    """Compiled, the training forward writes no buffer: its statistics wait in `_batch_stats` until `after_forward`
    absorbs them; two calls within one compiled function (a two-document batch) are both kept, and the EMA step
    then equals the eager one."""
    eager, comp = quantizer(), quantizer()

    def two_documents(vq, a, b):
        return vq(a)[0] + vq(b)[0]

    compiled = torch.compile(two_documents, backend="aot_eager", fullgraph=True)
    for vq in (eager, comp):
        vq.set_progress(0, 10)
    torch.testing.assert_close(compiled(comp, KEYS, KEYS.flip(1)), two_documents(eager, KEYS, KEYS.flip(1)))
    assert len(comp._batch_stats) == 2 and eager._batch_stats == ()
    assert all(torch.equal(a, b) for a, b in zip(comp.buffers(), quantizer().buffers()))  # nothing written yet
    comp.after_forward()
    assert comp._batch_stats == ()
    for vq in (eager, comp):
        vq.set_progress(1, 10)
    torch.testing.assert_close(comp.counts, eager.counts)
    torch.testing.assert_close(comp.sums, eager.sums)


def test_apply_update_absorbs_left_statistics():
    """A compiled forward's statistics left unabsorbed still enter the next EMA step (set_progress, apply_update)."""
    vq, ref = quantizer(), quantizer()
    for q in (vq, ref):
        q.set_progress(0, 10)
    torch.compile(vq, backend="aot_eager")(KEYS)
    ref(KEYS)
    vq.set_progress(1, 10)
    ref.set_progress(1, 10)
    torch.testing.assert_close(vq.counts, ref.counts)
    torch.testing.assert_close(vq.sums, ref.sums)
