#!/usr/bin/env bash
# The NCF paper's NeuMF with pretraining (He et al. 2017, section 3.4.1): GMF and MLP trained
# alone, then NeuMF started from both (its head: the two heads weighed 0.5 each), all three
# scored by the same code:
#   bash examples/ncf_paper.sh [ml-100k|ml-1m|PATH/u.data] [WORK_DIR]
# The paper's shapes (8 factors, MLP 64-32-16-8, 4 negatives per positive); everything else
# follows ncf's defaults for the dataset's size (validation split, epoch chosen on it).
# Run again, it replaces its own earlier output in WORK_DIR (--overwrite: never other files).
set -euo pipefail
SOURCE=${1:-ml-100k}
WORK=${2:-work}
NAME=$(basename "${SOURCE%.*}")
DATA="$WORK/data/$NAME"
RUNS="$WORK/runs/$NAME"
SHAPE=(--factors 8 --layers 64 32 16 8 --neg-per-pos 4)
ncf prepare "$SOURCE" --out "$DATA" --overwrite
ncf train "$DATA" --model gmf "${SHAPE[@]}" --out "$RUNS-gmf" --overwrite
ncf train "$DATA" --model mlp "${SHAPE[@]}" --out "$RUNS-mlp" --overwrite
ncf train "$DATA" --model neumf "${SHAPE[@]}" --lr 0.001 --out "$RUNS-neumf" --overwrite \
    --pretrained-gmf "$RUNS-gmf" --pretrained-mlp "$RUNS-mlp"
for model in gmf mlp neumf; do
    ncf eval "$RUNS-$model" -k 10 --json
done
