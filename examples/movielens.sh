#!/usr/bin/env bash
# MovieLens end to end: bash examples/movielens.sh [ml-100k|ml-1m|ml-20m|PATH/u.data] [WORK_DIR]
# A name is downloaded once into the cache (NCF_CACHE_DIR) and checked against its MD5; a path
# (zip, folder or ratings file) is read as it is. Training defaults follow the dataset's size.
# Run again, it replaces its own earlier output in WORK_DIR (--overwrite: never other files).
set -euo pipefail
SOURCE=${1:-ml-100k}
WORK=${2:-work}
NAME=$(basename "${SOURCE%.*}")
ncf prepare "$SOURCE" --out "$WORK/data/$NAME" --overwrite
ncf train "$WORK/data/$NAME" --out "$WORK/runs/$NAME" --overwrite   # add --gpus 8 --amp on a GPU box
ncf eval "$WORK/runs/$NAME" -k 5 10 20 --json
ncf eval "$WORK/runs/$NAME" -k 10 --full-ranking --json
