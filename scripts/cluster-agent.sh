#!/usr/bin/env bash
# mpirun's rsh agent for the local cluster of scripts/cluster.sh:
#   cluster-agent.sh HOST COMMAND...
# runs COMMAND (one bash command line, as ssh would) on HOST: inside the host's
# network namespace (ip netns exec), in a UTS namespace with the host's name and
# a mount namespace with the cluster's hosts file on /etc/hosts, so that every
# host name resolves.  HOST is a hostname, a namespace name or an address of
# the cluster in HPCNET_CLUSTER_DIR (default /run/hpcnet-cluster).
set -euo pipefail
state_dir="${HPCNET_CLUSTER_DIR:-/run/hpcnet-cluster}"
[ $# -ge 2 ] || { echo "usage: cluster-agent.sh HOST COMMAND..." >&2; exit 2; }
target="$1"
shift
read -r ns host _ < <(awk -v h="$target" 'tolower($1) == tolower(h) || $2 == tolower(h) || $3 == h' \
    "$state_dir/hostmap" 2>/dev/null) || true
if [ -z "${ns:-}" ]; then
    echo "cluster-agent.sh: no host '$target' in the local cluster ($state_dir/hostmap)" >&2
    exit 255
fi
# ssh carries no environment to another host: neither does this, for the tag by
# which hpcnet.launch finds what an attempt started on its own host.
unset HPCNET_PROCESS_TAG
# ip netns exec already gives the command a mount namespace of its own; --mount
# makes that explicit, --propagation private keeps the bind mount in it.
exec ip netns exec "$ns" unshare --uts --mount --propagation private -- /bin/bash -c \
    'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec /bin/bash -c "$*"' \
    cluster-agent "$host" "$state_dir/etc-hosts" "$@"
