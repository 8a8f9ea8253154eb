#!/usr/bin/env bash
# Start a real Slurm on this machine (no systemd, no cgroups), for the tests: one cluster, one slurm.conf
# (/etc/slurm/slurm.conf from tests/slurm/slurm.conf.in), one partition "debug" of N nodes.
#
#   bash tests/slurm/start-local-slurm.sh             # the cluster as it runs, or as configured; else 1 node
#   bash tests/slurm/start-local-slurm.sh --nodes 2   # 2 nodes (a changed count restarts the cluster)
#   bash tests/slurm/start-local-slurm.sh --stop      # stops it all, removes the namespaces and the bridge
#
# Idempotent: ~0.1 s when all runs, a few seconds from nothing once the packages are installed (~25 s
# with apt). A node that a test killed, or left DOWN, is started again and resumed.
#
# Installs Debian's slurmctld, slurmd, slurm-client and munge if they are missing, then starts
# munged (as the munge user) and, as root in daemon mode, each daemon that does not already run,
# and waits until every node is idle. Logs: /var/log/slurm/. Must run as root. Every node declares
# CPUs=4 (config_overrides) so 4 tasks fit on 2 cores; no accounting, so sacct does not work, as on
# many real clusters.
#
# N = 1: one node named `hostname -s` at 127.0.0.1, its slurmd an ordinary process.
# N >= 2: nodes n1..nN. Only the network of a node is its own: node nI is the network namespace
# mantra-nI, address 10.200.0.(10+I) on the bridge mantra-br0 (10.200.0.1, where slurmctld answers),
# and its slurmd runs with its own hostname (a UTS namespace) and, in a mount namespace, its own
# /etc/hosts (every node name to its address, this machine's name to the bridge). /proc, files, memory
# and CPUs stay shared. (`ip netns exec` would remount /sys and slurmd then dies; hence nsenter +
# unshare.) Without a hostname of its own, a node's gloo would advertise 127.0.0.1 and its peers be refused.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
log() { echo "start-local-slurm: $*" >&2; }
t0=$SECONDS
CONF=/etc/slurm/slurm.conf
HOSTS=/etc/slurm/nodes-hosts  # the namespaced nodes' /etc/hosts
BRIDGE=mantra-br0
NET=10.200.0

usage() { echo "usage: $0 [--nodes N] [--stop]" >&2; exit 2; }
nodes="" stop=0
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) [ $# -ge 2 ] || usage; nodes="$2"; shift 2 ;;
        --nodes=*) nodes="${1#--nodes=}"; shift ;;
        --stop) stop=1; shift ;;
        *) usage ;;
    esac
done
if [ -n "$nodes" ] && ! [[ "$nodes" =~ ^[1-9][0-9]?$ && "$nodes" -le 32 ]]; then
    log "--nodes: '$nodes' is not a node count; use 1 to 32"; exit 2
fi
if [ "$(id -u)" != 0 ]; then
    log "must run as root (it installs packages, starts daemons and makes network namespaces)"; exit 1
fi
host="$(hostname -s)"

# ---------------------------------------------------------------------------- the pieces

configured_nodes() {  # the node count of the slurm.conf in place (0: none of ours)
    grep -q '^ClusterName=mantra-local$' "$CONF" 2>/dev/null || { echo 0; return; }
    grep -c '^NodeName=' "$CONF" || true
}

node_names() {  # the names of the nodes of an N-node cluster
    if [ "$1" = 1 ]; then echo "$host"; else seq -f "n%g" "$1"; fi
}

render() {  # slurm.conf for $1 nodes
    local n="$1" i
    sed -e "s/@HOST@/$host/g" "$here/slurm.conf.in"
    if [ "$n" = 1 ]; then
        echo "NodeName=$host NodeAddr=127.0.0.1 CPUs=4 RealMemory=8192 State=UNKNOWN"
    else
        for i in $(seq "$n"); do
            echo "NodeName=n$i NodeAddr=$NET.$((10 + i)) NodeHostname=n$i CPUs=4 RealMemory=8192 State=UNKNOWN"
        done
    fi
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pidfiles() {  # stop the daemons whose pid files these are, together, and wait until they are gone
    local f pids=()
    for f in "$@"; do
        [ -f "$f" ] || continue
        kill -0 "$(cat "$f")" 2>/dev/null && pids+=("$(cat "$f")")
        rm -f "$f"
    done
    [ ${#pids[@]} -gt 0 ] || return 0
    kill "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "${pids[@]}" 2>/dev/null || break; sleep 0.1; done
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}

stop_cluster() {  # every slurmctld and slurmd (the steps of running jobs live on), namespaces and bridge
    local ns
    stop_pidfiles /run/slurmd*.pid /run/slurmctld*.pid
    for ns in $(ip netns list 2>/dev/null | awk '/^mantra-n[0-9]/ {print $1}'); do
        ip netns delete "$ns" 2>/dev/null || true  # its end of the veth pair goes with it
    done
    ip link delete "$BRIDGE" 2>/dev/null || true
}

make_network() {  # the bridge, one namespace + veth pair per node, and the nodes' hosts file
    local n="$1" i ns
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
    ip addr replace "$NET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    {
        echo "127.0.0.1 localhost"
        echo "$NET.1 $host"
        for i in $(seq "$n"); do echo "$NET.$((10 + i)) n$i"; done
    } >"$HOSTS"
    for i in $(seq "$n"); do
        ns="mantra-n$i"
        [ -e "/run/netns/$ns" ] || ip netns add "$ns"
        ip link show "mantra-v$i" >/dev/null 2>&1 || ip link add "mantra-v$i" type veth peer name eth0 netns "$ns"
        ip link set "mantra-v$i" master "$BRIDGE" up
        ip -n "$ns" addr replace "$NET.$((10 + i))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
    done
}

start_node() {  # the slurmd of node $1 of an N-node cluster ($2), unless it runs
    local node="$1" n="$2"
    pid_alive "/run/slurmd-$node.pid" && return 0
    mkdir -p "/var/spool/slurmd-$node"
    if [ "$n" = 1 ]; then
        slurmd
    else  # in its namespaces: own network, hostname and /etc/hosts
        nsenter --net="/run/netns/mantra-$node" unshare --uts --mount --propagation private sh -c \
            "hostname $node && mount --bind $HOSTS /etc/hosts && exec slurmd"
    fi
}

ready() {  # every node takes jobs (idle, mixed, allocated or completing)
    local states
    states="$(sinfo -h -N -o '%T' 2>/dev/null)" || return 1
    [ -n "$states" ] && ! grep -q -v -E '^(idle|mixed|allocated|completing)$' <<<"$states"
}

wait_ready() {  # resume nodes an earlier run (or a test that killed one) left down
    local i node
    for i in $(seq 150); do
        ready && return 0
        if [ $((i % 20)) = 0 ]; then
            for node in $(sinfo -h -N -o '%N %T' | awk '$2 !~ /^(idle|mixed|allocated|completing)$/ {print $1}'); do
                scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
            done
        fi
        sleep 0.2
    done
    log "a node did not come up: $(sinfo -h -N -o '%N %T %E' 2>&1 | paste -sd';'); see /var/log/slurm/"
    return 1
}

running() {  # the $1-node cluster runs as configured, every node up
    local node
    cmp -s "$CONF" <(render "$1") && pid_alive /run/slurmctld.pid || return 1
    for node in $(node_names "$1"); do pid_alive "/run/slurmd-$node.pid" || return 1; done
    ready
}

# ---------------------------------------------------------------------------- stop

if [ "$stop" = 1 ]; then
    stop_cluster
    stop_pidfiles /run/munge/munged.pid
    rm -rf /etc/slurm/multi "$HOSTS"  # /etc/slurm/multi: an earlier version's second cluster
    log "stopped in $((SECONDS - t0)) s: slurmctld, slurmd and munged; namespaces and bridge removed"
    exit 0
fi

# n: the node count asked for, else the one configured, else 1
n="${nodes:-$(configured_nodes)}"
[ "$n" -ge 1 ] || n=1

if command -v sbatch >/dev/null && running "$n"; then
    log "already running ($n node$([ "$n" -gt 1 ] && echo s))"
    exit 0
fi

# 1. packages
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
        || ! command -v munged >/dev/null; then
    log "installing slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

# 2. munge (authenticates every Slurm message)
if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile /etc/munge/munge.key 2>/dev/null \
        || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
mkdir -p /run/munge
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
chmod 0700 /etc/munge /var/log/munge
chmod 0600 /etc/munge/munge.key
chmod 0755 /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    rm -f /run/munge/munge.socket.2 /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# 3. the configuration; another node set restarts the cluster with a clean state (slurmctld learns
#    its nodes at its start, and jobs of the old nodes would have nowhere to go)
if ! getent hosts "$host" >/dev/null; then
    echo "127.0.0.1 $host" >>/etc/hosts
fi
mkdir -p /etc/slurm /var/spool/slurmctld /var/log/slurm
render "$n" >"$CONF.new"
clean=()
if ! cmp -s "$CONF.new" "$CONF" 2>/dev/null; then
    [ "$(configured_nodes)" != "$n" ] && clean=(-c)
    stop_cluster
    stop_pidfiles /run/slurmd.pid  # an earlier version's slurmd pid file
    rm -rf /etc/slurm/multi
    mv "$CONF.new" "$CONF"
else
    rm -f "$CONF.new"
fi

# 4. slurmctld, then one slurmd per node
if ! pid_alive /run/slurmctld.pid || ! scontrol ping >/dev/null 2>&1; then
    slurmctld "${clean[@]}"
    for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.1; done
fi
[ "$n" -ge 2 ] && make_network "$n"
for node in $(node_names "$n"); do start_node "$node" "$n"; done
wait_ready
log "ready in $((SECONDS - t0)) s: $n node$([ "$n" -gt 1 ] && echo "s ($(node_names "$n" | paste -sd' '), each in its own network namespace)")"
