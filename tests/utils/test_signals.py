"""The stop signals (`utils.signals`) against what our SLURM launcher asks SLURM to send."""

import re
import signal

from longmixer.utils.signals import STOP_SIGNALS


def test_slurm_launcher_pre_timeout_signal_is_a_stop_signal():
    """Regression: `hydra/launcher=slurm` submits with `--signal=USR2@120` (submitit's choice), but the run stopped
    with a checkpoint only on SIGTERM and SIGINT; submitit's own USR2 handler ended the job mid-step two minutes
    before the time limit, without a checkpoint, so everything since the last `last.ckpt` was lost. The sbatch line
    is built by submitit's own function from the composed launcher config."""
    from submitit.slurm.slurm import _make_sbatch_string

    from longmixer.utils.compose import compose

    launcher = compose(["hydra/launcher=slurm", "hydra.launcher.partition=gpu"], hydra_config=True).hydra.launcher
    sbatch = _make_sbatch_string(command="python -m longmixer.train", folder="/tmp/submitit",
                                 signal_delay_s=launcher.signal_delay_s)
    name, delay = re.search(r"^#SBATCH --signal=(\w+)@(\d+)$", sbatch, re.M).groups()
    assert signal.Signals["SIG" + name] in STOP_SIGNALS
    assert int(delay) == launcher.signal_delay_s > 0


def test_a_platform_without_sigusr2_still_imports_the_stop_signals(monkeypatch):
    """Windows' `signal` has no SIGUSR2: naming it outright made every entry point fail at import there."""
    import importlib

    import longmixer.utils.signals as signals

    monkeypatch.delattr(signal, "SIGUSR2")
    try:
        assert importlib.reload(signals).STOP_SIGNALS == (signal.SIGTERM, signal.SIGINT)
    finally:
        monkeypatch.undo()
        importlib.reload(signals)
    assert signals.STOP_SIGNALS == (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
