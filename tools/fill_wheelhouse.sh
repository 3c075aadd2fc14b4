#!/usr/bin/env bash
# Fill the wheel folder that tools/gpu_check.sh installs from on a GPU machine without network (docs/gpu.md).
# Run it on a machine that reaches the package registry, then copy the folder next to the GPU machine's checkout:
#
#   bash tools/fill_wheelhouse.sh                                  # wheels for this machine's Python and platform
#   bash tools/fill_wheelhouse.sh --python-version 3.11 --platform manylinux2014_x86_64 --only-binary=:all:
#   bash tools/fill_wheelhouse.sh --python-version 3.12 --platform manylinux2014_aarch64 --only-binary=:all:
#
# Extra arguments go to every `pip download` (the target's Python version and platform when they differ from
# this machine's: pip then needs --only-binary=:all:). The requirements are tools/gpu_check.py's
# (--requirements): klgrad's dependencies, its tests' (pytest, hypothesis) and LoRA's (peft). Never torch: peft
# and accelerate require torch, so they are fetched without their dependencies (their other requirements are
# in the list); the GPU machine keeps its own CUDA build of torch.
#
# KLGRAD_WHEELS sets the folder (default: wheels/ in the checkout); PYTHON the interpreter (default: python3).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
DEST=${KLGRAD_WHEELS:-wheels}
mkdir -p "$DEST"

mapfile -t with_deps < <("$PY" tools/gpu_check.py --requirements with-deps)
mapfile -t no_deps < <("$PY" tools/gpu_check.py --requirements no-deps)

# setuptools and wheel: the editable install of klgrad builds with the installed ones (no build isolation)
"$PY" -m pip download --dest "$DEST" "$@" "${with_deps[@]}" "setuptools>=70.1" wheel
"$PY" -m pip download --dest "$DEST" --no-deps "$@" "${no_deps[@]}"

if find "$DEST" -maxdepth 1 \( -iname 'torch-*' -o -iname 'nvidia_*' \) | grep -q .; then
    echo "fill_wheelhouse.sh: a torch or nvidia wheel landed in $DEST; remove it (the GPU machine keeps its own)" >&2
    exit 1
fi
echo "fill_wheelhouse.sh: $(find "$DEST" -maxdepth 1 -type f | wc -l) files, $(du -sh "$DEST" | cut -f1) in $DEST"
