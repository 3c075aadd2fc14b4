#!/usr/bin/env bash
# GPU readiness of klgrad in one command, from a fresh clone, with or without network (docs/gpu.md):
#
#   bash tools/gpu_check.sh                      # the check (on a machine with a CUDA GPU)
#   bash tools/gpu_check.sh --device cpu --small # its plumbing on CPU (tiny model, no vLLM)
#
# 1. refuses at once (exit 2) when torch is missing or sees no CUDA GPU (unless --device cpu);
# 2. installs, from the local wheel folder only (wheels/, or $KLGRAD_WHEELS; filled by
#    tools/fill_wheelhouse.sh on a machine with the package registry), the requirements whose module does not
#    import here, with torch pinned to the installed build: torch itself is never installed or replaced;
# 3. installs klgrad from this checkout without dependencies (pip install --no-deps -e .);
# 4. runs tools/gpu_check.py with the same arguments: the table, OUT/gpu_check.json, exit 1 on a failed step.
#
# PYTHON selects the interpreter (default: python3).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
WHEELS=${KLGRAD_WHEELS:-wheels}

"$PY" tools/gpu_check.py --preflight "$@" || exit $?

missing_text=$("$PY" tools/gpu_check.py --missing)
read -r -a missing <<< "$missing_text"
if [ "${#missing[@]}" -gt 0 ]; then
    echo "[gpu_check.sh] missing here: ${missing[*]}"
    if [ ! -d "$WHEELS" ]; then
        echo "[gpu_check.sh] no wheel folder $WHEELS: run tools/fill_wheelhouse.sh on a machine with the package" \
             "registry and copy its wheels/ here (or set KLGRAD_WHEELS), or install them yourself:" \
             "$PY -m pip install ${missing[*]}" >&2
        exit 2
    fi
    pin=$(mktemp)
    trap 'rm -f "$pin"' EXIT
    "$PY" -c 'import torch; print("torch==" + torch.__version__)' > "$pin"
    echo "[gpu_check.sh] installing from $WHEELS with $(cat "$pin") held"
    "$PY" -m pip install --no-index --find-links "$WHEELS" --constraint "$pin" "${missing[@]}"
fi

# this checkout's klgrad, unless it is already the installed one
if ! "$PY" - <<'EOF' 2>/dev/null
import pathlib, sys
import klgrad
sys.exit(0 if pathlib.Path(klgrad.__file__).resolve().is_relative_to(pathlib.Path("src").resolve()) else 1)
EOF
then
    echo "[gpu_check.sh] pip install --no-deps -e . (klgrad from this checkout)"
    "$PY" -m pip install --no-deps --no-build-isolation -e .
fi

exec "$PY" tools/gpu_check.py "$@"
