#!/usr/bin/env bash
# Install everything hsx needs on a fresh Debian/Ubuntu machine, idempotently.
#   scripts/setup.sh          runtime: redis-server, a venv in .venv, CPU torch, hsx
#   scripts/setup.sh --test   also the test tools (and scripts/peers.sh: the peers' trainers in .peers/): moto, pytest, playwright, chromium, docker-compose (v1; tests/test_compose_docker.py
#                           gets docker.io, an engine and base images from ../shared/docker/offline-base-images.sh)
# Torch: the pinned CPU wheel is installed first so that no multi-GB CUDA build is pulled.
# On a GPU machine, install the CUDA torch you want into .venv before running this (HSX_KEEP_TORCH=1).
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[ "${1:-}" = "--test" ] && want_test=1

apt_pkgs=()
command -v redis-server >/dev/null || apt_pkgs+=(redis-server)
if [ "$want_test" = 1 ]; then
  command -v docker-compose >/dev/null || apt_pkgs+=(docker-compose)
  command -v chromium >/dev/null || apt_pkgs+=(chromium)
  command -v chromedriver >/dev/null || apt_pkgs+=(chromium-driver)
  command -v slurmctld >/dev/null || apt_pkgs+=(slurm-wlm)   # tests/test_slurm.py: a one-node cluster, auth/none
fi
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "setup: apt-get install ${apt_pkgs[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${apt_pkgs[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=".venv/bin/python -m pip"
$pip install -q --upgrade pip >/dev/null
if [ "${HSX_KEEP_TORCH:-0}" != 1 ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU)"
  $pip install -q "torch==2.13.0"
fi
if [ "$want_test" = 1 ]; then
  $pip install -q -e ".[test]"
  scripts/compat.sh  # the GPU image's transformers beside the venv's, for tests/test_transformers_compat.py
  scripts/peers.sh   # the peers' released trainers, in venvs of their own, for tests/test_peers.py
else
  $pip install -q -e .
fi
echo "setup: done (.venv/bin/hsx)"
