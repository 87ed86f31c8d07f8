#!/usr/bin/env bash
# Soak: the scale job (4 hosts x 8 ranks on the local cluster) run again and again, each run under a
# timeout; a run that outlives it gets every rank's stacks (hpcnet's dump signal) before it is ended.
#
#   scripts/soak-cluster.sh [--runs N] [--timeout S] [--one-host-every K] [--out DIR] [-- TRAIN_OPTIONS...]
#
#   --runs N            cluster runs (default 10)
#   --timeout S         seconds one run may take (default 600)
#   --one-host-every K  before cluster run 1, 1+K, 1+2K, ... run the same job as 32 ranks on this one host
#                       (`mpirun --oversubscribe`): alternating pairs on the same cores (default 0: never)
#   --out DIR           logs and run directories (default /tmp/hpcnet-soak)
#   TRAIN_OPTIONS       replace the default options of the job: train.steps=20 train.eval_every=10
#                       train.batch_size=4 (data.dir defaults to the checkout's data/)
#
# The cluster (HPCNET_CLUSTER_PREFIX / _NET / _DIR as for scripts/cluster.sh) is started with
# `--hosts 4 --slots 8 --ifnames same` when it is not up, and stopped at the end if this script started it.
# One line a run on stdout and in DIR/results.tsv: kind, run, status, wall s, median step s, comm share,
# load average (status 124: ended at the timeout). Exit status 0 when every run ended with 0.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
runs=10 timeout_s=600 one_host_every=0 out=/tmp/hpcnet-soak
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) runs="$2"; shift 2 ;;
        --timeout) timeout_s="$2"; shift 2 ;;
        --one-host-every) one_host_every="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "soak-cluster.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
for n in "$runs" "$timeout_s" "$one_host_every"; do
    [[ "$n" =~ ^[0-9]+$ ]] || { echo "soak-cluster.sh: --runs, --timeout and --one-host-every take whole numbers, not '$n'" >&2; exit 2; }
done
job=(train.steps=20 train.eval_every=10 train.batch_size=4 "data.dir=$root/data")
[ $# -gt 0 ] && job=("$@")
mkdir -p "$out"
results="$out/results.tsv"
printf 'kind\trun\tstatus\twall_s\tmedian_step_s\tcomm_share\tload\n' > "$results"

started_cluster=0
if ! "$here/cluster.sh" status > /dev/null 2>&1; then
    "$here/cluster.sh" start --hosts 4 --slots 8 --ifnames same || exit 1
    started_cluster=1
fi
cleanup() { [ "$started_cluster" = 1 ] && "$here/cluster.sh" stop > /dev/null 2>&1; }
trap cleanup EXIT
read -r -a cluster_opts <<< "$("$here/cluster.sh" env)"

# The dump signal of hpcnet.fault.failure (SIGRTMIN + 4): every thread's stack to the rank's stderr.
dump_signal=$(python -c "from hpcnet.fault.failure import DUMP_SIGNAL; print(int(DUMP_SIGNAL))")

ranks() {  # the ranks of the run in directory $1: python processes whose command line ends with it (the hosts
           # share this machine's process table; mpirun, whose command line ends the same, is left out)
    local p
    for p in $(pgrep -f -- "run.dir=$1\$"); do
        case "$(cat "/proc/$p/comm" 2>/dev/null)" in python*) echo "$p" ;; esac
    done
}

one() {  # kind run_number: one run under the timeout, a line in results.tsv
    local kind="$1" n="$2" dir="$out/$1-$2" log="$out/$1-$2.log" opts pid status t0 t1
    rm -rf "$dir"
    if [ "$kind" = cluster ]; then opts=("${cluster_opts[@]}"); else opts=(--oversubscribe -x PYTHONPATH); fi
    t0=$(date +%s.%N)
    : > "$log"  # appended to by mpirun and by this script alike
    (cd "$root" && exec mpirun "${opts[@]}" -np 32 python -m mpi4py -m hpcnet.train "${job[@]}" "run.dir=$dir") \
        >> "$log" 2>&1 &
    pid=$!
    local timed_out=0
    while kill -0 "$pid" 2>/dev/null; do
        if (( $(date +%s) - ${t0%.*} > timeout_s )); then
            timed_out=1
            echo "soak-cluster.sh: run $kind-$n still going after $timeout_s s: stacks of every rank, then ended" >> "$log"
            # A rank still importing has not registered the signal yet: it ends there (signal 38 in mpirun's notice).
            for rank_pid in $(ranks "$dir"); do kill -s "$dump_signal" "$rank_pid" 2>/dev/null; done
            sleep 10
            kill -TERM "$pid" 2>/dev/null; sleep 5; kill -KILL "$pid" 2>/dev/null
            for rank_pid in $(ranks "$dir"); do kill -KILL "$rank_pid" 2>/dev/null; done
            break
        fi
        sleep 1
    done
    wait "$pid"; status=$?
    [ "$timed_out" = 1 ] && status=124  # as timeout(1) says it
    t1=$(date +%s.%N)
    local stats
    stats=$(python - "$dir" <<'EOF'
import glob, json, sys
found = glob.glob(f"{sys.argv[1]}/*/summary.json")
if not found:
    print("-\t-")
    sys.exit()
stats = json.load(open(found[0]))["step_stats"]
phases = stats["per_rank"][0]["phases_s"]
print(f"{stats['median_s']:.3f}\t{phases['comm'] / sum(phases.values()):.0%}")
EOF
)
    printf '%s\t%d\t%d\t%.0f\t%s\t%s\n' "$kind" "$n" "$status" "$(echo "$t1 - $t0" | bc)" "$stats" \
        "$(cut -d' ' -f1 /proc/loadavg)" | tee -a "$results"
    [ "$status" = 0 ]
}

failed=0
for n in $(seq 1 "$runs"); do
    if [ "$one_host_every" -gt 0 ] && (( (n - 1) % one_host_every == 0 )); then
        one one-host "$n" || failed=$((failed + 1))
    fi
    one cluster "$n" || failed=$((failed + 1))
done
echo "soak-cluster.sh: $failed failed run(s); results in $results"
[ "$failed" = 0 ]
