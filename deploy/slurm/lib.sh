#!/usr/bin/env bash
# Shared by producer.sbatch, worker.sbatch and node.sbatch (sourced; not run on its own).
#
# A worker task:  uploaders (HSX_SLURM_UPLOADERS per worker, in the background, this node's spool)
#                 + one `hsx worker` per GPU of the task (--exit-when-complete: a task ends when the run does)
# On SIGTERM (scancel, preemption) or the --signal sent HSX_SLURM_SIGNAL_LEAD seconds before the time limit
# (USR1): the workers get SIGTERM, once (each finishes or hands back its batch within HSX_GRACE_SECONDS and
# exits; a worker enforces that bound itself, docs/deploy.md "Stopping"), then
# `hsx upload --burst` drains this node's spool, then the uploaders stop. At the time limit the task then
# requeues itself (`scontrol requeue`): its successor goes on where the run is. A batch in hand when a task
# is killed outright (SIGKILL, node lost) comes back through its lease: at most one batch per killed worker.
set -uo pipefail

hsx_slurm_say() { echo "hsx-slurm: $(date +%T) ${HSX_SLURM_SELF:-${SLURM_JOB_ID:-?}} (restart ${SLURM_RESTART_COUNT:-0}): $*"; }

hsx_slurm_settings() {
  : "${HSX_SLURM_ENV:?HSX_SLURM_ENV must name the settings file of the run (deploy/slurm/hsx.env.example)}"
  set -a
  # shellcheck disable=SC1090
  source "$HSX_SLURM_ENV" || { echo "hsx-slurm: cannot read $HSX_SLURM_ENV" >&2; exit 2; }
  set +a
  : "${HSX_VENV:?set HSX_VENV in $HSX_SLURM_ENV}"
  HSX="$HSX_VENV/bin/hsx"
  [ -x "$HSX" ] || { echo "hsx-slurm: $HSX is not executable on $(hostname) (HSX_VENV in $HSX_SLURM_ENV)" >&2; exit 2; }
  export HSX_HOST="${HSX_HOST:-$(hostname -s)}"   # the upload queue upload@HOST of this node's spool
  export PYTHONUNBUFFERED=1
  # This task's own id: an array task is ARRAYID_TASK (its SLURM_JOB_ID may equal the array's id, and scontrol
  # or scancel given that would act on every task of the array).
  HSX_SLURM_SELF=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}
  HSX_SLURM_SELF=${HSX_SLURM_SELF:-$SLURM_JOB_ID}
}

HSX_SLURM_PIDS_WORKERS=()
HSX_SLURM_PIDS_UPLOADERS=()
HSX_SLURM_STOP=""   # why the task stops: "" (not stopping), "time limit", "terminated"

hsx_slurm_start_uploaders() {
  local n=$1 i
  for ((i = 0; i < n; i++)); do
    "$HSX" upload --name "upload-${HSX_HOST}-${SLURM_JOB_ID}-${i}" &
    HSX_SLURM_PIDS_UPLOADERS+=($!)
  done
}

# Wait for child $1 through the trapped signals that interrupt `wait` (status > 128 while it still runs);
# its exit status in HSX_SLURM_RC. (Not in $(...): a subshell cannot wait for this shell's children.)
HSX_SLURM_RC=0
hsx_slurm_wait() {
  while :; do
    wait "$1"; HSX_SLURM_RC=$?
    kill -0 "$1" 2>/dev/null || break
  done
}

# USR1: the --signal before the time limit. SLURM sends it on scancel too, with SIGTERM beside it: a SIGTERM
# (scancel, preemption, the limit itself) always wins, so a cancelled task is never requeued.
hsx_slurm_on_signal() {
  local first=$HSX_SLURM_STOP
  [ "$1" = terminated ] || [ -z "$first" ] || return 0
  HSX_SLURM_STOP=$1
  if [ -n "$first" ]; then
    [ "$first" != terminated ] && hsx_slurm_say "SIGTERM too (scancel, preemption): this task will not requeue itself"
    return 0
  fi
  hsx_slurm_say "stopping ($1): SIGTERM to ${#HSX_SLURM_PIDS_WORKERS[@]} worker(s)"
  if [ -n "${HSX_SLURM_STEPS:-}" ]; then
    scancel --signal=TERM "$HSX_SLURM_SELF"  # the workers of every job step, not this batch step: srun itself,
  else                                      # signalled, would cancel its step (SIGKILL, no grace)
    kill -TERM "${HSX_SLURM_PIDS_WORKERS[@]}" 2>/dev/null
  fi
}

# Requeue a task that stopped for its time limit: warned while running, or killed at the limit itself (a
# warning comes at slurmctld's next time check, so with a lead under ~60 s it can come with the kill). Never
# one being cancelled (scancel: JobState CANCELLED) or one whose run is complete.
hsx_slurm_requeue() {
  local state
  state=$(scontrol show job "$HSX_SLURM_SELF" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | head -1 | cut -d= -f2)
  if ! { [ "$HSX_SLURM_STOP" = "time limit" ] && [ "$state" = RUNNING ]; } && [ "$state" != TIMEOUT ]; then
    hsx_slurm_say "not requeued (stopped: ${HSX_SLURM_STOP:-run complete}, job ${state:-gone})"
    return 0
  fi
  hsx_slurm_say "requeueing this task for the rest of the run"
  scontrol requeue "$HSX_SLURM_SELF"
}

# Wait for the workers (a trapped signal interrupts `wait`; go on waiting), drain, stop the uploaders,
# requeue at the time limit. Exits with the first worker's failure, else 0.
hsx_slurm_finish() {
  local pid status=0
  for pid in "${HSX_SLURM_PIDS_WORKERS[@]}"; do
    hsx_slurm_wait "$pid"
    [ "$HSX_SLURM_RC" != 0 ] && [ "$status" = 0 ] && status=$HSX_SLURM_RC
  done
  hsx_slurm_say "workers ended (status $status); draining this node's spool"
  timeout "${HSX_SLURM_DRAIN_SECONDS:-$(( ${HSX_SLURM_SIGNAL_LEAD:-300} / 2 ))}" \
    "$HSX" upload --burst --name "upload-${HSX_HOST}-${SLURM_JOB_ID}-drain"
  kill -TERM "${HSX_SLURM_PIDS_UPLOADERS[@]}" 2>/dev/null
  for pid in "${HSX_SLURM_PIDS_UPLOADERS[@]}"; do hsx_slurm_wait "$pid"; done
  hsx_slurm_requeue
  hsx_slurm_say "done"
  return "$status"
}

hsx_slurm_traps() {
  trap 'hsx_slurm_on_signal "time limit"' USR1
  trap 'hsx_slurm_on_signal terminated' TERM INT
}

# The flags of every worker of a task; the device is the caller's.
hsx_slurm_worker_flags() {
  echo --run "$HSX_RUN" --wait-for-plan --exit-when-complete
}
