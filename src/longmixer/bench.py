"""Model-level speed and memory: training-step time, tokens/s and peak memory of every model family, and its
evaluation throughput, against a Transformer with materialized attention (the papers' baseline) and with SDPA.

    python -m longmixer.bench [--quick] [--compile none step-graph] [--out bench_out/model_bench.json]
        [--budget-s 230] [--models transformer_sdpa chela] [--settings text length table6] [--lengths 16384]

Each model is measured eager and compiled (`--compile`), and on CUDA one profiled pass gives the GPU-kernel time
and kernel launches per step: GPU busy = kernel time / wall-clock step time. `--compile step-graph` compiles the
blocks as `default` does and captures the whole training step (forward, loss, backward, optimizer step) in one CUDA
graph, replayed per step by training's own `TrainStepGraph` (utils/compile.py); it needs a CUDA GPU. Without a GPU
the benchmark runs `--quick` toy models (labelled as such in the table) so the command still finishes within its
budget, and records step-graph rows as skipped.

Settings, in order (a time budget skips what does not fit, recorded as "skipped"):
1. `text`: the papers' efficiency setting (CHELA / LongVQ / LaS / SeqBoat Table 1): each family's Text recipe
   (`experiment=<family>/text`) at length 4096, same batch for all (8 sequences, 32K tokens per step).
2. `length`: the same models at 1K, 2K, 4K, 8K, 16K with 32K tokens per step (batch 32 .. 2); 4K is the `text`
   setting's row. `--lengths 16384` measures only the 16K point (batch 2); a length that is no point of the sweep,
   or `--lengths` with `--settings` lacking `length`, is refused before anything is measured.
3. `table6`: SeqBoat Table 6 layout: MEGA, MEGA-chunk, SeqBoat-full, SeqBoat on each LRA task's recipe at the MEGA
   recipe's batch size: training-step speed, training memory and evaluation speed relative to MEGA.
Models are built from the model / recipe yamls by Hydra compose (the mixer partials as in training), in bf16
autocast with fp32 weights and AdamW, as the papers trained. Configs that run out of memory are recorded as "OOM".
A model that fails is recorded as "error: ..." and the others are measured; the command then exits 1, naming the
rows that failed.
The JSON's `environment` names the device, the host's CPU, the versions and the commit measured (`code`:
`-dirty` where tracked files differ from it; null outside a git checkout). `--out` (the JSON) and its `.md` (the
tables) are replaced after each row, each by a rename: a killed run leaves both with the rows measured so far, never
a cut file. An earlier file at `--out` is replaced from the first row on; `--merge` keeps its rows, from a JSON of
the same device (and `--quick` or not) only, since the table's header names one device for every row.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from longmixer.utils.cli import quiet_on_closed_stdout
from longmixer.utils.compile import COMPILE_MODES, STEP_GRAPH, TrainStepGraph, compile_blocks
from longmixer.utils.compose import CONFIG_DIR, compose, family_of

log = logging.getLogger(__name__)
CONFIGS = Path(CONFIG_DIR)
LENGTHS = (1024, 2048, 4096, 8192, 16384)
TEXT_LENGTH = 4096  # the papers' efficiency setting; the length sweep's 4K point is this setting's row
TOKENS_PER_STEP = 32768
# "auto" is a training default, not a measurement; step-graph: blocks compiled as "default", the whole step in one
# CUDA graph (training's `task.compile=step-graph` replays the same step, `TrainStepGraph`)
BENCH_COMPILE_MODES = COMPILE_MODES[1:]
STEP_GRAPH_WARMUP = 3  # eager steps before capture, at least (PyTorch's whole-network capture example uses 3)
# Untimed steps of a compiled model, at least: a model that recompiles once after its first training step (LongVQ,
# when its codebook's data init has run) compiles again and records new CUDA graphs (reduce-overhead) on the next
# steps; with 2 warm-up steps those landed in the timed window (LongVQ reduce-overhead: 38.5 ms timed, 12.2 ms after
# 8 warm-up steps on the same kind of H100).
COMPILED_WARMUP = 6
# The key mask the bench's batches carry (`--mask`). An all-true mask costs some models a masked path: PyTorch's
# fused attention takes 1.4-1.6x longer with it at Text-4K and 16K on an H100 (docs/benchmarks.md).
KEY_MASKS = ("none", "full")
NEEDS_CUDA = f"skipped ({STEP_GRAPH} needs a CUDA GPU)"
TABLE6_TASKS = ("listops", "text", "retrieval", "image", "pathfinder", "pathx")
TABLE6_MODELS = ("mega", "mega_chunk", "seqboat_full", "seqboat")
# The papers' variants, measured on their family's recipe (a model swap, as in training).
VARIANTS = {"mega": ("mega_chunk",), "las": ("las_chunk",), "seqboat": ("seqboat_full",)}
# The Transformer of the LRA Text task (Tay et al. 2020, the baseline every paper's Table 1 quotes), from its recipe.
TRANSFORMER_TEXT = ["experiment=transformer/text"]


def compose_model_config(overrides: list[str]):
    """The composed run config for `overrides` (experiment / model / data choices), as `python -m longmixer.train`."""
    return compose(["ops.backend=auto", *overrides])


def families() -> list[str]:
    """Every family with a Text recipe (configs/experiment/<family>/text.yaml): new families appear by themselves.
    The Transformer is measured separately, with both attention implementations."""
    return sorted(p.parent.name for p in CONFIGS.glob("experiment/*/text.yaml") if p.parent.name != "transformer")


def model_specs(setting: str, quick: bool) -> list[tuple[str, list[str]]]:
    """(name, overrides) of each model of a setting; the Transformer baselines first."""
    specs = [("transformer_materialized", [*TRANSFORMER_TEXT, "+model.mixer.implementation=materialized"]),
             ("transformer_sdpa", TRANSFORMER_TEXT)]
    for family in families():
        specs.append((family, [f"experiment={family}/text"]))
        for variant in VARIANTS.get(family, ()):
            specs.append((variant, [f"experiment={family}/text", f"model={variant}"]))
    if quick:
        specs = [(n, o + ["model.d_model=32", "model.n_layers=1"]) for n, o in specs]
    return specs


def make_batch(cfg, batch: int, length: int, device, key_mask: str = "none"):
    """Random inputs of the model's kind (tokens or real features), the key mask and labels. Every sequence is
    full-length, so `key_mask` "none" passes no mask (each model's unmasked path, the fastest correct call) and
    "full" an all-true one (the path that a padded task's batches take)."""
    if key_mask not in KEY_MASKS:
        raise ValueError(f"key mask {key_mask!r} is not one of {KEY_MASKS}")
    m = cfg.model
    if m.get("vocab_size") is not None:
        x = torch.randint(1, int(m.vocab_size), (batch, length), device=device)
    else:
        x = torch.randn(batch, length, int(m.d_input), device=device)
    mask = torch.ones(batch, length, dtype=torch.bool, device=device) if key_mask == "full" else None
    y = torch.randint(0, int(m.num_classes), (batch,), device=device)
    return x, mask, y


def _forward(model, cfg, x, mask):
    head = cfg.model.get("head")
    # two-document heads (Retrieval): the same random document twice costs what two documents cost
    extra = {"inputs2": x, "mask2": mask} if isinstance(head, str) and head.startswith("nli") else {}
    out, aux = model(x, mask, **extra)
    if hasattr(model, "after_forward"):
        model.after_forward()  # as the tasks do (LongVQ's codebook statistics, outside the compiled graph)
    return out, aux


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class BudgetExceeded(RuntimeError):
    """A job ran past the benchmark's time budget; the row is recorded as skipped."""


def _check_budget(deadline: float | None) -> None:
    if deadline is not None and time.perf_counter() > deadline:
        raise BudgetExceeded("time budget spent inside the job")


def compile_model(model, mode: str):
    """Compile the model's blocks as training does (`task.compile`, utils/compile.py); "none" leaves it eager and
    "step-graph" compiles them as "default" (`measure` then captures the whole step)."""
    if mode not in BENCH_COMPILE_MODES:
        raise ValueError(f"--compile {mode!r} is not one of {BENCH_COMPILE_MODES}")
    return compile_blocks(model, mode)


def gpu_profile(step, steps: int, top: int = 0) -> dict:
    """Kernels and GPU-kernel time per step of `step`, from torch.profiler's CUDA activity.

    GPU-busy % is this kernel time (intervals merged, so overlapping streams count once) over the unprofiled
    wall-clock step time, which the caller measures separately: the profiler's own host overhead would otherwise
    make the step look more host-bound than it is.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy_us, end = 0.0, -math.inf
    for a, b in spans:
        if b <= end:
            continue
        busy_us += b - max(a, end)
        end = b
    row = {"kernels_per_step": len(spans) / steps, "gpu_kernel_ms": busy_us / 1e3 / steps}
    if top:
        by_name: dict[str, list[float]] = {}
        for e in events:
            tally = by_name.setdefault(e.name[:90], [0.0, 0])
            tally[0] += (e.time_range.end - e.time_range.start) / 1e3 / steps
            tally[1] += 1 / steps
        row["top_kernels"] = sorted(([n, round(ms, 3), round(c, 1)] for n, (ms, c) in by_name.items()),
                                    key=lambda t: -t[1])[:top]
    return row


def measure(cfg, batch: int, length: int, device, warmup: int, iters: int, compile_mode: str = "none",
            profile_steps: int = 0, deadline: float | None = None, top_kernels: int = 0,
            key_mask: str = "none", seed: int = 0) -> dict:
    """Training-step ms, tokens/s and peak memory; evaluation ms and tokens/s; parameters; on CUDA with
    `profile_steps`, kernels per step and GPU-busy %. `key_mask`: see `make_batch`.

    The step is what a training run does: forward under bf16 autocast (on CUDA), loss, backward and a fused AdamW
    step; `compile_mode` compiles the model (not the optimizer), as `task.compile` does in training. A model's
    callable `after_forward` attribute, if any, runs right after each training forward. "step-graph" runs the step
    as `task.compile=step-graph` does in training (`TrainStepGraph`: eager warm-up steps on a side stream, one
    capture, then per step the batch copied into the captured inputs, the learning rates synced and one replay;
    `after_forward` runs at capture, its GPU work is replayed and the model's `after_replay` runs after each replay)
    and times those steps; evaluation then runs the blocks compiled as "default".

    The initial weights and the batch are drawn from `seed` (`--seed`), so a row does not depend on the jobs measured
    before it in the process: a model whose work follows its weights (SeqBoat's router activates a share of the
    tokens that depends on them) starts from the same initialization in every run. The row's `stats`, where the model
    reports any, holds its `stats/` aux values (per layer, e.g. SeqBoat's `act_rate/layer_00`) from one more training
    step, untimed, after the profiled ones.
    """
    from hydra.utils import instantiate

    graphed = compile_mode == STEP_GRAPH
    if graphed and device.type != "cuda":
        raise ValueError(f"--compile {STEP_GRAPH} needs a CUDA GPU (it captures the step in a CUDA graph); "
                         f"the device is {device}")
    torch.manual_seed(seed)  # every device's generator: the initial weights, the batch, dropout masks
    model = instantiate(cfg.model).to(device)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda", capturable=graphed)
    x, mask, y = make_batch(cfg, batch, length, device, key_mask)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    net = compile_model(model, compile_mode)

    def update(batch: dict) -> dict:  # forward, loss, backward, optimizer step; the gradients stay
        with amp:
            out, aux = _forward(net, cfg, batch["x"], batch["mask"])  # with the model's after_forward hook
            loss = F.cross_entropy(out.float(), batch["y"])
            loss = loss + sum(v for k, v in aux.items() if k.startswith("loss/"))
        loss.backward()
        opt.step()
        return {"loss": loss.detach(), **{k: v.detach() for k, v in aux.items() if k.startswith("stats/")}}

    batch_dict = {"x": x, "mask": mask, "y": y}
    graph_step = (TrainStepGraph(update, opt, warmup=max(warmup, STEP_GRAPH_WARMUP),
                                 after_replay=getattr(model, "after_replay", None)) if graphed else None)

    def train_step() -> dict:
        if graph_step is not None:  # zeroes the gradients before its eager steps; a replay refills them in place
            return graph_step(batch_dict)
        out = update(batch_dict)
        opt.zero_grad(set_to_none=True)
        return out

    def timed(fn, n):
        _sync(device)
        start = time.perf_counter()
        for _ in range(n):
            fn()
            _check_budget(deadline)
        _sync(device)
        return (time.perf_counter() - start) / n * 1e3

    model.train()
    compile_start = time.perf_counter()
    # step-graph: its eager warm-up steps, the capture (which also runs that step) and `warmup` replays
    untimed = (graph_step.warmup + 1 + warmup if graphed else
               warmup if compile_mode == "none" else max(warmup, COMPILED_WARMUP))
    for _ in range(untimed):
        train_step()
        _check_budget(deadline)
    _sync(device)
    first_ms = (time.perf_counter() - compile_start) * 1e3
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    train_ms = timed(train_step, iters)
    # CUDA graphs allocate their memory pool during warm-up or capture, before the reset: the peak after it is not
    # the step's
    peak = (torch.cuda.max_memory_allocated() / 2**20
            if device.type == "cuda" and compile_mode not in ("reduce-overhead", STEP_GRAPH) else float("nan"))
    row = {"params": params, "compile": compile_mode, "seed": seed, "warmup_ms": first_ms, "train_ms": train_ms,
           "train_tokens_per_s": batch * length / train_ms * 1e3, "peak_mem_mib": peak}
    if device.type == "cuda" and profile_steps:
        prof = gpu_profile(train_step, profile_steps, top_kernels)
        row.update(prof, gpu_busy=min(1.0, prof["gpu_kernel_ms"] / train_ms))
    # the model's own statistics of one more step, untimed (SeqBoat's router activation rate per layer: its
    # attention's work, and so its step time, follows it)
    stats = {k.removeprefix("stats/"): float(v) for k, v in train_step().items() if k.startswith("stats/")}
    if stats:
        row["stats"] = stats
    graph_step = None  # the captured graph and its pool go before the optimizer state it reads
    opt.zero_grad(set_to_none=True)
    opt.state.clear()  # free the Adam moments before timing evaluation (train_step still names opt)

    model.eval()

    @torch.no_grad()
    def eval_step():
        with amp:
            _forward(net, cfg, x, mask)

    for _ in range(warmup):
        eval_step()
        _check_budget(deadline)
    eval_ms = timed(eval_step, iters)
    row.update(eval_ms=eval_ms, eval_tokens_per_s=batch * length / eval_ms * 1e3)
    return row


def sweep_points(quick: bool, lengths: list[int] | None = None) -> list[int]:
    """The lengths of the `length` sweep besides the text setting's, in the sweep's order.

    Raises:
        ValueError: a value of `lengths` (`--lengths`) is not a point of the sweep (the message names the points).
    """
    text_len = 128 if quick else TEXT_LENGTH
    others = [n for n in ((64, 128, 32) if quick else LENGTHS) if n != text_len]  # text_len is the text setting's
    unknown = sorted(set(lengths or ()) - set(others))
    if unknown:
        hint = f"; {text_len} is measured by --settings text" if text_len in unknown else ""
        raise ValueError(f"--lengths {' '.join(map(str, unknown))}: the {'--quick ' if quick else ''}length sweep "
                         f"measures {', '.join(map(str, sorted(others)))}{hint}")
    return others


def plan(quick: bool, lengths: list[int] | None = None) -> list[dict]:
    """Every measurement, in priority order: the Text setting, the sweep's ends (1K, 16K), Table 6, the sweep's
    middle (2K, 8K); a time budget cuts from the end. `lengths` (`--lengths`) keeps only those points of the
    `length` sweep (the other settings are unchanged).

    Raises:
        ValueError: a value of `lengths` is not a point of the sweep (`sweep_points`).
    """
    tokens = 256 if quick else TOKENS_PER_STEP
    text_len = 128 if quick else TEXT_LENGTH
    others = sweep_points(quick, lengths)

    def sweep(points):
        return [{"setting": "length", "model": n, "overrides": o + [f"data.seq_len={length}"], "length": length,
                 "batch": tokens // length} for length in points if lengths is None or length in lengths
                for n, o in model_specs("length", quick)]

    jobs = [{"setting": "text", "model": n, "overrides": o + [f"data.seq_len={text_len}"], "length": text_len,
             "batch": tokens // text_len} for n, o in model_specs("text", quick)]
    jobs += sweep([min(others), max(others)])
    for task in TABLE6_TASKS:
        if not (CONFIGS / "experiment" / "mega" / f"{task}.yaml").exists():
            continue
        for name in TABLE6_MODELS:
            family = family_of(name)
            if not (CONFIGS / "experiment" / family / f"{task}.yaml").exists():
                continue
            overrides = [f"experiment={family}/{task}", f"model={name}"]
            if quick:
                overrides += ["model.d_model=32", "model.n_layers=1", "data.seq_len=64"]
            jobs.append({"setting": "table6", "task": task, "model": name, "overrides": overrides})
    jobs += sweep([n for n in others if n not in (min(others), max(others))])
    return jobs


def _slot(row: dict) -> tuple:
    length = row.get("length") if row["setting"] != "table6" else None
    # rows from before `--mask` existed were measured with an all-true mask
    return row["setting"], row["model"], row.get("task"), length, row.get("compile", "none"), row.get("mask", "full")


def host_cpu() -> str:
    """The host's CPU model and core count (a host-bound step moves with them): /proc/cpuinfo on Linux."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def code_version(repo_dir: Path = Path(__file__).resolve().parents[2]) -> str | None:
    """The commit the measured code is at (short hash, `-dirty` where tracked files differ from it), or None where
    this module is not that checkout's `src/longmixer/bench.py` (a package installed into site-packages, or a copy
    of the tree without `.git`): the docs name each table's commit."""
    from longmixer.runs.run_info import git_output

    if (repo_dir / "src" / "longmixer" / "bench.py").resolve() != Path(__file__).resolve():
        return None
    commit = git_output("rev-parse", "--short", "HEAD", cwd=repo_dir)
    if commit is None:
        return None
    return commit + ("-dirty" if git_output("status", "--porcelain", "--untracked-files=no", cwd=repo_dir) else "")


def device_name(device) -> str:
    """What the tables call the device: the GPU's name, or the CPU's."""
    return torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"


def environment(device) -> dict:
    import triton

    return {"device": device_name(device),
            "host": host_cpu(),
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "dtype": "bf16 autocast, fp32 weights, AdamW",
            "code": code_version(), "command": "python -m longmixer.bench " + " ".join(sys.argv[1:])}


def paper_claims() -> list[dict]:
    """The papers' efficiency numbers the markdown sets beside ours (paper_results.yaml)."""
    import yaml

    return yaml.safe_load((Path(__file__).parent / "paper_results.yaml").read_text()).get("efficiency", [])


def write_outputs(out: Path, result: dict, claims: list[dict]) -> str:
    """Write `out` (the JSON) and its `.md` (the tables), each by a rename, so a killed run leaves the old file or the
    new one, never a part, and the two always describe the same rows. Returns the markdown."""
    from longmixer.runs.resume import write_atomically

    table = markdown(result, claims)
    write_atomically(out, json.dumps(result, indent=1))
    write_atomically(out.with_suffix(".md"), table)
    return table


def _jobs(args) -> list[dict]:
    """The measurements this command makes (`plan`, narrowed by --models, --settings and --compile)."""
    return [{**j, "compile": mode, "mask": args.mask} for j in plan(args.quick, args.lengths) for mode in args.compile
            if (not args.models or j["model"] in args.models) and (not args.settings or j["setting"] in args.settings)]


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.quick:
        log.warning("no CUDA GPU: measuring --quick toy models on the CPU instead (the papers' settings need a GPU)")
        args.quick = True
    result = {"environment": environment(device), "quick": args.quick, "rows": []}
    claims = paper_claims()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    deadline = start + args.budget_s
    if STEP_GRAPH in args.compile and device.type != "cuda":
        log.warning("no CUDA GPU: --compile %s rows are recorded as skipped (it captures a CUDA graph)", STEP_GRAPH)
    jobs = _jobs(args)
    if args.merge:
        # keep the earlier run's rows for what this run does not measure again
        again = {_slot(j) for j in jobs}
        result["rows"] = [r for r in json.loads(Path(args.merge).read_text())["rows"] if _slot(r) not in again]
    for job in jobs:
        row = {k: v for k, v in job.items() if k != "overrides"}
        skip = ("skipped (time budget)" if time.perf_counter() > deadline
                else NEEDS_CUDA if job["compile"] == STEP_GRAPH and device.type != "cuda" else None)
        if skip is not None:
            row["status"] = skip
            result["rows"].append(row)
            continue
        try:
            cfg = compose_model_config(job["overrides"])
            length = job.get("length") or int(cfg.data.seq_len)
            batch = job.get("batch") or int(cfg.data.batch_size)
            if args.quick:
                batch = min(batch, 2)
            row.update(length=length, batch=batch, d_model=int(cfg.model.d_model), n_layers=int(cfg.model.n_layers))
            row.update(measure(cfg, batch, length, device, args.warmup, args.iters, compile_mode=job["compile"],
                               profile_steps=args.profile_steps, deadline=deadline,
                               top_kernels=args.top_kernels, key_mask=args.mask, seed=args.seed), status="ok")
        except BudgetExceeded:
            row["status"] = "skipped (time budget)"
        except torch.OutOfMemoryError:
            row["status"] = "OOM"
        except Exception as err:  # recorded, so one broken family does not stop the table (the row says why)
            row["status"] = "error: " + " ".join(f"{type(err).__name__}: {err}".split())[-240:].replace("|", "/")
            log.exception("%s failed", job["model"])
        if device.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()
        log.info("%s", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
        result["rows"].append(row)
        write_outputs(out, result, claims)  # after each row: a killed run keeps what it measured
    result["wall_s"] = time.perf_counter() - start
    write_outputs(out, result, claims)
    return result


def _mib(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:,.0f}"


def _ratio(a, b):
    return None if a is None or b is None or not b else a / b


def _fmt(v, suffix="x", digits=2) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}{suffix}"


def _mean_stat(row: dict, name: str) -> float | None:
    """The mean over layers of a model statistic the bench recorded (`stats`: "<name>/layer_<i>" keys), or None."""
    values = [v for k, v in row.get("stats", {}).items() if k.rsplit("/layer_", 1)[0] == name]
    return sum(values) / len(values) if values else None


def _point(row: dict) -> tuple:
    """What a row is compared within: its setting, length and compile mode."""
    return row["setting"], row.get("length"), row.get("compile", "none")


def _setting_label(row: dict) -> str:
    """A row's setting as the tables name it: "text 4K B8", "length 16K B2"."""
    n = row.get("length")
    size = "" if n is None else f" {n // 1024}K" if n >= 1024 and n % 1024 == 0 else f" {n}"
    return f"{row['setting']}{size}" + (f" B{row['batch']}" if "batch" in row else "")


def markdown(result: dict, claims: list[dict] | None = None) -> str:
    """The tables of docs/benchmarks.md "Model-level": the Text setting (eager and compiled, GPU-busy %, kernels per
    step, ratios to the SDPA and materialized Transformers of the same compile mode, the papers' claims), speed
    against SDPA across lengths, and the SeqBoat Table 6 layout."""
    env = result["environment"]
    quick = result.get("quick", False)
    lines = [f"Device: {env['device']}; host: {env.get('host', 'not recorded')}; torch {env['torch']}, "
             f"triton {env['triton']}, CUDA {env['cuda']}; {env['dtype']}.",
             f"Code: {env.get('code') or 'not recorded'}; command: `{env['command']}`.",
             "Key mask of the full-length batches (`--mask`): "
             + ", ".join(sorted({r.get("mask", "full") for r in result["rows"]})) + ".", ""]
    if quick:
        lines += ["**Toy models** (`--quick`: width 32, one layer, short sequences): a smoke test of the benchmark, "
                  "not the papers' setting; no paper claims are shown beside them.", ""]
    # every Text and length row, each against the Transformers of its own setting, length and compile mode
    rows = [r for r in result["rows"] if r["setting"] in ("text", "length")]
    ok = {_point(r) + (r["model"],): r for r in rows if r.get("status") == "ok"}
    lines += ["| Setting | Model | Compile | Params | Train ms/step | Train tok/s | Peak MiB | GPU busy | "
              "Kernels/step | Speed vs SDPA | Speed vs materialized | Mem vs materialized | Eval tok/s | "
              "Papers' claim vs Transformer |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mode, where = r.get("compile", "none"), _setting_label(r)
        if r.get("status") != "ok":
            lines.append(f"| {where} | {r['model']} | {mode} | {r.get('status')} |||||||||||")
            continue
        base, sdpa = (ok.get(_point(r) + (name,)) for name in ("transformer_materialized", "transformer_sdpa"))
        said = "" if quick or r["setting"] != "text" else "; ".join(
            f"{c['paper']} {c['speed']}x" + (f" / {c['memory']}x" if c.get("memory") else "")
            for c in claims or [] if c["model"] == r["model"] and c["baseline"] == "transformer")
        lines.append(
            f"| {where} | {r['model']} | {mode} | {r['params'] / 1e6:.2f}M | {r['train_ms']:.1f} "
            f"| {r['train_tokens_per_s']:,.0f} | {_mib(r['peak_mem_mib'])} "
            f"| {_fmt(r.get('gpu_busy', math.nan) * 100, '%', 0)} "
            f"| {_fmt(r.get('kernels_per_step'), '', 0)} "
            f"| {_fmt(_ratio(r['train_tokens_per_s'], sdpa and sdpa['train_tokens_per_s']))} "
            f"| {_fmt(_ratio(r['train_tokens_per_s'], base and base['train_tokens_per_s']))} "
            f"| {_fmt(_ratio(r['peak_mem_mib'], base and base['peak_mem_mib']))} | {r['eval_tokens_per_s']:,.0f} "
            f"| {said or '–'} |")
    sweep = [r for r in result["rows"] if r["setting"] in ("text", "length") and "length" in r]
    lengths = sorted({r["length"] for r in sweep})
    keys = list(dict.fromkeys((r["model"], r.get("compile", "none")) for r in sweep))
    cell = {(r["model"], r.get("compile", "none"), r["length"]): r for r in sweep}
    per_step = sorted({r["batch"] * r["length"] for r in sweep if "batch" in r})
    lines += ["", "Training speed relative to the SDPA Transformer of the same compile mode (tokens/s in brackets)"
              + (f", {' or '.join(map(str, per_step))} tokens per step:" if per_step else ":"), "",
              "| Model | Compile | " + " | ".join(f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths) + " |",
              "|---|---|" + "---|" * len(lengths)]
    for model, mode in keys:
        texts = []
        for n in lengths:
            r, ref = cell.get((model, mode, n), {}), cell.get(("transformer_sdpa", mode, n), {})
            if r.get("status") != "ok":
                texts.append(str(r.get("status", "–")))
                continue
            vs = _ratio(r["train_tokens_per_s"], ref.get("train_tokens_per_s") if ref.get("status") == "ok" else None)
            texts.append(f"{_fmt(vs)} ({r['train_tokens_per_s']:,.0f})")
        lines.append(f"| {model} | {mode} | " + " | ".join(texts) + " |")
    routed = [(r, rate) for r in result["rows"]
              if r.get("status") == "ok" and (rate := _mean_stat(r, "act_rate")) is not None]
    if routed:
        lines += ["", "Tokens the router activated (SeqBoat's `act_rate`, mean over layers, in one training step after "
                  "the timed ones, starting from the `--seed` initialization): its attention's work, and so its step "
                  "time, follows this share.", "",
                  "| Model | Setting | Length | Compile | Activated |", "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r.get('task') or r['setting']} | {r.get('length', '–')} | "
                  f"{r.get('compile', 'none')} | {rate:.1%} |" for r, rate in routed]
    t6 = [r for r in result["rows"] if r["setting"] == "table6"]
    if t6:
        claims6 = {} if quick else {(c["model"], c["task"]): c for c in claims or [] if c["baseline"] == "mega"}
        lines += ["", "SeqBoat Table 6 layout, relative to MEGA of the same compile mode (train speed / train memory / "
                  "eval speed; the paper's numbers in brackets):", "",
                  "| Model | Compile | " + " | ".join(TABLE6_TASKS) + " |", "|---|---|" + "---|" * len(TABLE6_TASKS)]
        by = {(r["model"], r.get("compile", "none"), r["task"]): r for r in t6}
        for mode in dict.fromkeys(r.get("compile", "none") for r in t6):
            for m in TABLE6_MODELS:
                texts = []
                for t in TABLE6_TASKS:
                    r, ref = by.get((m, mode, t), {}), by.get(("mega", mode, t), {})
                    if r.get("status") != "ok" or ref.get("status") != "ok":
                        texts.append(str(r.get("status", "–")) if r.get("status") != "ok"
                                     else f"MEGA {ref.get('status')}")
                        continue
                    text = (f"{r['train_tokens_per_s'] / ref['train_tokens_per_s']:.2f} / "
                            f"{_ratio(r['peak_mem_mib'], ref['peak_mem_mib']):.2f} / "
                            f"{r['eval_tokens_per_s'] / ref['eval_tokens_per_s']:.2f}")
                    c = claims6.get((m, t))
                    texts.append(text + (f" [{c['speed']} / {c['memory']} / {c['eval_speed']}]" if c else ""))
                lines.append(f"| {m} | {mode} | " + " | ".join(texts) + " |")
    return "\n".join(lines) + "\n"


def _count(least: int):
    """An argparse type: a whole number >= `least` (`--iters 0` timed no step and filled every row with a
    ZeroDivisionError)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} must be >= {least}")
        return value

    return parse


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0 (`inf`: no budget). `--budget-s 0` or a negative budget skipped
    every row and wrote that table over --out with exit status 0; `nan` was no budget at all."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:  # nan too
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds > 0")
    return value


def merge_problem(path: str, device: str, quick: bool) -> str | None:
    """Why the rows of `path` (`--merge`) cannot join this run's table, or None. The table has one header naming the
    device and whether the models are toys: rows measured elsewhere (a GPU's rows merged into a CPU run, or a CPU's
    toy rows into a GPU's table) would be labelled as this run's."""
    try:
        earlier = json.loads(Path(path).read_text())
        rows, env = earlier["rows"], earlier.get("environment") or {}
        if not isinstance(rows, list):
            raise TypeError("its rows are not a list")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"--merge {path}: not a readable bench JSON ({type(err).__name__}: {err})"
    theirs = (env.get("device", device), bool(earlier.get("quick", False)))
    if theirs != (device, quick):
        def what(name, toy):
            return f"{name}{' (--quick toy models)' if toy else ''}"

        return (f"--merge {path}: its rows were measured on {what(*theirs)}, this run measures on "
                f"{what(device, quick)}; a table has one device, so write this run to another --out")
    return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m longmixer.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models and lengths (CPU smoke test)")
    parser.add_argument("--out", default="bench_out/model_bench.json")
    parser.add_argument("--budget-s", type=_seconds, default=230.0,
                        help="stop measuring after this many seconds (> 0; inf: no budget), also inside a job (rows left "
                             "are 'skipped')")
    parser.add_argument("--compile", nargs="+", default=None, choices=BENCH_COMPILE_MODES,
                        help="compile modes to measure each model in (default: none and step-graph on a GPU, "
                             "the mode task.compile=auto trains fixed-shape data with on one GPU; none on CPU); "
                             "step-graph: blocks compiled as default, the whole step captured in one CUDA graph "
                             "(CUDA only); reduce-overhead: the mode auto falls back to where a run cannot be "
                             "captured whole (data-parallel, gradient accumulation, ...)")
    parser.add_argument("--profile-steps", type=_count(0), default=3,
                        help="steps traced by torch.profiler for GPU-busy %% and kernels per step (CUDA only; 0: off)")
    parser.add_argument("--warmup", type=_count(0), default=2)
    parser.add_argument("--iters", type=_count(1), default=5, help="timed steps per row (>= 1)")
    parser.add_argument("--top-kernels", type=_count(0), default=0,
                        help="record the N most expensive GPU kernels of a profiled step in each JSON row")
    parser.add_argument("--models", nargs="*", default=None, help="only these models (e.g. transformer_sdpa chela)")
    parser.add_argument("--settings", nargs="*", default=None, choices=("text", "length", "table6"))
    sweep = ", ".join(str(n) for n in LENGTHS if n != TEXT_LENGTH)
    parser.add_argument("--lengths", nargs="+", type=int, default=None,
                        help=f"only these points of the length sweep ({sweep}; 32K tokens per step): "
                             "--settings length --lengths 16384 measures 16K, batch 2")
    parser.add_argument("--mask", default="none", choices=KEY_MASKS,
                        help="the key mask of the batches, whose sequences are all full-length: none (every model's "
                             "unmasked path) or full (an all-true mask, the path of a padded task's batches)")
    parser.add_argument("--merge", default=None, help="an earlier JSON of the same device (and --quick or not): its "
                        "rows stay for what is not measured again")
    parser.add_argument("--seed", type=int, default=0,
                        help="each job's model and batch are drawn from this seed (the same for every job)")
    args = parser.parse_args(argv)
    if Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a directory; give the JSON file to write, e.g. "
                     f"--out {Path(args.out) / 'model_bench.json'}")
    known = sorted(name for name, _ in model_specs("text", quick=True))  # every setting times these models
    unknown = [name for name in args.models or () if name not in known]
    if unknown:  # a typo measured nothing and wrote an empty table over --out
        close = [difflib.get_close_matches(name, known, n=1) for name in unknown]
        hint = "".join(f" (did you mean {c[0]}?)" for c in close if c) if len(unknown) == 1 else ""
        parser.error(f"--models {' '.join(unknown)}: no such model{hint}; the models are {', '.join(known)}")
    if args.lengths and args.settings is not None and "length" not in args.settings:
        parser.error(f"--lengths picks points of the length sweep, which --settings {' '.join(args.settings)} "
                     "does not measure; add length to --settings")
    quick = args.quick or not torch.cuda.is_available()  # a CPU measures the --quick toy models (`run`)
    try:
        sweep_points(quick, args.lengths)
    except ValueError as err:
        parser.error(str(err))
    if args.merge and (problem := merge_problem(args.merge, device_name(torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")), quick)):
        parser.error(problem)
    if args.compile is None:
        args.compile = ["none", STEP_GRAPH] if torch.cuda.is_available() else ["none"]
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    result = run(args)  # writes --out and its .md
    sys.stdout.write(markdown(result, paper_claims()))
    measured = {_slot(j) for j in _jobs(args)}  # an error row kept by --merge is an earlier run's
    failed = [r for r in result["rows"] if str(r.get("status", "")).startswith("error") and _slot(r) in measured]
    if failed:
        sys.stdout.flush()
        sys.exit(f"{len(failed)} of the {len(measured)} rows measured failed (their status says why; the rest of the "
                 f"table is in {args.out}): " + ", ".join(f"{_setting_label(r)} {r['model']} {r.get('compile', 'none')}"
                                                          for r in failed))
    return result


@quiet_on_closed_stdout
def cli(argv: list[str] | None = None) -> None:
    """The `longmixer-bench` console script and `python -m`: `main` without its return value (the results), which the
    script wrapper would take for an exit status; a reader that stops early ends it quietly."""
    main(argv)


if __name__ == "__main__":
    cli(sys.argv[1:])
