#!/usr/bin/env bash
# The TRL matrix: klgrad.integrations.trl's tests under every minor TRL release the integration supports, each
# installed into a throwaway virtual environment over this machine's packages (torch, transformers, datasets:
# `--system-site-packages`, TRL alone `--no-deps`), never touching the environment you run it from. Writes
# docs/trl_matrix.md (klgrad.integrations.trl_support and tests/integrations/test_trl_support.py read it).
#
#   bash tools/trl_matrix.sh                        # every release below, report to docs/trl_matrix.md
#   VERSIONS="1.10.0 1.16.0" bash tools/trl_matrix.sh
#   WHEELS=/path/to/wheels bash tools/trl_matrix.sh # install from downloaded wheels (pip download --no-deps trl==X)
#
# A release whose import klgrad refuses (TRL 1.15 without Triton) is recorded with the refusal, and with what TRL's
# own GRPOTrainer does there (the reason for the refusal), instead of the tests. Minutes per release on 2 cores.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VERSIONS=${VERSIONS:-"1.10.0 1.11.0 1.12.0 1.13.0 1.14.2 1.15.0 1.16.0"}
VENVS=${VENVS:-${TMPDIR:-/tmp}/klgrad-trl-matrix}
REPORT=${REPORT:-$ROOT/docs/trl_matrix.md}
PYTHON=${PYTHON:-python3}
TESTS=(tests/integrations/test_trl.py tests/integrations/test_trl_presets.py tests/integrations/test_trl_example.py)
export PYTHONPATH="$ROOT/src:$ROOT" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

mkdir -p "$VENVS"
rows=()
for version in $VERSIONS; do
  venv="$VENVS/trl-$version"
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$venv"
  source=("trl==$version")
  [ -n "${WHEELS:-}" ] && source=(--no-index --find-links "$WHEELS" "trl==$version")
  "$venv/bin/python" -m pip install --quiet --no-deps "${source[@]}"
  got=$("$venv/bin/python" -c "import trl; print(trl.__version__)")
  [ "$got" = "$version" ] || { echo "trl $version: the venv imports trl $got" >&2; exit 1; }
  echo "== TRL $version ($venv)" >&2
  start=$(date +%s)
  if refusal=$(cd "$ROOT" && "$venv/bin/python" -c "import klgrad.integrations.trl" 2>&1); then
    log="$VENVS/trl-$version.log"
    set +e
    (cd "$ROOT" && "$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}") >"$log" 2>&1
    set -e
    summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$log" | tail -1 | sed -E 's/=+//g; s/ in [0-9.]+s.*//; s/^ +//; s/, [0-9]+ warnings?//')
    note=$(grep -E "^(FAILED|ERROR) " "$log" | head -3 | tr '\n' ';' || true)
  else
    summary="refused at import"
    note=$(printf '%s' "$refusal" | grep -E "^ImportError" | sed 's/^ImportError: //')
    # TRL's own trainer on the embedded model, to show the refusal's reason
    trl_own=$(cd "$ROOT" && "$venv/bin/python" - 2>/dev/null <<'PY' | tail -1
import shutil, tempfile
from importlib.resources import files
from pathlib import Path
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from klgrad.models import load_model_and_tokenizer
d = Path(tempfile.mkdtemp()) / "m"
shutil.copytree(Path(str(files("klgrad") / "assets" / "tiny_addition")), d)
model, tok = load_model_and_tokenizer(str(d), attn_implementation="eager")
data = Dataset.from_list([{"prompt": tok.bos_token + "12+34="}] * 8)
args = GRPOConfig(output_dir=tempfile.mkdtemp(), num_generations=4, per_device_train_batch_size=4, max_steps=1,
                  max_completion_length=4, bf16=False, use_cpu=True, report_to="none", save_strategy="no")
trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                      train_dataset=data, processing_class=tok)
try:
    trainer.train()
    print("TRL's own GRPOTrainer: trains")
except Exception as e:
    print(f"TRL's own GRPOTrainer fails too, at its first training step: {type(e).__name__}: {e}")
PY
)
    note="$note. $trl_own"
  fi
  seconds=$(( $(date +%s) - start ))
  echo "   $summary ($seconds s) $note" >&2
  rows+=("| $version | $summary | $seconds | ${note//|/\\|} |")
done

py() { "$PYTHON" -c "$1"; }
triton=$(py "import importlib.util; print('yes' if importlib.util.find_spec('triton') else 'no')")
dirty=$([ -n "$(git -C "$ROOT" status --porcelain -- src tests tools)" ] && echo " with uncommitted changes" || true)
{
  echo "# klgrad.integrations.trl across TRL releases"
  echo
  echo "Written by \`bash tools/trl_matrix.sh\` on $(date -u +%Y-%m-%d), klgrad at $(git -C "$ROOT" rev-parse --short HEAD)$dirty."
  echo "Each release was installed alone (\`pip install --no-deps trl==X\`) into a virtual environment over this machine's"
  echo "packages: Python $(py 'import platform; print(platform.python_version())'), torch $(py 'import torch; print(torch.__version__)'),"
  echo "transformers $(py 'import transformers; print(transformers.__version__)'), accelerate $(py 'import accelerate; print(accelerate.__version__)'),"
  echo "datasets $(py 'import datasets; print(datasets.__version__)'); Triton installed: $triton; $(nproc) CPU cores"
  echo "($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')). Tests: \`${TESTS[*]}\`"
  echo "(CPU, offline, the embedded tiny model). Seconds are wall time on a shared machine."
  echo
  echo "| TRL | result | seconds | note |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} >"$REPORT"
echo "wrote $REPORT" >&2
