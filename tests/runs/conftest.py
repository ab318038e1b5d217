"""The uninterrupted tiny run that the kill-and-resume tests compare with."""

import pytest

from tests.runs.helpers import describe, run_dir_of, run_train


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The run dir of one uninterrupted tiny run, made once per test process. Session-scoped: xdist interleaves
    modules on a worker, and a module-scoped fixture was torn down and rerun (13 s each) every time the worker came
    back to one of its modules. Its users only read it, or write beside its files (eval/, a rerun's log lines)."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = run_train(tmp, [])
    assert proc.returncode == 0, describe(proc)
    return run_dir_of(tmp)
