#!/bin/bash
# The GPU checks of issue 45 in one command, for a lent GPU machine with one call's time:
#   source .gpu/base/setup.sh && bash tools/gpu_checks.sh OUT_DIR [SECONDS] [STEPS]
# Runs the steps in order, each bounded by what is left of SECONDS (default 520), and writes
# OUT_DIR/steps.log (the GPU, each step's exit code and seconds, the benchmarks' output),
# OUT_DIR/tier.log (pytest -m gpu) and OUT_DIR/<bench>.{md,csv}. A step that fails or runs out
# of time does not stop the later ones. Env: BENCH_CONFIGS (default tfdp,none,mirrored) and
# BENCH_EPOCHS (default 2) for the benchmark steps. STEPS (default: all) picks steps by name, comma-separated:
#   tier       the GPU tier, tests/test_gpu.py (fit equivalence with and without XLA on the GPU
#              and on two logical GPUs, fp16/bf16 compression, tfdp-run --workers 2 on one GPU)
#   resnet256  ResNet-50 bf16, batch 256: tfdp default, no strategy (XLA by Keras), Mirrored default
#   resnet128  the same three at batch 128
#   encoder    the transformer encoder, bf16, batch 64: the same three
set -u
OUT=${1:?usage: gpu_checks.sh OUT_DIR [SECONDS] [STEPS]}
BUDGET=${2:-520}
WANT=${3:-tier,resnet256,resnet128,encoder}
START=$SECONDS
mkdir -p "$OUT"
LOG=$OUT/steps.log
export TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi | grep -o "CUDA Version: [0-9.]*"; python3 --version; } >>"$LOG" 2>&1

step() {  # step NAME LOGFILE COMMAND...
  local name=$1 log=$2 left begin rc
  shift 2
  [[ ,$WANT, == *,$name,* ]] || return 0
  left=$((BUDGET - (SECONDS - START)))
  if ((left < 40)); then echo "step $name: skipped, $left s left" >>"$LOG"; return 0; fi
  begin=$SECONDS
  echo "step $name: start at $((begin - START)) s, $left s left" >>"$LOG"
  timeout -k 10 "$left" "$@" >>"$log" 2>&1
  rc=$?
  echo "step $name: rc=$rc in $((SECONDS - begin)) s" >>"$LOG"
}

BENCH=(python3 tools/bench_gpu.py --precisions bf16 --configs "${BENCH_CONFIGS:-tfdp,none,mirrored}"
       --steps 30 --epochs "${BENCH_EPOCHS:-2}" ${BENCH_EXTRA:-})  # BENCH_EXTRA=--tiny: a CPU smoke run of this script
step tier "$OUT/tier.log" python3 -m pytest -m gpu tests/test_gpu.py -v -p no:cacheprovider \
  -o addopts="-rA --durations=10"
step resnet256 "$LOG" "${BENCH[@]}" --models resnet50 --batch 256 --out "$OUT/resnet256"
step resnet128 "$LOG" "${BENCH[@]}" --models resnet50 --batch 128 --out "$OUT/resnet128"
step encoder "$LOG" "${BENCH[@]}" --models transformer --batch 64 --out "$OUT/encoder"
echo "done at $((SECONDS - START)) s" >>"$LOG"
