"""Download, generate or verify one task's data: `python scripts/prepare_data.py <task> [key=value ...]`.

<task> is any `configs/data/<task>.yaml` (listops, listops_gen, text, retrieval, image, pathfinder, pathx,
pathfinder_gen, pathx_gen, ...). The data config is composed with Hydra's compose API together with `paths`
(so `paths.data_dir` defaults to `$LONGMIXER_DATA` or `./data`) and `seed`; overrides such as
`data.num_images=2000` or `paths.data_dir=/scratch/data` apply as in training. The datamodule's `prepare_data()`
runs (skipped when a matching manifest exists), then its `setup()` checks that the prepared data reads back, and
the manifest's summary is printed. Every run re-verifies the prepared files against the sha256 recorded in the
manifest, so `make data TASK=<task>` doubles as an integrity check.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from longmixer.utils.compose import CONFIG_DIR

CONFIG_DIR = Path(CONFIG_DIR)


def compose_data(task: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    if not (CONFIG_DIR / "data" / f"{task}.yaml").exists():
        known = sorted(p.stem for p in (CONFIG_DIR / "data").glob("*.yaml"))
        raise SystemExit(f"no data config {task!r}; choose one of {known}")
    from longmixer.utils.resolvers import register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(overrides=[f"+data={task}", "+paths=default", "+seed=0", *overrides])


def summary(manifest: dict) -> str:
    lines = []
    for split, stats in manifest.get("splits", {}).items():
        extra = ", ".join(f"{k}={v}" for k, v in stats.items() if k not in ("count", "labels"))
        lines.append(f"  {split:<6} {stats.get('count', '?'):>8} examples  labels {stats.get('labels')}  {extra}")
    meta = {k: v for k, v in manifest.get("meta", {}).items() if k != "vocab"}
    lines.append(f"  meta   {json.dumps(meta, sort_keys=True)}")
    lines.append(f"  files  {len(manifest.get('files', {}))} (sha256 in manifest.json)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", help="a configs/data/<task>.yaml name")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data.num_images=2000")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from hydra.utils import instantiate

    from longmixer.utils.errors import UserFacingError

    cfg = compose_data(args.task, args.overrides)
    datamodule = instantiate(cfg.data)
    try:
        datamodule.prepare_data()
        checked = datamodule.verify()
        datamodule.setup("fit")
    except (UserFacingError, ValueError, FileNotFoundError) as err:
        # the one-line message a training run ends with, without the library traceback: download and integrity
        # errors, a missing source file, and the readers' errors, which name the file and line of a malformed
        # source. LONGMIXER_TRACEBACK=1 shows the traceback of the other two kinds (a bug may raise them too).
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
