"""Imports flow one way (STYLE.md section 2.1): each package may import only the longmixer packages listed here."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "longmixer"
ALLOWED = {
    "utils": {"utils"},
    "ops": {"ops", "utils"},
    "layers": {"layers", "ops", "utils"},
    "mixers": {"mixers", "layers", "ops", "utils"},
    "models": {"models", "layers", "utils"},
    "tasks": {"tasks", "utils"},
    "data": {"data", "utils"},
    "callbacks": {"callbacks", "utils"},
    "report": {"report", "utils"},
    "runs": {"runs", "utils"},
    "configs": set(),  # yaml only: the package exists so Hydra can find pkg://longmixer.configs
}
ENTRY_POINTS = {"train", "evaluate", "bench", "__init__"}
HEAVY = {"hydra", "omegaconf", "wandb", "datasets"}  # absent on the GPU machine; ops/layers/mixers must not need them


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _modules():
    return sorted(p for p in SRC.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_flow_one_way(path):
    rel = path.relative_to(SRC)
    package = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else rel.stem
    for name in _imports(path):
        if not name.startswith("longmixer."):
            if package in ("ops", "layers", "mixers"):
                assert name.split(".")[0] not in HEAVY, f"{rel} imports {name}, which the GPU machine lacks"
            continue
        target = name.split(".")[1]
        allowed = {"utils", "runs"} if package in ENTRY_POINTS else ALLOWED[package]  # entry points build objects from _target_
        assert target in allowed, f"{rel} (package {package}) must not import {name}"


def test_ops_layers_mixers_import_without_the_config_stack():
    """The GPU machine has no omegaconf, hydra, wandb or datasets: every module of ops, layers, mixers and models
    imports without them, also through indirect imports (a fresh interpreter with those packages blocked)."""
    import subprocess
    import sys

    code = (
        "import sys, importlib, pkgutil\n"
        f"for m in {sorted(HEAVY)!r}: sys.modules[m] = None\n"
        "bad = []\n"
        "for pkg in ('longmixer.ops', 'longmixer.layers', 'longmixer.mixers', 'longmixer.models'):\n"
        "    p = importlib.import_module(pkg)\n"
        "    for info in pkgutil.walk_packages(p.__path__, pkg + '.'):\n"
        "        try:\n"
        "            importlib.import_module(info.name)\n"
        "        except ImportError as exc:\n"
        "            bad.append(f'{info.name}: {exc}')\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n")
    env_path = str(SRC.parent)
    import os

    env = {**os.environ, "PYTHONPATH": env_path + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, f"modules that need a heavy package:\n{out.stdout}{out.stderr[-2000:]}"
