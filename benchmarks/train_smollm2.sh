#!/usr/bin/env bash
# Self-distil SmolLM2-135M-Instruct, train DFlash + Domino drafters (same data, same steps),
# evaluate tau on held-out prompts (ar/dflash/domino, T=0 and T=1). ~8 min on one H200.
# Results: $OUT/train_smollm2.json (or benchmarks/results/train_smollm2.json).
# Extra arguments are passed through (e.g. --steps 800 --num-prompts 2000).
# CPU smoke test of the same pipeline: benchmarks/train_smollm2.sh --tiny
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null || true
exec "$PY" benchmarks/train_smollm2.py \
  --num-prompts 3000 --max-new-tokens 160 --max-prompt-len 160 --gen-batch 256 \
  --steps 1200 --batch-size 32 --max-length 320 --num-anchors 64 --lr 6e-4 \
  --draft-layers 2 --block-size 16 --gru-hidden-dim 256 --emb-dim 64 \
  --eval-prompts 64 --eval-max-new-tokens 128 --temperatures 0,1 --deadline 460 "$@"
