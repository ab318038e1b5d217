"""Data-parallel scaling: each recipe on 1, 2 and 4 GPUs (or N gloo CPU processes) at EQUAL GLOBAL BATCH for a
fixed number of steps, through the framework's own entry point (`python -m longmixer.train`), so what is measured
is what users run. Per run: tokens/s over all ranks, speedup and scaling efficiency against the 1-device run, peak
memory of every GPU, and the global-batch loss of every step; the loss curves of one recipe must overlap.

Each run is `python -m longmixer.train experiment=<recipe> data=<generated data> data.batch_size=<global / N>
trainer=<gpu | ddp | zero> trainer.devices=N trainer.max_steps=<steps>` with validation, testing and checkpoints
off and `callbacks/scaling.py::ScalingProbe` as the only callback (it writes the per-step loss averaged over the
global batch, the timed tokens/s and the per-rank peak memory). Recipes with BatchNorm switch to
`model.norm=syncbatchnorm` (per-rank statistics would change the model with N), dropout is set to 0 unless
`--dropout recipe` (each rank draws the same masks, so with dropout the curves differ by more than rounding), and
the LR warmup is shortened to `--lr-warmup` steps so that the compared models actually train.
Every process is started with NVLink multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1).

GPU (one command measures all):  PYTHONUNBUFFERED=1 PYTHONPATH=src python3 scripts/bench/scaling.py --out $OUT/scaling
CPU (gloo, tiny):  PYTHONPATH=src python scripts/bench/scaling.py --cpu 1 2 --recipes quickstart --steps 6 \
    --warmup 2 --global-batch 8 --out /tmp/scaling
With fewer than 2 GPUs and no --gpus / --cpu it prints one line and exits 0 (so `make bench` passes on one GPU);
asking for more GPUs than exist is refused with one line and exit status 2.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Recipe:
    experiment: str
    data: str
    global_batch: int          # rows per optimizer step, split evenly over the ranks
    overrides: tuple[str, ...] = field(default=())


# ListOps: LRA lengths (500-2000 tokens), as many generated examples as the steps consume (set in `run_overrides`).
# LM: the MEGA-chunk enwik8 recipe (12 layers, width 512, chunk 2048) on the synthetic byte stream, segments of
# 4 chunks (k_min = k_max, so every step has the same 8 x 8192 tokens).
RECIPES = {
    "chela_listops": Recipe("chela/listops", "listops_gen", 64, ("model.norm=syncbatchnorm",)),
    "mega_chunk_listops": Recipe("mega/listops", "listops_gen", 64, ("model=mega_chunk",)),
    "mega_chunk_bytes": Recipe("mega/enwik8", "synthetic_bytes", 8, ("model=mega_chunk", "data.k_min=4", "data.k_max=4")),
    # the embedded default (2-layer CHELA, 11-99 token ListOps): the CPU test's recipe
    "quickstart": Recipe("quickstart", "listops_quick", 64),
}
GPU_DEFAULT = ("chela_listops", "mega_chunk_listops", "mega_chunk_bytes")


def dropout_overrides(recipe: Recipe) -> list[str]:
    """`model.<path>=0.0` for every positive dropout rate of the composed recipe's model."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from longmixer.utils.resolvers import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={recipe.experiment}", f"data={recipe.data}",
                                          *recipe.overrides])
    GlobalHydra.instance().clear()
    model = OmegaConf.to_container(cfg.model, resolve=False)
    out = []

    def walk(node, path):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{path}{key}.")
            elif "dropout" in str(key) and isinstance(value, (int, float)) and not isinstance(value, bool) and value:
                out.append(f"model.{path}{key}=0.0")

    walk(model, "")
    return out


def run_id(name: str, world: int, strategy: str) -> str:
    return f"{name}_n1" if world == 1 else f"{name}_{strategy}_n{world}"


def run_overrides(name: str, recipe: Recipe, world: int, strategy: str, args, out: Path) -> list[str]:
    """The `longmixer.train` overrides of one run of `recipe` on `world` devices (one device: no strategy)."""
    if world == 1:
        trainer = ["trainer=cpu" if args.cpu else "trainer=gpu"]
    else:
        trainer = [f"trainer={strategy}", f"trainer.accelerator={'cpu' if args.cpu else 'gpu'}",
                   f"trainer.precision={'32-true' if args.cpu else 'bf16-mixed'}"]
    data = []
    if recipe.data.startswith("listops"):  # generate just the examples the steps consume (+ one spare batch)
        data = [f"data.num_train={recipe.global_batch * (args.steps + 1)}", "data.num_val=16", "data.num_test=16"]
    return [f"experiment={recipe.experiment}", f"data={recipe.data}", *recipe.overrides, *data,
            f"data.batch_size={recipe.global_batch // world}", *trainer, f"trainer.devices={world}",
            f"trainer.max_steps={args.steps}", "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0",
            "trainer.accumulate_grad_batches=1", "+trainer.enable_checkpointing=false",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "test=false",
            "callbacks=none", "~callbacks.checkpoint", "~callbacks.resume_step",  # no checkpointing at all
            "+callbacks.scaling._target_=longmixer.callbacks.scaling.ScalingProbe",
            f"+callbacks.scaling.out={out / 'runs' / (run_id(name, world, strategy) + '.json')}",
            f"+callbacks.scaling.warmup_steps={args.warmup}",
            f"paths.data_dir={(args.data_dir or out / 'data').resolve()}",
            f"paths.log_dir={out / 'logs'}", f"run_tag=scaling_{strategy}_n{world}", f"seed={args.seed}",
            f"scheduler.warmup_steps={args.lr_warmup}"]


def child_env(cpu: bool) -> dict[str, str]:
    env = {**os.environ, **NO_MULTICAST, "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    if cpu:
        env.setdefault("OMP_NUM_THREADS", "1")  # N processes share the cores
    return env


def train_command(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "longmixer.train", *overrides]


def run_one(name: str, recipe: Recipe, world: int, strategy: str, args, out: Path, extra: list[str]) -> dict:
    overrides = [*run_overrides(name, recipe, world, strategy, args, out), *extra]
    cmd = train_command(overrides)
    log_path = out / "runs" / (run_id(name, world, strategy) + ".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    probe = out / "runs" / (run_id(name, world, strategy) + ".json")
    probe.unlink(missing_ok=True)  # a file left by an earlier run must not pass for this one's result
    start = time.perf_counter()
    with open(log_path, "w") as log:
        # its own session: on a timeout the whole group goes (Lightning starts ranks 1..N-1 from rank 0)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(args.cpu), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        measured_at = None
        while (returncode := proc.poll()) is None:
            now = time.perf_counter()
            if measured_at is None and _read_probe(probe) is not None:
                measured_at = now
            if measured_at is not None and now - measured_at > args.exit_grace:
                returncode = f"killed {args.exit_grace} s after training ended (the processes did not exit)"
            elif now - start > args.timeout:
                returncode = f"killed after --timeout {args.timeout} s"
            else:
                time.sleep(0.5)
                continue
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
    wall = time.perf_counter() - start
    strategy = "single" if world == 1 else strategy
    result = _read_probe(probe)
    if result is None or (returncode != 0 and measured_at is None):
        tail = log_path.read_text()[-2000:]
        return {"recipe": name, "strategy": strategy, "world_size": world, "log_tail": tail,
                "failed": f"exit {returncode}; log {log_path}", "command": " ".join(cmd)}
    # a run whose probe was written measured all its steps: it counts even if its processes then hung at exit
    # (as DDP runs on H100s once did, docs/benchmarks.md "Scaling"); the row says so
    return {"recipe": name, "strategy": strategy, "wall_s": wall, "command": " ".join(cmd),
            "exit": "ok" if returncode == 0 else str(returncode), **result}


def _read_probe(path: Path) -> dict | None:
    """The probe's JSON once it is whole (rank 0 writes it at the end of training), else None."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summarise(results: list[dict]) -> list[dict]:
    """One row per successful run: speedup and efficiency against the same recipe's 1-device run, and the largest
    |loss - loss of the 1-device run| over the steps."""
    base = {r["recipe"]: r for r in results if "failed" not in r and r["world_size"] == 1}
    rows = []
    for r in results:
        if "failed" in r:
            continue
        ref = base.get(r["recipe"])
        speedup = r["tokens_per_s"] / ref["tokens_per_s"] if ref else float("nan")
        diff = max(abs(a - b) for a, b in zip(r["loss"], ref["loss"])) if ref else float("nan")
        peaks = [p for p in r["peak_mem_gib"] if p is not None]
        rows.append({"recipe": r["recipe"], "strategy": r["strategy"], "devices": r["world_size"],
                     "global_batch": r["rows_per_step"][0],
                     "tokens_per_step": r["tokens_per_step"][0], "steps": r["steps"], "timed_steps": r["timed_steps"],
                     "tokens_per_s": r["tokens_per_s"], "speedup": speedup, "efficiency": speedup / r["world_size"],
                     "step_ms_median": statistics.median(r["step_ms"]) if r.get("step_ms") else float("nan"),
                     "peak_mem_gib_max": max(peaks) if peaks else float("nan"),
                     "peak_mem_gib_per_device": peaks, "loss_first": r["loss"][0], "loss_last": r["loss"][-1],
                     "max_abs_loss_diff_vs_1": diff, "exit": r.get("exit", "ok")})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'recipe':<20} {'strategy':<8} {'dev':>3} {'batch':>5} {'tokens/s':>12} {'step ms':>8} {'speedup':>7} "
            f"{'eff':>5} "
            f"{'peak GiB':>8} "
            f"{'loss 0 -> last':>16} {'max|dloss|':>10}  exit")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['recipe']:<20} {r['strategy']:<8} {r['devices']:>3} {r['global_batch']:>5} "
                     f"{r['tokens_per_s']:>12,.0f} {r['step_ms_median']:>8.2f} "
                     f"{r['speedup']:>7.3f} {r['efficiency']:>5.2f} {r['peak_mem_gib_max']:>8.2f} "
                     f"{r['loss_first']:>7.4f} -> {r['loss_last']:<6.4f} {r['max_abs_loss_diff_vs_1']:>10.2e}  {r['exit']}")
    return "\n".join(lines)


def write_outputs(out: Path, results: list[dict], rows: list[dict], meta: dict) -> None:
    (out / "scaling.json").write_text(json.dumps({"meta": meta, "summary": rows, "runs": results}, indent=1))
    with open(out / "scaling.csv", "w", newline="") as f:
        fields = [k for k in rows[0] if k != "peak_mem_gib_per_device"] + ["peak_mem_gib_per_device"] if rows else []
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            peaks = " ".join(f"{p:.3f}" for p in r["peak_mem_gib_per_device"])
            writer.writerow({**r, "peak_mem_gib_per_device": peaks})
    with open(out / "loss_curves.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["recipe", "strategy", "devices", "step", "loss"])
        for r in results:
            for step, loss in enumerate(r.get("loss", [])):
                writer.writerow([r["recipe"], r["strategy"], r["world_size"], step, f"{loss:.8f}"])


def device_counts(args) -> list[int] | None:
    """The device counts to run, or None (with the note printed) when there is nothing to measure here."""
    if args.cpu:
        return args.cpu
    import torch

    available = torch.cuda.device_count()
    if args.gpus is None:
        if available < 2:
            print(f"scaling: skipped, {available} GPU(s) here; data-parallel scaling needs >= 2 "
                  "(pass --gpus or --cpu to run anyway)")
            return None
        return [n for n in (1, 2, 4) if n <= available]
    if max(args.gpus) > available:
        print(f"scaling: refused, asked for {max(args.gpus)} GPUs but this machine has {available}; "
              f"pass --gpus up to {available} (or --cpu N for gloo processes)", file=sys.stderr)
        raise SystemExit(2)
    return args.gpus


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, nargs="+", help="device counts (default 1 2 4, up to the GPUs present)")
    p.add_argument("--cpu", type=int, nargs="+", help="run on CPU with this many gloo processes instead (e.g. 1 2)")
    p.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), help=f"default: {' '.join(GPU_DEFAULT)}")
    p.add_argument("--strategies", nargs="+", choices=("ddp", "zero"), default=["ddp"],
                   help="trainer configs of the multi-device runs (zero: DDP with sharded optimizer state)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    p.add_argument("--lr-warmup", type=int, default=10,
                   help="scheduler.warmup_steps of the runs (the recipes' thousands would leave the lr ~0 for the "
                        "whole run, and the loss-curve comparison would compare untrained models)")
    p.add_argument("--global-batch", type=int, help="rows per step for every recipe (default: the recipe's)")
    p.add_argument("--dropout", choices=("off", "recipe"), default="off",
                   help="off: every dropout rate 0, so the curves can match to rounding")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", type=Path, help="where generated data goes (default <out>/data)")
    p.add_argument("--out", type=Path, default=Path("logs/scaling"), help="results: scaling.{json,csv}, "
                   "loss_curves.csv, runs/<recipe>_n<N>.{json,log}")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--exit-grace", type=int, default=60,
                   help="seconds a run may take to exit once its probe is written; then it is killed and its "
                        "measurement kept, marked in the `exit` column")
    p.add_argument("extra", nargs="*", help="more Hydra overrides for every run (after --)")
    args = p.parse_args(argv)
    if args.gpus and args.cpu:
        p.error("--gpus and --cpu exclude each other")
    if any(n < 1 for n in (args.gpus or args.cpu or [1])):
        p.error("device counts must be >= 1")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup {args.warmup} must be in [0, --steps {args.steps})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(NO_MULTICAST)
    counts = device_counts(args)
    if counts is None:
        return 0
    counts = sorted(set(counts))
    names = args.recipes or (["quickstart"] if args.cpu else list(GPU_DEFAULT))
    for name in names:
        batch = args.global_batch or RECIPES[name].global_batch
        if any(batch % n for n in counts):
            raise SystemExit(f"scaling: global batch {batch} of {name} is not divisible by every device count "
                             f"{counts}; pick --global-batch as a multiple of each")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    meta = {"devices": "cpu/gloo" if args.cpu else "cuda", "strategies": args.strategies, "steps": args.steps,
            "warmup": args.warmup, "dropout": args.dropout, "env": NO_MULTICAST,
            "argv": sys.argv[1:] if argv is None else argv}
    results = []
    for name in names:
        recipe = RECIPES[name]
        if args.global_batch:
            recipe = Recipe(recipe.experiment, recipe.data, args.global_batch, recipe.overrides)
        extra = [*(dropout_overrides(recipe) if args.dropout == "off" else []), *args.extra]
        for world in counts:
            for strategy in (["single"] if world == 1 else args.strategies):
                result = run_one(name, recipe, world, strategy, args, out, extra)
                results.append(result)
                state = result.get("failed") or f"{result['tokens_per_s']:,.0f} tokens/s" + (
                    "" if result["exit"] == "ok" else f" ({result['exit']})")
                print(f"{name} on {world} {'process(es)' if args.cpu else 'GPU(s)'} ({result['strategy']}): "
                      f"{state}", flush=True)
                write_outputs(out, results, summarise(results), meta)  # a run cut short keeps what it measured
    rows = summarise(results)
    print(table(rows))
    failed = [r for r in results if "failed" in r]
    for r in failed:
        print(f"FAILED {r['recipe']} on {r['world_size']} ({r['strategy']}): {r['failed']}\n{r['log_tail']}",
              file=sys.stderr)
    print(f"results: {out / 'scaling.json'}, {out / 'scaling.csv'}, {out / 'loss_curves.csv'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
