#!/usr/bin/env bash
# Reproduce LongVQ (arXiv 2404.11163): every results table, five seeds where the paper averages five (Table 2).
# Each line is one Hydra multirun (the multi-GPU DDP lines are single runs: Hydra's local multirun and DDP
# do not mix, README "Multi-GPU"); run dirs land in logs/runs/<experiment>/<hash>_seed<N>, and
#   python -m longmixer.report --runs logs/runs --out reports/ --papers longvq
# puts ours beside the paper's numbers. Data first: `make data TASK=<task>` (docs/data.md).
# GPU counts are what one job needs (80 GB A100/H100). Times are per-seed estimates on one H200, training steps only
# (no validation, no data loading): recipe max_steps x the step time of docs/benchmarks.md "Model-level" (measured at
# the recipe batch for MEGA, MEGA-chunk, SeqBoat(-full); other families scaled by their tokens/s ratio to MEGA at the
# same length). Not measured end to end.
set -euo pipefail
TABLES="all lra scifar sc10 lm ablation"
SEEDS=${SEEDS:-0,1,2,3,4}
source "$(dirname "$0")/reproduce.inc.sh"  # cd, PY, TABLE (checked)
shift || true

if [[ $TABLE == all || $TABLE == scifar ]]; then
  # Table 1 (sCIFAR). 1 GPU, ~30 h per seed.
  $PY -m longmixer.train -m experiment=longvq/scifar seed=$SEEDS "$@"
fi
if [[ $TABLE == all || $TABLE == lra ]]; then
  # Table 2 (LRA). 1 GPU each; ListOps ~7 h, Text ~2.5 h, Retrieval ~32 h, Image ~15 h, Pathfinder ~23 h, Path-X ~90 h.
  $PY -m longmixer.train -m experiment=longvq/listops seed=$SEEDS "$@"
  $PY -m longmixer.train -m experiment=longvq/text seed=$SEEDS "$@"
  $PY -m longmixer.train -m experiment=longvq/retrieval seed=$SEEDS "$@"
  $PY -m longmixer.train -m experiment=longvq/image seed=$SEEDS "$@"
  $PY -m longmixer.train -m experiment=longvq/pathfinder seed=$SEEDS "$@"
  $PY -m longmixer.train -m experiment=longvq/pathx seed=$SEEDS "$@"
fi
if [[ $TABLE == all || $TABLE == lm ]]; then
  # Table 3 (WikiText-103; paper 254M parameters, ours 256.4M, 252.3M with model.mixer.tied_qk=true): MEGA's 24
  # GPUs' worth of rows as 8 GPUs x 3 accumulation steps, three times the ~7 days of one row per GPU. One seed.
  $PY -m longmixer.train experiment=longvq/wikitext103 seed=0 trainer=ddp trainer.devices=8 \
    trainer.accumulate_grad_batches=3 "$@"
  # Table 4 (enwik8; paper 47M parameters, ours 47.8M, 47.1M tied): 8 GPUs, ~3 days. One seed.
  $PY -m longmixer.train experiment=longvq/enwik8 seed=0 trainer=ddp trainer.devices=8 "$@"
fi
if [[ $TABLE == all || $TABLE == sc10 ]]; then
  # Table 5 (Speech Commands SC10 raw; paper 542K parameters, ours 559,050, 541,500 with model.mixer.tied_qk=true).
  # 1 GPU, ~30 h per seed.
  $PY -m longmixer.train -m experiment=longvq/sc10 seed=$SEEDS "$@"
fi
if [[ $TABLE == all || $TABLE == ablation ]]; then
  # Table 6 (codebook size 256 / 512 / 1024 and laplace attention on Image, Text, ListOps). 1 GPU;
  # ~15 h / ~2.5 h / ~7 h per seed and variant.
  # The codebook-512 softmax row is the recipe itself: the same run dirs as the LRA table's (a finished run is not
  # trained again), run here so that this table alone is complete.
  for task in image text listops; do
    $PY -m longmixer.train -m experiment=longvq/$task seed=$SEEDS "$@"
    $PY -m longmixer.train -m experiment=longvq/$task \
      ablation=longvq/codebook256,longvq/codebook1024,longvq/laplace seed=$SEEDS "$@"
  done
fi
