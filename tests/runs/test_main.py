"""`python -m longmixer.runs` (`runs/__main__.py`), a name one types for the runs listing."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_python_m_longmixer_runs_names_the_commands_there_are():
    """Regression: `python -m longmixer.runs` ended in Python's "'longmixer.runs' is a package and cannot be
    directly executed", though the runs listing is `python -m longmixer.report.runs`. It now names the commands
    that exist, in one line with exit status 2."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "longmixer.runs"], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: ")
    named = re.findall(r"python -m ([\w.]+)", result.stderr)
    assert named == ["longmixer.report.runs", "longmixer.runs.carry"]
    assert all(importlib.util.find_spec(module) for module in named)
    assert "longmixer-runs = \"longmixer.report.runs:cli\"" in (ROOT / "pyproject.toml").read_text()
