#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for CI and for trying the launch scripts.
#
#   bash launch/ci_slurm.sh install   # apt-get Debian's slurmctld slurmd slurm-client munge (root)
#   bash launch/ci_slurm.sh start     # write slurm.conf into $CALIBCLIP_SLURM_DIR, start the daemons
#   bash launch/ci_slurm.sh env       # print `export SLURM_CONF=...` for sbatch/squeue/scontrol
#   bash launch/ci_slurm.sh status    # which daemons run (by pid file) and what sinfo says
#   bash launch/ci_slurm.sh stop      # cancel our jobs, stop the daemons by their pid files
#
# Why a private folder for everything (config, spool, state, logs, pid files, a munge socket
# and key): the cluster must not touch a system SLURM or munge, must be removable with one
# `rm -rf`, and several checkouts may start their own (pick another CALIBCLIP_SLURM_DIR and
# CALIBCLIP_SLURM_PORT). Why by pid file: `stop` must end exactly the daemons `start` began.
# Every command is idempotent: `start` on a running cluster only waits for the node; `stop` on
# a stopped one does nothing. Exit status 3 means "cannot here" (not root, no apt, no SLURM);
# the line starting with SKIP says why.
#
# Environment:
#   CALIBCLIP_SLURM_DIR    state folder (default /tmp/calibclip-slurm)
#   CALIBCLIP_SLURM_PORT   slurmctld port; slurmd uses PORT+1 (default 6817)
#   CALIBCLIP_SLURM_CPUS   CPUs of the node (default: nproc)
set -euo pipefail

DIR=${CALIBCLIP_SLURM_DIR:-/tmp/calibclip-slurm}
PORT=${CALIBCLIP_SLURM_PORT:-6817}
# (nproc alone would honour OMP_NUM_THREADS, which test runners set to 1)
CPUS=${CALIBCLIP_SLURM_CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
CONF="$DIR/slurm.conf"
MUNGE_DIR="$DIR/munge"
SOCKET="$MUNGE_DIR/munge.socket"
PACKAGES=(slurmctld slurmd slurm-client munge)

log() { echo "ci_slurm: $*" >&2; }
skip() { echo "SKIP: $*" >&2; exit 3; }

alive() {  # alive PIDFILE -> 0 if the process named in the pid file runs
    [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

have_slurm() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null
}

cmd_install() {
    if have_slurm; then
        log "already installed: $(slurmctld -V 2>/dev/null)"
        return 0
    fi
    [[ $(id -u) -eq 0 ]] || skip "installing SLURM needs root (apt-get); run as root or preinstall ${PACKAGES[*]}"
    command -v apt-get >/dev/null || skip "no apt-get here: install ${PACKAGES[*]} with this system's package manager"
    local t0=$SECONDS
    log "apt-get install ${PACKAGES[*]}"
    if ! DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>"$DIR.apt.log" \
        || ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${PACKAGES[@]}" >/dev/null 2>>"$DIR.apt.log"; then
        tail -5 "$DIR.apt.log" >&2 || true
        skip "apt-get could not install ${PACKAGES[*]} (see $DIR.apt.log)"
    fi
    have_slurm || skip "apt-get finished but slurmctld/slurmd/sbatch/munged are not on PATH"
    log "installed $(slurmctld -V) in $((SECONDS - t0)) s"
}

write_conf() {
    mkdir -p "$DIR"/{state,spool,log,run}
    chmod 755 "$DIR"  # the munge user must be able to reach its socket folder
    cat >"$CONF" <<EOF
# Written by launch/ci_slurm.sh: a one-node cluster on localhost, everything under $DIR.
ClusterName=calibclip-ci
SlurmctldHost=localhost
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire also delays the restart of a requeued job (default 120 s): 5 s keeps CI short
AuthInfo=socket=$SOCKET,cred_expire=5
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# look at pending jobs every 2 s (default 60 s): a requeued job restarts soon after its BeginTime
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
JobRequeue=1
# finished jobs stay visible to scontrol show job for 10 minutes (no accounting database)
MinJobAge=600
KillWait=30
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
    if alive "$MUNGE_DIR/munged.pid"; then
        return 0
    fi
    mkdir -p "$MUNGE_DIR"
    if [[ ! -s "$MUNGE_DIR/munge.key" ]]; then
        # a private key: this cluster never talks to another host
        dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
    fi
    chown -R munge:munge "$MUNGE_DIR"
    chmod 755 "$MUNGE_DIR"  # munged wants its socket folder searchable by all
    chmod 400 "$MUNGE_DIR/munge.key"
    runuser -u munge -- munged --socket="$SOCKET" --key-file="$MUNGE_DIR/munge.key" \
        --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
        --seed-file="$MUNGE_DIR/munged.seed"
    local i
    for i in $(seq 50); do
        [[ -S "$SOCKET" ]] && alive "$MUNGE_DIR/munged.pid" && return 0
        sleep 0.1
    done
    log "munged did not start; its log:"; tail -5 "$MUNGE_DIR/munged.log" >&2 || true
    return 1
}

wait_for_node() {  # the node must be idle (or allocated/mixed with our jobs) before sbatch
    local i state
    for i in $(seq 100); do
        state=$(SLURM_CONF="$CONF" sinfo -h -n localhost -o %T 2>/dev/null | head -1 || true)
        case "$state" in
            idle*|mixed*|allocated*|completing*) log "node localhost is $state"; return 0 ;;
            down*|drain*|fail*)
                SLURM_CONF="$CONF" scontrol update nodename=localhost state=resume >/dev/null 2>&1 || true ;;
        esac
        sleep 0.2
    done
    log "node did not become ready (state: ${state:-no answer}); logs:"
    tail -5 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
    return 1
}

cmd_start() {
    have_slurm || skip "SLURM is not installed (slurmctld/slurmd/sbatch/munged missing): run 'bash launch/ci_slurm.sh install' as root"
    [[ $(id -u) -eq 0 ]] || skip "this single-node cluster runs its daemons as root (SlurmUser=root)"
    if ! alive "$DIR/run/slurmctld.pid" || ! alive "$DIR/run/slurmd.pid"; then
        write_conf
    fi
    start_munge
    if ! alive "$DIR/run/slurmctld.pid"; then
        # -i: ignore state left by an earlier cluster in this folder
        slurmctld -f "$CONF" -i
    fi
    if ! alive "$DIR/run/slurmd.pid"; then
        slurmd -f "$CONF" -N localhost
    fi
    wait_for_node
    cmd_env
}

cmd_env() {
    echo "export SLURM_CONF=$CONF"
}

stop_pidfile() {  # stop_pidfile NAME PIDFILE: TERM, wait up to 10 s, then KILL
    local name=$1 file=$2 pid i
    alive "$file" || { rm -f "$file"; return 0; }
    pid=$(cat "$file")
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || { log "stopped $name (pid $pid)"; rm -f "$file"; return 0; }
        sleep 0.1
    done
    log "$name (pid $pid) ignored SIGTERM for 10 s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$file"
}

cmd_stop() {
    if alive "$DIR/run/slurmctld.pid" && [[ -f "$CONF" ]]; then
        # our jobs only: this controller knows no others
        local jobs
        jobs=$(SLURM_CONF="$CONF" squeue -h -o %i 2>/dev/null || true)
        if [[ -n "$jobs" ]]; then
            log "cancelling jobs: $(echo $jobs)"
            # shellcheck disable=SC2086
            SLURM_CONF="$CONF" scancel $jobs 2>/dev/null || true
            sleep 1
        fi
    fi
    stop_pidfile slurmd "$DIR/run/slurmd.pid"
    stop_pidfile slurmctld "$DIR/run/slurmctld.pid"
    stop_pidfile munged "$MUNGE_DIR/munged.pid"
}

cmd_status() {
    local name file
    for name in munged slurmctld slurmd; do
        file="$DIR/run/$name.pid"
        [[ $name == munged ]] && file="$MUNGE_DIR/munged.pid"
        if alive "$file"; then echo "$name: running (pid $(cat "$file"))"; else echo "$name: stopped"; fi
    done
    if alive "$DIR/run/slurmctld.pid"; then
        SLURM_CONF="$CONF" sinfo 2>&1 || true
    fi
}

case "${1:-}" in
    install) cmd_install ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) cmd_env ;;
    *) echo "usage: $0 {install|start|stop|status|env}" >&2; exit 2 ;;
esac
