"""The seeded synthetic byte stream: reproducible, text-like bytes with ids byte + 1, served by the LM protocol."""

import numpy as np
import pytest

from longmixer.data.synthetic_bytes import SyntheticBytes, make_lexicon, synthetic_bytes


def _module(tmp_path, **kw):
    args = dict(train_bytes=6000, eval_bytes=900, num_words=50, seq_len=16, k_min=2, k_max=2, batch_size=3,
                data_dir=tmp_path)
    return SyntheticBytes(**{**args, **kw})


def test_prepared_streams_are_reproducible_and_text_like(tmp_path):
    first, second = _module(tmp_path / "a"), _module(tmp_path / "b")
    for dm in (first, second):
        dm.prepare_data()
        dm.setup()
    train = np.load(first.root / "train.npy")
    assert np.array_equal(train, np.load(second.root / "train.npy"))
    assert train.size == 6000 and np.load(first.root / "val.npy").size == 900
    raw = set((train - 1).tolist())
    assert raw <= set(range(ord("a"), ord("z") + 1)) | {ord(" "), ord("\n")} and ord("\n") in raw
    batch = next(iter(first.train_dataloader()))
    assert batch["inputs"].shape == (3, 32) and int(batch["inputs"].min()) >= 1
    assert np.array_equal(batch["targets"][:, :-1].numpy(), batch["inputs"][:, 1:].numpy())


def test_runs_at_two_settings_keep_their_own_data(tmp_path):
    """The streams are made at prepare time from the settings: each combination has its own folder, so a run at
    another setting neither regenerates the first one's data nor makes it fail as prepared with other settings."""
    small, large = _module(tmp_path), _module(tmp_path, eval_bytes=1200)
    small.prepare_data()
    large.prepare_data()
    small.setup()  # without its own folder: "prepared with other settings" (the large run's)
    large.setup()
    assert np.load(small.root / "val.npy").size == 900 and np.load(large.root / "val.npy").size == 1200


def test_other_generator_seed_gives_other_data(tmp_path):
    rng_a, rng_b = np.random.default_rng(0), np.random.default_rng(1)
    a = synthetic_bytes(2000, rng_a, *make_lexicon(30, rng_a), zipf_a=1.1)
    b = synthetic_bytes(2000, rng_b, *make_lexicon(30, rng_b), zipf_a=1.1)
    assert a.size == b.size == 2000 and not np.array_equal(a, b)


@pytest.mark.parametrize("kw, message", [({"vocab_size": 300}, "data.vocab_size=300"),
                                         ({"zipf_a": 0.0}, "data.zipf_a=0.0"),
                                         ({"train_bytes": 1}, "data.train_bytes=1")])
def test_bad_settings_name_the_key(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        _module(tmp_path, **kw)
