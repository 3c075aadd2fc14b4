#!/usr/bin/env bash
# Issue 37, item 3 on the real model: SmolLM2-135M-Instruct's k3_as_loss against TRL >= 1.10's default
# (trl/grpo-k3-bias-correction), each with a float32 sampler (no mismatch), a bf16 sampler without correction and a
# bf16 sampler with token-level truncated IS. Paired seeds: a seed's runs share prompts and sampling draws.
# One klgrad compare grid per sampler/correction under $ROOT/smollm2_<name>, pinned to $REV so that code work
# beside it cannot change it. Resumable: a finished run is skipped.
#   REV=$(git rev-parse HEAD) bash experiments/mismatch/mismatch_smollm2.sh
#   PYTHONPATH=src python experiments/mismatch/mismatch_report.py experiments/mismatch --prefix smollm2
set -euo pipefail
REV=${REV:?set REV to the commit to pin}
ROOT=${ROOT:-experiments/mismatch}
SEEDS=${SEEDS:-0 1 2}
STEPS=${STEPS:-20}
METHODS=k3_as_loss,trl/grpo-k3-bias-correction
for s in $SEEDS; do
  for setting in "fp32 null none" "bf16_none bfloat16 none" "bf16_token bfloat16 token"; do
    read -r name dtype correction <<<"$setting"
    klgrad compare --pin "$REV" --config configs/smollm2_sharpen.yaml --methods "$METHODS" --seeds 3 \
      --only-seeds "$s" --steps "$STEPS" --betas 0.5 --algo.shaping rloo --rollout.prompts_per_step 4 \
      --train.eval_every "$STEPS" --train.save_every "$STEPS" --kl-prompts 10 --kl-samples 8 \
      --reward.timeout_s 60 --rollout.sampler_dtype "$dtype" --rollout.mismatch_correction "$correction" \
      --no-checkpoints --out "$ROOT/smollm2_$name"
  done
done
