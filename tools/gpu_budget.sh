# Sourced by the prepared GPU commands (experiments/smollm2_frameworks/gpu_frameworks.sh, experiments/smollm2_sharpen_converged/gpu_grid_seeds.sh): a lease is minutes, so
# the work runs under a budget and what finished in it is archived.
#
#   run_within_budget START BUDGET PID...
#
# Waits until every PID has exited or BUDGET seconds have passed since START (epoch seconds), then stops each PID's
# whole process group (every PID must lead its own: start it with `setsid CMD &`, so its children stop with it).
# Prints "budget reached: stopping" when the budget ended the wait. Empty PIDs are skipped.
run_within_budget() {
  local start=$1 budget=$2 p alive
  shift 2
  while :; do
    alive=0
    for p in "$@"; do [ -n "$p" ] && kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    if [ $(( $(date +%s) - start )) -ge "$budget" ]; then echo "budget reached: stopping"; break; fi
    sleep "${BUDGET_POLL_S:-5}"
  done
  for p in "$@"; do [ -n "$p" ] && kill -- "-$p" 2>/dev/null; done
  return 0
}
