#!/usr/bin/env bash
# This stop's device calls, one a call, each branching on the card it finds (an H200 gives the headline figures,
# an H100 the ratios, the profile and the fidelity); every step tees its log under $OUT.
#
#     bash bench/device_calls.sh A|B|C|D
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/bench-out}"
mkdir -p "$OUT"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "call $1 on: $GPU"
STATUS=0
step() {  # step LOG ENV... -- STEP: a failed step fails the call (its exit status), the next steps still run
  local log=$1; shift
  env PADDING=0 "$@" 2>&1 | tee "$OUT/$log" | grep -v '^\s*$' | tail -n 50
  [[ ${PIPESTATUS[0]} -eq 0 ]] || STATUS=1
}
case "$1:$GPU" in
  A:*H200*) step 27b.log TOKENS_27B=200000 T_27B=275 KERNELS="auto eager" bash bench/run_gpu.sh 27b-kernels ;;
  A:*)      step fid.log FID_MIN=1.5 T_FID=210 bash bench/run_gpu.sh kernel-fidelity
            step prof.log COMPUTES=fp8 T_PROF=340 bash bench/run_gpu.sh profile ;;
  B:*H200*) step fid.log FID_MIN=1.5 T_FID=200 bash bench/run_gpu.sh kernel-fidelity
            step 8b.log T_8B=180 KERNELS="auto eager" bash bench/run_gpu.sh 8b-kernels ;;
  B:*)      step 27b.log TOKENS_27B=200000 T_27B=275 KERNELS="auto eager" bash bench/run_gpu.sh 27b-kernels ;;
  C:*H200*) step prefix.log PER_TURN=every-message T_PREFIX=330 bash bench/run_gpu.sh prefix
            step prof.log COMPUTES=fp8 T_PROF=240 bash bench/run_gpu.sh profile ;;
  C:*)      step prefix.log PER_TURN=every-message T_PREFIX=330 bash bench/run_gpu.sh prefix
            step 8b.log T_8B=120 KERNELS="auto eager" bash bench/run_gpu.sh 8b-kernels ;;
  D:*)      step smoke.log bash bench/run_gpu.sh prefix-smoke
            step fid.log FID_MIN=1.0 T_FID=150 bash bench/run_gpu.sh kernel-fidelity
            step 8b.log TOKENS_8B=150000 T_8B=90 KERNELS="auto eager" bash bench/run_gpu.sh 8b-kernels ;;
  *)        echo "unknown call $1"; exit 2 ;;
esac
exit $STATUS
