#!/usr/bin/env bash
# From ratings to lists to serve, with an honest test figure on the way:
#   bash examples/refit_and_serve.sh [ml-100k|ml-1m|ml-20m|PATH/u.data] [WORK_DIR]
# 1. train with the size defaults; validation chooses the epoch (the test set chooses nothing);
# 2. refit those settings on train + validation for that many epochs (`ncf train --refit`), so
#    the model has seen every interaction but the test item, and score it on test once;
# 3. export the refitted model to ONNX (checked against PyTorch) and write every user's top 10,
#    leaving out everything the user interacted with (`--exclude-seen`).
# Run again, it replaces its own earlier output in WORK_DIR (--overwrite: never other files).
set -euo pipefail
SOURCE=${1:-ml-100k}
WORK=${2:-work}
NAME=$(basename "${SOURCE%.*}")
DATA="$WORK/data/$NAME"
RUN="$WORK/runs/$NAME"
ncf prepare "$SOURCE" --out "$DATA" --overwrite
ncf train "$DATA" --out "$RUN" --overwrite --json   # add --gpus 8 --amp on a GPU box
ncf train "$DATA" --refit "$RUN" --out "$RUN-refit" --overwrite --json
ncf eval "$RUN-refit" -k 10 --json
ncf eval "$RUN-refit" -k 10 --full-ranking --json
ncf export "$RUN-refit" --onnx --out "$WORK/serve/$NAME/ncf.onnx" --overwrite --json
ncf recommend "$RUN-refit" --all-users --exclude-seen -k 10 --out "$WORK/serve/$NAME/top10.parquet" \
    --overwrite --json
