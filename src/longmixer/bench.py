"""Model-level speed and memory: training-step time, tokens/s and peak memory of every model family, and its
evaluation throughput, against a Transformer with materialized attention (the papers' baseline) and with SDPA.

    python -m longmixer.bench [--quick] [--out bench_out/model_bench.json] [--budget-s 230]

Settings, in order (a time budget skips what does not fit, recorded as "skipped"):
1. `text`: the papers' efficiency setting (CHELA / LongVQ / LaS / SeqBoat Table 1): each family's Text recipe
   (`experiment=<family>/text`) at length 4096, same batch for all (8 sequences, 32K tokens per step).
2. `length`: the same models at 1K, 2K, 4K, 8K, 16K with 32K tokens per step (batch 32 .. 2).
3. `table6`: SeqBoat Table 6 layout: MEGA, MEGA-chunk, SeqBoat-full, SeqBoat on each LRA task's recipe at the MEGA
   recipe's batch size: training-step speed, training memory and evaluation speed relative to MEGA.
Models are built from the model / recipe yamls by Hydra compose (the mixer partials as in training), in bf16
autocast with fp32 weights and AdamW, as the papers trained. Configs that run out of memory are recorded as "OOM".
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from longmixer.utils.compose import CONFIG_DIR, compose, family_of

log = logging.getLogger(__name__)
CONFIGS = Path(CONFIG_DIR)
LENGTHS = (1024, 2048, 4096, 8192, 16384)
TOKENS_PER_STEP = 32768
TABLE6_TASKS = ("listops", "text", "retrieval", "image", "pathfinder", "pathx")
TABLE6_MODELS = ("mega", "mega_chunk", "seqboat_full", "seqboat")
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
        if family == "seqboat":
            specs.append(("seqboat_full", ["experiment=seqboat/text", "model=seqboat_full"]))
    if quick:
        specs = [(n, o + ["model.d_model=32", "model.n_layers=1"]) for n, o in specs]
    return specs


def make_batch(cfg, batch: int, length: int, device):
    """Random inputs of the model's kind (tokens or real features), a full mask, and labels."""
    m = cfg.model
    if m.get("vocab_size") is not None:
        x = torch.randint(1, int(m.vocab_size), (batch, length), device=device)
    else:
        x = torch.randn(batch, length, int(m.d_input), device=device)
    mask = torch.ones(batch, length, dtype=torch.bool, device=device)
    y = torch.randint(0, int(m.num_classes), (batch,), device=device)
    return x, mask, y


def _forward(model, cfg, x, mask):
    head = cfg.model.get("head")
    # two-document heads (Retrieval): the same random document twice costs what two documents cost
    extra = {"inputs2": x, "mask2": mask} if isinstance(head, str) and head.startswith("nli") else {}
    out, aux = model(x, mask, **extra)
    return out, aux


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(cfg, batch: int, length: int, device, warmup: int, iters: int) -> dict:
    """Training-step ms, tokens/s and peak memory; evaluation ms and tokens/s; parameters."""
    from hydra.utils import instantiate

    model = instantiate(cfg.model).to(device)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, mask, y = make_batch(cfg, batch, length, device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def train_step():
        with amp:
            out, aux = _forward(model, cfg, x, mask)
            loss = F.cross_entropy(out.float(), y)
            loss = loss + sum(v for k, v in aux.items() if k.startswith("loss/"))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(fn, n):
        _sync(device)
        start = time.perf_counter()
        for _ in range(n):
            fn()
        _sync(device)
        return (time.perf_counter() - start) / n * 1e3

    model.train()
    for _ in range(warmup):
        train_step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    train_ms = timed(train_step, iters)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    opt.zero_grad(set_to_none=True)
    del opt

    model.eval()

    @torch.no_grad()
    def eval_step():
        with amp:
            _forward(model, cfg, x, mask)

    for _ in range(warmup):
        eval_step()
    eval_ms = timed(eval_step, iters)
    tokens = batch * length
    return {"params": params, "train_ms": train_ms, "train_tokens_per_s": tokens / train_ms * 1e3,
            "peak_mem_mib": peak, "eval_ms": eval_ms, "eval_tokens_per_s": tokens / eval_ms * 1e3}


def plan(quick: bool) -> list[dict]:
    """Every measurement, in priority order: the Text setting, the sweep's ends (1K, 16K), Table 6, the sweep's
    middle (2K, 8K); a time budget cuts from the end."""
    lengths = (64, 128, 32) if quick else LENGTHS
    tokens = 256 if quick else TOKENS_PER_STEP
    text_len = 128 if quick else 4096

    def sweep(points):
        return [{"setting": "length", "model": n, "overrides": o + [f"data.seq_len={length}"], "length": length,
                 "batch": tokens // length} for length in points for n, o in model_specs("length", quick)]

    jobs = [{"setting": "text", "model": n, "overrides": o + [f"data.seq_len={text_len}"], "length": text_len,
             "batch": tokens // text_len} for n, o in model_specs("text", quick)]
    others = [n for n in lengths if n != text_len]
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
    return row["setting"], row["model"], row.get("task"), row.get("length") if row["setting"] != "table6" else None


def environment(device) -> dict:
    import triton

    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "dtype": "bf16 autocast, fp32 weights, AdamW",
            "command": "python -m longmixer.bench " + " ".join(sys.argv[1:])}


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"environment": environment(device), "rows": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    jobs = [j for j in plan(args.quick) if (not args.models or j["model"] in args.models)
            and (not args.settings or j["setting"] in args.settings)]
    if args.merge:
        # keep the earlier run's rows for what this run does not measure again
        again = {_slot(j) for j in jobs}
        result["rows"] = [r for r in json.loads(Path(args.merge).read_text())["rows"] if _slot(r) not in again]
    for job in jobs:
        row = {k: v for k, v in job.items() if k != "overrides"}
        if time.perf_counter() - start > args.budget_s:
            row["status"] = "skipped (time budget)"
            result["rows"].append(row)
            continue
        try:
            cfg = compose_model_config(job["overrides"])
            length = job.get("length") or int(cfg.data.seq_len)
            batch = job.get("batch") or int(cfg.data.batch_size)
            if args.quick:
                batch = min(batch, 2)
            row.update(length=length, batch=batch, d_model=int(cfg.model.d_model), n_layers=int(cfg.model.n_layers))
            row.update(measure(cfg, batch, length, device, args.warmup, args.iters), status="ok")
        except torch.OutOfMemoryError:
            row["status"] = "OOM"
        except Exception as err:  # recorded, so one broken family does not stop the table (the row says why)
            row["status"] = "error: " + " ".join(f"{type(err).__name__}: {err}".split())[-240:].replace("|", "/")
            log.exception("%s failed", job["model"])
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("%s", row)
        result["rows"].append(row)
        out.write_text(json.dumps(result, indent=1))  # after each row: a killed run keeps what it measured
    result["wall_s"] = time.perf_counter() - start
    out.write_text(json.dumps(result, indent=1))
    return result


def _mib(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:,.0f}"


def _ratio(a, b):
    return None if a is None or b is None or not b else a / b


def markdown(result: dict, claims: list[dict] | None = None) -> str:
    """The tables of docs/benchmarks.md "Model-level": text setting with ratios vs both Transformers and the papers'
    claimed ratios, the length sweep, and the Table 6 layout."""
    env = result["environment"]
    rows = [r for r in result["rows"] if r["setting"] == "text"]
    ok = {r["model"]: r for r in rows if r.get("status") == "ok"}
    base, sdpa = ok.get("transformer_materialized"), ok.get("transformer_sdpa")
    lines = [f"GPU: {env['device']}; torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}; {env['dtype']}.",
             f"Command: `{env['command']}`.", "",
             "| Model | Params | Train ms/step | Train tok/s | Peak MiB | Eval tok/s | Speed vs materialized | "
             "Mem vs materialized | Speed vs SDPA | Papers' claimed speed / mem vs Transformer |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | {r.get('status')} |||||||||")
            continue
        said = "; ".join(f"{c['paper']} {c['speed']}x" + (f" / {c['memory']}x" if c.get("memory") else "")
                         for c in claims or [] if c["model"] == r["model"] and c["baseline"] == "transformer")
        speed = _ratio(r["train_tokens_per_s"], base and base["train_tokens_per_s"])
        mem = _ratio(r["peak_mem_mib"], base and base["peak_mem_mib"])
        vs_sdpa = _ratio(r["train_tokens_per_s"], sdpa and sdpa["train_tokens_per_s"])
        f = lambda v, s="x": "–" if v is None or math.isnan(v) else f"{v:.2f}{s}"  # noqa: E731
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['train_ms']:.1f} | {r['train_tokens_per_s']:,.0f}"
                     f" | {_mib(r['peak_mem_mib'])} | {r['eval_tokens_per_s']:,.0f} | {f(speed)} | {f(mem)} | "
                     f"{f(vs_sdpa)} | {said or '–'} |")
    lengths = sorted({r["length"] for r in result["rows"] if r["setting"] in ("text", "length") and "length" in r})
    models = list(dict.fromkeys(r["model"] for r in result["rows"] if r["setting"] in ("text", "length")))
    cell = {(r["model"], r["length"]): r for r in result["rows"] if r["setting"] in ("text", "length")}
    per_step = sorted({r["batch"] * r["length"] for r in result["rows"] if r["setting"] == "length" and "batch" in r})
    lines += ["", f"Training tokens/s (peak MiB) across lengths, {', '.join(map(str, per_step))} tokens per step:", "",
              "| Model | " + " | ".join(f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for m in models:
        texts = []
        for n in lengths:
            r = cell.get((m, n), {})
            texts.append(f"{r['train_tokens_per_s']:,.0f} ({_mib(r['peak_mem_mib'])})" if r.get("status") == "ok"
                         else str(r.get("status", "–")))
        lines.append(f"| {m} | " + " | ".join(texts) + " |")
    t6 = [r for r in result["rows"] if r["setting"] == "table6"]
    if t6:
        claims6 = {(c["model"], c["task"]): c for c in claims or [] if c["baseline"] == "mega"}
        lines += ["", "SeqBoat Table 6 layout, relative to MEGA (train speed / train memory / eval speed; the paper's "
                  "Text numbers in brackets):", "", "| Model | " + " | ".join(TABLE6_TASKS) + " |",
                  "|---|" + "---|" * len(TABLE6_TASKS)]
        by = {(r["model"], r["task"]): r for r in t6}
        for m in TABLE6_MODELS:
            texts = []
            for t in TABLE6_TASKS:
                r, ref = by.get((m, t), {}), by.get(("mega", t), {})
                if r.get("status") != "ok" or ref.get("status") != "ok":
                    texts.append(str(r.get("status", "–")) if r.get("status") != "ok" else f"MEGA {ref.get('status')}")
                    continue
                text = (f"{r['train_tokens_per_s'] / ref['train_tokens_per_s']:.2f} / "
                        f"{_ratio(r['peak_mem_mib'], ref['peak_mem_mib']):.2f} / "
                        f"{r['eval_tokens_per_s'] / ref['eval_tokens_per_s']:.2f}")
                c = claims6.get((m, t))
                texts.append(text + (f" [{c['speed']} / {c['memory']} / {c['eval_speed']}]" if c else ""))
            lines.append(f"| {m} | " + " | ".join(texts) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m longmixer.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models and lengths (CPU smoke test)")
    parser.add_argument("--out", default="bench_out/model_bench.json")
    parser.add_argument("--budget-s", type=float, default=230.0, help="skip what is left after this many seconds")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--models", nargs="*", default=None, help="only these models (e.g. transformer_sdpa chela)")
    parser.add_argument("--settings", nargs="*", default=None, choices=("text", "length", "table6"))
    parser.add_argument("--merge", default=None, help="an earlier JSON: its rows stay for what is not measured again")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    result = run(args)
    import yaml

    claims = yaml.safe_load((Path(__file__).parent / "paper_results.yaml").read_text()).get("efficiency", [])
    table = markdown(result, claims)
    Path(args.out).with_suffix(".md").write_text(table)
    sys.stdout.write(table)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
