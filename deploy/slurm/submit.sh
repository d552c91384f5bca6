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
# Each request (producer, worker task) is checked against the partition's nodes first (sinfo): one that no node
# can hold would pend forever (reason PartitionConfig). A default that does not fit is sized to the largest node,
# said in one line; a value you set that does not fit is refused in one line naming its variable (exit 2).
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

partition_nodes() {  # "PARTITION CPUS MEMORY_MB" of each node of the partition the jobs go to; nothing where sinfo
  if [ -n "${HSX_SLURM_PARTITION:-}" ]; then  # cannot say
    sinfo -h -N -p "$HSX_SLURM_PARTITION" -o "%P %c %m" 2>/dev/null
  else  # the default partition: sinfo marks it with a '*'
    sinfo -h -N -o "%P %c %m" 2>/dev/null | awk '$1 ~ /[*]$/'
  fi | tr -d '+*' | sort -u || true
}

mem_mb() {  # an sbatch --mem value in MB (1500M, 32G, 1T, 4096); empty if it is not one
  local v=$1 n
  n=${v%[KkMmGgTt]}
  [[ "$n" =~ ^[0-9]+$ ]] || return 0
  case "${v#"$n"}" in
    K|k) echo $((n / 1024)) ;; ""|M|m) echo "$n" ;; G|g) echo $((n * 1024)) ;; T|t) echo $((n * 1024 * 1024)) ;;
  esac
}

sized=()  # fitted WHAT CPUS_VAR MEM_VAR DEFAULT_CPUS DEFAULT_MEM: sets sized=(CPUS MEM), fitted to the partition
fitted() {
  local what=$1 cpus_var=$2 mem_var=$3 cpus=${!2:-$4} mem=${!3:-$5} nodes want p c m part= max_c=0 max_m=0
  sized=("$cpus" "$mem")
  nodes=$(partition_nodes)
  want=$(mem_mb "$mem")
  [ -n "$nodes" ] && [[ "$cpus" =~ ^[0-9]+$ ]] && [ -n "$want" ] || return 0   # nothing to check against
  while read -r p c m; do
    [[ "$c" =~ ^[0-9]+$ && "$m" =~ ^[0-9]+$ ]] || continue
    part=$p
    if [ "$c" -ge "$cpus" ] && { [ "$want" -eq 0 ] || [ "$m" -ge "$want" ]; }; then return 0; fi  # a node holds it
    if [ "$c" -gt "$max_c" ]; then max_c=$c; fi
    if [ "$m" -gt "$max_m" ]; then max_m=$m; fi
  done <<< "$nodes"
  [ "$max_c" -gt 0 ] || return 0
  local too_big=() largest="$max_c CPUs, ${max_m}M"
  if [ "$cpus" -gt "$max_c" ]; then
    if [ -n "${!cpus_var:-}" ]; then too_big+=("$cpus_var=$cpus"); else sized[0]=$max_c; fi
  fi
  if [ "$want" -gt "$max_m" ]; then
    if [ -n "${!mem_var:-}" ]; then too_big+=("$mem_var=$mem"); else sized[1]="${max_m}M"; fi
  fi
  if [ ${#too_big[@]} -gt 0 ] || [ "${sized[*]}" = "$cpus $mem" ]; then  # a set value, or no single node holds both
    echo "submit.sh: the $what asks $cpus CPUs / $mem (${too_big[*]:-$cpus_var / $mem_var} in $HSX_SLURM_ENV) but no" \
      "node of partition $part holds that (largest: $largest): it would pend forever (PartitionConfig); lower it" >&2
    exit 2
  fi
  echo "submit.sh: the $what asks ${sized[0]} CPUs / ${sized[1]}, sized to partition $part's largest node ($largest;" \
    "the default $4 / $5 fits none; set $cpus_var / $mem_var to choose)" >&2
}

producer() {
  fitted producer HSX_SLURM_PRODUCER_CPUS HSX_SLURM_PRODUCER_MEM 8 32G
  echo "producer $(sbatch "${common[@]}" --cpus-per-task="${sized[0]}" --mem="${sized[1]}" \
    --output="$log_dir/hsx-produce-$HSX_RUN-%j.log" "$here/producer.sbatch")"
}

workers() {  # N array tasks of worker.sbatch
  local n=$1
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "submit.sh: the number of workers must be a positive integer, not '$n'" >&2; exit 2; }
  fitted "worker task" HSX_SLURM_CPUS_PER_TASK HSX_SLURM_MEM 8 64G
  echo "workers $(sbatch "${common[@]}" "${stopping[@]}" "${gpu[@]}" --array="0-$((n - 1))" \
    --cpus-per-task="${sized[0]}" --mem="${sized[1]}" \
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
