#!/usr/bin/env bash
# A throw-away, real multi-node Ray cluster on this one host: a head and N-1 more raylets,
# each with its own resources and a custom resource naming it (wf_node_1, wf_node_2, ...).
# For tests, CI, the benchmark and trying launcher=ray without a cluster. See docs/ray.md.
#
#   scripts/ray_cluster.sh start  [--nodes N] [--port P] [--cpus C] [--gpus G] [--object-store-mb M] [--dir DIR]
#   scripts/ray_cluster.sh stop   [--dir DIR]
#   scripts/ray_cluster.sh status [--dir DIR]
#   scripts/ray_cluster.sh start-node [I] [--dir DIR]  (start node I, or every dead node, again)
#
# Every process the cluster runs carries WF_RAY_CLUSTER=DIR in its environment or has a file open
# in its own Ray temp dir; `stop` ends exactly those processes, by pid, TERM then KILL. It never
# runs `ray stop`, which would end every Ray process of the user.
# Security: every server binds 127.0.0.1 only; DIR and Ray's temp dir (made here with mktemp,
# never reused unless this script made it) are owner-only; the cluster's own token is
# DIR/auth_token (0600): drivers use it through RAY_AUTH_TOKEN_PATH (DIR/env.sh exports it).
# RAY_AUTH_MODE=disabled turns token authentication off (then any local user can join).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PROG=$(basename "$0")
MARKER=.wf_ray_cluster        # a DIR holding this file was made by this script
UP_TIMEOUT=${RAY_CLUSTER_UP_TIMEOUT:-60}      # seconds for every node to be alive
STOP_TIMEOUT=${RAY_CLUSTER_STOP_TIMEOUT:-5}   # seconds the processes get to exit on SIGTERM

DIR="$REPO/.ray"
NODES=2
PORT=26380        # the head's GCS port; the cluster uses P .. P + 200 + 200 * N (see port_plan)
CPUS=4
GPUS=0
OBJECT_STORE_MB=100

# A driver of this script: keeps 127.0.0.1 as given (Ray would use the host's address, where
# nothing of this cluster listens). Not for `ray start` of a node: it refuses that mode.
DRIVER="env RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"

log() { printf '[%s] %s\n' "$PROG" "$*" >&2; }
die() { printf '[%s] ERROR: %s\n' "$PROG" "$*" >&2; exit 1; }

usage() {
    sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

setup_auth() {  # token authentication with the cluster's own token, DIR/auth_token (0600)
    AUTH_MODE=${RAY_AUTH_MODE:-token}
    export RAY_AUTH_MODE=$AUTH_MODE  # this script's own drivers (alive_nodes, status) need it too
    unset RAY_AUTH_TOKEN
    export RAY_AUTH_TOKEN_PATH=$TOKEN
}

make_token() {  # a fresh random token, readable by its owner only
    (umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$TOKEN") \
        || die "could not write the cluster's token $TOKEN"
}

find_ray() {  # the `ray` CLI: $RAY, the repository's venv, or PATH
    if [[ -n ${RAY:-} ]]; then
        [[ -x $RAY ]] || die "RAY=$RAY is not an executable"
    elif [[ -x $REPO/.venv/bin/ray ]]; then
        RAY=$REPO/.venv/bin/ray
    else
        RAY=$(command -v ray) || die "no 'ray' command: pip install 'worldfoundry-launch[ray]' (or set RAY=/path/to/ray)"
    fi
    PYTHON=$(dirname "$RAY")/python
    [[ -x $PYTHON ]] || PYTHON=$(command -v python3)
}

set_paths() {
    STATE="$DIR/cluster.env"    # PORT, NODES, TEMP of the running cluster
    LOG_DIR="$DIR/log"
    ENV_SH="$DIR/env.sh"
    TOKEN="$DIR/auth_token"
}

# ----------------------------------------------------------------------------- our processes
cluster_pids() {  # this cluster's processes (never this script or its parents): those whose environment
    # carries WF_RAY_CLUSTER=$DIR, and those with a file open in its Ray temp dir that are not drivers.
    # Ray rewrites the command line (and with it the environment block) of its agents and workers
    # (ray::...), and an agent whose raylet was killed (a drill's nodekill) can outlive it for minutes:
    # its open log files in the temp dir still say whose it is. A driver that joined the cluster (a
    # launcher, a user's script) has its own log open there too (python-core-driver-*): it is not ours.
    local f pid self=$$ parents=" "
    local p=$$
    while [[ $p -gt 1 ]]; do
        parents+="$p "
        p=$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null || echo 1)
    done
    for f in /proc/[0-9]*/environ; do
        pid=${f#/proc/}; pid=${pid%/environ}
        [[ $parents == *" $pid "* || $pid == "$self" ]] && continue
        if { tr '\0' '\n' <"$f"; } 2>/dev/null | grep -qxF "WF_RAY_CLUSTER=$DIR" \
                || { [[ -n ${TEMP:-} ]] && opened_here "$pid"; }; then
            alive "$pid" && echo "$pid"
        fi
    done
}

opened_here() {  # opened_here PID: the process has a file open in the cluster's Ray temp dir and is no driver
    local open
    open=$(ls -l "/proc/$1/fd" 2>/dev/null | grep -F -- " $TEMP/") || return 1
    [[ $open != *python-core-driver-* ]]
}

alive() {  # a process that exists and is not a zombie
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat%% *} != Z ]]
}

describe_pid() {
    { tr '\0' ' ' <"/proc/$1/cmdline"; } 2>/dev/null | cut -c1-100
}

kill_cluster() {  # TERM every process of the cluster, KILL what is left after STOP_TIMEOUT
    local pids pid deadline
    mapfile -t pids < <(cluster_pids)
    [[ ${#pids[@]} -eq 0 ]] && return 0
    log "stopping ${#pids[@]} process(es) of the cluster in $DIR"
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    deadline=$((SECONDS + STOP_TIMEOUT))
    while ((SECONDS < deadline)); do
        mapfile -t pids < <(cluster_pids)
        [[ ${#pids[@]} -eq 0 ]] && return 0
        sleep 0.3
    done
    mapfile -t pids < <(cluster_pids)
    log "SIGKILL to ${#pids[@]} process(es) still alive after ${STOP_TIMEOUT}s"
    for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    sleep 0.5
    mapfile -t pids < <(cluster_pids)
    [[ ${#pids[@]} -eq 0 ]] || die "still alive after SIGKILL: ${pids[*]}"
}

# ----------------------------------------------------------------------------- ports
# Node i (1-based) of a cluster whose head port is P:
#   head only   P (GCS), P+1 (Ray client server), P+2 (dashboard head, minimal: no UI)
#   node i      P+10i .. P+10i+5 (node manager, object manager, agent gRPC, agent HTTP, metrics,
#               runtime-env agent)
#   workers     P+200i .. P+200i+199 (each node its own range, clear of every port above)
node_ports() {  # node_ports I: the `ray start` port options of node I
    local i=$1 b=$((PORT + 10 * $1)) w=$((PORT + 200 * $1))
    echo "--node-manager-port=$b --object-manager-port=$((b + 1)) --dashboard-agent-grpc-port=$((b + 2))" \
         "--dashboard-agent-listen-port=$((b + 3)) --metrics-export-port=$((b + 4))" \
         "--runtime-env-agent-port=$((b + 5)) --min-worker-port=$w --max-worker-port=$((w + 199))"
}

check_ports() {  # every fixed port must be bindable (a port still in TIME_WAIT after a stop is not)
    local i last=$((PORT + 200 * NODES + 199)) ports=("$PORT" $((PORT + 1)) $((PORT + 2)))
    ((NODES <= 9)) || die "--nodes $NODES: at most 9 nodes (node i's fixed ports are P+10i .. P+10i+5, below P+100)"
    ((PORT >= 1024 && last < 32768)) || die "--port $PORT: the cluster uses $PORT..$last; keep it within 1024..32767 (below Linux's ephemeral ports)"
    for ((i = 1; i <= NODES; i++)); do ports+=($(seq $((PORT + 10 * i)) $((PORT + 10 * i + 5)))); done
    "$PYTHON" -c '
import socket, sys
for port in map(int, sys.argv[1:]):
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as exc:
            sys.exit(f"port {port} cannot be bound: {exc.strerror}")
' "${ports[@]}" || die "choose another --port (or wait a minute after a stop: ports linger in TIME_WAIT)"
}

# ----------------------------------------------------------------------------- start
start_node() {  # start_node I: the head (I = 1) or one more raylet
    local i=$1 role
    local -a args=(--node-ip-address=127.0.0.1 --temp-dir="$TEMP" --num-cpus="$CPUS" --num-gpus="$GPUS"
                   --resources="{\"wf_node_$i\": 1}" --object-store-memory=$((OBJECT_STORE_MB * 1024 * 1024))
                   --disable-usage-stats --include-log-monitor=false)
    # no log monitor: every driver of ours connects with log_to_driver=False, so what it would
    # stream (the workers' output, some 40 s of CPU over the suite) reaches nobody
    # shellcheck disable=SC2207
    args+=($(node_ports "$i"))
    if ((i == 1)); then
        role=head
        args+=(--head --port="$PORT" --ray-client-server-port=$((PORT + 1)) --dashboard-port=$((PORT + 2))
               --include-dashboard=false)
    else
        role=node$i
        args+=(--address="127.0.0.1:$PORT")
    fi
    if ! WF_RAY_CLUSTER="$DIR" RAY_USAGE_STATS_ENABLED=0 ray_start "${args[@]}" \
            >"$LOG_DIR/$role.log" 2>&1; then
        tail -n 20 "$LOG_DIR/$role.log" >&2
        return 1
    fi
}

ray_start() {  # `ray start` with --node-ip-address=127.0.0.1 kept as given: every server on loopback
    # (`ray start` replaces 127.0.0.1 by the host's address, and its servers then bind every interface)
    "$PYTHON" -c '
import sys
from ray._private import services
from ray.scripts.scripts import main
services.resolve_ip_for_localhost = lambda host: host
sys.argv[0] = "ray"
sys.exit(main())
' start "$@"
}

alive_nodes() {  # how many nodes the GCS reports alive
    $DRIVER timeout 30 "$PYTHON" - "127.0.0.1:$PORT" <<'EOF' 2>"$LOG_DIR/alive_nodes.err"
import sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
print(sum(1 for n in ray.nodes() if n["Alive"]))
EOF
}

fail_start() {  # fail_start MESSAGE: end what started, remove Ray's temp dir, and fail
    kill_cluster
    remove_temp
    die "$1"
}

cmd_start() {
    [[ $NODES =~ ^[0-9]+$ ]] && ((NODES >= 1)) || die "--nodes $NODES: expected an integer >= 1"
    [[ $CPUS =~ ^[0-9]+$ ]] && ((CPUS >= 1)) || die "--cpus $CPUS: expected an integer >= 1"
    [[ $GPUS =~ ^[0-9]+$ ]] || die "--gpus $GPUS: expected an integer >= 0"
    [[ $OBJECT_STORE_MB =~ ^[0-9]+$ ]] && ((OBJECT_STORE_MB >= 80)) || die "--object-store-mb: Ray needs at least 80"
    if [[ -d $DIR ]]; then
        [[ -O $DIR && ( -z $(ls -A "$DIR") || -e $DIR/$MARKER ) ]] \
            || die "$DIR exists and was not made by $PROG (as this user); choose another --dir"
        DIR=$(cd "$DIR" && pwd)
        set_paths
        local old_port=$PORT old_nodes=$NODES old_cpus=$CPUS old_gpus=$GPUS old_mb=$OBJECT_STORE_MB
        # shellcheck disable=SC1090
        [[ -f $STATE ]] && source "$STATE"  # the old cluster's TEMP, to find all of its processes
        kill_cluster
        remove_temp
        PORT=$old_port NODES=$old_nodes CPUS=$old_cpus GPUS=$old_gpus OBJECT_STORE_MB=$old_mb TEMP=""
        rm -rf "$DIR"
    fi
    mkdir -p -m 700 "$DIR"
    chmod 700 "$DIR"
    DIR=$(cd "$DIR" && pwd)
    set_paths
    touch "$DIR/$MARKER"
    mkdir -p "$LOG_DIR"
    check_ports
    make_token
    setup_auth
    # Ray's own temp dir: short (Unix socket paths inside it must stay under ~107 bytes), in a
    # dir made here by mktemp (an unpredictable name, mode 0700): no other user can have made it
    # first, and none can enter it (Ray makes its own session dirs 0777).
    TEMP=$(mktemp -d /tmp/wfray-XXXXXXXX)/ray || die "could not make a temp dir in /tmp"
    touch "${TEMP%/ray}/$MARKER"
    mkdir "$TEMP"
    printf 'PORT=%s\nNODES=%s\nTEMP=%s\nCPUS=%s\nGPUS=%s\nOBJECT_STORE_MB=%s\n' \
        "$PORT" "$NODES" "$TEMP" "$CPUS" "$GPUS" "$OBJECT_STORE_MB" >"$STATE"
    local t0=$SECONDS i
    log "starting the head (GCS on 127.0.0.1:$PORT, $CPUS CPU(s), $GPUS GPU(s), resource wf_node_1)"
    start_node 1 || fail_start "the head did not start (log: $LOG_DIR/head.log)"
    for ((i = 2; i <= NODES; i++)); do  # one after the other: a loaded host misses Ray's 30 s start-up bound
        log "starting node $i ($CPUS CPU(s), resource wf_node_$i)"
        start_node "$i" || fail_start "node $i did not start (log: $LOG_DIR/node$i.log)"
    done
    local deadline=$((SECONDS + UP_TIMEOUT)) up=0
    while ((SECONDS < deadline)); do
        up=$(alive_nodes || echo 0)
        [[ $up == "$NODES" ]] && break
        sleep 0.5
    done
    [[ $up == "$NODES" ]] || fail_start "$up/$NODES node(s) alive after ${UP_TIMEOUT}s (logs: $LOG_DIR/)"
    printf 'export RAY_ADDRESS=127.0.0.1:%s\nexport RAY_AUTH_MODE=%s\nexport RAY_AUTH_TOKEN_PATH=%s\n%s\n' \
        "$PORT" "$AUTH_MODE" "$TOKEN" "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" >"$ENV_SH"
    log "cluster up in $((SECONDS - t0))s: $NODES node(s); state in $DIR, Ray's temp dir $TEMP"
    echo "launcher.address=127.0.0.1:$PORT"
}

# ----------------------------------------------------------------------------- stop, status
read_state() {
    [[ -d $DIR ]] || return 1
    DIR=$(cd "$DIR" && pwd)
    set_paths
    [[ -O $DIR && -e $DIR/$MARKER ]] || die "$DIR was not made by $PROG (as this user)"
    # shellcheck disable=SC1090
    [[ -f $STATE ]] && source "$STATE"
    setup_auth
    return 0
}

remove_temp() {  # Ray's temp dir of the cluster and the dir above it, if this script made them
    local base=${TEMP:-}
    base=${base%/ray}
    if [[ -n ${TEMP:-} && $TEMP == */ray && -O $base && -e $base/$MARKER ]]; then rm -rf "$base"; fi
}

cmd_stop() {
    read_state || { log "no cluster folder $DIR; nothing to stop"; return 0; }
    kill_cluster
    remove_temp
    log "stopped the cluster in $DIR"
}

cmd_status() {
    read_state || { echo "no cluster folder $DIR"; return 1; }
    local pids pid
    mapfile -t pids < <(cluster_pids)
    [[ ${#pids[@]} -gt 0 ]] || { echo "no process of the cluster in $DIR runs"; return 1; }
    echo "--- ${#pids[@]} process(es) of the cluster in $DIR"
    for pid in "${pids[@]}"; do echo "$pid $(describe_pid "$pid")"; done
    echo "--- nodes (GCS 127.0.0.1:$PORT)"
    $DRIVER "$PYTHON" - "127.0.0.1:$PORT" <<'EOF'
import sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
for n in sorted(ray.nodes(), key=lambda n: not n["Alive"]):
    res = {k: v for k, v in n["Resources"].items() if k in ("CPU", "GPU") or k.startswith("wf_node_")}
    print(n["NodeID"][:12], "alive" if n["Alive"] else "dead", n["NodeManagerAddress"], res)
EOF
}

alive_names() {  # the wf_node_<i> numbers of the nodes the GCS reports alive
    $DRIVER timeout 30 "$PYTHON" -c '
import sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
for n in ray.nodes():
    if n["Alive"]:
        print(*[k.removeprefix("wf_node_") for k in n["Resources"] if k.startswith("wf_node_")])
' "127.0.0.1:$PORT" 2>>"$LOG_DIR/alive_nodes.err"
}

cmd_start_node() {  # start node I (default: every node that is not alive) again: its raylet was killed
    read_state || die "no cluster folder $DIR"
    local alive i want=()
    alive=" $(alive_names | tr '\n' ' ') "
    [[ $alive == *" 1 "* ]] || die "the head (node 1) is not alive: start the cluster again"
    if [[ -n $1 ]]; then
        [[ $1 =~ ^[0-9]+$ ]] && (($1 >= 2 && $1 <= NODES)) || die "start-node $1: expected a node in 2..$NODES (1 is the head)"
        [[ $alive != *" $1 "* ]] || { log "node $1 is alive already"; return 0; }
        want=("$1")
    else
        for ((i = 2; i <= NODES; i++)); do [[ $alive == *" $i "* ]] || want+=("$i"); done
    fi
    for i in "${want[@]}"; do
        log "starting node $i again ($CPUS CPU(s), resource wf_node_$i)"
        start_node "$i" || die "node $i did not start (log: $LOG_DIR/node$i.log)"
    done
    log "alive: node(s)$(alive_names | tr '\n' ' ')"
}

# ----------------------------------------------------------------------------- main
main() {
    [[ $# -ge 1 ]] || { usage >&2; exit 2; }
    local cmd=$1 node=""; shift
    if [[ $cmd == start-node && ${1:-} =~ ^[0-9]+$ ]]; then node=$1; shift; fi
    while [[ $# -gt 0 ]]; do
        case $1 in
            --nodes) NODES=${2:?--nodes needs a value}; shift 2 ;;
            --port) PORT=${2:?--port needs a value}; shift 2 ;;
            --cpus) CPUS=${2:?--cpus needs a value}; shift 2 ;;
            --gpus) GPUS=${2:?--gpus needs a value}; shift 2 ;;
            --object-store-mb) OBJECT_STORE_MB=${2:?--object-store-mb needs a value}; shift 2 ;;
            --dir) DIR=${2:?--dir needs a value}; shift 2 ;;
            -h|--help) usage; exit 0 ;;
            *) die "unknown option '$1' for '$cmd' (see $0 --help)" ;;
        esac
    done
    [[ $PORT =~ ^[0-9]+$ ]] || die "--port $PORT: expected a port number"
    set_paths
    case $cmd in
        start) find_ray; cmd_start ;;
        stop) cmd_stop ;;
        status) find_ray; cmd_status ;;
        start-node) find_ray; cmd_start_node "$node" ;;
        -h|--help|help) usage ;;
        *) usage >&2; die "unknown command '$cmd'" ;;
    esac
}

main "$@"
