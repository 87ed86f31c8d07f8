#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for the tests and for trying the
# job scripts:  scripts/slurm.sh start | stop | status
#
#   start   installs `slurm-wlm munge` with apt when missing (root), writes
#           /etc/slurm/slurm.conf for this host (real hostname, `nproc` CPUs,
#           memory below what is available), starts munged, slurmctld and slurmd,
#           and waits until `sinfo` shows the node idle.  Idempotent: a running
#           cluster is left as it is.
#   stop    cancels the cluster's jobs and stops the three daemons it started.
#   status  exit 0 and one line when the local cluster answers, 1 otherwise.
#
# Daemon state and logs live in HPCNET_SLURM_DIR (default /var/tmp/hpcnet-slurm):
# spool/, state/, slurmctld.log, slurmd.log.  The configuration is the one the
# SLURM commands read by default, so `sbatch`, `squeue`, `scontrol` work from any
# shell.  It is written only when absent or written by this script before: a
# site's slurm.conf is never touched.
#
# The plugins are the ones that work in a container without systemd or cgroups:
# proctrack/linuxproc, task/none, no cgroup.conf (Debian's 22.05 has no
# "disabled" cgroup plugin), MpiDefault=none (the job scripts ask for
# `srun --mpi=pmix`; pmi2 does not work with Debian's Open MPI), ReturnToService=2
# (the node comes back by itself after a restart), OverSubscribe=FORCE:4 (several
# small test jobs share the few cores).  cred_expire and sched_interval are cut
# so that a requeued job starts again within seconds, not minutes.
set -euo pipefail

state_dir="${HPCNET_SLURM_DIR:-/var/tmp/hpcnet-slurm}"
conf=/etc/slurm/slurm.conf
marker="# written by hpcnet scripts/slurm.sh"
node="$(hostname -s)"

die() { echo "slurm.sh: $*" >&2; exit 1; }

install_if_missing() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v sbatch >/dev/null && return 0
    [ "$(id -u)" = 0 ] || die "SLURM is not installed and this is not root: install slurm-wlm and munge"
    command -v apt-get >/dev/null || die "SLURM is not installed and there is no apt-get: install slurm-wlm and munge"
    echo "slurm.sh: installing slurm-wlm munge"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

write_conf() {
    if [ -e "$conf" ] && ! grep -qF "$marker" "$conf"; then
        die "$conf exists and was not written by this script; not touching a site's SLURM"
    fi
    local cpus mem_mb
    cpus="$(nproc)"
    # Below what is available now: slurmd drains a node that has less memory than configured.
    mem_mb="$(awk '/MemAvailable/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)"
    mkdir -p "$(dirname "$conf")" "$state_dir/spool" "$state_dir/state"
    cat >"$conf.tmp" <<EOF
$marker: a one-node cluster for tests.
ClusterName=hpcnet-local
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=5
# Test pending jobs every 2 s (default 60), so a requeued job starts once eligible.
SchedulerParameters=sched_interval=2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
MailProg=/bin/true
# SIGTERM -> SIGKILL: time for the ranks to save at the next step boundary.
KillWait=30
MinJobAge=600
StateSaveLocation=$state_dir/state
SlurmdSpoolDir=$state_dir/spool
SlurmctldPidFile=$state_dir/slurmctld.pid
SlurmdPidFile=$state_dir/slurmd.pid
SlurmctldLogFile=$state_dir/slurmctld.log
SlurmdLogFile=$state_dir/slurmd.log
NodeName=$node CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE OverSubscribe=FORCE:4 State=UP
EOF
    mv "$conf.tmp" "$conf"
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

is_ours() { [ -e "$conf" ] && grep -qF "$marker" "$conf"; }

node_state() { sinfo -h -N -n "$node" -o %t 2>/dev/null | head -n 1; }

start() {
    install_if_missing
    if is_ours && pid_alive "$state_dir/slurmctld.pid" && pid_alive "$state_dir/slurmd.pid" \
        && [ -n "$(node_state)" ]; then
        echo "slurm.sh: already running ($(status_line))"
        return 0
    fi
    write_conf
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        mkdir -p /run/munge /var/log/munge /var/lib/munge
        [ -s /etc/munge/munge.key ] || mungekey --create --force 2>/dev/null \
            || dd if=/dev/urandom of=/etc/munge/munge.key bs=1k count=1 2>/dev/null
        # --force: munged refuses to run as root otherwise.
        munged --force --pid-file="$state_dir/munged.pid" --log-file="$state_dir/munged.log" || die "munged did not start"
    fi
    # -c: a fresh cluster, no jobs left over from an earlier start.
    pid_alive "$state_dir/slurmctld.pid" || slurmctld -c || die "slurmctld did not start: see $state_dir/slurmctld.log"
    pid_alive "$state_dir/slurmd.pid" || slurmd || die "slurmd did not start: see $state_dir/slurmd.log"
    local deadline=$((SECONDS + 60)) state=""
    while [ $SECONDS -lt $deadline ]; do
        state="$(node_state)"
        case "$state" in
            idle|mix|alloc) echo "slurm.sh: started ($(status_line))"; return 0 ;;
            drain*|down*) scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true ;;
        esac
        sleep 1
    done
    die "node $node is '${state:-not reported}' after 60 s: see $state_dir/slurmctld.log and slurmd.log"
}

stop() {
    if is_ours && sinfo -h >/dev/null 2>&1; then
        scancel --quiet --partition=debug 2>/dev/null || true
    fi
    local name
    for name in slurmd slurmctld munged; do
        if pid_alive "$state_dir/$name.pid"; then
            local pid
            pid="$(cat "$state_dir/$name.pid")"
            kill "$pid"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
            kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        fi
        rm -f "$state_dir/$name.pid"
    done
    echo "slurm.sh: stopped"
}

status_line() { echo "node $node $(node_state), $(nproc) CPUs, partition debug, logs in $state_dir"; }

status() {
    if is_ours && pid_alive "$state_dir/slurmctld.pid" && [ -n "$(node_state)" ]; then
        echo "slurm.sh: running ($(status_line))"
    else
        echo "slurm.sh: not running"
        return 1
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: scripts/slurm.sh start|stop|status" >&2; exit 2 ;;
esac
