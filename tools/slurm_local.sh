#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, so that test_all.py can submit docs/SWEEPS.md's recipe
# (tools/slurm_sweep.sh) to a real scheduler. Debian's slurmctld and slurmd with munge, as root, on localhost.
# Idempotent: installs what is missing, writes /etc/slurm/slurm.conf (restarting the daemons when it changed),
# starts munged, slurmctld and slurmd where they are not running, and waits until `sinfo` shows the node idle.
# usage (as root; .ci/run calls it): tools/slurm_local.sh
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "error: tools/slurm_local.sh installs and starts daemons: run it as root" >&2; exit 1; }
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
        || ! command -v munged >/dev/null; then
    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        slurmctld slurmd slurm-client munge
fi

# munge: the key every Slurm daemon and client authenticates with (one host, so it never leaves this machine)
[ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }  # a daemon by its pid file
alive /run/munge/munged.pid || runuser -u munge -- munged

# slurm.conf: this host as controller and only node, with at most 2 CPUs and 90% of the memory slurmd sees.
# proctrack/linuxproc and task/none: no cgroups, which containers often lack; cons_tres with CR_CPU: two 1-CPU
# array tasks run side by side, and memory is not a consumable a job must ask for.
host=$(hostname -s)
hw=$(slurmd -C | head -1)
cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
mem=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
conf=$(cat <<EOF
ClusterName=nanokv
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host CPUs=$(( cpus < 2 ? cpus : 2 )) RealMemory=$(( mem * 9 / 10 )) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)
if [ "$(cat /etc/slurm/slurm.conf 2>/dev/null)" != "$conf" ]; then
    printf '%s\n' "$conf" > /etc/slurm/slurm.conf
    for pid in /run/slurmd.pid /run/slurmctld.pid; do  # a running daemon read the old file: restart it
        if alive "$pid"; then kill "$(cat "$pid")"; while alive "$pid"; do sleep 0.2; done; fi
    done
fi
alive /run/slurmctld.pid || slurmctld
alive /run/slurmd.pid || slurmd

for _ in $(seq 1 60); do  # at most a minute
    state=$(sinfo -h -N -n "$host" -o %T 2>/dev/null || true)
    case "$state" in
        idle|mixed|allocated) echo "slurm: node $host is $state"; exit 0 ;;
        down*|drain*) scontrol update NodeName="$host" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 1
done
echo "error: the Slurm node $host is not idle after a minute (sinfo says '${state:-nothing}'): see" \
     "/var/log/slurm/slurmctld.log and slurmd.log" >&2
exit 1
