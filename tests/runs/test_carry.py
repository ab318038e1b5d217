"""Carrying run dirs between machines in size-bounded parts (longmixer.runs.carry): the round trip is exact, a
broken or foreign pack is refused before anything is written, and a run stopped on one machine and unpacked under
another root resumes to the result of a run that was never stopped."""

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from longmixer.runs import carry
from longmixer.runs.carry import CarryError, pack, unpack
from tests.runs.helpers import TINY, describe, run_dir_of, run_train
from tests.runs.test_kill_resume import assert_same_run


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "logs"
    (root / "listops_chela" / "checkpoints").mkdir(parents=True)
    (root / "listops_chela" / "checkpoints" / "last.ckpt").write_bytes(bytes(range(256)) * 700)
    (root / "listops_chela" / "checkpoints" / "epoch=1-step=500.ckpt").write_bytes(b"\x01" * 90_000)
    (root / "listops_chela" / "checkpoints" / "last.ckpt.tmp").write_bytes(b"half written")
    (root / "listops_chela" / ".lock").write_bytes(b"")
    (root / "listops_chela" / ".lock.owner").write_text("pid 1")
    (root / "listops_chela" / "csv").mkdir()
    (root / "listops_chela" / "csv" / "metrics.csv").write_text("step,val/acc\n249,0.16\n")
    (root / "listops_chela.log").write_text("step 250\n")
    return root


def test_round_trip_is_exact_and_leaves_out_temporary_and_lock_files(runs, tmp_path):
    parts = pack(runs, tmp_path / "state", part_mib=0.05)
    assert len(parts) >= 4 and all(p.stat().st_size <= 0.05 * 2**20 for p in parts)
    assert all(carry.PART_RE.match(p.name) for p in parts)
    unpack(tmp_path / "state", tmp_path / "elsewhere")
    expected = {k: v for k, v in _tree(runs).items() if not k.endswith((".tmp", ".lock", ".lock.owner"))}
    assert _tree(tmp_path / "elsewhere") == expected


def test_last_only_leaves_out_the_best_checkpoint(runs, tmp_path):
    pack(runs, tmp_path / "state", last_only=True)
    unpack(tmp_path / "state", tmp_path / "out")
    ckpts = sorted(p.name for p in (tmp_path / "out").rglob("*.ckpt"))
    assert ckpts == ["last.ckpt"]


def test_unpack_replaces_older_files_in_place(runs, tmp_path):
    dest = tmp_path / "dest"
    (dest / "listops_chela" / "csv").mkdir(parents=True)
    (dest / "listops_chela" / "csv" / "metrics.csv").write_text("stale")
    pack(runs, tmp_path / "state")
    unpack(tmp_path / "state", dest)
    assert (dest / "listops_chela" / "csv" / "metrics.csv").read_text() == "step,val/acc\n249,0.16\n"


def test_a_missing_part_is_named(runs, tmp_path):
    parts = pack(runs, tmp_path / "state", part_mib=0.05)
    parts[1].unlink()
    with pytest.raises(CarryError, match=r"part\(s\) \[2\] of \d+ .* missing"):
        unpack(tmp_path / "state", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_python_without_tarfiles_filters_is_named_before_anything_is_written(runs, tmp_path, monkeypatch):
    """Python 3.10.0-3.10.11 and 3.11.0-3.11.3 (admitted by requires-python) lack tarfile's extraction filters, and
    `filter="data"` stopped the unpack with a TypeError; it is one line naming the Python and the fix."""
    pack(runs, tmp_path / "state")
    monkeypatch.delattr(tarfile, "data_filter")
    with pytest.raises(CarryError, match=r"Python [\d.]+ cannot unpack .*state safely.*unpack with a newer Python"):
        unpack(tmp_path / "state", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_truncated_part_fails_the_digest_before_anything_is_written(runs, tmp_path):
    parts = pack(runs, tmp_path / "state", part_mib=0.05)
    parts[-1].write_bytes(parts[-1].read_bytes()[:-10])
    with pytest.raises(CarryError, match="digest"):
        unpack(tmp_path / "state", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_parts_of_two_packs_in_one_folder_are_refused(runs, tmp_path):
    pack(runs, tmp_path / "state")
    (runs / "listops_chela.log").write_text("step 500\n")
    pack(runs, tmp_path / "state")
    with pytest.raises(CarryError, match="parts of 2 packs"):
        unpack(tmp_path / "state", tmp_path / "out")


def test_too_many_parts_are_refused_with_the_largest_files_named(runs, tmp_path):
    with pytest.raises(CarryError, match=r"more than max_parts=2.*last\.ckpt"):
        pack(runs, tmp_path / "state", part_mib=0.05, max_parts=2)
    assert not (tmp_path / "state").exists()


def test_a_pack_that_escapes_its_destination_is_refused(tmp_path):
    """A tar member with `..` in its path would write outside the destination: the data filter refuses it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    data = buf.getvalue()
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / f"runs-{hashlib.sha256(data).hexdigest()[:16]}-1of1.tar-part").write_bytes(data)
    with pytest.raises(CarryError, match="refused member"):
        unpack(tmp_path / "state", tmp_path / "dest")
    assert not (tmp_path / "escaped.txt").exists()


def test_cli_reports_errors_with_exit_code_2(tmp_path, capsys):
    assert carry.main(["unpack", str(tmp_path), "--into", str(tmp_path / "x")]) == 2
    assert "no '<name>-<digest>-<i>of<n>.tar-part' files" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_stopped_on_one_machine_resumes_on_another_to_the_uninterrupted_result(reference, tmp_path):
    """The device workflow: SIGTERM on machine A, pack its logs, unpack into machine B's logs (another root, where
    the data is generated again from its seed), run the same command there. Both run it from their own root with
    the default paths (./data, ./logs), as the same command on two checkouts does."""
    machine_a, machine_b = tmp_path / "a", tmp_path / "b"
    stopped = run_train(machine_a, TINY, fault="SIGTERM:train:9", tiny=False)
    assert stopped.returncode == 143, describe(stopped)
    assert carry.main(["pack", str(machine_a / "logs"), "--out", str(tmp_path / "state"), "--part-mib", "0.2"]) == 0
    assert carry.main(["unpack", str(tmp_path / "state"), "--into", str(machine_b / "logs")]) == 0
    resumed = run_train(machine_b, TINY, tiny=False)
    assert resumed.returncode == 0, describe(resumed)
    run_dir = run_dir_of(machine_b)
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'}" in (run_dir / "train.log").read_text()
    assert_same_run(reference, run_dir, mid_epoch=True)


def test_a_moved_run_dir_is_no_config_drift_but_a_changed_value_still_is():
    from longmixer.runs.resume import config_drift

    def cfg(root, lr):
        return {"paths": {"output_dir": f"{root}/runs/x"}, "trainer": {"default_root_dir": f"{root}/runs/x"},
                "callbacks": {"checkpoint": {"dirpath": f"{root}/runs/x/checkpoints"}},
                "data": {"data_dir": "./data/listops"}, "optim": {"lr": lr}}

    assert config_drift(cfg("/machine_a/logs", 1e-3), cfg("/machine_b/logs", 1e-3)) == {}
    assert config_drift(cfg("/machine_a/logs", 1e-3), cfg("/machine_b/logs", 2e-3)) == {"optim.lr": (1e-3, 2e-3)}
    # a path outside the run dir is compared as it is
    moved_data = {**cfg("/machine_b/logs", 1e-3), "data": {"data_dir": "/elsewhere/listops"}}
    assert set(config_drift(cfg("/machine_a/logs", 1e-3), moved_data)) == {"data.data_dir"}


def _learning_curves():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "learning_curves.py"
    spec = importlib.util.spec_from_file_location("learning_curves", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_learning_curves_state_falls_back_to_last_only_then_to_nothing(runs, tmp_path, monkeypatch, capsys):
    """`--state-out` keeps within the channel: the full pack (last + best) needs 4 parts of 0.1 MiB, last-only 2."""
    lc = _learning_curves()
    monkeypatch.setattr(lc, "pack", lambda *a, **k: pack(*a, part_mib=0.1, **k))
    (runs / "listops_chela" / "checkpoints" / "epoch=1-step=500.ckpt").write_bytes(b"\x01" * 150_000)
    lc.carry_state(runs, tmp_path / "full", max_parts=4)
    unpack(tmp_path / "full", tmp_path / "a")
    assert len(list((tmp_path / "a").rglob("*.ckpt"))) == 2
    lc.carry_state(runs, tmp_path / "last", max_parts=2)
    assert "retrying with last.ckpt only" in capsys.readouterr().err
    unpack(tmp_path / "last", tmp_path / "b")
    assert [p.name for p in (tmp_path / "b").rglob("*.ckpt")] == ["last.ckpt"]
    lc.carry_state(runs, tmp_path / "none", max_parts=1)
    assert "not packed" in capsys.readouterr().err and not (tmp_path / "none").exists()


def test_a_finished_run_moved_elsewhere_is_evaluated_from_its_own_checkpoints(reference, tmp_path):
    """results.json names the best checkpoint by its path on the first machine; evaluate finds it in the moved run
    dir's own checkpoints/ and scores it the same."""
    pack(reference.parents[2], tmp_path / "state")  # <tmp>/logs/runs/<run_name>/<hash>_seed0 -> the whole logs/runs
    unpack(tmp_path / "state", tmp_path / "moved")
    (moved,) = [p.parent for p in (tmp_path / "moved").rglob("results.json") if "eval" not in p.parts]
    proc = run_train(tmp_path, [f"run_dir={moved}"], entry="longmixer.evaluate", tiny=False)
    assert proc.returncode == 0, describe(proc)
    best = json.loads((moved / "results.json").read_text())["best_ckpt"]
    assert not best.startswith(str(tmp_path))  # still the first machine's path
    scored = json.loads((moved / "eval" / Path(best).stem / "results.json").read_text())["metrics"]
    assert scored["test/acc"] == json.loads((moved / "results.json").read_text())["metrics"]["test/acc"]


def test_an_evaluate_sweep_goes_on_past_a_job_whose_setting_is_refused(reference, tmp_path):
    """Under `evaluate -m`, a job whose setting a constructor refuses is recorded as failed and the next job runs (as
    in train's sweeps); only a single run prints the one line and exits 2."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    proc = run_train(tmp_path, ["-m", f"run_dir={run}", "trainer.devices=0,1"], entry="longmixer.evaluate",
                     tiny=False)
    assert proc.returncode == 1, describe(proc)
    assert len(list((run / "eval").glob("*/results.json"))) == 1, describe(proc)  # the second job scored
    (sweep,) = (run / "eval" / "sweeps").iterdir()  # the jobs' Hydra output in the run's eval/, not in logs/runs
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "1"]
    summary = (sweep / "summary.md").read_text()
    assert "FAILED (ConfigError: trainer (Trainer): " in summary and "| 1 | COMPLETED |" in summary, summary
    (row,) = [line for line in summary.splitlines() if line.startswith("| 1 | COMPLETED |")]
    (scored,) = (run / "eval").glob("*/results.json")
    assert "| val/acc |" in summary and f"{json.loads(scored.read_text())['metrics']['val/acc']:.4f}" in row, summary
    single = run_train(tmp_path, [f"run_dir={run}", "trainer.devices=0"], entry="longmixer.evaluate", tiny=False)
    assert single.returncode == 2 and "trainer (Trainer): " in single.stdout + single.stderr, describe(single)
