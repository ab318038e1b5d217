"""Stream batching for LM: ordered training segments (roll, K chunks, DDP shards, resume) and evaluation windows."""

from __future__ import annotations

import pytest
import torch

from longmixer.data.lm_stream import IGNORE_INDEX, LMEvalStream, LMStreamLoader, LMTrainStream, eval_windows


@pytest.mark.parametrize("num_tokens,window,context", [
    pytest.param(101, 24, 16, id="N101-W24-C16"),
    pytest.param(101, 24, 0, id="N101-W24-disjoint"),
    pytest.param(100, 10, 9, id="N100-W10-C9-stride1"),
    pytest.param(20, 24, 16, id="N20-shorter-than-window"),
    pytest.param(25, 24, 16, id="N25-exactly-window"),
    pytest.param(1000, 64, 33, id="N1000-W64-C33"),
])
def test_eval_windows_score_each_position_once_with_context(num_tokens, window, context):
    windows = eval_windows(num_tokens, window, context)
    scored = []
    n = num_tokens - 1
    for start, end, first in windows:
        assert 0 <= start <= first < end <= n
        assert end - start == min(window, n)  # equal lengths: nothing padded
        if start > 0:
            assert first - start >= context
        scored.extend(range(first, end))
    assert scored == list(range(n))


def test_eval_windows_disjoint_segments_when_no_context():
    assert eval_windows(31, 10, 0) == [(0, 10, 0), (10, 20, 10), (20, 30, 20)]
    assert eval_windows(33, 10, 0)[-1] == (22, 32, 30)  # the last window ends at the stream's end


@pytest.mark.parametrize("window,context", [(10, 10), (10, -1), (0, 0)])
def test_eval_windows_reject_bad_settings(window, context):
    with pytest.raises(ValueError, match="data.eval_"):
        eval_windows(100, window, context)


def test_eval_stream_targets_cover_the_stream_once():
    tokens = torch.arange(3, 104)  # 101 tokens
    stream = LMEvalStream(tokens, window=24, context=16, batch_size=3)
    batches = list(stream)
    assert len(eval_windows(101, 24, 16)) == 11
    assert len(batches) == len(stream) == 4  # 3 + 3 + 3 + 2 windows: the last partial batch is kept
    scored = []
    for batch in batches:
        assert batch["inputs"].dtype == torch.long and "mask" not in batch  # every position is real
        for inputs, targets in zip(batch["inputs"], batch["targets"]):
            keep = targets != IGNORE_INDEX
            assert torch.equal(targets[keep], inputs[keep] + 1)  # targets are the next tokens
            scored.extend(targets[keep].tolist())
    assert scored == tokens[1:].tolist()


def test_eval_stream_keeps_last_partial_batch_and_shards_by_rank():
    tokens = torch.arange(200)
    windows = eval_windows(200, 20, 10)
    full = [b for b in LMEvalStream(tokens, 20, 10, batch_size=4)]
    assert sum(b["inputs"].shape[0] for b in full) == len(windows)
    shards = [list(LMEvalStream(tokens, 20, 10, batch_size=4, rank=r, world_size=2)) for r in range(2)]
    starts = sorted(int(b["inputs"][i, 0]) for shard in shards for b in shard for i in range(b["inputs"].shape[0]))
    assert starts == sorted(s for s, _, _ in windows)


def make_train(tokens, **kw):
    args = dict(batch_size=2, chunk=4, k_min=1, k_max=3, seed=0, roll=True, rank=0, world_size=1)
    args.update(kw)
    return LMTrainStream(tokens, **args)


def test_train_segments_are_contiguous_multiples_of_the_chunk():
    tokens = torch.arange(1, 202, dtype=torch.int32)  # 201 tokens -> 2 rows of 100
    stream = make_train(tokens, roll=False)
    batches = list(stream)
    lengths = [b["inputs"].shape[1] for b in batches]
    assert all(length % 4 == 0 and 4 <= length <= 12 for length in lengths)
    assert len(set(lengths)) > 1  # K varies between batches
    rows = torch.cat([b["inputs"] for b in batches], dim=1)
    assert torch.equal(rows, tokens[:200].view(2, 100)[:, :rows.shape[1]].long())
    assert 100 - 1 - rows.shape[1] < 4  # only a rest shorter than k_min chunks is dropped
    for b in batches:
        assert b["inputs"].dtype == torch.long
        assert torch.equal(b["targets"], b["inputs"] + 1)


def test_train_roll_changes_per_epoch_and_is_reproducible():
    tokens = torch.arange(400)
    a, b = make_train(tokens), make_train(tokens)
    first = [x["inputs"] for x in a]
    assert all(torch.equal(x, y["inputs"]) for x, y in zip(first, b))  # same (seed, epoch) -> same batches
    a.set_epoch(1)
    second = [x["inputs"] for x in a]
    assert not torch.equal(first[0], second[0])
    for row in a.rows():  # a roll keeps each row a rotation of its contiguous slice
        diffs = (row[1:] - row[:-1]).tolist()
        assert sorted(set(diffs))[-1] == 1 and sum(d != 1 for d in diffs) <= 1


def test_train_ddp_shards_are_disjoint_rows_of_the_global_batch():
    tokens = torch.arange(800)
    single = make_train(tokens, batch_size=4, roll=False).rows()
    shards = [make_train(tokens, batch_size=2, roll=False, rank=r, world_size=2).rows() for r in range(2)]
    assert torch.equal(torch.cat(shards), single)
    k_draws = [[b["inputs"].shape[1] for b in make_train(tokens, batch_size=2, rank=r, world_size=2)]
               for r in range(2)]
    assert k_draws[0] == k_draws[1]  # every rank draws the same K, so steps line up


def test_train_stream_too_short_raises():
    with pytest.raises(ValueError, match="too short"):
        make_train(torch.arange(10), chunk=8).rows()


def test_loader_resumes_mid_epoch_on_the_next_batch():
    tokens = torch.arange(600)
    loader = LMStreamLoader(make_train(tokens))
    epoch0 = [b["inputs"] for b in loader]
    epoch1 = [b["inputs"] for b in loader]
    assert not torch.equal(epoch0[0], epoch1[0])  # the loader advances the epoch

    fresh = LMStreamLoader(make_train(tokens))
    it = iter(fresh)
    next(it), next(it)
    state = fresh.state_dict()
    assert state == {"epoch": 0, "consumed": 2}
    resumed = LMStreamLoader(make_train(tokens))
    resumed.load_state_dict(state)
    rest = [b["inputs"] for b in resumed]
    assert len(rest) == len(epoch0) - 2
    assert all(torch.equal(x, y) for x, y in zip(rest, epoch0[2:]))
    assert torch.equal(next(iter(resumed))["inputs"], epoch1[0])


def test_loader_workers_split_batches_without_duplicates():
    tokens = torch.arange(600)
    plain = [b["inputs"] for b in LMStreamLoader(make_train(tokens))]
    loader = LMStreamLoader(make_train(tokens), num_workers=2)
    workers = [b["inputs"] for b in loader]
    assert sorted(x.flatten().tolist() for x in plain) == sorted(x.flatten().tolist() for x in workers)
    second = [b["inputs"] for b in loader]  # the workers of the next epoch see the new roll
    assert sorted(x.flatten().tolist() for x in second) != sorted(x.flatten().tolist() for x in workers)


@pytest.mark.parametrize("consumed", [1, 2, 3])
def test_loader_with_workers_resumes_mid_epoch_in_order(consumed):
    """Workers deal the batches from the first one yielded: a resume after an odd number of batches gives the rest of
    the epoch in order (they used to deal from batch 0, so the first two came swapped, and a second resume then
    skipped one batch and repeated another)."""
    tokens = torch.arange(2000)
    epoch0 = [b["inputs"] for b in LMStreamLoader(make_train(tokens))]
    resumed = LMStreamLoader(make_train(tokens), num_workers=2)
    resumed.load_state_dict({"epoch": 0, "consumed": consumed})
    rest = [b["inputs"] for b in resumed]
    assert len(rest) == len(epoch0) - consumed
    assert all(torch.equal(x, y) for x, y in zip(rest, epoch0[consumed:]))


@pytest.mark.parametrize("seed", [0, 1, 4, 5])
def test_train_epochs_have_the_same_batches(seed):
    """Lightning counts `len(stream)` once and takes that many batches every epoch. With K drawn independently per
    batch the count changed from epoch to epoch (an epoch of 20 batches, then 17, 18, 16): a longer epoch lost its last
    batches, and a shorter one ended before Lightning's last batch, skipping its end-of-epoch validation and, under
    gradient accumulation, the gradients of its unfinished update."""
    stream = make_train(torch.arange(2000), batch_size=4, chunk=16, k_min=1, k_max=3, seed=seed)
    counts, ks = [], []
    for epoch in range(6):
        stream.set_epoch(epoch)
        lengths = [b["inputs"].shape[1] for b in stream]
        counts.append(len(lengths))
        ks.append(sorted(lengths))
    assert counts == [len(stream)] * 6
    assert all(k == ks[0] for k in ks) and len(set(ks[0])) == 3  # the same K every epoch, each of 1..3 chunks
    assert sum(ks[0]) > 499 - 16  # only a rest shorter than k_min chunks is left out


def _lightning_epochs(loader, n: int, epochs: int) -> list[list[torch.Tensor]]:
    """What Lightning takes of the loader: `n` batches an epoch, each epoch from a new iterator."""
    out = []
    for _ in range(epochs):
        it = iter(loader)
        out.append([next(it)["inputs"] for _ in range(n)])
    return out


@pytest.mark.parametrize("limit", [None, 3], ids=["whole-epochs", "limit_train_batches-3"])
def test_loader_restored_at_an_epoch_end_starts_the_next_epoch(limit):
    """Each epoch starts a fresh pass, also after a resume from a checkpoint written at an epoch's end. The loader
    restored (epoch, batches consumed) as they were, so it continued the finished epoch: after a whole epoch it
    gave an empty one, and under `trainer.limit_train_batches` it gave the cut pass's rest, so the resumed run
    trained on other batches than the uninterrupted one."""
    tokens = torch.arange(600)
    n = len(make_train(tokens)) if limit is None else limit
    uninterrupted = _lightning_epochs(LMStreamLoader(make_train(tokens), epoch_batches=limit), n, 3)
    for epoch in range(3):  # every epoch is the first n batches of its own pass
        stream = make_train(tokens)
        stream.set_epoch(epoch)
        assert all(torch.equal(x, y["inputs"]) for x, y in zip(uninterrupted[epoch], stream))
    resumed = LMStreamLoader(make_train(tokens), epoch_batches=limit)
    resumed.load_state_dict({"epoch": 0, "consumed": n})
    after = _lightning_epochs(resumed, n, 2)
    assert all(torch.equal(x, y) for got, ref in zip(after, uninterrupted[1:]) for x, y in zip(got, ref))


@pytest.mark.parametrize("limit", [None, 3], ids=["whole-pass", "overfit-3"])
def test_repeating_loader_gives_epoch_0_s_batches_every_epoch(limit):
    """`trainer.overfit_batches`: every epoch trains on the same first batches, as Lightning's sequential sampler
    does for a map-style set (the LM loader once moved to a new pass, with new rolls and K order, every epoch), and
    a resume at an epoch's end or in its middle continues that same repetition."""
    tokens = torch.arange(600)
    n = len(make_train(tokens)) if limit is None else limit
    first = make_train(tokens)
    first.set_epoch(0)
    expected = [batch["inputs"] for _, batch in zip(range(n), first)]
    epochs = _lightning_epochs(LMStreamLoader(make_train(tokens), epoch_batches=limit, repeat=True), n, 3)
    assert all(torch.equal(x, y) for got in epochs for x, y in zip(got, expected, strict=True))
    for consumed in (n, 1):  # a checkpoint at an epoch's end, and one in its middle
        resumed = LMStreamLoader(make_train(tokens), epoch_batches=limit, repeat=True)
        resumed.load_state_dict({"epoch": 0, "consumed": consumed})
        rest = [batch["inputs"] for _, batch in zip(range(n - consumed), resumed)]
        assert all(torch.equal(x, y) for x, y in zip(rest, expected[consumed:], strict=True))
        after = _lightning_epochs(resumed, n, 1)[0]
        assert all(torch.equal(x, y) for x, y in zip(after, expected, strict=True))


@pytest.mark.parametrize("trainer, epoch_batches, repeat", [
    ({"limit_train_batches": None, "overfit_batches": 0}, None, False),
    ({"limit_train_batches": 5, "overfit_batches": 0}, 5, False),
    ({"limit_train_batches": 0.5, "overfit_batches": 0}, 8, False),    # of the stream's 16 batches
    ({"limit_train_batches": 2, "overfit_batches": 2}, 2, True),       # Lightning keeps this loader under overfit
])
def test_datamodule_gives_the_loader_lightnings_epoch(tmp_path, trainer, epoch_batches, repeat):
    from types import SimpleNamespace

    from longmixer.data.synthetic_bytes import SyntheticBytes

    dm = SyntheticBytes(train_bytes=2000, eval_bytes=300, num_words=50, seq_len=16, k_min=1, k_max=3, batch_size=4,
                        data_dir=tmp_path)
    dm.prepare_data()
    dm.setup()
    dm.trainer = SimpleNamespace(**trainer)
    loader = dm.train_dataloader()
    assert len(loader) == 16 and loader.epoch_batches == epoch_batches and loader.repeat == repeat


@pytest.mark.parametrize("accumulate, epoch_batches", [(3, None), (3, 5), (4, 7)])
def test_batches_carry_their_optimizer_updates_tokens_under_accumulation(accumulate, epoch_batches):
    """Batch i of the epoch carries the tokens of its update's batches [u A, (u + 1) A), the last update cut at the
    epoch's end (`epoch_batches`, as Lightning steps the optimizer there); also past a mid-epoch resume."""
    stream = LMTrainStream(torch.arange(3000), batch_size=2, chunk=4, k_min=1, k_max=3, seed=1, roll=False)
    stream.accumulate, stream.epoch_batches = accumulate, epoch_batches
    batches = list(stream)
    n = epoch_batches or len(batches)
    tokens = [b["inputs"].numel() for b in batches]
    assert len(set(tokens)) > 1  # K varies, so a plain count of the batches would weigh tokens unequally
    for i, batch in enumerate(batches[:n]):
        first = i - i % accumulate
        assert int(batch["update_tokens"]) == sum(tokens[first:min(first + accumulate, n)]), i
    stream.skip = 4
    assert [int(b["update_tokens"]) for b in stream] == [int(b["update_tokens"]) for b in batches[4:]]
    stream.accumulate = 1
    assert all("update_tokens" not in b for b in stream)


def test_datamodule_hands_the_trainers_accumulation_to_the_stream(tmp_path):
    from types import SimpleNamespace

    from longmixer.data.synthetic_bytes import SyntheticBytes

    dm = SyntheticBytes(train_bytes=2000, eval_bytes=300, num_words=50, seq_len=16, k_min=1, k_max=3, batch_size=4,
                        data_dir=tmp_path)
    dm.prepare_data()
    dm.setup()
    dm.trainer = SimpleNamespace(limit_train_batches=5, overfit_batches=0, accumulate_grad_batches=2)
    loader = dm.train_dataloader()
    assert loader.dataset.accumulate == 2 and loader.dataset.epoch_batches == 5
    first, second = list(loader)[:2]  # one update
    assert int(first["update_tokens"]) == int(second["update_tokens"]) == first["inputs"].numel() + second["inputs"].numel()
