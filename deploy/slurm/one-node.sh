#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (docs/deploy.md, "SLURM on one machine"): prints its slurm.conf.
#
#   deploy/slurm/one-node.sh DIR > slurm.conf
#
# DIR holds the cluster's state, spool, pid and log files (made here). The node is this machine: its short host
# name, every CPU, 80 % of its memory. No munge: AuthType=auth/none, so only for a machine of your own. Settings
# (environment): HSX_SLURM_CONF_PORTS="6817 6818" (slurmctld's and slurmd's ports), HSX_SLURM_CONF_KILL_WAIT=30
# (s from SIGTERM to SIGKILL when a job is cancelled: a cancelled task drains its spool in it),
# HSX_SLURM_CONF_PARTITION=local, HSX_SLURM_CONF_GPUS=0 (N: the node offers gpu:N, /dev/nvidia0..N-1, written to
# DIR/gres.conf: copy it beside slurm.conf; not tested here, CI has no GPU). tests/slurmcluster.py starts the cluster of this file (tests/test_slurm.py).
set -euo pipefail
dir=${1:?usage: deploy/slurm/one-node.sh DIR > slurm.conf}
case "$dir" in /*) ;; *) dir="$PWD/$dir" ;; esac
mkdir -p "$dir/state" "$dir/spool" "$dir/log"
read -r ctld_port slurmd_port <<<"${HSX_SLURM_CONF_PORTS:-6817 6818}"
node=$(hostname -s)
gpus=${HSX_SLURM_CONF_GPUS:-0}
gres=""
if [ "$gpus" -gt 0 ]; then
  gres=" Gres=gpu:$gpus"
  echo "Name=gpu File=/dev/nvidia[0-$((gpus - 1))]" > "$dir/gres.conf"
fi
memory_mb=$(awk '/^MemTotal:/ { printf "%d", $2 / 1024 * 0.8 }' /proc/meminfo)
cat <<CONF
# slurm.conf of a one-node cluster ($node), written by deploy/slurm/one-node.sh
ClusterName=hsx
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
# one machine of your own: no munge
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
SwitchType=switch/none
$(if [ "$gpus" -gt 0 ]; then echo GresTypes=gpu; else echo "# no GPUs offered (HSX_SLURM_CONF_GPUS=N offers N)"; fi)
ReturnToService=2
JobRequeue=1
# SIGTERM to SIGKILL when a job is cancelled: a cancelled task drains its spool in it
KillWait=${HSX_SLURM_CONF_KILL_WAIT:-30}
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5,sched_interval=5
MinJobAge=600
# a requeued task waits cred_expire + 1 s before it starts again (120 s by default)
AuthInfo=cred_expire=10
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(nproc --all) RealMemory=$memory_mb$gres State=UNKNOWN
# tasks share the cores (CPU workers spend most of their time waiting; GPU tasks ask --gres=gpu:1 anyway)
PartitionName=${HSX_SLURM_CONF_PARTITION:-local} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
