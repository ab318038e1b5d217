"""Download, generate or verify one task's data: `python scripts/prepare_data.py <task> [key=value ...]`.

<task> is any `configs/data/<task>.yaml` (listops, listops_gen, text, retrieval, image, pathfinder, pathx,
pathfinder_gen, pathx_gen, ...). The config is composed as training composes it (`data=<task>` and the overrides,
so `paths.data_dir` defaults to `$LONGMIXER_DATA` or `./data`) and checked as training checks it; overrides such as
`data.num_images=2000` or `paths.data_dir=/scratch/data` apply as in training. The datamodule's `prepare_data()`
runs (skipped when a matching manifest exists), then its `setup()` checks that the prepared data reads back, and
the manifest's summary is printed. Every run re-verifies the prepared files against the sha256 recorded in the
manifest, so `make data TASK=<task>` doubles as an integrity check. A mistake in the command (an unknown task or
key, a refused value) and a data error end in one line, `error: ...`, with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from longmixer.utils.cli import quiet_on_closed_stdout
from longmixer.utils.compose import CONFIG_DIR

CONFIG_DIR = Path(CONFIG_DIR)


def compose_data(task: str, overrides: list[str]):
    """The training config with `data=<task>` and `overrides`, composed as `python -m longmixer.train` composes it.

    Raises:
        ConfigError: no `configs/data/<task>.yaml`.
        HydraException: an override Hydra refuses.
    """
    import difflib

    from longmixer.utils.compose import compose
    from longmixer.utils.config import ConfigError

    if not (CONFIG_DIR / "data" / f"{task}.yaml").exists():
        known = sorted(p.stem for p in (CONFIG_DIR / "data").glob("*.yaml"))
        close = difflib.get_close_matches(task, known, n=1)
        raise ConfigError(f"no data config {task!r}" + (f" (did you mean {close[0]}?)" if close else "")
                          + f"; choose one of {', '.join(known)}")
    return compose([f"data={task}", *overrides])


def summary(manifest: dict) -> str:
    lines = []
    for split, stats in manifest.get("splits", {}).items():
        extra = ", ".join(f"{k}={v}" for k, v in stats.items() if k not in ("count", "labels"))
        lines.append(f"  {split:<6} {stats.get('count', '?'):>8} examples  labels {stats.get('labels')}  {extra}")
    meta = {k: v for k, v in manifest.get("meta", {}).items() if k != "vocab"}
    lines.append(f"  meta   {json.dumps(meta, sort_keys=True)}")
    lines.append(f"  files  {len(manifest.get('files', {}))} (sha256 in manifest.json)")
    return "\n".join(lines)


@quiet_on_closed_stdout
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", help="a configs/data/<task>.yaml name")
    # default=[]: without a default, argparse counts a `*` positional as required and names it in the missing-task error
    parser.add_argument("overrides", nargs="*", default=[], help="Hydra overrides, e.g. data.num_images=2000")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from hydra.errors import HydraException

    from longmixer.runs.run import instantiate_node
    from longmixer.utils.compose import override_hint
    from longmixer.utils.config import validate_config
    from longmixer.utils.errors import UserFacingError

    try:
        cfg = compose_data(args.task, args.overrides)
    except HydraException as err:
        # Hydra's own message names no keys; override_hint's line says which keys there are (as train's)
        hint = override_hint([f"data={args.task}", *args.overrides])
        for line in (hint or str(err).splitlines()[0]).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    except UserFacingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        validate_config(cfg)
        datamodule = instantiate_node(cfg.data)
        datamodule.prepare_data()
        checked = datamodule.verify()
        datamodule.setup("fit")
    except (UserFacingError, ValueError, FileNotFoundError) as err:
        # the one-line message a training run ends with, without the library traceback: config refusals,
        # download and integrity errors, a missing source file, and the readers' errors, which name the file and
        # line of a malformed source. LONGMIXER_TRACEBACK=1 shows the traceback of the other two kinds (a bug may
        # raise them too).
        if not isinstance(err, UserFacingError) and os.environ.get("LONGMIXER_TRACEBACK") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)
        if not isinstance(err, UserFacingError):
            print("(LONGMIXER_TRACEBACK=1 shows where it was raised)", file=sys.stderr)
        return 2
    print(f"{args.task}: prepared at {datamodule.root} ({checked} files match their sha256)")
    print(summary(datamodule.manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
