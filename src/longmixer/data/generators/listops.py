"""A seeded reimplementation of the LRA ListOps generator (Tay et al. 2021, arXiv:2011.04006; the logic of
`lra_benchmarks/data/listops.py` as described in shared/research/frameworks.md section 3.1).

Differences from the original, all deliberate: the RNG is seeded (`random.Random(seed)`), and deduplication keeps
first-generation order instead of Python set order, so the same seed gives byte-identical files.
"""

from __future__ import annotations

import csv
import multiprocessing
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from longmixer.data.generators.workers import exit_with_parent
from longmixer.utils.errors import UserFacingError

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")  # [FIRST and [LAST are defined but disabled in LRA
END = "]"
VALUE_P = 0.25  # a node becomes a leaf when r > VALUE_P: leaf probability 0.75


class ListOpsSpecError(UserFacingError, ValueError):
    """A generator spec that cannot give the number of distinct examples asked for."""


@dataclass(frozen=True)
class ListOpsSpec:
    """Generator settings; the defaults are LRA's (`basic` task)."""

    num_train: int = 96_000
    num_val: int = 2_000
    num_test: int = 2_000
    max_depth: int = 10
    max_args: int = 10
    min_length: int = 500   # exclusive: LRA keeps min_length < length < max_length
    max_length: int = 2_000

    def __post_init__(self):
        if not 0 <= self.min_length < self.max_length:
            raise ValueError(f"ListOps min_length={self.min_length} must be >= 0 and < max_length={self.max_length}")
        if self.max_args < 2 or self.max_depth < 2:
            raise ValueError(f"ListOps max_args={self.max_args} and max_depth={self.max_depth} must be >= 2")


def sample_tree(rng: random.Random, depth: int, spec: ListOpsSpec):
    """A leaf digit, or a left-nested binary tuple `((((op, c1), c2), ..., cn), "]")`."""
    r = rng.random() if depth < spec.max_depth else 1.0
    if r > VALUE_P:
        return rng.randint(0, 9)
    n_args = rng.randint(2, spec.max_args)
    op = rng.choice(OPERATORS)
    node = op
    for _ in range(n_args):
        node = (node, sample_tree(rng, depth + 1, spec))
    return (node, END)


def tree_length(tree) -> int:
    """Tokens without parentheses: a leaf is 1, an operator node 2 (op and `]`) plus its children."""
    if isinstance(tree, tuple):
        return tree_length(tree[0]) + tree_length(tree[1])
    return 1


def to_string(tree) -> str:
    """LRA's rendering: every binary pair wrapped as `( left right )`."""
    if isinstance(tree, tuple):
        return f"( {to_string(tree[0])} {to_string(tree[1])} )"
    return str(tree)


def evaluate(tree) -> int:
    """The answer 0-9: MIN, MAX, MED = int(median) (even counts average then truncate), SM = sum mod 10."""
    if not isinstance(tree, tuple):
        return int(tree)
    args, node = [], tree[0]
    while isinstance(node, tuple):
        args.append(evaluate(node[1]))
        node = node[0]
    args.reverse()
    op: Callable = {"[MIN": min, "[MAX": max, "[MED": lambda a: int(np.median(a)),
                    "[SM": lambda a: sum(a) % 10}[node]
    return int(op(args))


SHARD = 512  # samples per generator shard: the unit of parallel work; fixed, so the output never depends on workers
SHARD_TRIES = 100 * SHARD  # draws a shard makes at most
STALL_SHARDS = 8  # consecutive shards that add no new example before `generate` gives up on its spec


def _shard(spec: ListOpsSpec, seed: int, index: int) -> list[tuple[str, int]]:
    """SHARD (source, target) pairs with min_length < length < max_length from shard `index`'s own RNG."""
    rng = random.Random(f"listops:{seed}:{index}")  # str seeds hash deterministically (sha512)
    out = []
    # a spec that no tree meets would loop forever: stop after SHARD_TRIES draws (LRA's lengths accept about 8% of
    # the trees, so a shard of theirs ends after about 6,000 draws and never meets the cap)
    for _ in range(SHARD_TRIES):
        tree = sample_tree(rng, 1, spec)
        if spec.min_length < tree_length(tree) < spec.max_length:
            out.append((to_string(tree), evaluate(tree)))
            if len(out) == SHARD:
                break
    return out


def _shard_args(args: tuple) -> list[tuple[str, int]]:
    return _shard(*args)


def generate(spec: ListOpsSpec, seed: int, progress: Callable[[int], None] | None = None,
             workers: int = 1) -> Iterator[tuple[str, int]]:
    """Unique (source, target) pairs with min_length < length < max_length.

    Samples come from shards 0, 1, 2, ... (each with its own seeded RNG) read in shard order and deduplicated in
    that order, so the result depends only on `spec` and `seed`, never on `workers`: with workers > 1 the shards
    are drawn by a process pool (LRA's rejection sampling at lengths 500-2000 takes minutes on one core).
    """
    total = spec.num_train + spec.num_val + spec.num_test
    seen: set[str] = set()

    def shards(pool):
        index = 0
        while True:
            batch = range(index, index + max(1, workers) * 4)
            yield from (pool.imap(_shard_args, [(spec, seed, i) for i in batch]) if pool is not None
                        else (_shard(spec, seed, i) for i in batch))
            index = batch.stop

    pool = None
    if workers > 1:
        # the workers end with this process, also when it is killed with SIGKILL (generators/workers.py)
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=exit_with_parent,
                                                         initargs=(os.getpid(),))
    try:
        stalled = 0
        for samples in shards(pool):
            before = len(seen)
            for source, target in samples:
                if source in seen:
                    continue
                seen.add(source)
                if progress is not None:
                    progress(1)
                yield source, target
                if len(seen) == total:
                    return
            stalled = stalled + 1 if len(seen) == before else 0
            if stalled == STALL_SHARDS:
                raise ListOpsSpecError(
                    f"the ListOps generator found only {len(seen)} distinct examples with {spec.min_length} < length "
                    f"< {spec.max_length} (max_depth={spec.max_depth}, max_args={spec.max_args}), and its last "
                    f"{STALL_SHARDS} shards of samples added none, short of the {total} asked for "
                    "(data.num_train + data.num_val + data.num_test). Widen data.min_length / data.max_length, raise "
                    "data.max_depth / data.max_args, or ask for fewer examples")
    finally:
        if pool is not None:
            pool.terminate()


def write_tsv_splits(out_dir: Path, spec: ListOpsSpec, seed: int, task: str = "basic",
                     progress: Callable[[int], None] | None = None, workers: int = 1) -> dict[str, Path]:
    """Write `{task}_{train,val,test}.tsv` in the LRA format (header `Source\\tTarget`), train first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    samples = generate(spec, seed, progress, workers)
    paths = {}
    for split, count in (("train", spec.num_train), ("val", spec.num_val), ("test", spec.num_test)):
        paths[split] = out_dir / f"{task}_{split}.tsv"
        with open(paths[split], "w", newline="") as f:
            writer = csv.writer(f, delimiter="\t")
            writer.writerow(["Source", "Target"])
            for _ in range(count):
                writer.writerow(next(samples))
    return paths
