"""The run-dir hash (`lm.run_hash`): which command lines share a run dir."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from longmixer.utils.compose import CONFIG_DIR
from longmixer.utils.resolvers import _run_hash

# the keys configs/hydra/default.yaml leaves out of the hash, as a run passes them
EXCLUDE = list(OmegaConf.load(Path(CONFIG_DIR) / "hydra" / "default.yaml").job.config.override_dirname.exclude_keys)


@pytest.mark.parametrize("overrides, pinned", [
    (["model.d_model=64"], "61502f457b"),
    (["model=mega_chunk", "optim.lr=2e-3", "trainer.max_steps=100", "+model.mixer.truncation=64", "~callbacks.ema",
      "seed=3", "model@foo=bar", "data.seq_len=[1,2]"], "ca99ce2402"),
])
def test_a_command_line_without_a_repeated_key_keeps_its_run_dir(overrides, pinned):
    """The hashes these commands had before repeated keys were counted by their last value: a change of the hash
    would orphan every existing run dir (a rerun would start over in a new dir instead of resuming)."""
    assert _run_hash(overrides, EXCLUDE) == pinned
    assert _run_hash(list(reversed(overrides)), EXCLUDE) == pinned


def test_a_repeated_key_is_hashed_by_the_value_that_wins():
    """`X=a X=b` runs with b and `X=b X=a` with a: they were hashed as the same set of both and shared a run dir,
    while `X=b` alone, the same run as the first, got another."""
    first = _run_hash(["model.d_model=-3", "model.d_model=32"], EXCLUDE)
    assert first == _run_hash(["model.d_model=32"], EXCLUDE)
    assert _run_hash(["model.d_model=32", "model.d_model=-3"], EXCLUDE) == _run_hash(["model.d_model=-3"], EXCLUDE)
    assert _run_hash(["model.d_model=32", "model.d_model=-3"], EXCLUDE) != first
    # the last of an add and a set, of a set and a delete; a group's packages are separate keys
    assert _run_hash(["+model.mixer.truncation=8", "model.mixer.truncation=16"], EXCLUDE) == \
        _run_hash(["model.mixer.truncation=16"], EXCLUDE)
    assert _run_hash(["optim.eps=1e-6", "~optim.eps"], EXCLUDE) == _run_hash(["~optim.eps"], EXCLUDE)
    assert _run_hash(["model=mega", "model@foo=bar"], EXCLUDE) != _run_hash(["model@foo=bar"], EXCLUDE)
