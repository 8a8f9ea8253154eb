#!/usr/bin/env bash
# Start a real, single-node Slurm on this machine (no systemd, no cgroups), for the tests.
#
#   bash tests/slurm/start-local-slurm.sh      # idempotent; ~25 s with the apt install, ~3 s without
#
# Installs Debian's slurmctld, slurmd, slurm-client and munge if they are missing, writes
# /etc/slurm/slurm.conf from tests/slurm/slurm.conf.in (one node, one partition "debug",
# CPUs=4 declared with config_overrides so 4 tasks fit on 2 cores; no accounting, so sacct
# does not work, as on many real clusters), then starts munged (as the munge user),
# slurmctld and slurmd (as root, daemon mode) unless they already answer, and waits until
# the node is idle. Logs: /var/log/slurm/. Must run as root.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
log() { echo "start-local-slurm: $*" >&2; }
t0=$SECONDS

if [ "$(id -u)" != 0 ]; then
    log "must run as root (it installs packages and starts daemons)"; exit 1
fi

node_ready() {
    # idle, mixed or allocated: the node takes jobs
    local state
    state="$(sinfo -h -N -o '%T' 2>/dev/null | head -n1)" || return 1
    case "$state" in idle|mixed|allocated|completing) return 0 ;; *) return 1 ;; esac
}

conf_current() {
    [ -f /etc/slurm/slurm.conf ] && cmp -s /etc/slurm/slurm.conf <(sed -e "s/@HOST@/$(hostname -s)/g" "$here/slurm.conf.in")
}

if command -v sbatch >/dev/null && conf_current && scontrol ping >/dev/null 2>&1 && node_ready; then
    log "already running ($(sinfo -h -o '%P %D %T' | head -n1))"
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

# 2. configuration
host="$(hostname -s)"
if ! getent hosts "$host" >/dev/null; then
    echo "127.0.0.1 $host" >>/etc/hosts
fi
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
sed -e "s/@HOST@/$host/g" "$here/slurm.conf.in" >/etc/slurm/slurm.conf.new
if ! cmp -s /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf 2>/dev/null; then
    mv /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf
    changed=1
else
    rm -f /etc/slurm/slurm.conf.new
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

# 4. slurmctld and slurmd (a changed configuration is picked up with a reconfigure)
if scontrol ping >/dev/null 2>&1; then
    [ "$changed" = 1 ] && scontrol reconfigure
else
    slurmctld
    for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.1; done
fi
if [ ! -f /run/slurmd.pid ] || ! kill -0 "$(cat /run/slurmd.pid)" 2>/dev/null; then
    slurmd
fi

# 5. wait for the node to take jobs (resume it if an earlier run left it down)
for i in $(seq 150); do
    node_ready && break
    if [ $((i % 20)) = 0 ]; then
        scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
    fi
    sleep 0.2
done
if ! node_ready; then
    log "the node did not come up: $(sinfo -h -N -o '%N %T %E' 2>&1 | head -n1); see /var/log/slurm/"
    exit 1
fi
log "ready in $((SECONDS - t0)) s: $(sinfo -h -o 'partition %P, %D node, %T' | head -n1)"
