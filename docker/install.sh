#!/bin/sh
# Shared install steps of both image targets (Dockerfile), over the torch already in the image.
#   install.sh deps [EXTRA]  hsx's dependencies, read from pyproject.toml alone (its own layer: a source
#                     change does not reinstall transformers & co.), and an extra's (gpu: the fused kernels
#                     `hsx worker --kernels auto` runs, pinned wheels that need no build)
#   install.sh reqs [EXTRA]  print what deps installs
#   install.sh hsx    hsx itself (no dependency resolution left to do), an import check of every
#                     module of every package, the user hsx (uid 10001) and the mount points it owns
set -eu
cd "$(dirname "$0")/.."   # /opt/hsx in the image
reqs() {
  python - "${1:-}" <<'PY'
import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extra = sys.argv[1]
if extra and extra not in project.get("optional-dependencies", {}):
    sys.exit(f"install.sh: no extra {extra!r} in pyproject.toml")
print("\n".join(project["dependencies"] + (project["optional-dependencies"][extra] if extra else [])))
PY
}
case "${1:-}" in
  reqs)
    reqs "${2:-}"
    ;;
  deps)
    reqs "${2:-}" > /tmp/hsx-requirements.txt
    pip install -r /tmp/hsx-requirements.txt ${EXTRA_PIP:-}
    rm /tmp/hsx-requirements.txt
    ;;
  hsx)
    pip install --no-deps .
    # Every module of the installed packages imports (a package left out of the wheel fails here).
    (cd / && python /opt/hsx/docker/importcheck.py)
    getent passwd hsx >/dev/null || useradd --uid 10001 --create-home --shell /usr/sbin/nologin hsx
    mkdir -p /var/spool/hsx /models /out
    chown hsx /var/spool/hsx /models /out
    ;;
  *)
    echo "usage: install.sh deps [EXTRA]|reqs [EXTRA]|hsx" >&2
    exit 2
    ;;
esac
