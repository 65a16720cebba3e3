#!/usr/bin/env bash
# Trains the small M3 (configs/m3_small_kjv.json: 6.96 M parameters, 13.9 MB in bf16; one full-attention + dense-MLP
# layer, four sparse-attention + MoE layers (8 experts, top-2, a shared expert), partial RoPE, SwiGLU-OAI, one MTP
# module; indexer blocks of 32 keys, top-4, so a 512-token row keeps 4 of its 16 blocks) on the King James Bible.
#
#   bash scripts/train_small.sh                  # the full run (one GPU); OUT=... STEPS=... override
#   STEPS=30 BATCH=4 WARMUP=3 INDEXER_WARMUP=10 EVAL_EVERY=10 CHECKPOINT_EVERY=10 OUT=/tmp/m3-small-check \
#     bash scripts/train_small.sh --compute-dtype float32      # a short CPU check
#
# On a machine that cannot reach Debian's archive (the GPU machines), run `python scripts/prepare_kjv.py` where it
# can and bring data/kjv along (it is git-ignored); the script leaves a prepared data/kjv/kjv.txt alone.
# Extra arguments go to `m3jax train`. Rerun the same command to resume after an interruption.
# The router-balancing rate is 10x DeepSeek-V3's 1e-3: a 40-step CPU check of this command saw the busiest expert
# reach 3.5-4x the mean load within 10 steps, and at 1e-3 per step the bias needs hundreds of steps to answer.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" scripts/prepare_kjv.py --out data/kjv
exec "$PY" -m m3jax.cli train \
  --config configs/m3_small_kjv.json \
  --data data/kjv/kjv.txt \
  --out "${OUT:-runs/m3-small-kjv}" \
  --steps "${STEPS:-1500}" \
  --batch "${BATCH:-32}" \
  --seq-len 512 \
  --lr 2e-3 --warmup-steps "${WARMUP:-100}" --min-lr-ratio 0.1 --weight-decay 0.1 --clip-norm 1.0 \
  --mtp-weight 0.3 --indexer-weight 1.0 --indexer-warmup-steps "${INDEXER_WARMUP:-300}" \
  --router-bias-rate 1e-2 \
  --eval-every "${EVAL_EVERY:-100}" --eval-batches 8 --checkpoint-every "${CHECKPOINT_EVERY:-200}" \
  --holdout 0.02 --seed 0 \
  "$@"
