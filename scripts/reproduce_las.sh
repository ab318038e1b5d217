#!/usr/bin/env bash
# Reproduce LaS (arXiv 2311.16620): every results table, three seeds as appendix A states ("each result was
# obtained by averaging over three different seed values"; appendix C's WikiText-103 runs average two).
# Run dirs land in logs/runs/<experiment>/<hash>_seed<N>, and
#   python -m longmixer.report --runs logs/runs --out reports/ --papers las
# puts ours beside the paper's numbers. Data first: `make data TASK=<task>` (docs/data.md).
# GPU counts are what one job needs (80 GB A100/H100). Times are per-seed estimates on one H200, training steps only
# (no validation, no data loading): recipe max_steps x the step time of docs/benchmarks.md "Model-level" (measured at
# the recipe batch for MEGA, MEGA-chunk, SeqBoat(-full); other families scaled by their tokens/s ratio to MEGA at the
# same length). Not measured end to end.
set -euo pipefail
TABLES="all lra mnist ablation lm"
SEEDS=${SEEDS:-0,1,2}
source "$(dirname "$0")/reproduce.inc.sh"  # cd, PY, TABLE (checked)
shift || true

if [[ $TABLE == all || $TABLE == lra ]]; then
  # Table 1 (LRA), LaS rows (full L x L attention: Text and Retrieval at 4K are the heavy ones).
  # 1 GPU each; ListOps ~2 h, Text ~0.5 h, Retrieval ~7 h, Image ~3 h, Pathfinder ~5 h. No Path-X (the paper has none).
  # Those times are bf16 step times; the LaS LRA recipes train in float32, as the paper did (V100s), and a float32
  # ListOps step measured about 3x the bf16 one on an H100 (docs/reproduction.md), so expect up to 3x longer.
  $PY -m longmixer.train -m experiment=las/listops seed=$SEEDS "$@"
  $PY -m longmixer.train -m experiment=las/text seed=$SEEDS "$@"
  $PY -m longmixer.train -m experiment=las/retrieval seed=$SEEDS "$@"
  $PY -m longmixer.train -m experiment=las/image seed=$SEEDS "$@"
  $PY -m longmixer.train -m experiment=las/pathfinder seed=$SEEDS "$@"
  # LaS-chunk rows (chunks of 128, linear in L). 1 GPU each; about half the LaS times.
  $PY -m longmixer.train -m experiment=las/listops model=las_chunk seed=$SEEDS "$@"
  $PY -m longmixer.train -m experiment=las/text model=las_chunk seed=$SEEDS "$@"
  $PY -m longmixer.train -m experiment=las/retrieval model=las_chunk seed=$SEEDS "$@"
  $PY -m longmixer.train -m experiment=las/image model=las_chunk seed=$SEEDS "$@"
  $PY -m longmixer.train -m experiment=las/pathfinder model=las_chunk seed=$SEEDS "$@"
  # The MEGA and MEGA-chunk rows: scripts/reproduce_mega.sh lra.
fi
if [[ $TABLE == all || $TABLE == mnist ]]; then
  # Table 2 (sMNIST, pMNIST; length 784): LaS and the vanilla-attention Transformer on the same block. 1 GPU, ~4 h.
  # (a config group cannot be swept to null: the LaS rows are the recipes alone, the vanilla rows the ablation)
  for task in smnist pmnist; do
    $PY -m longmixer.train -m experiment=las/$task seed=$SEEDS "$@"
    $PY -m longmixer.train -m experiment=las/$task ablation=las/vanilla seed=$SEEDS "$@"
  done
fi
if [[ $TABLE == all || $TABLE == ablation ]]; then
  # Table 3 (smooth / local operators on chunked attention, cT = chunk 128): ListOps, Text, Retrieval, Image.
  # 1 GPU; ~1 h / ~0.5 h / ~4 h / ~2 h per seed and variant. The LaS-attention row is the las_chunk run above.
  for task in listops text retrieval image; do
    $PY -m longmixer.train -m experiment=las/$task model=las_chunk \
      ablation=las/alibi,las/l,las/s,las/smooth_alibi seed=$SEEDS "$@"
  done
fi
if [[ $TABLE == all || $TABLE == lm ]]; then
  # Appendix C (WikiText-103, 12 layers x 768, context 512): vanilla, L-, S- and LaS attention, two seeds as the paper.
  # 4 GPUs, ~2 days per model and seed.
  # DDP jobs run one at a time (Hydra's local multirun and DDP do not mix: README, "Multi-GPU").
  for seed in 0 1; do
    $PY -m longmixer.train experiment=las/wikitext103 seed=$seed trainer=ddp trainer.devices=4 "$@"
    for ablation in las/vanilla las/l las/s; do
      $PY -m longmixer.train experiment=las/wikitext103 ablation=$ablation seed=$seed trainer=ddp trainer.devices=4 "$@"
    done
  done
fi
