#!/usr/bin/env bash
# Install the offline dependencies made by bench/prepare_offline.sh on the GPU
# machine (no internet): the wheels in .whl/ go to $OFFLINE_SITE (default
# /tmp/site) and the unpacked redis in .redis/ is put on PATH.
#
# Preferred use, from the repo root; installs, then exports into this shell:
#
#     source bench/install_offline.sh
#
# or run it and eval the export lines it prints on stdout:
#
#     eval "$(bash bench/install_offline.sh)"
#
# Exports: PYTHONPATH (+$OFFLINE_SITE), PATH (+.redis/usr/bin, +$OFFLINE_SITE/bin
# for the `rq` command), LD_LIBRARY_PATH (+.redis/usr/lib/x86_64-linux-gnu,
# which holds only libjemalloc.so.2 and liblzf.so.1).
#
# Safe to source from shells with or without `set -euo pipefail`: the install
# runs in a child bash, so the caller's shell options are never changed.
# Idempotent: reinstalling overwrites, and sourcing twice does not duplicate
# path entries.

# ---------------------------------------------------------------- sourced ---
if (return 0 2>/dev/null); then
  _offline_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  _offline_site="${OFFLINE_SITE:-/tmp/site}"

  # Prepend $2 to the colon-separated variable named $1 unless already there.
  _offline_prepend() {
    local cur
    eval "cur=\${$1:-}"
    case ":$cur:" in
      *":$2:"*) ;;
      *) export "$1=$2${cur:+:$cur}" ;;
    esac
  }

  if bash "${BASH_SOURCE[0]}" >/dev/null; then
    _offline_prepend PYTHONPATH "$_offline_site"
    _offline_prepend PATH "$_offline_site/bin"
    _offline_prepend PATH "$_offline_root/.redis/usr/bin"
    _offline_prepend LD_LIBRARY_PATH "$_offline_root/.redis/usr/lib/x86_64-linux-gnu"
    unset -f _offline_prepend
    unset _offline_root _offline_site
  else
    unset -f _offline_prepend
    unset _offline_root _offline_site
    echo "[install_offline] FAILED; environment left unchanged" >&2
    return 1
  fi
  return 0
fi

# --------------------------------------------------------------- executed ---
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SITE="${OFFLINE_SITE:-/tmp/site}"
PYTHON="${PYTHON:-python3}"
REDIS_BIN="$ROOT/.redis/usr/bin"
REDIS_LIB="$ROOT/.redis/usr/lib/x86_64-linux-gnu"

log() { printf '[install_offline] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

shopt -s nullglob
wheels=("$ROOT"/.whl/*.whl)
shopt -u nullglob
[[ ${#wheels[@]} -gt 0 ]] || die "no wheels in $ROOT/.whl (run bench/prepare_offline.sh on a connected machine; carry .whl)"
[[ -x "$REDIS_BIN/redis-server" ]] || die "no $REDIS_BIN/redis-server (carry .redis)"

log "installing ${#wheels[@]} wheels into $SITE"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target "$SITE" "${wheels[@]}" >&2 || die "pip install failed"

# Quick checks, with the same environment the caller will get.
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c \
  'import redis, rq, boto3, croniter; print("[install_offline] redis", redis.__version__, "rq", rq.__version__, "boto3", boto3.__version__)' >&2 \
  || die "python imports failed"
if ! LD_LIBRARY_PATH="$REDIS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
     "$REDIS_BIN/redis-server" --version >&2; then
  LD_LIBRARY_PATH="$REDIS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    ldd "$REDIS_BIN/redis-server" | grep 'not found' >&2 || true
  die "redis-server does not run here"
fi

# Export lines for `eval` (the sourced path above applies the same, deduplicated).
printf 'export PYTHONPATH=%q${PYTHONPATH:+:$PYTHONPATH}\n' "$SITE"
printf 'export PATH=%q:%q:$PATH\n' "$REDIS_BIN" "$SITE/bin"
printf 'export LD_LIBRARY_PATH=%q${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}\n' "$REDIS_LIB"
