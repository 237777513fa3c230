#!/usr/bin/env bash
# The whole pipeline on a GPU machine in about 8 minutes, printing every GPU figure the README
# promises:
#
#   bash benchmarks/device_check.sh [OUT_DIR]      # OUT_DIR default: $OUT, else /tmp/ncf-device
#   NCF_CHECK_DEVICE=cpu NCF_CHECK_SIZE=ml-100k bash benchmarks/device_check.sh OUT   # CPU smoke run
#   bash benchmarks/device_check.sh --plan          # the planned steps and their limits; runs nothing
#
# Needs python3 (or $PYTHON) with torch (CUDA) and CuPy; cuDF and RMM are used when present. It
# runs the checkout's code (PYTHONPATH), so nothing has to be installed and no `ncf` script is
# needed. Every step has its own time limit (LIMIT below) inside a total budget
# (NCF_CHECK_BUDGET_S, 480 s); on the GPU the planned steps' limits add up to no more than the
# budget, so no step is starved by the ones before it (tests/test_device_check.py checks the
# sum). The limits are reasoned from the CPU run's step times and the GPU figures the README
# targets, not measured on a GPU; a step that needs longer says so in one FAILED line with its
# limit. A failing step does not stop the others. Each step ends with one line, `OK: NAME`, `FAILED
# (CODE): NAME: why` or `SKIPPED: NAME: why`; its output is in OUT_DIR/NAME.log and the figures
# and step lines are collected in OUT_DIR/summary.txt. A step that ran but did not do what it
# was for (the sequence term off, one worker where two were asked) is `FAILED (check)`. The
# exit status is 0 only when every planned step is OK; a step this machine cannot run at all
# (`gpus-2` with one GPU, `prepare-dask` on a GPU without dask-cuda) says SKIPPED with the
# reason, is not part of the plan, and is counted apart in the last line.
#   machine      nvidia-smi, ncf info
#   tests        the GPU tests (byte equality CPU/GPU, zero-copy, train/eval/export on CUDA) and
#                the CPU checks of the GPU rules (tests/test_cupy_api.py, tests/test_backend.py)
#   prepare      an ml-20m-shaped synthetic ratings.csv (20M rows) on the device, twice: wall,
#                in-process seconds (the work after imports and CUDA set-up, judged on the second
#                run, CuPy's kernels cached: target <= 2 s on a GPU), peak GPU memory
#   prepare-cpu  the same file on this machine's CPUs, for comparison
#   prepare-dask the same file on the Dask engine (on a GPU: dask_cuda.LocalCUDACluster, one
#                worker per GPU with an RMM pool: each block parsed by cuDF on the GPU, its
#                summary, cut, dedup and split in CuPy; issue 35); fails unless the dataset's
#                fingerprint is the memory engine's; on a GPU without dask-cuda, SKIPPED
#   train-tf32, train-amp
#                NVIDIA's model and batch (2^20), verified negatives: samples/s per epoch
#                (target >= 102M, a 99M-sample epoch in < 1 s; NVIDIA 1x A100: 22.6M TF32,
#                34.1M AMP), HR@10, peak GPU memory
#   eval-full    full-ranking HR/NDCG over every user, wall seconds
#   eval-sampled HR/NDCG@1,5,10,20 on the 100 sampled negatives
#   export       ONNX export, onnxruntime vs torch max abs difference
#   recommend    top-10 for one user
#   refit        `ncf train --refit` of that run: train + validation on the device, test HR@10
#   order        one epoch with the order term (--order-factors 64; the first tier's default, off
#                at ml-20m's size): the previous items on the device, samples/s, test HR@10
#   sequence     one epoch with the sequence term forced on (--sequence-length 20: the synthetic
#                data has no time signal, so the default leaves it off) under --amp on a GPU:
#                samples/s, test HR@10; fails unless the run's sequence_length is 20
#   gpus-2       `--gpus 2`: two NCCL workers, one epoch; fails unless the run had 2 ranks;
#                SKIPPED (not run) on a machine with fewer than 2 GPUs, never one worker instead
#   small        a small synthetic dataset (2,000 users, 8 buckets) prepared on the device, for
#                the two steps below (tune's trials at ml-20m's size would not fit the budget)
#   shard-users  `--shard users` on 2 ranks: `--gpus 2` (NCCL), on one GPU 2 torchrun ranks
#                sharing it over gloo (NCF_DIST_BACKEND=gloo: NCCL refuses a GPU twice), on a
#                CPU `--nproc 2`; each rank's rows and users; fails unless the layout is users
#   tune-jobs    `ncf tune --jobs 2` (2 worker processes, with --device cuda each on its GPU of
#                CUDA_VISIBLE_DEVICES, modulo the count), MF, 2 trials of at most 1 epoch
#   large-batch  the lr rule at 8x NVIDIA's batch: 2^23 (in micro-batches of 2^20) against 2^20,
#                6 epochs each, validation-chosen test HR@10 (issue 10: within 0.01); CPU: 2^17
#                against the ml-100k column's 2^14, one epoch, the figures not judged
#   scaling      weak scaling over every GPU count the machine has (CPU: 1 and 2 workers)
# In cpu mode (NCF_CHECK_DEVICE=cpu) the CUDA-only tests, prepare-cpu (it would repeat prepare),
# train-amp and gpus-2 are not part of the plan (gpus-2 says SKIPPED), the sequence step runs
# without --amp, training runs one epoch at the default batch, and
# large-batch and scaling train at 4 negatives per positive (about 7x fewer samples than ml-100k's
# default: they check the code path, their figures are not judged), so the run takes about two
# minutes on 2 cores (tests/test_device_check.py runs it in CI). Its limits
# are 4x the GPU's: 2 shared cores do in a minute what the GPU box does in seconds, and the
# budget still bounds the whole run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEV=${NCF_CHECK_DEVICE:-cuda}
SIZE=${NCF_CHECK_SIZE:-ml-20m}
BUDGET=${NCF_CHECK_BUDGET_S:-480}
STEPS=(machine tests prepare prepare-cpu prepare-dask train-tf32 train-amp eval-full eval-sampled
  export recommend refit order sequence gpus-2 small shard-users tune-jobs large-batch scaling)
# Seconds per step on the GPU plan: they add up to 480, the default budget (a lent GPU machine
# has 15 minutes, its start-up included).
declare -A LIMIT=(
  [machine]=10 [tests]=80 [prepare]=45 [prepare-cpu]=20 [prepare-dask]=25 [train-tf32]=30
  [train-amp]=25 [eval-full]=15 [eval-sampled]=10 [export]=20 [recommend]=10 [refit]=20
  [order]=20 [sequence]=20 [gpus-2]=20 [small]=10 [shard-users]=15 [tune-jobs]=25
  [large-batch]=40 [scaling]=20
)
SCALE=1
[ "$DEV" = cpu ] && SCALE=4
PLAN=("${STEPS[@]}")
[ "$DEV" = cpu ] && PLAN=(machine tests prepare prepare-dask train-tf32 eval-full eval-sampled export
  recommend refit order sequence small shard-users tune-jobs large-batch scaling)
PLAN_S=0
for name in "${PLAN[@]}"; do PLAN_S=$((PLAN_S + LIMIT[$name] * SCALE)); done
if [ "${1:-}" = --plan ]; then
  for name in "${PLAN[@]}"; do echo "step $name $((LIMIT[$name] * SCALE))"; done
  echo "total $PLAN_S budget $BUDGET device $DEV"
  exit 0
fi
OUT_DIR=${1:-${OUT:-/tmp/ncf-device}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=${NCF_BENCH_DIR:-/tmp/ncf-bench}
mkdir -p "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCF_CACHE_DIR="$WORK/cache"
DEADLINE=$(($(date +%s) + BUDGET))
SUMMARY="$OUT_DIR/summary.txt"
DATA="$WORK/$SIZE"
# What an earlier run of this script wrote in OUT_DIR is removed (and nothing else), so each
# run starts clean: the step logs, runs that hold ncf's config.json, the export folder.
for name in "${STEPS[@]}"; do rm -f "$OUT_DIR/$name.out" "$OUT_DIR/$name.log"; done
for run in run-tf32 run-amp run-refit run-order run-sequence run-gpus-2 run-shard; do
  [ -f "$OUT_DIR/$run/config.json" ] && rm -rf "${OUT_DIR:?}/$run"
done
[ -f "$OUT_DIR/tune-jobs/tune.json" ] && rm -rf "${OUT_DIR:?}/tune-jobs" # else it would resume
[ -f "$OUT_DIR/export/ncf.onnx" ] && rm -rf "${OUT_DIR:?}/export"
: >"$SUMMARY"
NCF=("$PY" -m ncfcli) # a command, not a shell function, so `timeout` can run it
PLANNED=0
PASSED=0
ABSENT=0

note() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }

# step NAME CMD...: run CMD with its stdout in OUT_DIR/NAME.out and stderr in NAME.log, within
# the step's LIMIT and the remaining budget; end with one OK/FAILED/SKIPPED line.
step() {
  local name=$1 limit=$((LIMIT[$1] * SCALE))
  shift
  PLANNED=$((PLANNED + 1))
  note ""
  note "== $name"
  local left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt 5 ]; then
    note "SKIPPED: $name: the ${BUDGET} s budget (NCF_CHECK_BUDGET_S) is spent"
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0 rc
  t0=$(date +%s.%N)
  timeout -k 10 "$limit" "$@" >"$OUT_DIR/$name.out" 2>"$OUT_DIR/$name.log"
  rc=$?
  SECS=$("$PY" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$t0" "$(date +%s.%N)")
  if [ "$rc" -eq 0 ]; then
    PASSED=$((PASSED + 1))
    note "OK: $name ($SECS s)"
    return 0
  fi
  local why
  why=$(tail -n 1 "$OUT_DIR/$name.log" 2>/dev/null)
  [ "$rc" -eq 124 ] && why="no result within $limit s"
  note "FAILED ($rc): $name after $SECS s: ${why:-see $OUT_DIR/$name.log}"
  tail -n 15 "$OUT_DIR/$name.log" | sed 's/^/    /'
  return "$rc"
}

skip() { # skip NAME WHY: a planned step that cannot run
  PLANNED=$((PLANNED + 1))
  note ""
  note "== $1"
  note "SKIPPED: $1: $2"
}

absent() { # absent NAME WHY: a step this machine cannot run at all (not planned, not a failure)
  ABSENT=$((ABSENT + 1))
  note ""
  note "== $1"
  note "SKIPPED: $1: $2"
}

# expect NAME PYTHON_EXPR WHAT: after an OK step, FAILED (check) unless the expression holds on
# the last JSON line of OUT_DIR/NAME.out (as d): the step ran but did not do what it was for.
expect() {
  if "$PY" - "$OUT_DIR/$1.out" "$2" <<'PYEOF'; then
import json, sys
lines = [l for l in open(sys.argv[1]).read().splitlines() if l.startswith("{")]
sys.exit(0 if lines and eval(sys.argv[2], {"d": json.loads(lines[-1])}) else 1)
PYEOF
    return 0
  fi
  PASSED=$((PASSED - 1))
  note "FAILED (check): $1: $3"
  return 1
}

# figure NAME PYTHON_EXPR: one summary line from the last JSON line of OUT_DIR/NAME.out (as d)
figure() {
  "$PY" - "$OUT_DIR/$1.out" "$2" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
lines = [l for l in open(sys.argv[1]).read().splitlines() if l.startswith("{")]
d = json.loads(lines[-1])
print("  " + str(eval(sys.argv[2], {"d": d})))
PYEOF
}

note "device check: device $DEV, data $SIZE, budget $BUDGET s (step limits add up to $PLAN_S s), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"

step machine "${NCF[@]}" info
if [ "$DEV" = cuda ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/  /' | tee -a "$SUMMARY"
fi
grep -E "torch|cupy|cudf|rmm|backend|GPUs|CUDA" "$OUT_DIR/machine.out" | sed 's/^/  /' | tee -a "$SUMMARY"

# test_backend.py first: it resets ncfcli.backend's caches, which the GPU tests then fill for real.
tests=(tests/test_backend.py tests/test_cupy_api.py)
[ "$DEV" = cuda ] && tests+=(tests/test_gpu.py)
# -rs lists every skipped test with its reason; a GPU test that skips on a GPU box is a finding.
step tests "$PY" -m pytest -q -rs -p no:cacheprovider "${tests[@]}"
tail -n 8 "$OUT_DIR/tests.out" | grep -E "passed|failed|SKIPPED|error" | sed 's/^/  /' | tee -a "$SUMMARY"

repeat=2
[ "$DEV" = cpu ] && repeat=1
if step prepare "$PY" benchmarks/bench_prepare.py --size "$SIZE" --device "$DEV" \
  --repeat "$repeat" --work-dir "$WORK" --out "$DATA"; then
  grep -E "^(wall|peak GPU|target)" "$OUT_DIR/prepare.out" | sed 's/^/  /' | tee -a "$SUMMARY"
fi
if [ "$DEV" != cpu ] && step prepare-cpu "$PY" benchmarks/bench_prepare.py --size "$SIZE" \
  --device cpu --work-dir "$WORK" --out "$WORK/$SIZE-cpu"; then
  grep -E "^wall" "$OUT_DIR/prepare-cpu.out" | sed 's/^/  /' | tee -a "$SUMMARY"
fi

# The Dask engine (LocalCUDACluster with --device cuda: cuDF parses each block, CuPy cuts, dedups
# and splits) on the same CSV: the dataset must be the memory engine's (same fingerprint), or the
# step fails.
CSV="$WORK/ratings-$SIZE-seed0.csv"
if [ "$DEV" = cuda ] && ! "$PY" -c "import dask_cuda" >/dev/null 2>&1; then
  absent prepare-dask "dask-cuda is not installed, so no Dask worker runs on a GPU (pip install 'ncfcli[dask-gpu]')"
elif [ -f "$CSV" ] && [ -f "$DATA/meta.json" ]; then
  if step prepare-dask bash -c '"$0" -m ncfcli prepare "$1" --engine dask --device "$2" --out "$3" \
      --overwrite --json -q && "$0" -c "import json, sys
a, b = (json.load(open(p + \"/meta.json\")) for p in sys.argv[1:])
print(\"  dask engine vs memory engine: fingerprint\", \"equal\" if a[\"fingerprint\"] == b[\"fingerprint\"] else \"DIFFERENT\")
sys.exit(a[\"fingerprint\"] != b[\"fingerprint\"])" "$4" "$3"' "$PY" "$CSV" "$DEV" "$WORK/$SIZE-dask" "$DATA"; then
    grep -E "fingerprint" "$OUT_DIR/prepare-dask.out" | sed 's/^/  /' | tee -a "$SUMMARY"
  fi
else
  skip prepare-dask "no CSV at $CSV or no prepared data at $DATA (the prepare step failed)"
fi

modes=(tf32 amp)
train_flags=(--epochs 3 --batch-size 1048576)
if [ "$DEV" = cpu ]; then # autocast on a CPU is not what this script measures
  modes=(tf32)
  train_flags=(--epochs 1)
fi
RUN=""
for mode in "${modes[@]}"; do
  if [ ! -f "$DATA/meta.json" ]; then
    skip "train-$mode" "no prepared data at $DATA (the prepare step failed)"
    continue
  fi
  flags=("${train_flags[@]}" --device "$DEV" --json -q --seed 0)
  [ "$mode" = amp ] && flags+=(--amp)
  if step "train-$mode" "${NCF[@]}" train "$DATA" --out "$OUT_DIR/run-$mode" "${flags[@]}"; then
    RUN="$OUT_DIR/run-$mode"
    figure "train-$mode" "f'{d[\"samples_per_second\"]/1e6:.2f}M samples/s over {d[\"epochs\"]} epoch(s) (incl. epoch 1), HR@10 {d[\"metrics\"][\"hr@10\"]:.4f}, {d[\"seconds\"]:.1f} s' + (f', peak GPU {d[\"peak_gpu_bytes\"] / 2**30:.2f} GiB' if d.get('peak_gpu_bytes') else '')"
    "$PY" - "$RUN/metrics.jsonl" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    sps = r.get("samples_per_second")
    held = ", ".join(f"{s} HR@10 {r[s]['hr@10']:.4f}" for s in ("validation", "test") if r.get(s))
    print(f"    epoch {r.get('epoch')}: " + (f"{sps / 1e6:.2f}M samples/s" if sps else "?")
          + f", {held}")
PYEOF
  fi
done
[ "$DEV" = cuda ] && note "  NVIDIA, 1x A100: 22.6M (TF32) / 34.1M (AMP) samples/s; target >= 102M (99M-sample epoch < 1 s)"

if [ -z "$RUN" ]; then
  for name in eval-full eval-sampled export recommend refit order; do
    skip "$name" "no trained run (the train steps failed or were skipped)"
  done
else
  step eval-full "${NCF[@]}" eval "$RUN" --full-ranking --device "$DEV" --json --k 10 &&
    figure eval-full "f'full ranking, {d[\"users\"]} users: {d[\"metrics\"]} in $SECS s (whole command)'"
  step eval-sampled "${NCF[@]}" eval "$RUN" --device "$DEV" --json --k 1 5 10 20 &&
    figure eval-sampled "f'sampled: {d[\"metrics\"]}'"
  mkdir -p "$OUT_DIR/export"
  step export "${NCF[@]}" export "$RUN" --onnx --out "$OUT_DIR/export/ncf.onnx" \
    --triton "$OUT_DIR/export/triton" --json &&
    figure export "f'onnxruntime vs torch: max abs diff {d[\"max_abs_diff\"]:.2g}'"
  step recommend "${NCF[@]}" recommend "$RUN" --user 1 -k 10 --device "$DEV" --json &&
    figure recommend "f'user {d[\"user\"]}: {d[\"items\"]}'"
  step refit "${NCF[@]}" train "$DATA" --refit "$RUN" --out "$OUT_DIR/run-refit" --device "$DEV" \
    --json -q &&
    figure refit "f'train + validation, {d[\"epochs\"]} epoch(s) as chosen: test HR@10 {d[\"metrics\"][\"hr@10\"]:.4f}, {d[\"seconds\"]:.1f} s'"
  step order "${NCF[@]}" train "$DATA" --order-factors 64 --epochs 1 --out "$OUT_DIR/run-order" \
    --device "$DEV" --seed 0 --json -q &&
    figure order "f'order term {d[\"order_factors\"]}: {d[\"samples_per_second\"]/1e6:.2f}M samples/s, test HR@10 {d[\"metrics\"][\"hr@10\"]:.4f}, {d[\"seconds\"]:.1f} s'"
fi

# GPUs torch sees here (CUDA_VISIBLE_DEVICES applied); 0 in cpu mode
GPUS=0
[ "$DEV" = cuda ] && GPUS=$(timeout 60 "$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
epoch=(--epochs 1 --seed 0 --json -q)
[ "$DEV" = cuda ] && epoch+=(--batch-size 1048576)

if [ ! -f "$DATA/meta.json" ]; then
  skip sequence "no prepared data at $DATA (the prepare step failed)"
else
  seq=(--sequence-length 20)
  [ "$DEV" = cuda ] && seq+=(--amp)
  step sequence "${NCF[@]}" train "$DATA" "${seq[@]}" "${epoch[@]}" --out "$OUT_DIR/run-sequence" \
    --device "$DEV" &&
    expect sequence "d['sequence_length'] == 20" "the run's sequence_length is not 20: the term did not train" &&
    figure sequence "f'sequence term {d[\"sequence_length\"]} ($([ "$DEV" = cuda ] && echo AMP || echo fp32)): {d[\"samples_per_second\"]/1e6:.2f}M samples/s, test HR@10 {d[\"metrics\"][\"hr@10\"]:.4f}, {d[\"seconds\"]:.1f} s'"
fi

if [ "$GPUS" -lt 2 ]; then
  absent gpus-2 "needs 2 GPUs, found $GPUS$([ "$DEV" = cpu ] && echo " (device cpu)")"
elif [ ! -f "$DATA/meta.json" ]; then
  skip gpus-2 "no prepared data at $DATA (the prepare step failed)"
else
  step gpus-2 "${NCF[@]}" train "$DATA" --gpus 2 "${epoch[@]}" --out "$OUT_DIR/run-gpus-2" &&
    expect gpus-2 "len(d.get('shard', {}).get('rank_rows', [])) == 2" "the run did not have 2 ranks" &&
    figure gpus-2 "f'2 NCCL workers: {d[\"samples_per_second\"]/1e6:.2f}M samples/s, test HR@10 {d[\"metrics\"][\"hr@10\"]:.4f}, rows per rank {d[\"shard\"][\"rank_rows\"]}, {d[\"seconds\"]:.1f} s'"
fi

SMALL="$WORK/small"
step small "${NCF[@]}" prepare synthetic --users 2000 --items 1000 --interactions 60000 \
  --buckets 8 --seed 0 --out "$SMALL" --device "$DEV" --overwrite --json -q
if [ ! -f "$SMALL/meta.json" ]; then
  skip shard-users "no small dataset at $SMALL (the small step failed)"
  skip tune-jobs "no small dataset at $SMALL (the small step failed)"
else
  shard=(train "$SMALL" --shard users --epochs 1 --seed 0 --json -q --out "$OUT_DIR/run-shard")
  how="2 gloo CPU workers"
  if [ "$GPUS" -ge 2 ]; then
    cmd=("${NCF[@]}" "${shard[@]}" --gpus 2)
    how="2 NCCL workers"
  elif [ "$DEV" = cuda ]; then # NCCL refuses two ranks on one GPU; gloo reduces through the host
    cmd=(env NCF_DIST_BACKEND=gloo "$PY" -m torch.distributed.run --standalone --nproc-per-node 2
      -m ncfcli "${shard[@]}" --device cuda)
    how="2 ranks on GPU 0 over gloo (one GPU)"
  else
    cmd=("${NCF[@]}" "${shard[@]}" --nproc 2)
  fi
  step shard-users "${cmd[@]}" &&
    expect shard-users "d.get('shard', {}).get('mode') == 'users' and len(d['shard']['rank_rows']) == 2" \
      "the run's layout is not users over 2 ranks" &&
    figure shard-users "f'--shard users, $how: rows per rank {d[\"shard\"][\"rank_rows\"]}, users {d[\"shard\"][\"rank_users\"]}, test HR@10 {d[\"metrics\"][\"hr@10\"]:.4f}, {d[\"seconds\"]:.1f} s'"
  step tune-jobs "${NCF[@]}" tune "$SMALL" --jobs 2 --device "$DEV" --models mf --trials 2 \
    --max-epochs 1 --out "$OUT_DIR/tune-jobs" --json -q &&
    expect tune-jobs "d['trials'] >= 2 and d['best'] is not None" "fewer than 2 trials ended, or none is best" &&
    figure tune-jobs "f'2 workers on $DEV: {d[\"trials\"]} trials in {d[\"spent_seconds\"]:.1f} s, best {d[\"best\"][\"model\"]} validation HR@10 {d[\"best\"][\"validation\"][\"hr@10\"]:.4f}'"
fi

if [ -f "$DATA/meta.json" ]; then
  large=(--batches 8388608 --micro-batch 1048576 --epochs 6)
  [ "$DEV" = cpu ] && large=(--batches 131072 --micro-batch 16384 --epochs 1 --tolerance 1
    --common "--neg-per-pos 4")
  step large-batch "$PY" benchmarks/bench_large_batch.py --prepared "$DATA" --device "$DEV" \
    --seeds 0 --nproc --sampled-only "${large[@]}" &&
    grep -E "seed|vs default" "$OUT_DIR/large-batch.out" | sed 's/^/  /' | tee -a "$SUMMARY"
else
  skip large-batch "no prepared data at $DATA (the prepare step failed)"
fi

if [ -f "$DATA/meta.json" ]; then
  scale=(--scaling-device "$DEV" --scaling-data "$DATA")
  [ "$DEV" = cuda ] && scale+=(--amp)
  [ "$DEV" = cpu ] && scale+=(--scaling-batch 65536 --scaling-flags "--neg-per-pos 4")
  step scaling "$PY" benchmarks/bench_distributed.py --skip-cpu "${scale[@]}" &&
    sed 's/^/  /' "$OUT_DIR/scaling.out" | tee -a "$SUMMARY"
else
  skip scaling "no prepared data at $DATA (the prepare step failed)"
fi

note ""
note "== done: $PASSED of $PLANNED steps OK, $ABSENT not possible on this machine (SKIPPED), in $(($(date +%s) - DEADLINE + BUDGET)) s; summary: $SUMMARY"
[ "$PASSED" -eq "$PLANNED" ]
