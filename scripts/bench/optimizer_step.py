"""The optimizer part of a training step, behind the same compiled model step: torch's foreach AdamW after
`torch.nn.utils.clip_grad_norm_` (what training ran before) against fused AdamW after `utils/optim.clip_grad_norm`
(training's default on a CUDA GPU without a gradient scaler, `SequenceTask._fused_optimizer`).

For each model (its Text recipe at --batch x --length tokens; the forward compiled as `reduce-overhead` and run under
bf16 autocast, cross-entropy plus the aux losses, backward), each step clips the gradients' norm at 1.0, steps the
optimizer and a per-step LambdaLR schedule, and sets the gradients to None, as the recipes train. Both optimizers
hold the same parameters; the two paths alternate over --repeats rounds. Per round and path: wall ms per step over
--steps steps, then kernels and GPU-kernel ms per step from one profiled pass (`bench.gpu_profile`); the table gives
the medians. Parity first, on the GPU: from equal parameters and gradients, three steps of each path give the same
clipped gradients and parameters (fused and foreach AdamW differ by rounding only).

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 scripts/bench/optimizer_step.py --models las_chunk mega_chunk \
        --csv optimizer_step.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time

import torch
from torch.nn import functional as F

PATHS = ("foreach + torch clip", "fused + clip_grad_norm")


def _optimizers(params: list[torch.Tensor]) -> dict:
    from longmixer.utils.optim import clip_grad_norm

    made = {}
    for path, fused, clip in zip(PATHS, (False, True), (torch.nn.utils.clip_grad_norm_, clip_grad_norm)):
        kind = {"fused": True} if fused else {"foreach": True}
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kind)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 1000))
        made[path] = (opt, sched, clip)
    return made


def parity(device) -> float:
    """Largest relative difference between the two paths, from the same start over three steps: of the clipped
    gradients at each step (Adam's update hides a gradient's scale, so they are compared directly) and of the
    parameters after the last step."""
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = [(256, 256), (256,), (1024, 64), (16,), (3, 5, 7)]
    start = [torch.randn(s, generator=gen, device=device) for s in shapes]
    grads = [[scale * torch.randn(s, generator=gen, device=device) for s in shapes] for scale in (10.0, 0.001, 3.0)]
    seen = []
    for path in PATHS:
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt, sched, clip = _optimizers(params)[path]
        record = []
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            clip(params, 1.0)
            record += [p.grad.clone() for p in params]
            opt.step()
            sched.step()
        seen.append(record + [p.detach() for p in params])
    return max(((a - b).norm() / b.norm()).item() for a, b in zip(*seen))


def measure(name: str, overrides: list[str], args, device) -> list[dict]:
    from hydra.utils import instantiate

    from longmixer.bench import _forward, compile_model, compose_model_config, gpu_profile, make_batch

    torch.manual_seed(0)
    cfg = compose_model_config([*overrides, f"data.seq_len={args.length}"])
    model = instantiate(cfg.model).to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    paths = _optimizers(params)
    x, mask, y = make_batch(cfg, args.batch, args.length, device, "full")  # as measured in docs/benchmarks.md
    net = compile_model(model, "reduce-overhead")

    def step_of(path):
        opt, sched, clip = paths[path]

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out, aux = _forward(net, cfg, x, mask)
                loss = F.cross_entropy(out.float(), y)
                loss = loss + sum(v for k, v in aux.items() if k.startswith("loss/"))
            loss.backward()
            clip(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return step

    steps = {path: step_of(path) for path in PATHS}
    for step in steps.values():  # compile, record the CUDA graphs, create the optimizers' state
        for _ in range(12):
            step()
    rounds = []
    for r in range(args.repeats):
        for path, step in steps.items():
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3 / args.steps
            prof = gpu_profile(step, 10)
            rounds.append({"model": name, "path": path, "round": r, "step_ms": ms, "params": len(params), **prof})
            print(f"{name:12s} {path:24s} round {r}: {ms:.3f} ms/step, GPU {prof['gpu_kernel_ms']:.3f} ms, "
                  f"{prof['kernels_per_step']:.0f} kernels", flush=True)
    return rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["las_chunk", "mega_chunk"],
                        help="bench model names (python -m longmixer.bench's, e.g. chela, las_chunk, mega_chunk)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per round and path")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the two paths alternate within each")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("optimizer_step.py times a compiled GPU training step: it needs a CUDA GPU (skipped)")
        return 0
    from longmixer.bench import host_cpu, model_specs

    device = torch.device("cuda")
    machine = {"gpu": torch.cuda.get_device_name(), "host": host_cpu()}
    print(f"{machine['gpu']}; host {machine['host']}; torch {torch.__version__}")
    err = parity(device)
    print(f"parity: largest relative difference of the clipped gradients and parameters over 3 steps {err:.2e}")
    if err > 1e-5:
        print("parity FAILED")
        return 1
    specs = dict(model_specs("text", quick=False))
    unknown = [m for m in args.models if m not in specs]
    if unknown:
        parser.error(f"--models {unknown} unknown; choose from {sorted(specs)}")
    rows = [{**r, **machine} for name in args.models for r in measure(name, specs[name], args, device)]
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print("\n| model | optimizer path | step ms | GPU-kernel ms | GPU busy | kernels / step |\n|---|---|---|---|---|---|")
    for name in args.models:
        med = {}
        for path in PATHS:
            mine = [r for r in rows if r["model"] == name and r["path"] == path]
            med[path] = {k: statistics.median(r[k] for r in mine) for k in ("step_ms", "gpu_kernel_ms",
                                                                               "kernels_per_step")}
            m = med[path]
            print(f"| {name} | {path} | {m['step_ms']:.2f} | {m['gpu_kernel_ms']:.2f} | "
                  f"{100 * min(1.0, m['gpu_kernel_ms'] / m['step_ms']):.0f}% | {m['kernels_per_step']:.0f} |")
        old, new = (med[p]["step_ms"] for p in PATHS)
        print(f"| {name} | old / new | {old / new:.2f}x | | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
