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
ncf recommend "$WORK/runs/synthetic" --user 1 --user 2 -k 5 --json
# The served model's scores for user 1, after the item `recommend` scored them after ("after",
# present when the model has an order term, ncf's default on small data with times).
AFTER=$(ncf recommend "$WORK/runs/synthetic" --user 1 -k 1 --json |
  python -c 'import json, sys; a = json.load(sys.stdin).get("after"); print("" if a is None else a)')
python "$(dirname "$0")/serve_onnx.py" "$WORK/runs/synthetic/export" 1 -k 5 ${AFTER:+--after "$AFTER"}
