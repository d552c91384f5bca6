#!/bin/sh
# Shared last step of both image targets (Dockerfile): install hsx over the torch already in the
# image, create the unprivileged user hsx (uid 10001) and the mount points it owns.
set -eu
cd /opt/hsx
pip install . ${EXTRA_PIP:-}
python -c "import torch, hsx; print('hsx', hsx.__version__, 'torch', torch.__version__)"
getent passwd hsx >/dev/null || useradd --uid 10001 --create-home --shell /usr/sbin/nologin hsx
mkdir -p /var/spool/hsx /models /out
chown hsx /var/spool/hsx /models /out
