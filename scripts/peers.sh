#!/usr/bin/env bash
# Separate venvs with the peers' released trainers, pinned, for tests/test_peers.py (run by scripts/setup.sh --test).
#   .peers/specforge     specforge 0.2.0 (--no-deps) + the runtime deps of its offline training path (no sglang)
#   .peers/speculators   speculators 0.9.0 + hs-connectors 0.9.0 (--no-deps) + their small runtime deps
# Each venv gets the CPU torch 2.13.0 wheel first (specforge asks for torch==2.11.0, which only matters to its
# sglang rollout path; speculators accepts >=2.9,<=2.14.1; hs-connectors >=2.6), then its own transformers pin.
# Idempotent and cached: the venvs live in ${HSX_PEERS_DIR:-~/.cache/hsx/peers} (survives a fresh clone, as in
# CI), .peers is a link to it, and a venv whose stamp matches its pins is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
TORCH="torch==2.13.0"
# name | packages installed --no-deps | their runtime deps (installed with deps, torch already satisfied)
SPECFORGE_PKGS="specforge==0.2.0"
SPECFORGE_DEPS="transformers==5.8.1 datasets==5.1.0 accelerate tqdm numpy pydantic psutil pyyaml safetensors requests typing-extensions huggingface-hub"
SPECULATORS_PKGS="speculators==0.9.0 hs-connectors==0.9.0"
SPECULATORS_DEPS="transformers==5.19.0 datasets==5.1.0 openai aiohttp click typer rich loguru==0.7.3 pydantic pydantic-settings safetensors tqdm numpy psutil protobuf httpx huggingface-hub"

root=${HSX_PEERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hsx/peers}
mkdir -p "$root"
if [ ! -e .peers ] || [ -L .peers ]; then ln -sfn "$root" .peers; fi

# pip, quiet: on failure its whole output; on success only what is news. Dropped: the warning some machines'
# extra file:// indexes print a package, and the resolver's list of what --no-deps left out (sglang, wandb, ...).
run_pip() {
  local log rc=0
  log=$(mktemp)
  "$@" -q >"$log" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    grep -v "is ignored: it is neither" "$log" >&2 || true
    rm -f "$log"
    echo "peers: failed: $*" >&2
    exit "$rc"
  fi
  grep -v -E "is ignored: it is neither|dependency resolver|requires .*(, which is|, but you have)|^ *$" "$log" || true
  rm -f "$log"
}

make_venv() {
  local name=$1 pkgs=$2 deps=$3
  local dir="$root/$name" want
  want="$PY $TORCH | $pkgs | $deps"
  if [ -f "$dir/.hsx-stamp" ] && [ "$(cat "$dir/.hsx-stamp")" = "$want" ]; then
    echo "peers: $name up to date"
    return
  fi
  echo "peers: installing into $name: $pkgs"
  [ -x "$dir/bin/python" ] || "$PY" -m venv "$dir"
  rm -f "$dir/.hsx-stamp"
  local pip="$dir/bin/python -m pip"
  run_pip $pip install --upgrade pip
  run_pip $pip install "$TORCH"
  # shellcheck disable=SC2086
  run_pip $pip install --no-deps $pkgs
  # shellcheck disable=SC2086
  run_pip $pip install $deps "$TORCH"
  echo "$want" >"$dir/.hsx-stamp"
}

make_venv specforge "$SPECFORGE_PKGS" "$SPECFORGE_DEPS"
make_venv speculators "$SPECULATORS_PKGS" "$SPECULATORS_DEPS"

# What hsx_reader and the plugins in peers/hsx_peers need beside the peers' own deps (zero-copy and follow
# mode read the store and the ledger in the peer's process). hsx and hsx_peers themselves are not installed
# here (the venvs outlive a checkout): the tests put this checkout on PYTHONPATH; users `pip install hsx ./peers`.
READER_DEPS="boto3 redis zstandard"
for name in specforge speculators; do
  stamp="$root/$name/.hsx-reader-stamp"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$READER_DEPS" ]; then continue; fi
  # shellcheck disable=SC2086
  "$root/$name/bin/python" -m pip install -q $READER_DEPS "$TORCH"
  echo "$READER_DEPS" >"$stamp"
done
echo "peers: done ($root)"
