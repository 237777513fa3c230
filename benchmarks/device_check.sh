#!/usr/bin/env bash
# The whole pipeline on a GPU machine in a few minutes, printing the figures the issues ask for.
#
#   bash benchmarks/device_check.sh [OUT_DIR]      # OUT_DIR default: $OUT, else /tmp/ncf-device
#
# Needs python3 with torch (CUDA) and CuPy; cuDF and RMM are used when present. It runs from
# the checkout (PYTHONPATH), so nothing has to be installed. Every step has its own time limit
# and a failing step does not stop the others; the summary lands in OUT_DIR/summary.txt.
#   1. ncf info, the GPU tests (CPU/GPU byte equality, zero-copy, train/eval/export on CUDA)
#   2. prepare: the ml-20m-shaped synthetic ratings.csv (20M rows) on the GPU (target <= 2 s),
#      with peak GPU memory, and the same file on this machine's CPUs for comparison
#   3. train: NVIDIA's model and batch (2^20) with verified negatives, TF32 and AMP
#      (target: an epoch of 99M samples in < 1 s, i.e. >= 3 x 34.1M samples/s)
#   4. eval --full-ranking over every user, export --onnx, recommend
#   5. weak scaling over every GPU count the machine has
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/ncf-device}}
mkdir -p "$OUT_DIR"
WORK=${NCF_BENCH_DIR:-/tmp/ncf-bench}
mkdir -p "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCF_CACHE_DIR="$WORK/cache"
PY=${PYTHON:-python3}
# A smoke run of this script itself on a CPU box: NCF_CHECK_DEVICE=cpu NCF_CHECK_SIZE=ml-100k
DEV=${NCF_CHECK_DEVICE:-cuda}
SIZE=${NCF_CHECK_SIZE:-ml-20m}
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"

ncf() { "$PY" -m ncfcli "$@"; }
step() { printf '\n== %s\n' "$*" | tee -a "$SUMMARY"; }
note() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }
run() {  # run LIMIT_SECONDS CMD...: time-limited, output kept in the log, failure noted
  local limit=$1
  shift
  timeout "$limit" "$@"
  local rc=$?
  [ "$rc" -eq 0 ] || note "FAILED ($rc): $*"
  return "$rc"
}
json_field() { "$PY" -c "import json,sys; d=json.loads(sys.stdin.read().strip().splitlines()[-1]); print($1)"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$SUMMARY" || true
run 60 ncf info

step "GPU tests"
run 300 "$PY" -m pytest -q -rs -m gpu tests/test_gpu.py tests/test_cupy_api.py tests/test_cli_basics.py 2>&1 \
  | tail -n 5 | tee -a "$SUMMARY"

step "prepare: $SIZE-shaped synthetic ratings.csv"
run 300 "$PY" benchmarks/bench_prepare.py --size "$SIZE" --device "$DEV" --repeat 2 --work-dir "$WORK" \
  | tee "$OUT_DIR/prepare_gpu.txt" | tail -n 4 | tee -a "$SUMMARY"
CSV="$WORK/ratings-$SIZE-seed0.csv"
if [ -f "$CSV" ]; then
  res=$(run 120 ncf prepare "$CSV" --out "$WORK/$SIZE" --device "$DEV" --json -q)
  note "prepare on $DEV (in-process): $(echo "$res" | json_field "f'{d[\"seconds\"]} s, peak GPU {d.get(\"peak_gpu_bytes\", 0) / 2**30:.2f} GiB, {d[\"n_train\"]:,} train positives'")"
  run 300 "$PY" benchmarks/bench_prepare.py --size "$SIZE" --device cpu --work-dir "$WORK" \
    | tail -n 2 | tee -a "$SUMMARY"
fi

DATA="$WORK/$SIZE"
if [ -f "$DATA/meta.json" ]; then
  step "train: NeuMF 64 / 256-256-128-64, batch 2^20, verified negatives"
  modes=(tf32 amp)
  [ "$DEV" = cpu ] && modes=(tf32)  # autocast on a CPU is not what this script measures
  for mode in "${modes[@]}"; do
    flags=(--epochs 3 --batch-size 1048576 --device "$DEV" --json -q --seed 0)
    [ "$mode" = amp ] && flags+=(--amp)
    res=$(run 300 ncf train "$DATA" --out "$OUT_DIR/run-$mode" "${flags[@]}")
    note "$mode: $(echo "$res" | json_field "f'{d[\"samples_per_second\"]/1e6:.1f}M samples/s over {d[\"epochs\"]} epochs (incl. epoch 1), HR@10 {d[\"metrics\"][\"hr@10\"]:.4f}, {d[\"seconds\"]:.1f} s'")"
    "$PY" - "$OUT_DIR/run-$mode/metrics.jsonl" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    keys = [k for k in r if "second" in k or "samples" in k]
    held = {s: round(r[s]["hr@10"], 4) for s in ("validation", "test") if r.get(s)}
    print("  epoch", r.get("epoch"), {k: r[k] for k in keys}, "hr@10", held)
PYEOF
  done
  note "NVIDIA, 1x A100: 22.6M (TF32) / 34.1M (AMP) samples/s; target >= 102M (99M-sample epoch < 1 s)"

  RUN="$OUT_DIR/run-${modes[-1]}"
  step "eval, export, recommend"
  start=$(date +%s.%N)
  res=$(run 300 ncf eval "$RUN" --full-ranking --device "$DEV" --json --k 10)
  end=$(date +%s.%N)
  note "full ranking, every user: $(echo "$res" | json_field "d['metrics'], d['users']") in $("$PY" -c "print(round($end - $start, 2))") s (whole command)"
  res=$(run 120 ncf eval "$RUN" --device "$DEV" --json --k 1 5 10 20)
  note "sampled: $(echo "$res" | json_field "d['metrics']")"
  res=$(run 300 ncf export "$RUN" --onnx --out "$OUT_DIR/ncf.onnx" --triton "$OUT_DIR/triton" --json)
  note "export: $(echo "$res" | json_field "d['max_abs_diff']") max abs diff (onnxruntime vs torch)"
  run 120 ncf recommend "$RUN" --user 1 -k 10 --device "$DEV" --json | tee -a "$SUMMARY"

  step "weak scaling over this machine's GPUs"
  run 500 "$PY" benchmarks/bench_distributed.py --skip-cpu --gpu-data "$DATA" --amp \
    | tee -a "$SUMMARY"
fi

step "done"
cat "$SUMMARY" >/dev/null
