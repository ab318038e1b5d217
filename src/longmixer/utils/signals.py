"""The signals that stop a run with a checkpoint (callbacks/checkpoint.py) and that its DataLoader workers leave to
it (data/base.py).

- SIGTERM: what SLURM sends at the time limit, on `scancel` and on preemption (then SIGKILL after its grace time);
  also coreutils' `timeout`.
- SIGINT: Ctrl+C.
- SIGUSR2: SLURM's warning before the time limit. Our SLURM launcher (`configs/hydra/launcher/slurm.yaml`, through
  submitit) submits with `--signal=USR2@<signal_delay_s>`, so the run checkpoints while the job still has time
  left. USR2 rather than Lightning's SLURM default, USR1 (`SLURMEnvironment.requeue_signal`): submitit asks for
  USR2 and warns that NCCL may catch USR1. Lightning's own USR1 handler saves `hpc_ckpt_<n>.ckpt` from inside the
  handler, mid-step, where `resume=auto` continues from `last.ckpt`, so it is not the path we use.
"""

from __future__ import annotations

import signal

# SIGUSR2 where the platform has it (not on Windows, where SLURM does not run either)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR2") if hasattr(signal, name))
