#!/usr/bin/env bash
# Set up (if needed), then run the whole test suite after ruff and mypy: a serial pass
# (every test, MPI tests on one rank, plus the tests that launch mpirun, submit
# SLURM jobs or run jobs on the local cluster themselves), then the MPI tests
# on 2 and 3 ranks on this host (an odd size finds what even ones hide: virtual
# nodes of unequal sizes, sums of more than two in another order) and on 4
# ranks: as 2 hosts x 2 ranks of the local cluster when it runs (distinct
# interface names, every collective between the hosts over TCP, Open MPI
# yielding since mpirun sees 2 slots per host, not 4 ranks on 2 cores), on this
# host otherwise or with HPCNET_CLUSTER_MPI=off (docs/testing.md).
# pyproject.toml passes pytest-mpi's --with-mpi (without it every MPI test is
# skipped); python -m mpi4py aborts the job when one rank fails instead of
# leaving the others hanging. --slow (a pytest option of tests/conftest.py,
# passed on like every argument) also runs the tests marked slow: more time or
# memory than the default suite has (docs/testing.md).
#
# The serial pass runs beside a one-node SLURM on this machine
# (scripts/slurm.sh, which installs slurm-wlm and munge when missing) and the
# local multi-host cluster (scripts/cluster.sh: hosts as network namespaces),
# both started here and stopped afterwards unless they were running already
# (the cluster after the 4-rank pass, which runs on it).
# Where one cannot start (not root, no apt, no namespaces) its tests skip and
# say why; HPCNET_SLURM=off and HPCNET_CLUSTER=off skip starting them.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
echo "=== ruff (lint, import order, docstrings: pyproject.toml) ==="
ruff check hpcnet tests scripts
echo "=== mypy (types of the packages setup.cfg lists) ==="
mypy
# Bytecode for hpcnet once, before the passes: where PYTHONDONTWRITEBYTECODE is set (as on this project's
# machines) no process writes it, and every rank of every job the tests start compiled hpcnet's modules again
# (0.2 s of CPU for a 2-rank job that stops at its options, a tenth of it). Stale files are recompiled by mtime.
python -m compileall -q hpcnet
# torch's OpenMP workers sleep once a parallel region ends instead of spinning for it (libgomp spins where a process
# sees as many cores as threads, which every rank here does of the 2 cores that all share): 8-15% less CPU in the
# MPI passes, which are CPU-bound, and no change to what any test computes (the wait policy is not the threads).
export OMP_WAIT_POLICY=PASSIVE
slurm_started=0
cluster_started=0
stop_started() {
    if [ "$slurm_started" = 1 ]; then scripts/slurm.sh stop; slurm_started=0; fi
    if [ "$cluster_started" = 1 ]; then scripts/cluster.sh stop; cluster_started=0; fi
}
trap stop_started EXIT
if [ "${HPCNET_SLURM:-on}" != off ] && ! scripts/slurm.sh status >/dev/null 2>&1; then
    if scripts/slurm.sh start; then
        slurm_started=1
    else
        echo "test.sh: the local SLURM did not start; the SLURM tests will be skipped" >&2
    fi
fi
if [ "${HPCNET_CLUSTER:-on}" != off ] && ! scripts/cluster.sh status >/dev/null 2>&1; then
    if scripts/cluster.sh start; then
        cluster_started=1
    else
        echo "test.sh: the local cluster did not start; the cluster tests will be skipped" >&2
    fi
fi
# The serial pass on pytest-xdist's workers (HPCNET_TEST_WORKERS, default 3; the cluster's and SLURM's tests each
# stay on one worker: tests/conftest.py); most of its time is spent waiting on the jobs its tests start.
python -m pytest -n "${HPCNET_TEST_WORKERS:-3}" --dist loadgroup "$@"
if [ "$slurm_started" = 1 ]; then scripts/slurm.sh stop; slurm_started=0; fi
# The MPI passes collect the files that hold MPI tests (tests/helpers/mpi_files.py; the serial pass checks that
# every MPI test is in one): each rank imports what it collects. Not where arguments other than options name what
# to run.
mpi_paths=()
if [ $# -eq 0 ] || ! printf '%s\n' "$@" | grep -qv '^-'; then
    mapfile -t mpi_paths < <(python -m tests.helpers.mpi_files)
fi
# Blocked ranks yield the core (mpi_yield_when_idle): Open MPI does so by itself only where it sees more ranks than
# cores (3 here), and 2 ranks that busy-poll take the cores from their own worker and monitor threads.
for n in 2 3; do
    echo "=== MPI tests on $n ranks ==="
    timeout 900 mpiexec -n "$n" --mca mpi_yield_when_idle 1 python -m mpi4py -m pytest -m mpi -q "$@" "${mpi_paths[@]}"
done
if [ "${HPCNET_CLUSTER_MPI:-on}" != off ] && scripts/cluster.sh status >/dev/null 2>&1; then
    echo "=== MPI tests on 4 ranks: 2 hosts x 2 ranks of the local cluster ==="
    timeout 900 scripts/cluster.sh mpirun --mca mpi_yield_when_idle 1 -x OMP_WAIT_POLICY --host "$(scripts/cluster.sh hosts | awk 'NR<=2 {printf "%s%s:2", sep, $1; sep=","}')" \
        -np 4 python -m mpi4py -m pytest -m mpi -q "$@" "${mpi_paths[@]}"
else
    echo "=== MPI tests on 4 ranks on this host (the local cluster is not running) ==="
    timeout 900 mpiexec -n 4 python -m mpi4py -m pytest -m mpi -q "$@" "${mpi_paths[@]}"
fi
stop_started
trap - EXIT
