#!/usr/bin/env bash
# The whole pipeline on generated data, no download: bash examples/quickstart.sh [WORK_DIR]
# Add --device cuda to any command to run it on a GPU (auto picks one when CuPy sees it).
set -euo pipefail
WORK=${1:-work}
ncf prepare synthetic --out "$WORK/data/synthetic" --seed 0
ncf train "$WORK/data/synthetic" --out "$WORK/runs/synthetic"
ncf eval "$WORK/runs/synthetic" --k 1 5 10 20                # sampled protocol (100 negatives)
ncf eval "$WORK/runs/synthetic" --k 10 --full-ranking        # every unseen item is a candidate
ncf export "$WORK/runs/synthetic" --onnx --triton "$WORK/triton"
ncf recommend "$WORK/runs/synthetic" --user 1 --user 2 -k 5 --json
python "$(dirname "$0")/serve_onnx.py" "$WORK/runs/synthetic/export" 1 -k 5
