#!/usr/bin/env bash
# Start a real Slurm on this machine (no systemd, no cgroups), for the tests.
#
#   bash tests/slurm/start-local-slurm.sh             # the one-node Slurm (an N-node one is left as it is)
#   bash tests/slurm/start-local-slurm.sh --nodes 3   # and beside it a 3-node Slurm (--nodes 1: none)
#   bash tests/slurm/start-local-slurm.sh --stop      # stops both, removes the namespaces and the bridge
#
# Idempotent: ~0.1 s when all runs, ~2 s from nothing once the packages are installed (~25 s with apt).
#
# Installs Debian's slurmctld, slurmd, slurm-client and munge if they are missing, then starts
# munged (as the munge user) and, as root in daemon mode, each daemon that does not already run,
# and waits until every node is idle. Logs: /var/log/slurm/. Must run as root.
#
# The one-node Slurm (always started) is the default for every Slurm command here:
# /etc/slurm/slurm.conf from tests/slurm/slurm.conf.in, partition "debug" with one node named
# `hostname -s` that declares CPUs=4 (config_overrides) so 4 tasks fit on 2 cores; no accounting,
# so sacct does not work, as on many real clusters.
#
# The N-node Slurm (--nodes N, N >= 2) is a second cluster: /etc/slurm/multi/slurm.conf
# (slurm.conf.in with tests/slurm/multi.conf.in over it), its own slurmctld on port 6827, and a
# default partition "debug" of nodes n1..nN. Reach it with SLURM_CONF=/etc/slurm/multi/slurm.conf.
# Only the network of a node is its own: node nI is the network namespace mantra-nI, address
# 10.200.0.(10+I) on the bridge mantra-br0 (10.200.0.1), and its slurmd runs with its own hostname
# (a UTS namespace) and, in a mount namespace, its own /etc/hosts (every node name to its address,
# this machine's name to the bridge, where the controller answers) and the cluster's file as
# /etc/slurm/slurm.conf, so jobs there talk to their own cluster. /proc, files, memory and CPUs stay
# shared. (`ip netns exec` would remount /sys and slurmd then dies; hence nsenter + unshare.)
# Without a hostname of its own, a node's gloo would advertise 127.0.0.1 and its peers be refused.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
log() { echo "start-local-slurm: $*" >&2; }
t0=$SECONDS
CONF=/etc/slurm/slurm.conf
MULTI=/etc/slurm/multi/slurm.conf
HOSTS=/etc/slurm/multi/hosts  # the nodes' /etc/hosts
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

render_single() {
    sed -e "s/@HOST@/$host/g" "$here/slurm.conf.in"
}

render_multi() {  # slurm.conf.in with multi.conf.in's keys replacing its own, and nodes n1..n$1
    local n="$1" keys i
    keys="$(grep -o '^[A-Za-z]*=' "$here/multi.conf.in" | sed 's/=$//' | paste -sd'|')"
    render_single | grep -v -E "^(${keys})=|^NodeName=|^PartitionName=|^# A single-node Slurm"
    cat "$here/multi.conf.in"
    for i in $(seq "$n"); do
        echo "NodeName=n$i NodeAddr=$NET.$((10 + i)) NodeHostname=n$i CPUs=4 RealMemory=8192 State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=n[1-$n] Default=YES MaxTime=INFINITE State=UP"
}

multi_nodes() {  # the node count of the N-node Slurm's configuration (0: none)
    grep -c '^NodeName=n[0-9]' "$MULTI" 2>/dev/null || true
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

stop_multi() {  # the N-node Slurm's daemons (the steps of its jobs live on), namespaces and bridge
    local ns
    stop_pidfiles /run/slurmd-n[0-9]*.pid /run/slurmctld-multi.pid
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

start_node() {  # slurmd of node n$1 in its namespaces: own network, hostname, /etc/hosts and slurm.conf
    local i="$1"
    pid_alive "/run/slurmd-n$i.pid" && return 0
    mkdir -p "/var/spool/slurmd-n$i"
    nsenter --net="/run/netns/mantra-n$i" unshare --uts --mount --propagation private sh -c \
        "hostname n$i && mount --bind $HOSTS /etc/hosts && mount --bind $MULTI $CONF && exec slurmd"
}

ready() {  # every node of the cluster whose slurm.conf is $1 takes jobs (idle, mixed or allocated)
    local states
    states="$(SLURM_CONF="$1" sinfo -h -N -o '%T' 2>/dev/null)" || return 1
    [ -n "$states" ] && ! grep -q -v -E '^(idle|mixed|allocated|completing)$' <<<"$states"
}

wait_ready() {  # $1: slurm.conf; resume nodes an earlier run left down
    local conf="$1" i node
    for i in $(seq 150); do
        ready "$conf" && return 0
        if [ $((i % 20)) = 0 ]; then
            for node in $(SLURM_CONF="$conf" sinfo -h -N -o '%N %T' | awk '$2 !~ /^(idle|mixed|allocated|completing)$/ {print $1}'); do
                SLURM_CONF="$conf" scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
            done
        fi
        sleep 0.2
    done
    log "a node did not come up: $(SLURM_CONF="$conf" sinfo -h -N -o '%N %T %E' 2>&1 | paste -sd';'); see /var/log/slurm/"
    return 1
}

multi_running() {
    local n="$1" i
    cmp -s "$MULTI" <(render_multi "$n") && pid_alive /run/slurmctld-multi.pid || return 1
    for i in $(seq "$n"); do pid_alive "/run/slurmd-n$i.pid" || return 1; done
    ready "$MULTI"
}

# ---------------------------------------------------------------------------- stop

if [ "$stop" = 1 ]; then
    stop_multi
    rm -rf /etc/slurm/multi
    stop_pidfiles /run/slurmd.pid /run/slurmctld.pid
    stop_pidfiles /run/munge/munged.pid
    log "stopped in $((SECONDS - t0)) s: slurmctld, slurmd (both Slurms) and munged; namespaces and bridge removed"
    exit 0
fi

# n: the N-node Slurm asked for; 1 none (one that runs is stopped); 0 (no --nodes) leave it as it is
n="${nodes:-0}"

single_running() {
    [ -f "$CONF" ] && cmp -s "$CONF" <(render_single) && scontrol ping >/dev/null 2>&1 && ready "$CONF"
}

if command -v sbatch >/dev/null && single_running \
        && case "$n" in 0) true ;; 1) [ "$(multi_nodes)" = 0 ] ;; *) multi_running "$n" ;; esac; then
    log "already running (the one-node Slurm$([ "$n" -ge 2 ] && echo " and the $n-node Slurm"))"
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

# 2. configuration of the one-node Slurm
if ! getent hosts "$host" >/dev/null; then
    echo "127.0.0.1 $host" >>/etc/hosts
fi
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
render_single >"$CONF.new"
if ! cmp -s "$CONF.new" "$CONF" 2>/dev/null; then
    mv "$CONF.new" "$CONF"
    changed=1
else
    rm -f "$CONF.new"
    changed=0
fi

# 3. munge (authenticates every Slurm message)
if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile /etc/munge/munge.key 2>/dev/null \
        || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
chmod 0700 /etc/munge /var/log/munge
chmod 0600 /etc/munge/munge.key
chmod 0755 /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    rm -f /run/munge/munge.socket.2 /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# 4. the one-node Slurm: slurmctld and slurmd (a changed configuration is picked up with a reconfigure)
if scontrol ping >/dev/null 2>&1; then
    [ "$changed" = 1 ] && scontrol reconfigure
else
    slurmctld
    for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.1; done
fi
if [ ! -f /run/slurmd.pid ] || ! kill -0 "$(cat /run/slurmd.pid)" 2>/dev/null; then
    slurmd
fi
wait_ready "$CONF"

# 5. the N-node Slurm (a changed node count restarts it: slurmctld learns nodes at its start)
if [ "$n" -ge 2 ]; then
    mkdir -p /etc/slurm/multi /var/spool/slurmctld-multi
    render_multi "$n" >"$MULTI.new"
    if ! cmp -s "$MULTI.new" "$MULTI" 2>/dev/null; then
        stop_multi
        mv "$MULTI.new" "$MULTI"
    else
        rm -f "$MULTI.new"
    fi
    make_network "$n"
    if ! pid_alive /run/slurmctld-multi.pid; then
        slurmctld -f "$MULTI"
        for _ in $(seq 100); do SLURM_CONF="$MULTI" scontrol ping >/dev/null 2>&1 && break; sleep 0.1; done
    fi
    for i in $(seq "$n"); do start_node "$i"; done
    wait_ready "$MULTI"
elif [ "$n" = 1 ] && [ "$(multi_nodes)" != 0 ]; then
    stop_multi
    rm -rf /etc/slurm/multi
fi
log "ready in $((SECONDS - t0)) s: the one-node Slurm$([ "$n" -ge 2 ] && echo " and the $n-node Slurm (SLURM_CONF=$MULTI)")"
