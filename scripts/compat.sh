#!/usr/bin/env bash
# transformers as the GPU image has it (5.17.0, with the huggingface_hub it needs), beside the venv's newer one,
# for tests/test_transformers_compat.py: the cache-continuing and fused-kernel tests run again against it, since
# an API renamed between the two (e.g. the decoder's `past_key_values` -> `cache`) fails silently, not loudly.
# Installed --no-deps into a folder put first on PYTHONPATH; cached in ${HSX_COMPAT_DIR:-~/.cache/hsx/compat}
# (survives a fresh clone, as in CI); .compat is a link to it. Run by scripts/setup.sh --test.
set -euo pipefail
cd "$(dirname "$0")/.."
PINS="transformers==5.17.0 huggingface_hub==1.33.0"
root=${HSX_COMPAT_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hsx/compat}
mkdir -p "$root"
if [ ! -e .compat ] || [ -L .compat ]; then ln -sfn "$root" .compat; fi
target="$root/transformers-5.17"
if [ "$(cat "$target/.hsx-stamp" 2>/dev/null)" = "$PINS" ]; then exit 0; fi
rm -rf "$target"
# shellcheck disable=SC2086
.venv/bin/python -m pip install -q --no-deps --target "$target" $PINS 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python - "$target" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import transformers
assert transformers.__version__ == "5.17.0", transformers.__version__
PY
echo "$PINS" >"$target/.hsx-stamp"
echo "compat: transformers 5.17.0 in $target"
