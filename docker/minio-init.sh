#!/bin/sh
# minio_init (docker-compose.yml, profile minio): create the bucket HSX_MINIO_BUCKET (default hsx).
# The root user reaches `mc alias set` on stdin, so it is in no URL and on no command line.
set -eu
printf '%s\n%s\n' "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD" | mc alias set minio http://minio:9000 >/dev/null
exec mc mb --ignore-existing "minio/${HSX_MINIO_BUCKET:-hsx}"
