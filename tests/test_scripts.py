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


def test_parity_cases_filter_runs_only_the_named_case(monkeypatch, capsys):
    """scripts/bench/parity.py --cases: one case, in the Triton interpreter (the GPU runs all of them)."""
    import importlib.util

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("parity", ROOT / "scripts" / "bench" / "parity.py")
    parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parity)
    assert parity.main(["--quick", "--no-compile", "--cases", "ema bidirectional=False"]) == 0
    out = capsys.readouterr().out
    assert "| ema bidirectional=False | fp32 | eager |" in out and "1 passed, 0 failed" in out
    assert "linear_attention" not in out
