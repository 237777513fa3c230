#!/usr/bin/env bash
# The whole pipeline on generated data, no download:
#   bash examples/quickstart.sh [WORK_DIR] [FLAGS FOR ncf prepare synthetic, e.g. --preset ml-1m]
# Add --device cuda to any command to run it on a GPU (auto picks one when CuPy sees it).
# Run again, it replaces its own earlier output in WORK_DIR (--overwrite: never other files).
set -euo pipefail
WORK=${1:-work}
[ $# -gt 0 ] && shift
ncf prepare synthetic --out "$WORK/data/synthetic" --seed 0 --overwrite "$@"
ncf train "$WORK/data/synthetic" --out "$WORK/runs/synthetic" --overwrite
ncf eval "$WORK/runs/synthetic" -k 1 5 10 20                # sampled protocol (100 negatives)
ncf eval "$WORK/runs/synthetic" -k 10 --full-ranking        # every unseen item is a candidate
ncf export "$WORK/runs/synthetic" --onnx --triton "$WORK/triton" --overwrite
ncf recommend "$WORK/runs/synthetic" --user 1 --user 2 -k 5 --exclude-seen --json  # lists to serve
# The served model, on user and item alone, scores user 1 as `recommend --exclude-seen` does
# (it does not know the user's history, so its list may hold items the user already has).
python "$(dirname "$0")/serve_onnx.py" "$WORK/runs/synthetic/export" 1 -k 5
