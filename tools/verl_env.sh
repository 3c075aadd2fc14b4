#!/usr/bin/env bash
# Build (or reuse) the separate virtual environment in which klgrad.integrations.verl runs against verl 0.9.1.
#
# Why separate: verl 0.9.1 pins transformers >=5.5.3,<5.11 (and !=5.6.0); klgrad's main environment has a newer
# transformers. Idempotent: a finished environment (marker file present and `import klgrad.integrations.verl`
# working) is left alone and the script exits at once.
#
# What is installed, and why not `pip install verl==0.9.1` with its dependencies:
#   verl's metadata requires ray[default], wandb, datasets, peft, accelerate, torchdata, pandas, hydra-core, ...
#   (no CUDA wheels: those only come with its extras fsdp/megatron/vllm/sglang, and its `cpu` extra pins
#   torch==2.11). The verl modules klgrad uses (trainer.ppo.core_algos, workers.config, workers.utils.losses)
#   import only torch, numpy, omegaconf/hydra, tensordict, ray, transformers, codetiming, packaging, and (through
#   verl.utils.dataset) datasets, pandas and pillow on CPU, so verl is installed with --no-deps and exactly those
#   are added (pip check therefore lists wandb, peft, accelerate, torchdata, ... as missing; that is expected). torch is pinned to the local CPU wheel by constraints/cpu.txt: no nvidia-*
#   wheel can come in, and the script fails if one did.
#
# Usage: tools/verl_env.sh            (environment at ${KLGRAD_VERL_ENV:-.venvs/verl}, relative to the repo)
#        KLGRAD_VERL_ENV=/tmp/v tools/verl_env.sh
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
env_dir="${KLGRAD_VERL_ENV:-.venvs/verl}"
python_bin="${PYTHON:-python3}"
marker="$env_dir/.klgrad-verl-ready"
check='import verl, klgrad.integrations.verl, verl.trainer.ppo.core_algos, verl.workers.utils.losses'

if [[ -f "$marker" ]] && "$env_dir/bin/python" -c "$check" >/dev/null 2>&1; then
  echo "verl env ready: $env_dir"
  exit 0
fi

start=$(date +%s)
rm -f "$marker"
"$python_bin" -m venv "$env_dir"
pip=("$env_dir/bin/python" -m pip --disable-pip-version-check)
constraints=(-c constraints/cpu.txt)

"${pip[@]}" install -q "${constraints[@]}" \
  "torch==2.13.0" \
  "numpy>=2.0.0" \
  "packaging>=20.0" \
  "omegaconf>=2.3" \
  "hydra-core" \
  "codetiming" \
  "tensordict>=0.8.0,<=0.10.0,!=0.9.0" \
  "ray>=2.41.0" \
  "transformers>=5.5.3,<5.11,!=5.6.0" \
  "datasets" \
  "pandas" \
  "pillow"
"${pip[@]}" install -q --no-deps "verl==0.9.1"
# klgrad itself, editable; its verl integration needs only torch (already there), so no dependencies.
"${pip[@]}" install -q --no-deps -e .

if "${pip[@]}" list --format=freeze | grep -qi '^nvidia-'; then
  echo "verl_env.sh: CUDA wheels (nvidia-*) were installed; refusing to continue" >&2
  "${pip[@]}" list --format=freeze | grep -i '^nvidia-' >&2
  exit 1
fi
"$env_dir/bin/python" -c "$check"
touch "$marker"
echo "verl env built in $(( $(date +%s) - start )) s: $env_dir"
