"""The console scripts of pyproject.toml resolve to callables, and the argparse ones answer --help."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # the standard library from Python 3.11

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _resolve(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_the_documented_scripts_are_declared():
    assert {"longmixer-train", "longmixer-evaluate", "longmixer-report", "longmixer-runs",
            "longmixer-bench"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_entry_point_resolves(name):
    assert callable(_resolve(SCRIPTS[name])), SCRIPTS[name]


@pytest.mark.parametrize("name", ["longmixer-report", "longmixer-runs", "longmixer-bench"])
def test_argparse_scripts_answer_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _resolve(SCRIPTS[name])(["--help"])
    assert exit_info.value.code == 0 and "usage" in capsys.readouterr().out
