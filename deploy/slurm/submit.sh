#!/usr/bin/env bash
# Submit an hsx run to SLURM, or add workers to one (docs/deploy.md, "SLURM").
#
#   HSX_SLURM_ENV=/abs/myrun.env deploy/slurm/submit.sh run        producer + a worker array of HSX_SLURM_GPUS tasks
#   HSX_SLURM_ENV=/abs/myrun.env deploy/slurm/submit.sh add N      N more worker tasks (join the run at once)
#   HSX_SLURM_ENV=/abs/myrun.env deploy/slurm/submit.sh run-nodes N  producer + N whole-node jobs (HSX_SLURM_GPUS
#                                                                    GPUs each, one job step per GPU)
#   HSX_SLURM_ENV=/abs/myrun.env deploy/slurm/submit.sh add-nodes N  N more whole-node jobs
#
# The settings file (deploy/slurm/hsx.env.example) is read here for the HSX_SLURM_* scheduler settings, without
# exporting anything from it: credentials in it are read again inside each job, never passed through sbatch.
# Prints the job ids, one per line ("producer JOBID", "workers JOBID", "nodes JOBID"). A requeued task waits
# about 2 minutes before it starts again (slurmctld's credential lifetime, AuthInfo=cred_expire).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" >&2; exit 2; }
[ $# -ge 1 ] || usage
what=$1; shift
: "${HSX_SLURM_ENV:?set HSX_SLURM_ENV to the settings file of the run (an absolute path every node reads)}"
case "$HSX_SLURM_ENV" in /*) ;; *) echo "submit.sh: HSX_SLURM_ENV must be an absolute path, not $HSX_SLURM_ENV" >&2; exit 2 ;; esac
[ -r "$HSX_SLURM_ENV" ] || { echo "submit.sh: cannot read $HSX_SLURM_ENV (HSX_SLURM_ENV)" >&2; exit 2; }
# shellcheck disable=SC1090
source "$HSX_SLURM_ENV"   # plain shell variables: nothing is exported to sbatch from here
: "${HSX_RUN:?set HSX_RUN in $HSX_SLURM_ENV}"
log_dir=${HSX_SLURM_LOG_DIR:-$PWD/hsx-slurm-logs}
mkdir -p "$log_dir"
export HSX_SLURM_DIR="$here" HSX_SLURM_ENV

common=(--parsable --time="${HSX_SLURM_TIME:-24:00:00}")
[ -n "${HSX_SLURM_PARTITION:-}" ] && common+=(--partition="$HSX_SLURM_PARTITION")
[ -n "${HSX_SLURM_ACCOUNT:-}" ] && common+=(--account="$HSX_SLURM_ACCOUNT")
# shellcheck disable=SC2206
[ -n "${HSX_SLURM_EXTRA:-}" ] && common+=($HSX_SLURM_EXTRA)
stopping=(--signal="B:USR1@${HSX_SLURM_SIGNAL_LEAD:-300}")
gpu=(); [ "${HSX_SLURM_DEVICE:-gpu}" = cpu ] || gpu=(--gres=gpu:1)

producer() {
  echo "producer $(sbatch "${common[@]}" --cpus-per-task="${HSX_SLURM_PRODUCER_CPUS:-8}" --mem="${HSX_SLURM_PRODUCER_MEM:-32G}" \
    --output="$log_dir/hsx-produce-$HSX_RUN-%j.log" "$here/producer.sbatch")"
}

workers() {  # N array tasks of worker.sbatch
  local n=$1
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "submit.sh: the number of workers must be a positive integer, not '$n'" >&2; exit 2; }
  echo "workers $(sbatch "${common[@]}" "${stopping[@]}" "${gpu[@]}" --array="0-$((n - 1))" \
    --cpus-per-task="${HSX_SLURM_CPUS_PER_TASK:-8}" --mem="${HSX_SLURM_MEM:-64G}" \
    --output="$log_dir/hsx-worker-$HSX_RUN-%A_%a.log" "$here/worker.sbatch")"
}

nodes() {  # N whole-node jobs of node.sbatch
  local n=$1 g=${HSX_SLURM_GPUS:-8} per_gpu
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "submit.sh: the number of nodes must be a positive integer, not '$n'" >&2; exit 2; }
  node_gpu=(); [ "${HSX_SLURM_DEVICE:-gpu}" = cpu ] || node_gpu=(--gres="gpu:$g" --exclusive)
  per_gpu=${HSX_SLURM_CPUS_PER_STEP:-1}
  echo "nodes $(sbatch "${common[@]}" "${stopping[@]}" "${node_gpu[@]}" --array="0-$((n - 1))" --nodes=1 \
    --ntasks="$g" --cpus-per-task="$per_gpu" --mem="${HSX_SLURM_NODE_MEM:-0}" \
    --output="$log_dir/hsx-node-$HSX_RUN-%A_%a.log" "$here/node.sbatch")"
}

case "$what" in
  run)  producer; workers "${HSX_SLURM_GPUS:-8}" ;;
  add)  [ $# = 1 ] || usage; workers "$1" ;;
  run-nodes) [ $# = 1 ] || usage; producer; nodes "$1" ;;
  add-nodes) [ $# = 1 ] || usage; nodes "$1" ;;
  *)    usage ;;
esac
