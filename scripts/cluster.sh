#!/usr/bin/env bash
# A local multi-host cluster on this machine, for the tests and for trying
# multi-host jobs: each host is a network namespace with its own hostname,
# address and interface, joined to the others by a bridge that exists only
# inside this machine.  Root only.
#
#   start [--hosts H] [--slots N] [--link-gbit R] [--ifnames same|distinct]
#           makes H hosts (default 2) with N slots each (default 2), installs
#           iproute2, util-linux and iputils-ping with apt when missing.  On a
#           running cluster it says so and exits 0; an explicit --link-gbit or
#           --ifnames is then applied in place, a different --hosts or --slots
#           is refused (stop first).
#           While it runs, kernel.sched_autogroup_enabled is 0 (see start()).
#   stop    kills every process on every host, deletes the hosts, their links,
#           the bridge and the state directory; puts autogroup back as it was.
#   status  exit 0 and one line per host when the cluster is up, 1 otherwise.
#   hosts   the host file for mpirun (`hostname slots=N` per host).
#   env     the mpirun options that run a job on the hosts, on one line:
#           mpirun $(scripts/cluster.sh env) -np 4 python ...
#   mpirun ARGS...   mpirun with those options (--host for every host's slots
#           unless ARGS name hosts themselves).
#   ftmpirun ARGS... the same with scripts/ftmpirun (Open MPI 5, fault tolerance on).
#   exec HOST CMD... runs a command on a host (what mpirun's rsh agent does).
#   fail HOST        SIGKILL every process on the host (its daemon included).
#   partition HOST / heal HOST   its link down / up, from the bridge's side.
#   slow HOST|all RATE           a tbf rate on the host's interface: a number of
#                    Gbit/s or a tc rate (100mbit); `off` removes it.
#   ifnames same|distinct        renames every host's interface in place.
#
# HOST is a hostname (hpca), a namespace name (hpcA) or an address.
#
# Layout (HPCNET_CLUSTER_PREFIX=hpc, HPCNET_CLUSTER_NET=10.77.0): host i is the
# namespace hpcA, hpcB, ... with hostname hpca, hpcb, ..., address 10.77.0.i/24
# on an interface named eth-hpca (distinct) or eth0 (same), the peer v-hpca on
# the bridge hpcbr0, which has 10.77.0.254 so that mpirun in this namespace
# reaches every host.  No host has a default route and nothing forwards out of
# the bridge: the hosts reach each other and this machine's bridge address only.
# The rsh agent scripts/cluster-agent.sh enters a host: `ip netns exec`, then a
# UTS namespace with the host's name and the cluster's hosts file bind-mounted on
# /etc/hosts, so every host name resolves on every host.  The file system and
# /dev/shm stay shared, like a cluster's shared file system.
#
# State (what the agent and the verbs read) lives in HPCNET_CLUSTER_DIR
# (default /run/hpcnet-cluster): config, hostmap (namespace hostname address
# interface veth per line), hosts (the mpirun host file), etc-hosts.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
agent="$here/cluster-agent.sh"
state_dir="${HPCNET_CLUSTER_DIR:-/run/hpcnet-cluster}"
prefix="${HPCNET_CLUSTER_PREFIX:-hpc}"
net="${HPCNET_CLUSTER_NET:-10.77.0}"
bridge="${prefix}br0"
bridge_ip="$net.254"
subnet="$net.0/24"
letters=(A B C D E F G H I J K L M N O P Q R S T U V W X Y Z)
autogroup=/proc/sys/kernel/sched_autogroup_enabled
# Interface names have at most 15 characters: eth-<prefix>a, v-<prefix>a, <prefix>br0.
[[ "$prefix" =~ ^[a-z][a-z0-9]{0,9}$ ]] || { echo "cluster.sh: HPCNET_CLUSTER_PREFIX: 1 to 10 lower-case letters or digits, not '$prefix'" >&2; exit 2; }
[[ "$net" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || { echo "cluster.sh: HPCNET_CLUSTER_NET: the first three parts of a /24 (10.77.0), not '$net'" >&2; exit 2; }

die() { echo "cluster.sh: $*" >&2; exit 1; }
say() { echo "cluster.sh: $*"; }

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

# --- what the cluster needs -------------------------------------------------

install_if_missing() {
    local missing=()
    command -v ip >/dev/null || missing+=(iproute2)
    command -v tc >/dev/null || missing+=(iproute2)
    command -v unshare >/dev/null && command -v mount >/dev/null || missing+=(util-linux mount)
    command -v ping >/dev/null || missing+=(iputils-ping)
    [ ${#missing[@]} = 0 ] && return 0
    command -v apt-get >/dev/null || die "missing ${missing[*]} and there is no apt-get: install them"
    say "installing ${missing[*]}"
    if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 \
        || { DEBIAN_FRONTEND=noninteractive apt-get update -qq \
             && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; }; }; then
        command -v ip >/dev/null && command -v unshare >/dev/null \
            || die "could not install ${missing[*]} with apt-get"
        say "could not install ${missing[*]}; going on without" >&2
    fi
}

# Namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN): try one and say why not.
check_can_make_namespaces() {
    [ "$(id -u)" = 0 ] || die "not root: network namespaces need root (uid $(id -u))"
    local probe="${prefix}probe$$" out
    if ! out="$(ip netns add "$probe" 2>&1)"; then
        die "cannot make a network namespace (ip netns add: ${out:-refused})"
    fi
    if ! out="$(ip netns exec "$probe" unshare --uts --mount true 2>&1)"; then
        ip netns del "$probe" 2>/dev/null || true
        die "cannot enter a network namespace with its own hostname (${out:-refused})"
    fi
    ip netns del "$probe"
    if ! out="$(ip link add "${prefix}probe0" type bridge 2>&1)"; then
        die "cannot make a bridge (ip link add type bridge: ${out:-refused})"
    fi
    ip link del "${prefix}probe0"
}

# --- state ------------------------------------------------------------------

# hostmap: namespace hostname address interface veth
hostmap() { cat "$state_dir/hostmap"; }

conf() { sed -n "s/^$1=//p" "$state_dir/config" 2>/dev/null; }

set_conf() {
    if grep -q "^$1=" "$state_dir/config"; then
        sed -i "s|^$1=.*|$1=$2|" "$state_dir/config"
    else
        echo "$1=$2" >>"$state_dir/config"
    fi
}

is_up() {
    [ -r "$state_dir/hostmap" ] && [ -r "$state_dir/config" ] && [ -s "$state_dir/hostmap" ] \
        && ip link show "$bridge" >/dev/null 2>&1 || return 1
    local ns _
    while read -r ns _; do
        [ -e "/run/netns/$ns" ] || return 1
    done 2>/dev/null <"$state_dir/hostmap"
}

# One row of hostmap for a host named by namespace, hostname or address.
lookup() {
    local row
    row="$(awk -v h="$1" 'tolower($1) == tolower(h) || $2 == tolower(h) || $3 == h' "$state_dir/hostmap" 2>/dev/null)"
    [ -n "$row" ] || die "no host '$1' in the cluster (hosts: $(awk '{print $2}' "$state_dir/hostmap" 2>/dev/null | xargs))"
    echo "$row"
}

# The hosts a verb applies to: one, or every host for `all`.
targets() {
    if [ "$1" = all ]; then hostmap; else lookup "$1"; fi
}

ifname_for() {  # hostname mode
    if [ "$2" = same ]; then echo eth0; else echo "eth-$1"; fi
}

# --- link rates -------------------------------------------------------------

# A rate as tc takes it: a bare number is Gbit/s.
tc_rate() {
    case "$1" in
        *[!0-9.]*) echo "$1" ;;
        *) echo "${1}gbit" ;;
    esac
}

# tbf's bucket: 2 ms of the rate, at least 64 KiB (one 64 KiB segment): a larger one lets
# a message of a few MiB through faster than the rate.
tbf_burst() {
    local bits
    bits="$(tc_bits "$1")"
    awk -v b="$bits" 'BEGIN { x = b / 8 / 500; if (x < 65536) x = 65536; printf "%d", x }'
}

tc_bits() {
    local r="${1,,}"
    awk -v r="$r" 'BEGIN {
        n = r + 0; u = r; sub(/^[0-9.]+/, "", u)
        m["bit"] = 1; m["kbit"] = 1e3; m["mbit"] = 1e6; m["gbit"] = 1e9; m["tbit"] = 1e12
        m["bps"] = 8; m["kbps"] = 8e3; m["mbps"] = 8e6; m["gbps"] = 8e9
        if (!(u in m)) { exit 1 }
        printf "%d", n * m[u] }' || die "not a rate: $1 (Gbit/s as a number, or a tc rate like 100mbit)"
}

set_rate() {  # namespace interface rate|off
    if [ "$3" = off ] || [ "$3" = 0 ]; then
        ip netns exec "$1" tc qdisc del dev "$2" root 2>/dev/null || true
        return 0
    fi
    local rate
    rate="$(tc_rate "$3")"
    ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$rate" burst "$(tbf_burst "$rate")" latency 50ms \
        || die "tc refused a tbf rate of $rate on $2 in $1"
}

# --- interface names --------------------------------------------------------

rename_ifaces() {  # same|distinct
    local mode="$1" tmp ns host addr ifname veth new
    tmp="$(mktemp)"
    while read -r ns host addr ifname veth; do
        new="$(ifname_for "$host" "$mode")"
        if [ "$new" != "$ifname" ]; then
            ip -n "$ns" link set dev "$ifname" down
            ip -n "$ns" link set dev "$ifname" name "$new"
            ip -n "$ns" link set dev "$new" up
        fi
        echo "$ns $host $addr $new $veth" >>"$tmp"
    done <"$state_dir/hostmap"
    mv "$tmp" "$state_dir/hostmap"
    set_conf ifnames "$mode"
}

# --- start / stop -----------------------------------------------------------

start() {
    local hosts=2 slots=2 rate="" ifnames=distinct rate_given=0 ifnames_given=0 hosts_given=0 slots_given=0 autogroup_note=""
    while [ $# -gt 0 ]; do
        case "$1" in
            --hosts) hosts="${2:?--hosts H}"; hosts_given=1; shift 2 ;;
            --slots) slots="${2:?--slots N}"; slots_given=1; shift 2 ;;
            --link-gbit) rate="${2:?--link-gbit R}"; rate_given=1; shift 2 ;;
            --ifnames) ifnames="${2:?--ifnames same|distinct}"; ifnames_given=1; shift 2 ;;
            *) die "start: unknown option $1 (--hosts H --slots N --link-gbit R --ifnames same|distinct)" ;;
        esac
    done
    case "$ifnames" in same|distinct) ;; *) die "--ifnames takes same or distinct, not $ifnames" ;; esac
    [[ "$hosts" =~ ^[1-9][0-9]*$ ]] && [ "$hosts" -le ${#letters[@]} ] || die "--hosts takes 1 to ${#letters[@]}"
    [[ "$slots" =~ ^[1-9][0-9]*$ ]] || die "--slots takes a positive number"
    [ -z "$rate" ] || tc_bits "$(tc_rate "$rate")" >/dev/null
    [ "$(id -u)" = 0 ] || die "not root: network namespaces need root (uid $(id -u))"

    if is_up; then
        if [ "$hosts_given" = 1 ] && [ "$hosts" != "$(conf hosts)" ]; then
            die "already running with $(conf hosts) hosts; stop it first for $hosts"
        fi
        if [ "$slots_given" = 1 ] && [ "$slots" != "$(conf slots)" ]; then
            die "already running with $(conf slots) slots a host; stop it first for $slots"
        fi
        if [ "$ifnames_given" = 1 ] && [ "$ifnames" != "$(conf ifnames)" ]; then
            rename_ifaces "$ifnames"
        fi
        if [ "$rate_given" = 1 ]; then
            local ns ifname
            while read -r ns _ _ ifname _; do set_rate "$ns" "$ifname" "$rate"; done <"$state_dir/hostmap"
        fi
        say "already running ($(summary))"
        return 0
    fi
    install_if_missing
    check_can_make_namespaces
    # Whatever a start that failed half-way left behind.
    teardown quiet

    mkdir -p "$state_dir"
    # The hosts share one kernel, whose autogroup scheduling (one group per
    # session, and each host's daemon starts a session) would share the CPUs
    # between hosts as if they were jobs of different users: a busy host then
    # starves a rank of another for seconds, which separate machines never do.
    # Off while the cluster runs (the old value is kept in the state directory
    # and put back by stop): docs/testing.md.
    if [ -w "$autogroup" ] && [ "$(cat "$autogroup")" != 0 ]; then
        cat "$autogroup" >"$state_dir/autogroup"
        echo 0 >"$autogroup"
        autogroup_note="; kernel.sched_autogroup_enabled 0 until stop"
    fi
    printf 'hosts=%s\nslots=%s\nifnames=%s\nprefix=%s\nnet=%s\n' \
        "$hosts" "$slots" "$ifnames" "$prefix" "$net" >"$state_dir/config"
    : >"$state_dir/hostmap"
    : >"$state_dir/hosts"
    printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n%s\t%s-bridge\n' \
        "$bridge_ip" "$prefix" >"$state_dir/etc-hosts"

    ip link add "$bridge" type bridge
    ip addr add "$bridge_ip/24" dev "$bridge"
    ip link set "$bridge" up
    local i ns host addr ifname veth
    for ((i = 0; i < hosts; i++)); do
        ns="$prefix${letters[$i]}"
        host="${ns,,}"
        addr="$net.$((i + 1))"
        ifname="$(ifname_for "$host" "$ifnames")"
        veth="v-$host"
        ip netns add "$ns"
        ip link add "$veth" type veth peer name "$ifname" netns "$ns"
        ip link set "$veth" master "$bridge"
        ip link set "$veth" up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "$addr/24" dev "$ifname"
        ip -n "$ns" link set "$ifname" up
        [ -z "$rate" ] || set_rate "$ns" "$ifname" "$rate"
        echo "$ns $host $addr $ifname $veth" >>"$state_dir/hostmap"
        echo "$host slots=$slots" >>"$state_dir/hosts"
        printf '%s\t%s\n' "$addr" "$host" >>"$state_dir/etc-hosts"
    done
    # The same names for the IPv4-mapped IPv6 addresses that a dual-stack listener (torch's
    # TCPStore) sees its clients as, so that the reverse lookup of a peer finds its name too.
    awk '{printf "::ffff:%s\t%s\n", $3, $2}' "$state_dir/hostmap" >>"$state_dir/etc-hosts"
    # Every host answers on the bridge before start returns.
    local deadline=$((SECONDS + 10))
    while read -r ns host addr _; do
        # A refused connection to the bridge's port 9 (discard) is an answer.
        until [[ "$(ip netns exec "$ns" timeout 1 bash -c "exec 3<>/dev/tcp/$bridge_ip/9" 2>&1)" == *refused* ]]; do
            [ $SECONDS -lt $deadline ] || die "host $host ($addr) does not reach the bridge at $bridge_ip"
            sleep 0.1
        done
    done <"$state_dir/hostmap"
    say "started ($(summary))${autogroup_note:-}"
}

# Kill every process in a namespace until none is left (a dying daemon may fork).
kill_all_in() {
    local pids _
    for _ in $(seq 50); do
        pids="$(ip netns pids "$1" 2>/dev/null || true)"
        [ -n "$pids" ] || return 0
        # shellcheck disable=SC2086
        kill -9 $pids 2>/dev/null || true
        sleep 0.1
    done
    echo "cluster.sh: processes still in $1: $(ip netns pids "$1" | tr '\n' ' ')" >&2
    return 1
}

# Everything this cluster's names point to, whether the state directory is there or not.
teardown() {
    local ns
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
        [[ "$ns" =~ ^${prefix}[A-Z]$ ]] || continue
        kill_all_in "$ns" || true
        ip netns del "$ns" 2>/dev/null || true
    done
    local link
    for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//'); do
        [[ "$link" =~ ^v-${prefix}[a-z]$ ]] && ip link del "$link" 2>/dev/null || true
    done
    ip link del "$bridge" 2>/dev/null || true
    if [ -r "$state_dir/autogroup" ]; then
        cat "$state_dir/autogroup" >"$autogroup" 2>/dev/null || true
    fi
    rm -rf "$state_dir"
    [ "${1:-}" = quiet ] || say "stopped"
}

stop() {
    [ "$(id -u)" = 0 ] || die "not root: only root can remove the cluster's namespaces"
    teardown
}

summary() {
    local ns host addr ifname _ rate parts=()
    while read -r ns host addr ifname _; do
        rate="$(host_rate "$ns" "$ifname")"
        parts+=("$host $addr $ifname${rate:+ $rate}")
    done <"$state_dir/hostmap"
    local joined
    joined="$(printf '%s, ' "${parts[@]}")"
    echo "$(conf hosts) hosts x $(conf slots) slots: ${joined%, }; bridge $bridge $bridge_ip"
}

# The tbf rate on a host's interface, as tc shows it (1Gbit), or nothing.
host_rate() {
    ip netns exec "$1" tc qdisc show dev "$2" 2>/dev/null | awk '$2 == "tbf" {for (i = 1; i < NF; i++) if ($i == "rate") print $(i + 1)}'
}

status() {
    if is_up; then
        say "running ($(summary); state in $state_dir)"
        local ns host addr ifname veth state qdisc
        while read -r ns host addr ifname veth; do
            state="$(ip -br link show "$veth" 2>/dev/null | awk '{print $2}')"
            qdisc="$(host_rate "$ns" "$ifname")"
            echo "  $host ($ns) $addr $ifname link ${state:-?}${qdisc:+ tbf $qdisc} processes $(ip netns pids "$ns" | wc -l)"
        done <"$state_dir/hostmap"
    else
        say "not running"
        return 1
    fi
}

# --- mpirun -----------------------------------------------------------------

host_list() {
    local slots
    slots="$(conf slots)"
    awk -v s="$slots" '{printf "%s%s:%s", (NR > 1 ? "," : ""), $2, s}' "$state_dir/hostmap"
}

# The options without --host: the agent, the interfaces, the environment.
base_options() {
    opts=(--mca plm_rsh_agent "$agent" --mca plm_rsh_no_tree_spawn 1
          --mca oob_tcp_if_include "$subnet" --mca btl_tcp_if_include "$subnet")
    local var
    for var in PATH PYTHONPATH LD_LIBRARY_PATH VIRTUAL_ENV; do
        [ -z "${!var:-}" ] || opts+=(-x "$var")
    done
    opts+=(-wdir "$PWD")
    if [ "$(id -u)" = 0 ] && [ -z "${OMPI_ALLOW_RUN_AS_ROOT:-}" ]; then
        opts+=(--allow-run-as-root)
    fi
}

run_mpirun() {
    is_up || die "not running: scripts/cluster.sh start"
    local opts arg named=0
    base_options
    for arg in "$@"; do
        case "$arg" in
            --host|-host|-H|--hostfile|-hostfile|--machinefile|-machinefile|--host=*|--hostfile=*|--default-hostfile) named=1 ;;
        esac
    done
    [ "$named" = 1 ] || opts+=(--host "$(host_list)")
    export HPCNET_CLUSTER_DIR="$state_dir"
    exec mpirun "${opts[@]}" "$@"
}

# scripts/ftmpirun (Open MPI 5, fault tolerance on) with the cluster's options, in PRRTE's names.
run_ftmpirun() {
    is_up || die "not running: scripts/cluster.sh start"
    local opts=(--prtemca plm_ssh_agent "$agent" --prtemca oob_tcp_if_include "$subnet"
                --mca btl_tcp_if_include "$subnet" --wdir "$PWD") arg named=0 var
    for var in PATH PYTHONPATH VIRTUAL_ENV; do
        [ -z "${!var:-}" ] || opts+=(-x "$var")
    done
    for arg in "$@"; do
        case "$arg" in --host|-H|--hostfile|--host=*|--hostfile=*) named=1 ;; esac
    done
    [ "$named" = 1 ] || opts+=(--host "$(host_list)")
    export HPCNET_CLUSTER_DIR="$state_dir"
    exec "$here/ftmpirun" "${opts[@]}" "$@"
}

print_env() {
    is_up || die "not running: scripts/cluster.sh start"
    local opts
    base_options
    opts+=(--host "$(host_list)")
    echo "${opts[*]}"
}

# --- faults -----------------------------------------------------------------

fail() {
    local ns host
    read -r ns host _ < <(lookup "$1")
    kill_all_in "$ns"
    say "killed every process on $host"
}

link() {  # HOST up|down
    local host veth
    read -r _ host _ _ veth < <(lookup "$1")
    ip link set "$veth" "$2"
    if [ "$2" = down ]; then say "$host cut off ($veth down)"; else say "$host reconnected ($veth up)"; fi
}

slow() {
    local target="${1:?slow HOST|all RATE}" rate="${2:?slow HOST|all RATE (Gbit/s, a tc rate, or off)}"
    local ns host ifname
    targets "$target" >/dev/null  # an unknown host ends the script here
    while read -r ns host _ ifname _; do
        set_rate "$ns" "$ifname" "$rate"
        if [ "$rate" = off ]; then say "$host: no rate limit"; else say "$host: $ifname at $(tc_rate "$rate")"; fi
    done < <(targets "$target")
}

# --- verbs ------------------------------------------------------------------

verb="${1:-}"
[ $# -gt 0 ] && shift
case "$verb" in
    start) start "$@" ;;
    stop) stop ;;
    status) status ;;
    hosts) is_up || die "not running"; cat "$state_dir/hosts" ;;
    env) print_env ;;
    mpirun) run_mpirun "$@" ;;
    ftmpirun) run_ftmpirun "$@" ;;
    exec) is_up || die "not running"; [ $# -ge 2 ] || die "exec HOST COMMAND..."
          # The agent takes one shell command line, as ssh does: quote each argument.
          target="$1"; shift
          HPCNET_CLUSTER_DIR="$state_dir" exec "$agent" "$target" "$(printf '%q ' "$@")" ;;
    fail) is_up || die "not running"; fail "${1:?fail HOST}" ;;
    partition) is_up || die "not running"; link "${1:?partition HOST}" down ;;
    heal) is_up || die "not running"; link "${1:?heal HOST}" up ;;
    slow) is_up || die "not running"; slow "$@" ;;
    ifnames) is_up || die "not running"
             case "${1:-}" in same|distinct) rename_ifaces "$1"; say "interfaces: $(summary)" ;;
                              *) die "ifnames same|distinct" ;; esac ;;
    -h|--help|help) usage ;;
    *) usage ;;
esac
