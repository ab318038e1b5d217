"""The entry points against a reader that stops early (`longmixer-runs | head -1`): `utils.cli`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from longmixer.utils.cli import CLOSED_PIPE_EXIT, quiet_on_closed_stdout

ROOT = Path(__file__).resolve().parents[2]


def _with_closed_stdout(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run `python <args>` with stdout a pipe whose reader is already gone: every write to it fails (EPIPE), as one
    does after `head -1` has read its line and exited."""
    read, write = os.pipe()
    os.close(read)
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        return subprocess.run([sys.executable, *args], stdout=write, stderr=subprocess.PIPE, text=True, cwd=cwd,
                              env=env, timeout=300)
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [
    pytest.param(["-m", "longmixer.report.runs", "--runs", "runs"], id="runs-listing"),
    pytest.param(["-m", "longmixer.train", "--cfg", "job"], id="train-cfg-job"),
    pytest.param(["-m", "longmixer.runs.carry", "pack", "runs", "--out", "parts"], id="carry-pack"),
])
def test_a_reader_that_stops_early_ends_the_command_quietly(args, tmp_path):
    """Regression: `longmixer-runs | head -1` (and `longmixer-train --cfg job | head -1`, `longmixer-bench`'s table,
    prepare_data's summary) ended in a BrokenPipeError traceback once `head` had closed the pipe. The command now
    ends with no output on stderr and the status a shell gives a program killed by SIGPIPE."""
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "config_resolved.yaml").write_text("seed: 0\n")
    result = _with_closed_stdout(args, tmp_path)
    assert "BrokenPipeError" not in result.stderr, result.stderr
    assert "Exception ignored" not in result.stderr, result.stderr
    assert result.returncode == CLOSED_PIPE_EXIT, result.stderr


def test_a_broken_pipe_other_than_stdout_is_raised():
    """Only a closed stdout is a reader that stopped listening: a BrokenPipeError from a socket or a worker's pipe
    keeps its traceback."""
    @quiet_on_closed_stdout
    def main():
        raise BrokenPipeError("a worker's pipe")

    with pytest.raises(BrokenPipeError, match="a worker's pipe"):
        main()


def test_the_listing_csv_is_written_before_the_listing_is_cut_short(tmp_path):
    """`longmixer-runs --csv` wrote its CSV after printing, so a reader that stopped early left no CSV."""
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "config_resolved.yaml").write_text("seed: 0\n")
    result = _with_closed_stdout(["-m", "longmixer.report.runs", "--runs", "runs", "--csv", "runs.csv"], tmp_path)
    assert result.returncode == CLOSED_PIPE_EXIT, result.stderr
    assert (tmp_path / "runs.csv").read_text().startswith("run,status")
