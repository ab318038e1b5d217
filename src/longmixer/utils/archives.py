"""What every tar extraction of the project needs from Python: tarfile's extraction filters (PEP 706), through which
each archive is unpacked with `filter="data"`, so that a member with an absolute path, `..` or a link out of the
folder is never written outside it. The data downloads (`data.download`) and the run-dir packs (`runs.carry`) both
ask here, each adding its own way out."""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path


def tar_filters_missing(archive: str | Path) -> str | None:
    """Why this Python cannot unpack `archive` safely, or None where it can. The filters came with Python 3.10.12,
    3.11.4 and 3.12; `requires-python` cannot say "3.10.12 or 3.11.4", and without them `filter="data"` stops the
    extraction with a TypeError traceback."""
    if hasattr(tarfile, "data_filter"):
        return None
    version = ".".join(map(str, sys.version_info[:3]))
    return (f"Python {version} cannot unpack {archive} safely: its tarfile lacks the extraction filters (Python "
            "3.10.12, 3.11.4 or 3.12 and later) that keep a member from being written outside the folder")
