#!/bin/sh
# Shared install steps of both image targets (Dockerfile), over the torch already in the image.
#   install.sh deps   hsx's dependencies, read from pyproject.toml alone (its own layer: a source
#                     change does not reinstall transformers & co.)
#   install.sh hsx    hsx itself (no dependency resolution left to do), an import check of every
#                     module of every package, the user hsx (uid 10001) and the mount points it owns
set -eu
cd /opt/hsx
case "${1:-}" in
  deps)
    python - <<'PY' > /tmp/hsx-requirements.txt
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"]))
PY
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
    echo "usage: install.sh deps|hsx" >&2
    exit 2
    ;;
esac
