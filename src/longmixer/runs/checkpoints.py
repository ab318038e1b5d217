"""Reading checkpoints safely: `torch.load(weights_only=True)` only, intact-file checks, and the choice of the
checkpoint a run resumes from.

A checkpoint is data, never code: every read goes through the restricted unpickler of `weights_only=True`, which
refuses any global it was not told about. What our checkpoints hold beyond tensors and builtins (the `longmixer`
RNG state is tuples of ints and tensors; Lightning's loop and callback states are dicts of numbers and strings) loads
without an allowlist; `ALLOWED_GLOBALS` lists the few extra types and is registered once with
`torch.serialization.add_safe_globals`. Paths stored inside a checkpoint (ModelCheckpoint's `best_model_path`) are
only used after checking they name a file in the run's own checkpoint dir, and that file is again loaded with
`weights_only=True`.
"""

from __future__ import annotations

import logging
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from longmixer.utils.errors import UserFacingError

log = logging.getLogger("longmixer")

ALLOWED_GLOBALS: list[Any] = []  # nothing beyond torch's own weights_only set is needed by our checkpoints


class CheckpointError(UserFacingError, RuntimeError):
    """A checkpoint file is unreadable or refused by the safe loader; the message names the file."""


class CheckpointAccessError(UserFacingError, OSError):
    """The operating system could not read a checkpoint file (permissions, an I/O error of its filesystem): nothing
    is known of its content, so unlike a `CheckpointError` it is never skipped as damaged; the message names it."""


def register_safe_globals() -> None:
    if ALLOWED_GLOBALS:
        torch.serialization.add_safe_globals(ALLOWED_GLOBALS)


def load_checkpoint(path: str | Path, mmap: bool = False) -> dict:
    """`torch.load(path, weights_only=True)` on CPU, with errors that name the file. `mmap`: tensors are mapped
    from the file rather than read, for a look at the step or the shapes of a file already checked whole.

    Raises:
        CheckpointError: the file is truncated/corrupt, or holds objects outside the allowlist (a crafted file).
        CheckpointAccessError: the file could not be read at all (permission denied, an I/O error).
    """
    register_safe_globals()
    try:
        if mmap:
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # a file in torch's legacy (non-zip) format cannot be mapped
                pass
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"refused to load {path}: it is corrupt, or holds objects outside the weights-only "
                              f"allowlist (a checkpoint is data, never code): {_unpickler_reason(err)}") from err
    except MemoryError:
        raise  # not the file's fault: a resume must not skip a good checkpoint for it
    except (IsADirectoryError, NotADirectoryError) as err:
        raise CheckpointError(f"cannot read checkpoint {path} ({type(err).__name__}): it is no file") from err
    except OSError as err:
        # not the file's fault either: a resume that skipped it would go back to an older checkpoint and, at its
        # next save, replace this one, which may well be intact
        raise CheckpointAccessError(f"cannot read checkpoint {path} ({type(err).__name__}: {err}); its content was "
                                    "not checked, so nothing falls back to an older checkpoint: make it readable "
                                    "(permissions, the filesystem) and run the command again") from err
    except Exception as err:  # any file that is no checkpoint: the safe unpickler of a text or other non-zip
        # file raises KeyError / IndexError / TypeError as well as the usual read errors
        raise CheckpointError(f"cannot read checkpoint {path} ({type(err).__name__}: {err}); it is truncated, "
                              "corrupt or not a checkpoint") from err


# what every Lightning load of a checkpoint reads first (its version, for the migration of older files; the weights)
LIGHTNING_KEYS = ("pytorch-lightning_version", "state_dict")


def check_lightning_checkpoint(state: Any, path: str | Path) -> None:
    """Refuse a file that loads but is not a Lightning checkpoint (a bare `state_dict`, or weights converted by hand
    without Lightning's version), which Lightning's load would stop at with a bare `KeyError` traceback.

    Raises:
        CheckpointError: names the file, the missing keys and how to make the file one.
    """
    missing = [k for k in LIGHTNING_KEYS if k not in state] if isinstance(state, dict) else list(LIGHTNING_KEYS)
    if missing:
        held = f"a {type(state).__name__}" if not isinstance(state, dict) else f"keys {sorted(map(str, state))[:4]}"
        raise CheckpointError(f"{path} is not a Lightning checkpoint: it holds {held}, without {', '.join(missing)}; "
                              "pass one written by train, or save converted weights as {'state_dict': <the task's "
                              "weights>, 'pytorch-lightning_version': pytorch_lightning.__version__}")


def not_a_checkpoint_file(path: Path) -> str | None:
    """Why `path`, given as `ckpt_path`, names no checkpoint file ("does not exist", or a directory with the files in
    it to name instead); None when it is a file."""
    if path.is_file():
        return None
    if not path.is_dir():
        return "does not exist"
    inside = sorted(path.glob("*.ckpt"))
    example = f"e.g. {inside[-1].name}" if inside else "it holds none"
    return f"is a directory, not a checkpoint file: name one of its .ckpt files ({example})"


def check_weights_fit(module: torch.nn.Module, state: dict, path: str | Path, fix: str) -> None:
    """Refuse a checkpoint whose weights are not `module`'s (another family's, or the same family at another width)
    before Lightning's strict load dumps every key or every size mismatch.

    Raises:
        CheckpointError: names the file, the first differences and `fix`.
    """
    wanted = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    weights = state.get("state_dict", {}) if isinstance(state, dict) else {}
    found = {k: tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)}
    missing, unexpected = sorted(wanted.keys() - found.keys()), sorted(found.keys() - wanted.keys())
    if missing or unexpected:
        raise CheckpointError(f"{path} does not hold this model's weights: {len(missing)} of its parameters are "
                              f"missing (e.g. {missing[:2]}) and {len(unexpected)} are not its own (e.g. "
                              f"{unexpected[:2]}); {fix}")
    resized = [f"{k} {found[k]} (the model's: {wanted[k]})" for k in sorted(wanted) if found[k] != wanted[k]]
    if resized:
        raise CheckpointError(f"{path} holds weights of another size than this model's: {len(resized)} differ, e.g. "
                              f"{'; '.join(resized[:2])}; {fix}")


def check_model_config(state: dict, model_cfg: dict, path: str | Path, source: str, fix: str) -> None:
    """Refuse a checkpoint whose recorded model config (`checkpoint["longmixer"]["model_config"]`, written by train)
    differs from `model_cfg`, the one about to be built, in a key that changes what the model computes: variants
    whose weights have the same shapes (LaS and LaS-chunk, MEGA with another attention) load into each other's model
    without an error and score wrongly. Dropout (off in evaluation) and the kernel backend (the same function) may
    differ. A checkpoint without the record (an earlier version's) is loaded with a warning.

    Raises:
        CheckpointError: names the file, the differing keys with both values, `source` (where `model_cfg` comes
            from) and `fix`.
    """
    recorded = (state.get("longmixer") or {}).get("model_config")
    if recorded is None:
        log.warning("%s holds no record of the model config it was trained with (a checkpoint of an earlier "
                    "version): that it is a checkpoint of %s's model is not checked", path, source)
        return
    theirs, ours = _flat(recorded), _flat(model_cfg)
    differ = [k for k in sorted(theirs.keys() | ours.keys()) if theirs.get(k) != ours.get(k)
              and "dropout" not in k.rsplit(".", 1)[-1] and k.rsplit(".", 1)[-1] != "backend"]
    if differ:
        listing = "; ".join(f"model.{k}={theirs.get(k)} in the checkpoint, {ours.get(k)} in the run's"
                            for k in differ[:3])
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        raise CheckpointError(f"{path} was trained with another model config than {source}'s: {listing}{more}; "
                              f"{fix}")


def _flat(node: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted key: value}."""
    flat = {}
    for key, value in node.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _unpickler_reason(err: Exception) -> str:
    """What the weights-only unpickler refused (the global it met), without torch's advice around it to load the
    file with `weights_only=False`, which this project never does."""
    for line in str(err).splitlines():
        line = line.strip().removeprefix("WeightsUnpickler error:").strip()
        if "weights_only" in line or line.startswith(("Weights only load failed", "Check the documentation")):
            continue
        if line:
            # "Unsupported global: GLOBAL io.open was not an allowed global by default. Please use ..."
            return re.split(r"(?<=\.) Please use", line)[0]
    return "no reason given"


def is_intact(path: Path) -> bool:
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as err:
        log.warning("%s", err)
        return False
    if not (isinstance(ckpt, dict) and "state_dict" in ckpt and "global_step" in ckpt):
        log.warning("%s loads but is not a Lightning checkpoint (no state_dict / global_step)", path)
        return False
    return True


def newest_intact(ckpt_dir: Path) -> Path | None:
    """`last.ckpt` if it loads; else the intact `*.ckpt` with the highest global step (a warning names what was
    skipped); None if the dir holds no checkpoint. A file the OS cannot read (`CheckpointAccessError`) is not
    skipped: it stops the resume."""
    last = ckpt_dir / "last.ckpt"
    if last.exists() and is_intact(last):
        return last
    others = []
    for path in ckpt_dir.glob("*.ckpt"):
        if path == last:
            continue
        try:
            others.append((int(load_checkpoint(path)["global_step"]), path))
        except (CheckpointError, KeyError, TypeError, ValueError) as err:
            log.warning("skipping checkpoint %s: %s", path, err)
    if not others:
        if last.exists():
            raise CheckpointError(f"{last} is corrupt and {ckpt_dir} holds no other intact checkpoint; delete the "
                                  "run dir (or pass run_tag=<name>) to start over")
        return None
    step, newest = max(others)
    if last.exists():
        log.warning("%s is corrupt: resuming from the newest intact checkpoint %s (step %d)", last, newest, step)
    return newest


def trusted_best_path(path: str | None, ckpt_dir: Path) -> str | None:
    """`path` (a best-checkpoint path read from a checkpoint or callback) if it is a file inside `ckpt_dir`.

    Raises:
        CheckpointError: the path points outside the run's checkpoint dir.
    """
    if not path:
        return None
    resolved = Path(path).resolve()
    if resolved.parent != ckpt_dir.resolve() or resolved.suffix != ".ckpt":
        raise CheckpointError(f"best checkpoint path {path} is not a .ckpt file in {ckpt_dir}: refusing to load a "
                              "path taken from a checkpoint")
    if not resolved.is_file():
        raise CheckpointError(f"best checkpoint {path} does not exist")
    return str(resolved)
