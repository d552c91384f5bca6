#!/usr/bin/env bash
# The GPU throughput benchmark in one command, on a GPU machine without internet:
#
#     bash bench/run_gpu.sh [STEPS...]        (from the repo root; .whl/ and .redis/ present)
#
# STEPS (default: 8b hybrid-fla hybrid-torch 32b), each its own process (one model in GPU memory):
#   8b            Qwen3-8B shape: mix32k, mix32k_serial, uniform1024, mix64k (targets 1, 2, 4)
#   hybrid-fla    Qwen3.5-style Gated DeltaNet shape, flash-linear-attention importable (target 5)
#   hybrid-torch  the same without it (transformers' PyTorch fallback)
#   32b           Qwen3-32B shape, mix32k (target 5)
#   8b-shm        8b's mix32k with the store in /dev/shm: the store's bytes off the local disk, as with S3
#   8b-formats    issue 15: memory-first spool (8 GiB tier in /dev/shm, disk tier on this machine's disk), store
#                 in /dev/shm (as S3); bf16, FP8, bf16+zstd, FP8+zstd (SECTIONS_FMT to choose)
#   ceiling       ../shared/bench/forward_ceiling.py (8B, mode A: the bare forward ceiling), beside the steps below
#   8b-compute    issue 22: 8B mix32k at --compute-dtype bfloat16 then float8 (MEM_GIB: memory tier GiB, default auto
#                 as the worker's default; 0 = off; ACCUM: float8's --fp8-accumulation, default fp32)
#   27b-compute   issue 22: the 27B hybrid shape (hybrid27b, fla) the same way
#   fp8-speed     issue 22: where FP8 compute's time goes, bare forward variants + profiles (bench/fp8_speed.py)
#   fp8-checkpoint issue 22: an e4m3 block-scaled FP8 checkpoint (8B shape, written to /dev/shm) loaded as stored, its
#                 bare forward beside bf16 and FP8 compute from bf16 weights (bench/fp8_checkpoint.py)
#   producer      issue 22: a real `hsx produce` of 1M generated rows to its first enqueue (bench/producer_e2e.py)
#   27b-kernels   issue 39: hybrid27b mix32k through the pipeline at --kernels eager then auto (CD: compute dtype,
#                 default float8; KERNELS: which of auto, padded, eager)
#   8b-kernels    issue 39: the 8B shape the same way
#   profile       issue 39: bench/forward_profile.py on hybrid27b (GPU time by kernel kind, each lever, module parity)
#   prefix        issue 40: shared prefixes computed once, hybrid27b (CD: compute dtype, default float8), fla on the
#                 path: stored and computed tok/s with and without reuse on a per-turn agentic mix and a seeds-like mix,
#                 reused vs lone fidelity (bench/prefix_reuse.py; no Redis); PER_TURN: hsx (default: hsx's --per-turn
#                 samples) | every-message (cut after every assistant message: the issue's 2x case)
#   forward-host  issue 40: the host's time to queue a forward against the GPU's time, for a tree batch's small
#                 forwards (bench/forward_host.py: plain and cached shapes, cProfile of the host work)
#   packed-parity issue 39: packed rows (varlen attention and GDN) against padded rows, the same samples, per stored layer,
#                 bf16 and FP8 compute, the 27B's first PAR_LAYERS (default 8) layers (bench/packed_parity.py)
#   gdn-continue  issue 40: the 27B's GDN layer on fla continuing a cached state vs one call (bench/gdn_continue.py)
#   prefix-smoke  issue 40: the same on the hybrid shape, 20k tokens (a minute): fla's kernels continuing transformers' cache
#   kernel-fidelity issue 39: a small Qwen3.5 hybrid (ARCH=dense: the Qwen3) trained on the GPU, per stored layer the rel L2
#                 against its fp32 forward of bf16 and FP8 compute, eager and fused kernels (bench/fp8_fidelity.py --kernels-only)
#   fidelity      issue 22: FP8 compute vs bf16 hidden states per layer on a model trained on the GPU (bench/fp8_fidelity.py)
# The padding table of 1M planned samples (target 3) runs beside them on the CPU.
# Results: one JSON per step under $OUT (or ./bench-out); the table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-$PWD/bench-out}"
mkdir -p "$OUTDIR"
STEPS=("$@")
[[ ${#STEPS[@]} -gt 0 ]] || STEPS=(8b hybrid-fla hybrid-torch 32b)

source bench/install_offline.sh || exit 1
# flash-linear-attention goes to its own folder: only the "with fla" step sees it.
FLA_SITE=/tmp/site-fla
mkdir -p "$FLA_SITE"
for p in /tmp/site/fla /tmp/site/fla_core-*.dist-info /tmp/site/flash_linear_attention-*.dist-info; do
  [[ -e "$p" ]] && rm -rf "$FLA_SITE/$(basename "$p")" && mv "$p" "$FLA_SITE/"
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
# fla's Triton kernels compile and autotune for each new shape and dtype: minutes of a step's first pass, on every
# fresh machine. Triton keeps both in TRITON_CACHE_DIR (fla caches its autotune results there). A call may carry the
# last call's cache as .triton-cache.tgz; this one leaves its own in $OUT as triton-cache.tgz.partNN (15 MiB each,
# at most 30 MiB: what comes back from $OUT and what a carry can hold; past that, its newest entries that fit);
# `cat` them into .triton-cache.tgz.
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/hsx-triton-cache}"
mkdir -p "$TRITON_CACHE_DIR"
if [[ -f .triton-cache.tgz ]] && tar xzf .triton-cache.tgz -C "$TRITON_CACHE_DIR"; then
  echo "[triton] the last call's cache: $(du -sh "$TRITON_CACHE_DIR" | cut -f1) in $TRITON_CACHE_DIR"
fi
keep_triton_cache() {   # over 30 MiB compressed: its newest entries (this call's compiles first) that fit
  local tgz=/tmp/hsx-triton-cache.tgz limit=$((30 * 1024 * 1024))
  tar czf "$tgz" -C "$TRITON_CACHE_DIR" . || return
  local bytes keep total; bytes=$(stat -c %s "$tgz")
  local -a entries; mapfile -t entries < <(ls -1t "$TRITON_CACHE_DIR")
  keep=${#entries[@]} total=${#entries[@]}
  while (( bytes > limit && keep > 1 )); do
    keep=$(( keep * limit / bytes * 9 / 10 )); (( keep < 1 )) && keep=1
    tar czf "$tgz" -C "$TRITON_CACHE_DIR" "${entries[@]:0:keep}" || return
    bytes=$(stat -c %s "$tgz")
  done
  if (( bytes > limit )); then
    echo "[triton] cache of $((bytes >> 20)) MiB compressed: over 30 MiB, not kept"
  else
    split -b 15m -d "$tgz" "$OUTDIR/triton-cache.tgz.part" && echo "[triton] cache kept: $((bytes >> 20)) MiB in" \
      "$OUTDIR$( (( keep < total )) && echo " ($keep of its $total entries, the newest)")"
  fi
  rm -f "$tgz"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader || true

PADDING_PID=
if [[ "${PADDING:-1}" = 1 ]]; then  # PADDING=0: no CPU work beside the measured steps
  python bench/gpu_bench.py --padding --out "$OUTDIR" >"$OUTDIR/padding.log" 2>&1 &
  PADDING_PID=$!
fi

B="python bench/gpu_bench.py --out $OUTDIR"
FAILED=()
for step in "${STEPS[@]}"; do
  echo "=== $step ($(date +%T))"
  case "$step" in
    8b)           timeout "${T_8B:-300}" $B --shape qwen3-8b --tag gpu --io-probe --tokens "${TOKENS_8B:-500000}" \
                    --sections "${SECTIONS_8B:-mix32k,mix32k_serial,uniform1024,mix64k}" ;;
    hybrid-fla)   PYTHONPATH="$FLA_SITE:$PYTHONPATH" timeout "${T_HYBRID:-150}" $B --shape hybrid --tag fla \
                    --tokens "${TOKENS_HYBRID:-300000}" --sections mix32k ;;
    hybrid-torch) timeout "${T_HYBRID:-150}" $B --shape hybrid --tag torch --tokens "${TOKENS_HYBRID:-300000}" \
                    --sections mix32k --no-full ;;
    32b)          timeout "${T_32B:-200}" $B --shape qwen3-32b --tag gpu --tokens "${TOKENS_32B:-200000}" \
                    --sections mix32k --no-full ;;
    8b-shm)       timeout "${T_8B:-300}" $B --shape qwen3-8b --tag shmstore --tokens "${TOKENS_8B:-500000}" \
                    --sections "${SECTIONS_8B:-mix32k}" --store-dir /dev/shm/hsx-bench-store ;;
    8b-formats)   timeout "${T_FMT:-420}" $B --shape qwen3-8b --tag formats --io-probe --tokens "${TOKENS_FMT:-1000000}" \
                    --sections "${SECTIONS_FMT:-mix32k_bf16,mix32k_fp8,mix32k_zstd,mix32k_fp8zstd}" \
                    --memory-spool-gib "${MEM_GIB:-8}" --store-dir /dev/shm/hsx-bench-store ;;
    ceiling)      SHAPE=qwen3-8b timeout "${T_CEIL:-150}" python "${CEILING:-../shared/bench/forward_ceiling.py}" 2>&1 | grep '"mode": "A"' ;;
    8b-compute)   for cd in bfloat16 float8; do  # issue 22: bf16 vs FP8 compute, 8B, mix 32k
                    timeout "${T_8B:-200}" $B --shape qwen3-8b --tag "$cd" --compute-dtype "$cd" --tokens "${TOKENS_8B:-400000}" \
                      --fp8-accumulation "${ACCUM:-fp32}" --sections mix32k --memory-spool-gib "${MEM_GIB:-auto}"; done ;;
    27b-compute)  for cd in bfloat16 float8; do  # issue 22: the Qwen3.5/3.6-27B text shape, fla, bf16 vs FP8 compute
                    PYTHONPATH="$FLA_SITE:$PYTHONPATH" timeout "${T_27B:-240}" $B --shape hybrid27b --tag "$cd" \
                      --compute-dtype "$cd" --tokens "${TOKENS_27B:-200000}" --sections mix32k --no-full \
                      --fp8-accumulation "${ACCUM:-fp32}" \
                      --memory-spool-gib "${MEM_GIB:-auto}"; done ;;
    27b-kernels)  for k in ${KERNELS:-eager auto}; do  # issue 39: the 27B hybrid FP8 pipeline, transformers' forward vs fused
                    PYTHONPATH="$FLA_SITE:$PYTHONPATH" timeout "${T_27B:-240}" $B --shape hybrid27b --tag "${CD:-float8}-$k" \
                      --compute-dtype "${CD:-float8}" --kernels "$k" --tokens "${TOKENS_27B:-200000}" --sections mix32k \
                      --no-full --memory-spool-gib "${MEM_GIB:-auto}"; done ;;
    8b-kernels)   for k in ${KERNELS:-eager auto}; do  # issue 39: the 8B shape must not regress (fla on the path)
                    PYTHONPATH="$FLA_SITE:$PYTHONPATH" timeout "${T_8B:-200}" $B --shape qwen3-8b --tag "${CD:-float8}-$k" --compute-dtype "${CD:-float8}" \
                      --kernels "$k" --tokens "${TOKENS_8B:-400000}" --sections mix32k --memory-spool-gib "${MEM_GIB:-auto}"; done ;;
    profile)      PYTHONPATH="$FLA_SITE:$PYTHONPATH" timeout "${T_PROF:-420}" python bench/forward_profile.py --shape hybrid27b \
                    --tokens "${TOKENS_PROF:-100000}" --profile-batches 2 ${LEVERS---levers} --computes "${COMPUTES:-bf16,fp8}" \
                    --out "$OUTDIR" ;;
    fp8-speed)    timeout "${T_SPEED:-200}" python bench/fp8_speed.py --shape qwen3-8b --tokens 150000 --profile --out "$OUTDIR"
                  PYTHONPATH="$FLA_SITE:$PYTHONPATH" timeout "${T_SPEED27:-330}" python bench/fp8_speed.py --shape hybrid27b \
                    --tokens 100000 --profile --out "$OUTDIR" \
                    --variants "fp8 as landed (compiled quantiser),triton + shared input,triton + shared + fast accum" ;;
    fp8-checkpoint) timeout "${T_CKPT:-200}" python bench/fp8_checkpoint.py --shape qwen3-8b --tokens "${TOKENS_CKPT:-150000}" \
                    --layers "${CKPT_LAYERS:-0}" --fp8-accumulation "${ACCUM:-fp32}" --out "$OUTDIR" ;;
    producer)     timeout "${T_PROD:-240}" python bench/producer_e2e.py --rows "${PROD_ROWS:-1000000}" --out "$OUTDIR" ;;
    fidelity)     PYTHONPATH="$FLA_SITE:$PYTHONPATH" timeout "${T_FID:-240}" python bench/fp8_fidelity.py \
                    --minutes "${FID_MIN:-1.5}" --fp8-accumulation "${ACCUM:-fp32}" --out "$OUTDIR" ;;
    kernel-fidelity) timeout "${T_FID:-240}" python bench/fp8_fidelity.py --arch "${ARCH:-hybrid}" --train-only \
                    --minutes "${FID_MIN:-1.5}" --out "$OUTDIR" \
                  && PYTHONPATH="$FLA_SITE:$PYTHONPATH" timeout "${T_FID:-240}" python bench/fp8_fidelity.py \
                    --arch "${ARCH:-hybrid}" --kernels-only --trained --out "$OUTDIR" --columns "${FID_COLUMNS:-}" \
                    --held-out "${FID_HELD:-64}" ;;   # trained without fla
    prefix-smoke) PYTHONPATH="$FLA_SITE:$PYTHONPATH" timeout "${T_SMOKE:-150}" python bench/prefix_reuse.py \
                    --shape hybrid --compute-dtype bfloat16 --tokens 20000 --token-budget 8192 --repeats 1 \
                    --fidelity-samples 8 --per-turn every-message --out "$OUTDIR" ;;   # fla continuing a cache
    prefix)       PYTHONPATH="$FLA_SITE:$PYTHONPATH" timeout "${T_PREFIX:-540}" python bench/prefix_reuse.py --shape hybrid27b \
                    --compute-dtype "${CD:-float8}" --tokens "${TOKENS_PREFIX:-200000}" --per-turn "${PER_TURN:-hsx}" \
                    --out "$OUTDIR" ${PREFIX_ARGS:-} ;;   # e.g. PREFIX_ARGS="--fidelity-only" CD=bfloat16,float8
    forward-host) PYTHONPATH="$FLA_SITE:$PYTHONPATH" timeout "${T_HOST:-300}" python bench/forward_host.py --shape hybrid27b \
                    --compute-dtype "${CD:-float8}" --kernels "${KERNELS:-auto}" --out "$OUTDIR" ;;   # issue 40
    gdn-continue) PYTHONPATH="$FLA_SITE:$PYTHONPATH" timeout "${T_GDN:-240}" python bench/gdn_continue.py ;;   # issue 40
    packed-parity) PYTHONPATH="$FLA_SITE:$PYTHONPATH" timeout "${T_PAR:-200}" python bench/packed_parity.py \
                    --layers "${PAR_LAYERS:-8}" --out "$OUTDIR" ;;   # issue 39: packed rows vs padded, per stored layer
    *)            echo "unknown step $step"; false ;;
  esac
  rc=$?
  echo "=== $step exit $rc"
  [[ $rc -eq 0 ]] || FAILED+=("$step")
done
if [[ -n "$PADDING_PID" ]]; then
  wait "$PADDING_PID"
  tail -n 3 "$OUTDIR/padding.log"
fi
keep_triton_cache
echo
python bench/gpu_bench.py --table "$OUTDIR"
if [[ ${#FAILED[@]} -gt 0 ]]; then echo "failed steps: ${FAILED[*]}"; exit 1; fi
