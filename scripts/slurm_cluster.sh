#!/usr/bin/env bash
# A throw-away, real SLURM cluster on this one host, for tests, CI and trying wf_launch's
# SLURM path without a cluster. Debian/Ubuntu, run as root, no systemd needed.
#
#   scripts/slurm_cluster.sh install
#   scripts/slurm_cluster.sh start  [--nodes 1|2] [--dir DIR] [--cpus N] [--mem-mb MB]
#                                   [--ctld-port P] [--slurmd-port P] [--dbd-port P] [--db-port P]
#   scripts/slurm_cluster.sh stop   [--dir DIR]
#   scripts/slurm_cluster.sh status [--dir DIR]
#
# The cluster has accounting (slurmdbd on a private MariaDB), so `sacct` works and
# submitit can read job states (COMPLETED / FAILED / CANCELLED / TIMEOUT). All state
# lives under DIR (default: <repo>/.slurm) and is wiped on every start. See
# docs/slurm-cluster.md.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PROG=$(basename "$0")
MARKER=.wf_slurm_cluster      # a DIR holding this file may be wiped by `start`
PACKAGES=(slurm-wlm slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
CLUSTER_NAME=wfl
UP_TIMEOUT=${SLURM_CLUSTER_UP_TIMEOUT:-30}      # seconds each daemon gets to come up
STOP_TIMEOUT=${SLURM_CLUSTER_STOP_TIMEOUT:-15}  # seconds each daemon gets to exit on SIGTERM

# Defaults kept clear of a system slurm (6817-6819) and MariaDB (3306).
DIR="$REPO/.slurm"
NODES=1
CPUS=8
MEM_MB=""
CTLD_PORT=16817
SLURMD_PORT=16818   # node n<i> listens on SLURMD_PORT + i - 1
DBD_PORT=16820
DB_PORT=16821

log() { printf '[%s] %s\n' "$PROG" "$*" >&2; }
die() { printf '[%s] ERROR: %s\n' "$PROG" "$*" >&2; exit 1; }

usage() {
    sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

need_root() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (slurmd and slurmctld run as root here); try: sudo $0 $*"
}

is_installed() {
    [[ $(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true) == "install ok installed" ]]
}

# ----------------------------------------------------------------------------- install
cmd_install() {
    need_root install
    command -v apt-get >/dev/null || die "apt-get not found: install needs Debian or Ubuntu"
    local missing=() p
    for p in "${PACKAGES[@]}"; do is_installed "$p" || missing+=("$p"); done
    if [[ ${#missing[@]} -eq 0 ]]; then
        log "all packages already installed: ${PACKAGES[*]}"
        return 0
    fi
    log "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed"
    for p in "${PACKAGES[@]}"; do is_installed "$p" || die "package $p still not installed"; done
    log "installed: ${missing[*]}"
}

# ----------------------------------------------------------------------------- helpers
# Paths inside the state folder.
set_paths() {
    CONF="$DIR/slurm.conf"
    DBD_CONF="$DIR/slurmdbd.conf"
    MUNGE_DIR="$DIR/munge"
    MUNGE_SOCK="$MUNGE_DIR/munge.socket"
    DB_DIR="$DIR/db"
    DB_SOCK="$DB_DIR/mysql.sock"
    LOG_DIR="$DIR/log"
    RUN_DIR="$DIR/run"
    ENV_SH="$DIR/env.sh"
    # Pid files, in the order daemons are stopped.
    DAEMONS=(slurmd-n1 slurmd-n2 slurmctld slurmdbd mariadbd munged)
}

pidfile() { echo "$RUN_DIR/$1.pid"; }

pid_of() {  # prints the daemon's pid if its pid file names a live process
    local f; f=$(pidfile "$1")
    [[ -s $f ]] || return 1
    local pid; pid=$(tr -dc '0-9' <"$f")
    [[ -n $pid ]] && alive "$pid" && echo "$pid"
}

alive() {  # a process that exists and is not a zombie (pid 1 here may reap slowly)
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat%% *} != Z ]]
}

show_log() {  # show_log NAME FILE: the tail of a daemon's log, for error messages
    if [[ -s $2 ]]; then
        printf -- '----- last 30 lines of %s (%s) -----\n' "$1" "$2" >&2
        tail -n 30 "$2" >&2
        printf -- '-----\n' >&2
    else
        printf -- '----- %s wrote no log at %s -----\n' "$1" "$2" >&2
    fi
}

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every 0.2 s until it succeeds.
wait_for() {
    local secs=$1 what=$2; shift 2
    local deadline=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            log "$what did not happen within ${secs}s"
            return 1
        fi
        sleep 0.2
    done
}

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

abs_path() { mkdir -p "$1" && (cd "$1" && pwd); }

slurm_env() { env SLURM_CONF="$CONF" "$@"; }

# ----------------------------------------------------------------------------- start
FAILED_DAEMON=""
START_DONE=0
on_start_exit() {  # EXIT trap of `start`: on any failure show the log, stop what came up
    local rc=$?
    [[ $START_DONE -eq 1 ]] && return 0
    set +e
    if [[ -n $FAILED_DAEMON ]]; then show_log "$FAILED_DAEMON" "$FAILED_LOG"; fi
    log "start failed (exit $rc)${FAILED_DAEMON:+ while starting $FAILED_DAEMON}; stopping whatever came up"
    stop_daemons
    exit $((rc == 0 ? 1 : rc))
}

ensure_hosts() {  # node names must resolve to 127.0.0.1 (torch uses MASTER_ADDR=n1)
    local n addr missing=()
    for n in "$@"; do
        addr=$( (getent ahostsv4 "$n" 2>/dev/null || true) | awk 'NR==1{print $1}')
        if [[ -z $addr ]]; then
            missing+=("$n")
        elif [[ $addr != 127.0.0.1 ]]; then
            die "node name $n resolves to $addr, not 127.0.0.1; fix /etc/hosts"
        fi
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
        log "adding '127.0.0.1 ${missing[*]}' to /etc/hosts"
        if [[ -s /etc/hosts && -n $(tail -c1 /etc/hosts) ]]; then echo >>/etc/hosts; fi
        printf '127.0.0.1 %s  # wf_launch scripts/slurm_cluster.sh\n' "${missing[*]}" >>/etc/hosts \
            || die "cannot write /etc/hosts; add '127.0.0.1 ${missing[*]}' yourself"
    fi
}

prepare_dir() {
    if [[ -e $DIR && ! -d $DIR ]]; then die "--dir $DIR exists and is not a folder"; fi
    mkdir -p "$DIR"
    DIR=$(cd "$DIR" && pwd)
    set_paths
    if [[ -n $(ls -A "$DIR") && ! -e $DIR/$MARKER ]]; then
        die "$DIR is not empty and was not made by $PROG; refusing to wipe it (pick another --dir)"
    fi
    local running=() d
    for d in "${DAEMONS[@]}"; do pid_of "$d" >/dev/null && running+=("$d"); done
    if [[ ${#running[@]} -gt 0 ]]; then
        log "a cluster is running in $DIR (${running[*]}); stopping it first"
        stop_daemons
    fi
    # Fresh state: job ids restart at 1, so a submitit folder must be fresh too.
    find "$DIR" -mindepth 1 -delete
    touch "$DIR/$MARKER"
    mkdir -p "$MUNGE_DIR" "$DB_DIR" "$LOG_DIR" "$RUN_DIR" "$DIR/ctld" "$DIR/spool"
    chmod 755 "$DIR" "$MUNGE_DIR"   # munged wants its socket folder o+x
}

write_configs() {
    local host=$1 node_list="" i
    {
        cat <<EOF
# Written by $PROG start; wiped by the next start.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job restarts after cred_expire + 1 s (default 120 s; 5 is the minimum).
AuthInfo=socket=$MUNGE_SOCK,cred_expire=5
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
# Schedule at once on submit, and rescan every 1-2 s (a requeued job waits for a periodic pass).
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
EnforcePartLimits=ALL
KillWait=5
# Default is 300 s; finished jobs stay visible to scontrol for 10 minutes (sacct keeps them forever).
MinJobAge=600
JobRequeue=1
SlurmdParameters=config_overrides
# Accounting: slurmdbd on a private MariaDB, so sacct (and submitit's job.state) works.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# The munge socket for talking to slurmdbd (else the default /run/munge socket is used).
AccountingStoragePass=$MUNGE_SOCK
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
EOF
        for ((i = 1; i <= NODES; i++)); do
            echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + i - 1))" \
                "CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM_MB State=UNKNOWN"
            node_list+="${node_list:+,}n$i"
        done
        echo "PartitionName=debug Nodes=$node_list Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF"

    (umask 077 && cat >"$DBD_CONF" <<EOF
# Written by $PROG start.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=$host
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$RUN_DIR/slurmdbd.pid
LogFile=$LOG_DIR/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    )
}

start_munge() {
    FAILED_DAEMON=munged FAILED_LOG="$LOG_DIR/munged.log"
    mungekey --create --keyfile="$MUNGE_DIR/munge.key"
    chmod 600 "$MUNGE_DIR/munge.key"
    munged --key-file="$MUNGE_DIR/munge.key" --socket="$MUNGE_SOCK" \
        --pid-file="$RUN_DIR/munged.pid" --seed-file="$MUNGE_DIR/munge.seed" \
        --log-file="$FAILED_LOG" >>"$FAILED_LOG" 2>&1
    wait_for "$UP_TIMEOUT" "munged answering on $MUNGE_SOCK" \
        bash -c "munge -S '$MUNGE_SOCK' -n | unmunge -S '$MUNGE_SOCK'"
}

start_mariadb() {
    FAILED_DAEMON=mariadbd FAILED_LOG="$LOG_DIR/mariadbd.log"
    local opts=(--no-defaults --datadir="$DB_DIR/data" --user=root --skip-name-resolve
                --innodb-buffer-pool-size=32M --innodb-log-file-size=8M)
    mariadb-install-db "${opts[@]}" --auth-root-authentication-method=normal --skip-test-db \
        >"$LOG_DIR/mariadb-install-db.log" 2>&1 \
        || { FAILED_LOG="$LOG_DIR/mariadb-install-db.log"; return 1; }
    # mariadbd stays in the foreground; detach it from our stdio and process group.
    setsid mariadbd "${opts[@]}" --socket="$DB_SOCK" --port="$DB_PORT" --bind-address=127.0.0.1 \
        --pid-file="$RUN_DIR/mariadbd.pid" --log-error="$FAILED_LOG" </dev/null >/dev/null 2>&1 &
    echo $! >"$RUN_DIR/mariadbd.pid"  # at once, so a failed start can stop it (mariadbd rewrites it)
    wait_for "$UP_TIMEOUT" "mariadbd answering on $DB_SOCK" \
        mariadb-admin --no-defaults --socket="$DB_SOCK" -uroot ping
    mariadb --no-defaults --socket="$DB_SOCK" -uroot -e "
        CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
}

start_slurmdbd() {
    FAILED_DAEMON=slurmdbd FAILED_LOG="$LOG_DIR/slurmdbd.log"
    # slurmdbd reads slurmdbd.conf from the folder of $SLURM_CONF.
    slurm_env slurmdbd </dev/null >>"$FAILED_LOG" 2>&1
    wait_for "$UP_TIMEOUT" "slurmdbd listening on port $DBD_PORT" port_in_use "$DBD_PORT"
}

start_slurmctld() {
    FAILED_DAEMON=slurmctld FAILED_LOG="$LOG_DIR/slurmctld.log"
    # The cluster must exist in the accounting database before slurmctld registers.
    slurm_env sacctmgr -i add cluster "$CLUSTER_NAME" >"$LOG_DIR/sacctmgr.log" 2>&1 \
        || { FAILED_DAEMON=sacctmgr FAILED_LOG="$LOG_DIR/sacctmgr.log"; return 1; }
    slurm_env slurmctld -i </dev/null >>"$FAILED_LOG" 2>&1
    wait_for "$UP_TIMEOUT" "slurmctld answering scontrol ping" \
        bash -c "SLURM_CONF='$CONF' scontrol ping | grep -q 'is UP'"
}

nodes_idle() {
    local states
    states=$(slurm_env sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
    [[ $(grep -c ' idle$' <<<"$states") -eq $NODES ]]
}

start_slurmd() {
    local i
    for ((i = 1; i <= NODES; i++)); do
        FAILED_DAEMON=slurmd-n$i FAILED_LOG="$LOG_DIR/slurmd-n$i.log"
        mkdir -p "$DIR/spool/n$i"
        slurm_env slurmd -N "n$i" </dev/null >>"$FAILED_LOG" 2>&1
    done
    FAILED_DAEMON=slurmctld FAILED_LOG="$LOG_DIR/slurmctld.log"
    if ! wait_for "$UP_TIMEOUT" "all $NODES node(s) idle" nodes_idle; then
        slurm_env sinfo -N -l >&2 || true
        for ((i = 1; i <= NODES; i++)); do show_log "slurmd-n$i" "$LOG_DIR/slurmd-n$i.log"; done
        return 1
    fi
    FAILED_DAEMON=""
}

cmd_start() {
    need_root start
    [[ $NODES == 1 || $NODES == 2 ]] || die "--nodes must be 1 or 2, got $NODES"
    [[ $CPUS =~ ^[1-9][0-9]*$ ]] || die "--cpus must be a positive integer, got $CPUS"
    local b
    for b in munged mungekey slurmctld slurmd slurmdbd mariadbd mariadb-install-db sinfo; do
        command -v "$b" >/dev/null || die "$b not found; run: $0 install"
    done
    if [[ -z $MEM_MB ]]; then  # split 80 % of the machine's memory across the nodes
        local total_kb; total_kb=$(awk '/^MemTotal:/{print $2}' /proc/meminfo)
        MEM_MB=$((total_kb / 1024 * 8 / 10 / NODES))
    fi
    [[ $MEM_MB =~ ^[1-9][0-9]*$ ]] || die "--mem-mb must be a positive integer, got $MEM_MB"

    local t0=$SECONDS host p
    host=$(hostname -s)
    prepare_dir
    local ports=("$CTLD_PORT" "$DBD_PORT" "$DB_PORT")
    for ((p = 0; p < NODES; p++)); do ports+=($((SLURMD_PORT + p))); done
    for p in "${ports[@]}"; do
        port_in_use "$p" && die "port $p on 127.0.0.1 is in use (another cluster?); stop it or pick" \
            "other ports with --ctld-port/--slurmd-port/--dbd-port/--db-port"
    done
    local names=(); for ((p = 1; p <= NODES; p++)); do names+=("n$p"); done
    ensure_hosts "${names[@]}"
    write_configs "$host"

    trap on_start_exit EXIT
    start_munge
    start_mariadb
    start_slurmdbd
    start_slurmctld
    start_slurmd

    cat >"$ENV_SH" <<EOF
# source this file to talk to the cluster in $DIR
export SLURM_CONF=$CONF
EOF
    log "cluster up in $((SECONDS - t0))s: $NODES node(s) x $CPUS CPUs, ${MEM_MB} MB each, state in $DIR"
    slurm_env sinfo -N -o '%N %T %c %m' >&2
    echo "export SLURM_CONF=$CONF"
    START_DONE=1
}

# ----------------------------------------------------------------------------- stop
# Processes whose environment names this cluster's slurm.conf and that descend from a
# slurmstepd: job steps left behind if the daemons died before the jobs did.
stray_job_pids() {
    local p env_file comm
    for env_file in /proc/[0-9]*/environ; do
        p=${env_file#/proc/}; p=${p%/environ}
        [[ $p == "$$" ]] && continue
        comm=$(cat "/proc/$p/comm" 2>/dev/null) || continue
        [[ $comm == slurmstepd ]] || continue
        tr '\0' '\n' <"$env_file" 2>/dev/null | grep -qxF "SLURM_CONF=$CONF" || continue
        echo "$p"
        descendants "$p"
    done
}

descendants() {
    local c
    for c in $(cat /proc/"$1"/task/*/children 2>/dev/null); do
        echo "$c"
        descendants "$c"
    done
}

stop_group() {  # stop_group NAME...: SIGTERM these daemons together, SIGKILL after STOP_TIMEOUT
    local d pid pids=() names=() i
    for d in "$@"; do
        if pid=$(pid_of "$d"); then pids+=("$pid"); names+=("$d"); kill -TERM "$pid" 2>/dev/null || true; fi
    done
    [[ ${#pids[@]} -gt 0 ]] || return 0
    local deadline=$((SECONDS + STOP_TIMEOUT)) left
    while :; do
        left=()
        for i in "${!pids[@]}"; do alive "${pids[$i]}" && left+=("$i"); done
        [[ ${#left[@]} -gt 0 ]] || return 0
        if ((SECONDS >= deadline)); then
            for i in "${left[@]}"; do
                log "${names[$i]} (pid ${pids[$i]}) ignored SIGTERM for ${STOP_TIMEOUT}s; sending SIGKILL"
                kill -KILL "${pids[$i]}" 2>/dev/null || true
            done
            sleep 0.2
            return 0
        fi
        sleep 0.1
    done
}

stop_daemons() {
    if pid_of slurmctld >/dev/null && slurm_env timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; then
        # Cancel every job and give them KillWait (5 s) + a margin to end.
        local ids; ids=$(slurm_env timeout 5 squeue -h -o %i 2>/dev/null || true)
        if [[ -n $ids ]]; then
            # shellcheck disable=SC2086  # one job id per word
            slurm_env timeout 5 scancel --quiet $ids 2>/dev/null || true
            wait_for 15 "all jobs gone from squeue" \
                bash -c "[[ -z \$(SLURM_CONF='$CONF' timeout 5 squeue -h -o %i 2>/dev/null) ]]" || true
        fi
    fi
    # Slurm daemons first (they may still talk to slurmdbd and munged on the way out).
    stop_group slurmd-n1 slurmd-n2 slurmctld
    stop_group slurmdbd mariadbd munged
    local strays; strays=$(stray_job_pids | sort -u | tr '\n' ' ')
    if [[ -n ${strays// /} ]]; then
        log "killing leftover job processes: $strays"
        kill -KILL $strays 2>/dev/null || true
    fi
}

cmd_stop() {
    need_root stop
    [[ -d $DIR ]] || { log "no cluster folder $DIR; nothing to stop"; return 0; }
    DIR=$(cd "$DIR" && pwd)
    set_paths
    [[ -e $DIR/$MARKER ]] || die "$DIR was not made by $PROG"
    stop_daemons
    local d left=()
    for d in "${DAEMONS[@]}"; do pid_of "$d" >/dev/null && left+=("$d"); done
    [[ ${#left[@]} -eq 0 ]] || die "still running after stop: ${left[*]}"
    log "stopped cluster in $DIR"
}

# ----------------------------------------------------------------------------- status
cmd_status() {
    [[ -d $DIR && -e $DIR/$MARKER ]] || die "no cluster folder at $DIR (start one with: $0 start)"
    DIR=$(cd "$DIR" && pwd)
    set_paths
    local d pid any=0
    echo "cluster folder: $DIR"
    echo "export SLURM_CONF=$CONF"
    for d in "${DAEMONS[@]}"; do
        if pid=$(pid_of "$d"); then echo "  $d: running (pid $pid)"; any=1
        elif [[ -e $(pidfile "$d") ]]; then echo "  $d: NOT running (stale pid file)"; fi
    done
    [[ $any -eq 1 ]] || { echo "no daemon running"; return 1; }
    echo "--- sinfo"
    slurm_env sinfo -N -o '%N %T %c %m' || return 1
    echo "--- squeue"
    slurm_env squeue -o '%.6i %.9P %.20j %.8T %.10M %.4D %R'
}

# ----------------------------------------------------------------------------- main
main() {
    [[ $# -ge 1 ]] || { usage >&2; exit 2; }
    local cmd=$1; shift
    while [[ $# -gt 0 ]]; do
        case $1 in
            --nodes) NODES=${2:?--nodes needs a value}; shift 2 ;;
            --dir) DIR=${2:?--dir needs a value}; shift 2 ;;
            --cpus) CPUS=${2:?--cpus needs a value}; shift 2 ;;
            --mem-mb) MEM_MB=${2:?--mem-mb needs a value}; shift 2 ;;
            --ctld-port) CTLD_PORT=${2:?--ctld-port needs a value}; shift 2 ;;
            --slurmd-port) SLURMD_PORT=${2:?--slurmd-port needs a value}; shift 2 ;;
            --dbd-port) DBD_PORT=${2:?--dbd-port needs a value}; shift 2 ;;
            --db-port) DB_PORT=${2:?--db-port needs a value}; shift 2 ;;
            -h|--help) usage; exit 0 ;;
            *) die "unknown option '$1' for '$cmd' (see $0 --help)" ;;
        esac
    done
    for p in "$CTLD_PORT" "$SLURMD_PORT" "$DBD_PORT" "$DB_PORT"; do
        [[ $p =~ ^[0-9]+$ ]] && ((p > 0 && p < 65535)) || die "bad port: $p"
    done
    set_paths
    case $cmd in
        install) cmd_install ;;
        start) cmd_start ;;
        stop) cmd_stop ;;
        status) cmd_status ;;
        -h|--help|help) usage ;;
        *) usage >&2; die "unknown command '$cmd'" ;;
    esac
}

main "$@"
