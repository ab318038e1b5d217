"""The console scripts of pyproject.toml resolve to callables, and the argparse ones answer --help."""

from __future__ import annotations

import importlib
import json
import os
import stat
import subprocess
import sys
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


def test_console_scripts_exit_zero_after_a_run(tmp_path, monkeypatch, capsys):
    """A console script's wrapper exits with what its function returns (`sys.exit(fn())`), so a run that worked must
    return None: the report, runs and bench mains return their results, which the scripts call through `cli`. The
    runs listing is printed to stdout, where a redirect finds it."""
    import longmixer.bench

    runs = tmp_path / "runs"
    runs.mkdir()
    assert _resolve(SCRIPTS["longmixer-runs"])(["--runs", str(runs)]) is None
    assert capsys.readouterr().out.startswith("(no runs)")
    assert _resolve(SCRIPTS["longmixer-report"])(["--runs", str(runs), "--out", str(tmp_path / "r"),
                                                   "--no-plots"]) is None
    monkeypatch.setattr(longmixer.bench, "main", lambda argv=None: {"rows": []})
    assert _resolve(SCRIPTS["longmixer-bench"])(["--quick"]) is None
    for name in ("longmixer-train", "longmixer-evaluate"):  # Hydra mains, which return None
        assert SCRIPTS[name].endswith(":main")


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


def _bench_script(name: str):
    """Import scripts/bench/<name>.py as running it does: its folder on sys.path (for `_common`)."""
    import importlib.util
    import sys

    folder = str(ROOT / "scripts" / "bench")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_anchor_with_toeplitz_bias_is_megas_full_attention():
    """scripts/bench/anchors.py times SDPA with the relative-position bias materialized as MEGA's full-length
    attention: the same output and gradients as `local_attention` (torch path), so the comparison is like for like."""
    import torch

    from longmixer.ops.local_attention import local_attention

    anchors = _bench_script("anchors")
    g = torch.Generator().manual_seed(0)
    B, L, K, V = 2, 24, 8, 12
    q, k = (torch.randn(B, 1, L, K, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    v = torch.randn(B, 1, L, V, generator=g, dtype=torch.float64).requires_grad_()
    table = (0.3 * torch.randn(2 * L - 1, generator=g, dtype=torch.float64)).requires_grad_()
    outs = []
    for fn in (lambda: anchors.toeplitz_sdpa(q, k, v, table), lambda: local_attention(q, k, v, bias=table,
                                                                                       backend="torch")):
        o = fn()
        outs.append([o, *torch.autograd.grad(o, [q, k, v, table], torch.ones_like(o))])
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-10), (a - b).abs().max()


def test_anchors_skips_without_a_gpu(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["anchors.py"])
    assert _bench_script("anchors").main() == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["ema_chunked", "las_attention", "linear_attention", "mega", "seqboat",
                                  "vq_attention"])
def test_kernel_scripts_skip_without_a_gpu_and_refuse_full_sizes_in_the_interpreter(name, monkeypatch, capsys):
    """`make bench` on a CPU machine runs every script: those that time kernels say they need a GPU and exit 0 (not
    a traceback from the Triton launch), and full sizes in Triton's CPU interpreter are refused (exit 2, with the
    `--quick` that runs the smoke test)."""
    import torch

    script = _bench_script(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr("sys.argv", [f"{name}.py"])
    assert script.main() == 0
    out = capsys.readouterr().out
    assert f"{name}.py times GPU kernels: it needs a CUDA GPU" in out and "--quick" in out
    monkeypatch.setattr("sys.argv", [f"{name}.py", "--quick"])
    assert script.main() == 0  # --quick outside the interpreter cannot launch Triton on CPU tensors either
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr("sys.argv", [f"{name}.py"])
    assert script.main() == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # on a GPU host too: the interpreter is asked for
    assert script.main() == 2
    assert "add --quick" in capsys.readouterr().err


def test_kernel_scripts_fail_on_a_parity_error_out_of_bound(capsys):
    """The kernel scripts go on to time their kernels after the parity checks, and exit 1 at the end when a case
    was out of its bound (a NaN too), naming each."""
    _bench_script("las_attention")  # puts scripts/bench on sys.path for `_common`
    import _common

    failures = []
    _common.out_of_bound(failures, "fp32 o", 3e-7, 1e-4)
    assert failures == [] and _common.parity_status("x.py", failures) == 0
    _common.out_of_bound(failures, "bf16 dq", 5e-2, 2e-2)
    _common.out_of_bound(failures, "bf16 dk", float("nan"), 2e-2)
    assert _common.parity_status("x.py", failures) == 1
    err = capsys.readouterr().err
    assert "x.py: parity FAILED bf16 dq: 5.00e-02 > 2e-02" in err and "bf16 dk: nan > 2e-02" in err
    for name in ("ema_chunked", "las_attention", "linear_attention", "mega", "vq_attention"):
        script = _bench_script(name)
        assert "float32" in script.PARITY_BOUND and max(script.PARITY_BOUND.values()) <= 6e-2
        assert 'parity_status("' + name + '.py"' in (ROOT / "scripts" / "bench" / f"{name}.py").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name, args", [("ema_chunked", []),
                                        ("las_attention", ["--only", "ours_dispatch", "--heads", "2"]),
                                        ("linear_attention", []), ("mega", []), ("seqboat", []),
                                        ("vq_attention", [])])
def test_kernel_scripts_smoke_run_in_the_interpreter(name, args):
    """Each kernel script's `--quick` run, as its docstring gives it (TRITON_INTERPRET=1 on a CPU): parity at tiny
    sizes, then every timing section once, so a renamed constructor argument or op signature fails here, not on the
    GPU (seqboat.py's layer section and linear_attention.py's layer check once built their mixers with names the
    mixers had dropped)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src"), "OUT": "",
           "CUDA_VISIBLE_DEVICES": ""}
    script = [sys.executable, str(ROOT / "scripts" / "bench" / f"{name}.py")]
    proc = subprocess.run([*script, "--quick", *args], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = any(line.replace(" ", "").startswith("|---") for line in proc.stdout.splitlines())
    assert "Traceback" not in proc.stderr and table, proc.stdout[-2000:] + proc.stderr[-2000:]
    # the refusal's status reaches the shell (make bench stops on it): main()'s status (2, checked in-process by
    # the test above) is the process's, through the script's `sys.exit(main())`; one script shows it end to end
    source = (ROOT / "scripts" / "bench" / f"{name}.py").read_text()
    assert source.rstrip().endswith('if __name__ == "__main__":\n    sys.exit(main())'), name
    if name == "ema_chunked":
        refused = subprocess.run(script, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
        assert refused.returncode == 2 and "add --quick" in refused.stderr, refused.stderr[-2000:]


def test_long_span_skips_without_a_gpu(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _bench_script("long_span").main([]) == 0
    assert _bench_script("long_span").main(["--skip-parity", "--ops", "seqboat-full"]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_long_span_times_every_seqboat_full_path(monkeypatch):
    """long_span.py's SeqBoat-full paths run the op each way (the Triton interpreter, L 136 > 128 so the packed
    route's three paths take it, V 160 for the dv pass; the timers stubbed), and the module settings they change
    are restored."""
    import torch
    import triton.testing

    from longmixer.ops.local_attention import kernel as local_kernel
    from longmixer.ops.sparse_local_attention import kernel as sparse_kernel

    script = _bench_script("long_span")
    settings = []  # what each timed call ran with: the route, its pieces and a bidirectional packed tile's mode

    def bench(fn):
        settings.append((sparse_kernel.PACKED_LONG_SPAN, local_kernel.PACKED_PIECE_QUERIES,
                         local_kernel.packed_tile_mode(256, False, 64, 128, 128)))
        fn()
        return 1.0

    monkeypatch.setattr(triton.testing, "do_bench", bench)
    monkeypatch.setattr(script, "kernel_ms", lambda fn: 1.0)
    monkeypatch.setattr(script, "ROWS", [])
    before = (local_kernel.PACKED_PIECE_QUERIES, local_kernel.packed_tile_mode, sparse_kernel.PACKED_LONG_SPAN,
              sparse_kernel.DV_PASS_TILES, set(sparse_kernel.FUSED_BWD_MODES))
    script.seqboat_full(torch.device("cpu"), 1, 136, 0.7, backend="triton", K=16, V=160)
    assert [r["path"] for r in script.ROWS[::3]] == ["split", "one-pass", "fused", "packed-masked", "pieces-masked",
                                                     "default"]
    assert settings[6::2] == [(True, None, 1), (True, 2048, 1), (True, 2048, 2)], settings
    assert (local_kernel.PACKED_PIECE_QUERIES, local_kernel.packed_tile_mode, sparse_kernel.PACKED_LONG_SPAN,
            sparse_kernel.DV_PASS_TILES, set(sparse_kernel.FUSED_BWD_MODES)) == before


def test_seqboat_script_runs_the_sections_asked_for():
    """`--sections` splits the script (whole, it runs past a ten-minute GPU call); only those tables print."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "seqboat.py"), "--quick", "--sections",
                           "parity", "bandwidth"], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    headings = [line for line in proc.stdout.splitlines() if line.startswith("## ")]
    assert [h.split()[1] for h in headings] == ["SeqBoat", "Reference"], headings  # parity, then bandwidth


def test_long_span_baselines_are_the_previous_paths():
    """The script's "split" rows run the kernels the one-pass path replaced (the dq kernel and bias atomics), its
    "one-pass" rows the backward the two-pass default replaced (dv in the same kernel, no dv pass)."""
    long_span = _bench_script("long_span")
    assert not long_span.SPLIT_BWD.get("dq_atomic") and long_span.SPLIT_BWD["BLOCK_V_MAX"] == 128
    assert long_span.ONE_PASS_BWD["dq_atomic"] and "dv_pass" not in long_span.ONE_PASS_BWD
    assert long_span.ONE_PASS_BWD["BLOCK_M"] == 32
    assert long_span.local_kernel.LONG_SPAN_K64["dq_atomic"] and long_span.local_kernel.LONG_SPAN_K64["dv_pass"]
    assert long_span.sparse_kernel.DV_PASS_TILES is not None and long_span.sparse_kernel.PACKED_LONG_SPAN


def test_long_span_table_sets_each_path_beside_the_default():
    """A table per op: each path's time in the order measured, the default last, and each path's time over the
    default's; a path an op did not measure is a dash."""
    rows = [dict(op="mega", shape="B8 L4096", what="backward", path=p, ms=ms)
            for p, ms in (("split", 2.0), ("one-pass", 1.0), ("default", 0.8))]
    rows += [dict(op="seqboat-full", shape="B8 L4096 78%", what="forward", path=p, ms=ms)
             for p, ms in (("fused", 0.5), ("default", 0.4))]
    rows.append(dict(op="seqboat-full", shape="B2 L16384 78%", what="forward", path="default", ms=1.0))
    table = _bench_script("long_span").markdown(rows).splitlines()
    assert table[0] == "| op | shape | what | split ms | one-pass ms | default ms | split / default | one-pass / default |"
    assert table[2] == "| mega | B8 L4096 | backward | 2.000 | 1.000 | 0.800 | 2.50x | 1.25x |"
    assert table[4] == "| op | shape | what | fused ms | default ms | fused / default |"
    assert table[6:] == ["| seqboat-full | B8 L4096 78% | forward | 0.500 | 0.400 | 1.25x |",
                         "| seqboat-full | B2 L16384 78% | forward | - | 1.000 | - |"]


def test_optimizer_step_skips_without_a_gpu(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _bench_script("optimizer_step").main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_optimizer_step_paths_agree():
    """The two optimizer paths the script times (foreach AdamW after torch's clip, fused AdamW after
    `clip_grad_norm`) take the same steps, up to rounding; on a CPU here, on the GPU in the script."""
    import torch

    assert _bench_script("optimizer_step").parity(torch.device("cpu")) < 1e-5


def test_train_util_exits_with_the_training_runs_status(tmp_path):
    """train_util.py exited 0 when the training run it measured had failed (a refused setting, a crash), so `make
    bench`, which stops at a script's failure, went on as if the run had been measured. It now exits with the run's
    status and names the command on stderr."""
    tool = tmp_path / "bin" / "nvidia-smi"  # a GPU for the sampler, so the script runs the training command
    tool.parent.mkdir()
    tool.write_text('#!/bin/sh\ncase "$*" in *name*) echo "Fake GPU";; *) echo "40, 100";; esac\n')
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PATH": f"{tool.parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "train_util.py"), "--out",
                           str(tmp_path / "out"), "--name", "refused", "--", "optim.lr=-1",
                           f"paths.log_dir={tmp_path / 'logs'}", f"paths.data_dir={tmp_path / 'data'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert json.loads((tmp_path / "out" / "train_util_refused.json").read_text())["exit_code"] == 2
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "train_util: the training run exited with status 2" in proc.stderr
