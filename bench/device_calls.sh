#!/usr/bin/env bash
# This stop's device calls, one a call, each branching on the card it finds (an H200 gives the headline figures,
# an H100 the ratios, the profile and the fidelity); every step tees its log under $OUT.
#
#     bash bench/device_calls.sh E|F|...|X|Y|Z|AA|...|AS
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
  E:*H200*) step 27b.log TOKENS_27B=200000 T_27B=270 KERNELS="auto eager" bash bench/run_gpu.sh 27b-kernels ;;
  E:*)      step smoke.log T_SMOKE=170 bash bench/run_gpu.sh prefix-smoke
            step prefix.log PER_TURN=every-message TOKENS_PREFIX=150000 T_PREFIX=330 bash bench/run_gpu.sh prefix ;;
  F:*)      step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=520 bash bench/run_gpu.sh prefix ;;
  G:*)      step fid.log FID_MIN=1.0 T_FID=150 bash bench/run_gpu.sh kernel-fidelity
            step 8b.log TOKENS_8B=200000 T_8B=120 KERNELS="auto eager" bash bench/run_gpu.sh 8b-kernels ;;
  H:*)      step fid.log FID_MIN=0.6 T_FID=170 FID_COLUMNS="bf16 fused,FP8 fused" FID_HELD=16 \
              bash bench/run_gpu.sh kernel-fidelity ;;
  I:*)      step fid.log FID_MIN=0.6 T_FID=300 bash bench/run_gpu.sh kernel-fidelity   # one batch shape: one compile a column
            step 8b.log TOKENS_8B=200000 T_8B=200 KERNELS=auto bash bench/run_gpu.sh 8b-kernels ;;
  J:*)      step 8b.log TOKENS_8B=300000 T_8B=170 KERNELS=auto bash bench/run_gpu.sh 8b-kernels   # batches run = planned?
            step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=390 bash bench/run_gpu.sh prefix ;;
  K:*H200*) step 27b.log TOKENS_27B=200000 T_27B=270 KERNELS="auto eager" bash bench/run_gpu.sh 27b-kernels ;;
  K:*)      step 27b.log CD=bfloat16 TOKENS_27B=200000 T_27B=270 KERNELS="auto eager" bash bench/run_gpu.sh 27b-kernels ;;
  L:*)      step prefix.log CD=bfloat16,float8 PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=450 \
              PREFIX_ARGS="--fidelity-only --fidelity-samples 8" bash bench/run_gpu.sh prefix ;;
  M:*)      step prefix.log CD=bfloat16 PER_TURN=every-message TOKENS_PREFIX=30000 T_PREFIX=270 PREFIX_ARGS="--shape hybrid \
              --model-dtype float32 --token-budget 8192 --forward-tokens 256 --fidelity-only --fidelity-samples 8" bash bench/run_gpu.sh prefix ;;
  N:*)      step gdn.log T_GDN=240 bash bench/run_gpu.sh gdn-continue ;;
  O:*H200*) step 27b.log TOKENS_27B=200000 T_27B=270 KERNELS="auto eager" bash bench/run_gpu.sh 27b-kernels ;;
  O:*)      step gdn.log T_GDN=240 bash bench/run_gpu.sh gdn-continue
            step 27b.log CD=bfloat16 TOKENS_27B=150000 T_27B=300 KERNELS=auto bash bench/run_gpu.sh 27b-kernels ;;
  P:*)      step host.log T_HOST=330 bash bench/run_gpu.sh forward-host
            step gdn.log T_GDN=200 bash bench/run_gpu.sh gdn-continue ;;
  Q:*)      step host.log T_HOST=200 bash bench/run_gpu.sh forward-host    # after the packed-rows sync is gone
            step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=330 \
              PREFIX_ARGS="--fidelity-samples 4" bash bench/run_gpu.sh prefix ;;
  R:*)      step host.log T_HOST=200 bash bench/run_gpu.sh forward-host    # where a forward waits for the GPU
            step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=330 \
              PREFIX_ARGS="--fidelity-samples 4" bash bench/run_gpu.sh prefix ;;   # merged rows going on
  S:*H200*) step 27b.log TOKENS_27B=200000 T_27B=230 KERNELS=auto bash bench/run_gpu.sh 27b-kernels ;;
  S:*)      step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=200 \
              PREFIX_ARGS="--fidelity-samples 2" bash bench/run_gpu.sh prefix ;;   # where a tree batch waits
  T:*)      step 27b.log TOKENS_27B=200000 T_27B=270 KERNELS="auto padded" bash bench/run_gpu.sh 27b-kernels ;;  # packed rows
  U:*)      step parity.log T_PAR=150 bash bench/run_gpu.sh packed-parity
            step 8b.log TOKENS_8B=300000 T_8B=170 KERNELS="auto padded" bash bench/run_gpu.sh 8b-kernels ;;
  V:*)      step fid.log FID_MIN=0.6 T_FID=330 bash bench/run_gpu.sh kernel-fidelity ;;   # packed columns added
  W:*)      step prof.log LEVERS= COMPUTES=bf16,fp8 T_PROF=480 bash bench/run_gpu.sh profile ;;   # eager, fused, packed
  X:*)      step fid.log FID_MIN=0.4 T_FID=200 FID_HELD=16 FID_COLUMNS="bf16 fused,bf16 packed,FP8 fused,FP8 packed" \
              bash bench/run_gpu.sh kernel-fidelity ;;   # V cut to what the last device seconds hold
  Y:*H200*) step 27b.log TOKENS_27B=200000 T_27B=270 KERNELS="auto padded" bash bench/run_gpu.sh 27b-kernels ;;  # T on the H200
  Y:*)      step fid.log FID_MIN=0.6 T_FID=330 bash bench/run_gpu.sh kernel-fidelity ;;   # V
  Z:*H200*) step fid.log FID_MIN=0.6 T_FID=330 bash bench/run_gpu.sh kernel-fidelity ;;   # V
  Z:*)      step prof.log LEVERS= COMPUTES=bf16,fp8 T_PROF=480 bash bench/run_gpu.sh profile ;;   # W
  AA:*)     step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=420 \
              PREFIX_ARGS="--fidelity-samples 4 --also-forward-tokens 0" bash bench/run_gpu.sh prefix ;;   # packed waves
  AB:*)     step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=540 PREFIX_ARGS="--fidelity-samples 0 \
              --repeats 1 --warm-batches 0 --no-seeds-like --also-forward-tokens 0" bash bench/run_gpu.sh prefix ;;  # AA, cut
  AC:*H200*) step 27b.log TOKENS_27B=200000 T_27B=270 KERNELS="auto padded" bash bench/run_gpu.sh 27b-kernels ;;  # Y on the H200
  AC:*|AD:*) step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=540 PREFIX_ARGS="--fidelity-samples 0 \
              --repeats 1 --warm-batches 0 --no-seeds-like --also-forward-tokens 0 --also-stored-budgets 4" \
              bash bench/run_gpu.sh prefix ;;  # AB, and tree batches storing 4 budgets
  AE:*)     step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=470 PREFIX_ARGS="--fidelity-samples 0 \
              --repeats 1 --warm-batches 0 --no-seeds-like --forward-tokens 0 --also-stored-budgets 4" \
              bash bench/run_gpu.sh prefix ;;  # AD cut to what few device seconds hold: off, every tree kept, 4 budgets
  AF:*H200*) step 27b.log TOKENS_27B=200000 T_27B=270 KERNELS="auto padded" bash bench/run_gpu.sh 27b-kernels ;;  # AC
  AF:*)     step prof.log LEVERS= COMPUTES=bf16,fp8 T_PROF=480 bash bench/run_gpu.sh profile ;;   # W: the levers attributed
  AG:*)     step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=540 PREFIX_ARGS="--fidelity-samples 4 \
              --repeats 1 --warm-batches 0 --also-forward-tokens 2560" bash bench/run_gpu.sh prefix ;;  # item 7 at the new
              # defaults (512 a forward, 4 stored budgets) against off and the old default (2560, 1), seeds-like too
  AH:*)     step 27b.log CD=bfloat16 TOKENS_27B=200000 T_27B=300 KERNELS="auto padded" bash bench/run_gpu.sh 27b-kernels ;;  # bf16, packed
  AI:*)     step 27b.log TOKENS_27B=200000 T_27B=270 KERNELS="auto padded" bash bench/run_gpu.sh 27b-kernels ;;  # AC on any
              # card: the issue's 16,000 on an H200; on an H100, T again after the host-wait fixes
  AJ:*)     step 27b.log TOKENS_27B=200000 T_27B=240 KERNELS="auto padded" bash bench/run_gpu.sh 27b-kernels   # AI
            step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=300 PREFIX_ARGS="--fidelity-samples 4 \
              --repeats 1 --warm-batches 0 --also-forward-tokens 2560" bash bench/run_gpu.sh prefix ;;  # AG, cut to fit
  AK:*)     step 27b.log TOKENS_27B=200000 T_27B=170 KERNELS=auto bash bench/run_gpu.sh 27b-kernels ;;  # AI's packed
              # half only: what a session's last ~300 device seconds hold
  AL:*H200*) step 27b.log TOKENS_27B=200000 T_27B=240 KERNELS="auto padded" bash bench/run_gpu.sh 27b-kernels   # AJ
            step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=300 PREFIX_ARGS="--fidelity-samples 4 \
              --repeats 1 --warm-batches 0 --also-forward-tokens 2560" bash bench/run_gpu.sh prefix ;;
  AL:*)     step 27b.log TOKENS_27B=200000 T_27B=270 KERNELS="auto padded" bash bench/run_gpu.sh 27b-kernels ;;  # AI on an
              # H100: the FP8 packed pipeline after the host-wait fixes (AG's prefix table on an H100 is made already)
  AM:*H200*) step 27b.log TOKENS_27B=200000 T_27B=240 KERNELS="auto padded" bash bench/run_gpu.sh 27b-kernels   # AJ
            step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=300 PREFIX_ARGS="--fidelity-samples 4 \
              --repeats 1 --warm-batches 0 --also-forward-tokens 2560" bash bench/run_gpu.sh prefix ;;
  AM:*)     echo "an H100 again: AL measured all an H100 has left to give; nothing run" ;;  # the start's seconds only
  AN:*H200*) step 27b.log TOKENS_27B=200000 T_27B=240 KERNELS="auto padded" bash bench/run_gpu.sh 27b-kernels ;;  # AM's
              # first half: issue 39 on an H200, what ~500 device seconds hold
  AN:*)     echo "an H100 again: AL measured all an H100 has left to give; nothing run" ;;
  AO:*H200*) step 27b.log TOKENS_27B=200000 T_27B=170 KERNELS=auto bash bench/run_gpu.sh 27b-kernels ;;  # AK on an
              # H200 only: the packed pipeline, what a session's last ~300 device seconds hold
  AO:*)     echo "an H100 again: AL measured all an H100 has left to give; nothing run" ;;
  AP:*H200*) step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=540 PREFIX_ARGS="--fidelity-samples 4 \
              --repeats 1 --warm-batches 0 --also-forward-tokens 2560" bash bench/run_gpu.sh prefix ;;  # AG on the H200:
              # issue 40's item 7 (issue 39 is resolved, so the whole call goes to this table)
  AP:*)     echo "an H100 again: AG made this table on an H100 already; nothing run" ;;
  AQ:*)     step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=540 PREFIX_ARGS="--fidelity-samples 4 \
              --repeats 1 --warm-batches 0 --also-padded-rows" bash bench/run_gpu.sh prefix ;;  # AG with --prefix-rows
              # packed (the new default) against padded (the plan before): issue 40's table on an H200, the ratio on an H100
  AR:*)     step prefix.log PER_TURN=every-message TOKENS_PREFIX=60000 T_PREFIX=380 PREFIX_ARGS="--fidelity-samples 2 \
              --repeats 1 --warm-batches 0" bash bench/run_gpu.sh prefix ;;  # AQ cut to what ~450 device seconds hold:
              # off against the defaults (packed rows) on both mixes, 60k tokens a mix
  AS:*H200*) step prefix.log PER_TURN=every-message TOKENS_PREFIX=40000 T_PREFIX=290 PREFIX_ARGS="--fidelity-samples 2 \
              --repeats 1 --warm-batches 0" bash bench/run_gpu.sh prefix ;;  # AR cut to a session's last ~430 s
  AS:*)     step prefix.log PER_TURN=every-message TOKENS_PREFIX=60000 T_PREFIX=290 PREFIX_ARGS="--fidelity-samples 2 \
              --repeats 1 --warm-batches 0 --seeds-like-first" bash bench/run_gpu.sh prefix ;;  # on an H100 the
              # seeds-like mix first: the packed plan's +5 % goal
  AT:*)     step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=400 PREFIX_ARGS="--fidelity-samples 2 \
              --repeats 1 --warm-batches 0 --also-padded-rows --seeds-like-first" bash bench/run_gpu.sh prefix ;;  # AQ's
              # seeds-like half, which AQ's Triton compiles pushed past its limit: carry AQ's cache (.triton-cache.tgz)
  AU:*)     step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=420 PREFIX_ARGS="--fidelity-samples 2 \
              --repeats 2 --warm-batches 0 --also-padded-rows --seeds-like-first" bash bench/run_gpu.sh prefix ;;  # AT
              # with two timed passes a mode: on an H200 issue 40's table, on an H100 AT again on another machine
  AV:*H200*) step prefix.log PER_TURN=every-message,hsx TOKENS_PREFIX=100000 T_PREFIX=430 PREFIX_ARGS="--fidelity-samples 2 \
              --repeats 1 --warm-batches 0 --also-padded-rows --seeds-like-first" bash bench/run_gpu.sh prefix ;;  # AT on
              # an H200 (issue 40's table), then hsx's own per-turn cut
  AV:*)     step prefix.log PER_TURN=hsx TOKENS_PREFIX=100000 T_PREFIX=430 PREFIX_ARGS="--fidelity-samples 2 \
              --repeats 1 --warm-batches 0 --also-padded-rows --no-seeds-like" bash bench/run_gpu.sh prefix ;;  # on an
              # H100 (AT and AU made the every-message and seeds-like rows there): hsx's own per-turn cut
  AW:*H200*) step prefix.log PER_TURN=every-message TOKENS_PREFIX=100000 T_PREFIX=250 PREFIX_ARGS="--fidelity-samples 2 \
              --repeats 1 --warm-batches 0 --seeds-like-first" bash bench/run_gpu.sh prefix ;;  # AT on an H200, off
              # against the defaults only: what a session's last ~380 device seconds hold
  AW:*)     echo "an H100 again: AT, AU and AV made these rows on H100s already; nothing run" ;;
  *)        echo "unknown call $1"; exit 2 ;;
esac
exit $STATUS
