#!/bin/sh
# Uploaders beside one worker, sharing its spool: the pod's native sidecar (an init container with
# restartPolicy: Always), so Kubernetes stops it only after the worker has exited, and the worker's last batch is
# in the spool by then. On SIGTERM: the uploaders stop, then `hsx upload --burst` drains this pod's spool, so a
# pod that is scaled down or evicted leaves nothing behind (within terminationGracePeriodSeconds).
# HSX_UPLOADERS: uploader processes (default 4: docs/deploy.md); HSX_HOST: the pod's name (one upload queue, upload@HOST, a pod).
n=${HSX_UPLOADERS:-4}
pids=""
i=0
while [ "$i" -lt "$n" ]; do
  hsx upload --name "upload-$HSX_HOST-$i" &
  pids="$pids $!"
  i=$((i + 1))
done
drain() {
  trap '' TERM INT
  # shellcheck disable=SC2086
  kill -TERM $pids 2>/dev/null
  wait
  echo "uploader-sidecar: uploaders stopped; draining the spool of $HSX_HOST"
  exec hsx upload --burst --name "upload-$HSX_HOST-drain"
}
trap drain TERM INT
wait
