#!/usr/bin/env bash
# Run seeds of the sharpening grid (experiments/smollm2_sharpen_converged) one after another into a working grid
# folder, from any checkout: the grid's design exactly as registered, pinned to its commit c798603.
#
#   bash experiments/smollm2_sharpen_converged/sharpen_lane.sh WORK SEED [SEED ...]
#
# WORK starts as a copy of the committed grid.json (its design and the amendment to 56 seeds) unless it holds a
# grid already; a seed killed mid-run resumes there from its last checkpoint (every 6 steps) when the lane is
# started again with it. Each seed is followed by its final measurements afterwards, which need the final weights
# (`klgrad compare measure`: downstream, with the pinned revision's `klgrad eval`, and for a registered seed, 0-15,
# forgetting); then the seed's checkpoints (1.6 GB a run) are deleted. The pinned command is re-executed by
# c798603 with its arguments as given: its flags are the spellings that revision knows. The log marks
# "=== seed S done" when a seed may be merged:
#
#   klgrad compare merge WORK [WORK ...] --only-seeds S,... --out experiments/smollm2_sharpen_converged
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
export OMP_NUM_THREADS=${THREADS:-1} MKL_NUM_THREADS=${THREADS:-1} MPLBACKEND=Agg
cd "$repo"
mkdir -p "$work"
[ -f "$work/grid.json" ] || cp "$grid/grid.json" "$work/grid.json"
for s in "$@"; do
  echo "=== seed $s start $(date -u +%FT%TZ)"
  klgrad compare --pin c798603 --config configs/smollm2_sharpen.yaml --out "$work" \
    --seeds 56 --only-seeds "$s" --steps 60 --betas 0.5 --level sequence --methods k3_as_loss,k2_as_loss \
    --primary "k3_as_loss<k2_as_loss:batch_kl_k1" --converge-gap 0.08 --kl-prompts 22 --kl-samples 16 \
    --algo.shaping rloo --optim.lr 3e-6 --optim.schedule cosine
  rc=$?
  echo "=== seed $s trained rc $rc $(date -u +%FT%TZ)"
  [ $rc -eq 0 ] || continue
  measures=(downstream)
  [ "$s" -lt 16 ] && measures+=(forgetting:samples=4)  # forgetting on the registered seeds only (the amendment)
  klgrad compare measure "$work" "${measures[@]}" --only-seeds "$s" --device cpu
  rc=$?
  echo "=== seed $s measured rc $rc $(date -u +%FT%TZ)"
  [ $rc -eq 0 ] || continue
  rm -rf "$work/runs/k3_as_loss-beta0.5-seed$s/checkpoints" "$work/runs/k2_as_loss-beta0.5-seed$s/checkpoints"
  echo "=== seed $s done $(date -u +%FT%TZ)"
done
