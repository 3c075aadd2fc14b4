#!/usr/bin/env bash
cd /work/main
for sh in rloo grpo; do
  nice -n 10 python -m klgrad compare --pin e72cc25 --config configs/tiny_add.yaml --out /work/grids/shaping/$sh \
    --seeds 3 --steps 150 --betas 0.5 --level sequence --methods k2_as_loss \
    --converge-gap 0.05 \
    --algo.shaping $sh --optim.schedule cosine || exit 1
done
