"""Logger factories: W&B offline by default, resumable under the same run id."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def wandb_run_id(save_dir: str | Path) -> str:
    """The run dir's W&B id: read from `<save_dir>/wandb_id.txt`, or made and stored there, so a resumed run
    (same run dir) continues the same W&B run."""
    path = Path(save_dir) / "wandb_id.txt"
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:12]
    path.write_text(run_id)
    return run_id


def wandb_logger(project: str, save_dir: str, run_name: str, seed: int, tags=(), group: str | None = None,
                 entity: str | None = None, model_name: str | None = None, data_name: str | None = None):
    """A `WandbLogger` named `<run_name>-seed<seed>`, grouped by run name, tagged; offline unless the user set
    `WANDB_MODE` or an API key (`WANDB_API_KEY`). The full resolved config is sent by the entry point."""
    from pytorch_lightning.loggers import WandbLogger

    online = "WANDB_MODE" in os.environ or "WANDB_API_KEY" in os.environ
    mode = os.environ.get("WANDB_MODE", "online") if online else "offline"
    return WandbLogger(project=project, entity=entity, save_dir=save_dir, name=f"{run_name}-seed{seed}",
                       group=group, tags=[*tags, *(t for t in (model_name, data_name) if t), f"seed{seed}"], id=wandb_run_id(save_dir), resume="allow",
                       mode=mode)
