#!/usr/bin/env bash
# Run seeds of the sharpening grid (experiments/smollm2_sharpen_converged) one after another into a working grid
# folder, from any checkout: the grid's design exactly as registered, pinned to its commit c798603.
#
#   bash experiments/smollm2_sharpen_converged/sharpen_lane.sh WORK SEED [SEED ...]
#
# WORK starts as a copy of the committed grid.json (its design and the amendment to 56 seeds) unless it holds a
# grid already; a seed killed mid-run resumes there from its last checkpoint (every 6 steps) when the lane is
# started again with it. Each registered seed (0-15) is followed by its forgetting measurement, which needs the
# final weights; then the seed's checkpoints (1.6 GB a run) are deleted. The log marks "=== seed S done" when a
# seed may be merged:
#
#   klgrad compare --merge WORK [WORK ...] --only-seeds S,... --out experiments/smollm2_sharpen_converged
#
# Two lanes on a 2-core CPU: THREADS=1 (the default) gives each process one thread, so two lanes do not fight
# over both cores. THREADS=2 for one lane alone.
set -u
if [ $# -lt 2 ]; then
  echo "usage: bash experiments/smollm2_sharpen_converged/sharpen_lane.sh WORK SEED [SEED ...]" >&2
  exit 2
fi
work=$(realpath -m "$1"); shift
repo=$(cd "$(dirname "$0")/../.." && pwd)
grid=experiments/smollm2_sharpen_converged
export OMP_NUM_THREADS=${THREADS:-1} MKL_NUM_THREADS=${THREADS:-1} PYTHONPATH="$repo/experiments/smollm2_sharpen_converged" MPLBACKEND=Agg
cd "$repo"
mkdir -p "$work"
[ -f "$work/grid.json" ] || cp "$grid/grid.json" "$work/grid.json"
for s in "$@"; do
  echo "=== seed $s start $(date -u +%FT%TZ)"
  klgrad compare --pin c798603 --config configs/smollm2_sharpen.yaml --out "$work" \
    --seeds 56 --only-seeds "$s" --steps 60 --betas 0.5 --level sequence --methods k3_as_loss,k2_as_loss \
    --primary "k3_as_loss<k2_as_loss:batch_kl_k1" --converge-gap 0.08 --kl-prompts 22 --kl-samples 16 \
    --final-hook downstream=grid_hooks:downstream --algo.shaping rloo --optim.lr 3e-6 --optim.schedule cosine
  rc=$?
  echo "=== seed $s trained rc $rc $(date -u +%FT%TZ)"
  [ $rc -eq 0 ] || continue
  if [ "$s" -lt 16 ]; then  # forgetting is measured on the registered seeds only (grid.json's amendments)
    python experiments/smollm2_sharpen_converged/grid_forgetting.py "$work" --samples 4 --device cpu \
      --only "k3_as_loss-beta0.5-seed$s" "k2_as_loss-beta0.5-seed$s"
    rc=$?
    echo "=== seed $s forgetting rc $rc $(date -u +%FT%TZ)"
    [ $rc -eq 0 ] || continue
  fi
  rm -rf "$work/runs/k3_as_loss-beta0.5-seed$s/checkpoints" "$work/runs/k2_as_loss-beta0.5-seed$s/checkpoints"
  echo "=== seed $s done $(date -u +%FT%TZ)"
done
