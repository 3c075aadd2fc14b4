#!/usr/bin/env bash
# The frameworks' default KLs head to head on SmolLM2, and each framework's own remedy (issue 35, items 2 and 3):
# one `klgrad compare` grid, pinned to REV, at the same nominal KL strength (--beta-scale length). The protocol
# and why: docs/frameworks.md, "Head to head on SmolLM2 (protocol)".
#
#   REV=$(git rev-parse HEAD) OUT=runs/frameworks_smollm2 bash experiments/smollm2_frameworks/frameworks_grid.sh
#
# Design (pre-registered; change it only before the first run, into a new OUT):
#   config configs/smollm2_sharpen.yaml, 40 steps, seeds 0..7 (SEEDS=8), β = 0.5 at sequence level, every method with
#   algo.shaping rloo, lr 3e-6 cosine, grad clip 1.0 and the policy-gradient aggregation of the config (token sum):
#   only the KL term differs. Methods:
#     trl/grpo-k3                    TRL < 1.10 default (k3 in the loss, batch token mean)
#     trl/grpo-k3-bias-correction    TRL >= 1.10 default (k3 x pi/pi_old, batch token mean)
#     verl/kl-loss-low-var-kl        verl's default KL loss (k3, clamped, batch token mean)
#     openrlhf/k1-reward             OpenRLHF's default (k1 in the reward, reward-to-go, clamped, token mean)
#     k2_as_loss                     klgrad's exact sequence-level head (--level sequence, token sum)
#     none                           no KL
#     trl/rloo-k1-reward             TRL's own flags for the exact gradient (RLOOTrainer, k1 summed in the reward)
#     verl/kl-reward-gae             verl's own flags for the exact gradient (use_kl_in_reward, GAE gamma=lambda=1)
#   Primary: k2_as_loss < trl/grpo-k3-bias-correction on the final KL(pi||pi_ref) (stepwise, held-out prompts).
#
# One `klgrad compare` invocation per seed (--only-seeds), every method of that seed in it, so each seed's pair
# completes together and a stopped grid is resumed by running the script again (finished runs are skipped,
# interrupted ones resume). Sequential seeds share OUT (L̄ is measured by the first invocation and reused);
# PARALLEL=N runs N seeds at once (a CUDA machine), each into OUT/seedS with L̄ measured once beforehand and given
# (--beta-scale length=L, L from `klgrad compare mean-length`), then merges them into OUT (`klgrad compare merge`,
# by this tree's klgrad). With SPLIT=methods each (seed,
# method) is its own process instead (--only-methods, into OUT/seedS-mI), queued seed by seed, so N processes keep a
# machine busy with fewer seeds and a stopped queue leaves whole seeds behind it.
#
# Environment (defaults in brackets): REV [required; "none" runs this tree unpinned, for dry runs], OUT [required],
# CONFIG [configs/smollm2_sharpen.yaml], STEPS [40], SEEDS [8], RUN_SEEDS [0..SEEDS-1], BETAS [0.5; a second beta,
# e.g. 0.5,0.1, doubles the cost and adds a frontier], LR [3e-6], KL_PROMPTS [22], KL_SAMPLES [16],
# PARALLEL [1], SPLIT [seeds; or methods], LBAR [measured; give the L̄ a grid recorded to continue it on another
# machine: a seed's β' must be the grid's], PYTHON [python3], EXTRA [more klgrad compare flags, word-split].
# The pinned command is re-executed by the pinned revision with its arguments as given, so its flags are the
# spellings that revision knows (--kl-prompts, --converge-gap; this klgrad accepts them too).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

REV=${REV:?set REV (a commit to pin, or none)}
OUT=${OUT:?set OUT}
CONFIG=${CONFIG:-configs/smollm2_sharpen.yaml}
STEPS=${STEPS:-40}
SEEDS=${SEEDS:-8}
RUN_SEEDS=${RUN_SEEDS:-$(seq -s ' ' 0 $((SEEDS - 1)))}
BETAS=${BETAS:-0.5}
LR=${LR:-3e-6}
KL_PROMPTS=${KL_PROMPTS:-22}
KL_SAMPLES=${KL_SAMPLES:-16}
PARALLEL=${PARALLEL:-1}
SPLIT=${SPLIT:-seeds}
PYTHON=${PYTHON:-python3}
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"

METHODS=trl/grpo-k3,trl/grpo-k3-bias-correction,verl/kl-loss-low-var-kl,openrlhf/k1-reward,k2_as_loss,none
METHODS=$METHODS,trl/rloo-k1-reward,verl/kl-reward-gae
PRIMARY="k2_as_loss<trl/grpo-k3-bias-correction:kl"
SHARED=(--algo.shaping rloo --optim.lr "$LR" --optim.schedule cosine --optim.grad_clip 1.0)
PIN=()
[ "$REV" = none ] || PIN=(--pin "$REV")

compare() {  # compare OUT_DIR SEED BETA_SCALE [more flags]
  "$PYTHON" -m klgrad compare "${PIN[@]}" --config "$CONFIG" --out "$1" --seeds "$SEEDS" --only-seeds "$2" \
    --steps "$STEPS" --betas "$BETAS" --level sequence --methods "$METHODS" --beta-scale "$3" \
    --primary "$PRIMARY" --converge-gap 0.08 --kl-prompts "$KL_PROMPTS" --kl-samples "$KL_SAMPLES" \
    --no-checkpoints "${SHARED[@]}" "${EXTRA_ARGS[@]}" "${@:4}"
}

mkdir -p "$OUT"
if [ "$PARALLEL" -le 1 ]; then
  for s in $RUN_SEEDS; do
    echo "== seed $s: $(date -u +%FT%TZ)"
    compare "$OUT" "$s" "length${LBAR:+=$LBAR}"
  done
  exit 0
fi

# seeds at once, each into its own folder, one L̄ given to all of them (recorded as given)
LBAR=${LBAR:-$(PYTHONPATH=${PYTHONPATH:-src} "$PYTHON" -m klgrad compare mean-length --config "$CONFIG" "${SHARED[@]}")}
echo "L̄ = $LBAR tokens (the reference's mean response length)"
pids=()
dirs=()
IFS=, read -r -a METHOD_LIST <<< "$METHODS"
for s in $RUN_SEEDS; do
  if [ "$SPLIT" = methods ]; then
    for i in "${!METHOD_LIST[@]}"; do
      compare "$OUT/seed$s-m$i" "$s" "length=$LBAR" --only-methods "${METHOD_LIST[$i]}" > "$OUT/seed$s-m$i.log" 2>&1 &
      pids+=($!)
      dirs+=("$OUT/seed$s-m$i")
      while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do sleep 2; done
    done
  else
    compare "$OUT/seed$s" "$s" "length=$LBAR" > "$OUT/seed$s.log" 2>&1 &
    pids+=($!)
    dirs+=("$OUT/seed$s")
    while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do sleep 5; done
  fi
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
"$PYTHON" -m klgrad compare merge "${dirs[@]}" --out "$OUT"
exit $status
