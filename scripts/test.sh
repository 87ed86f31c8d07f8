#!/usr/bin/env bash
# Set up (if needed), then run the whole test suite: a serial pass (every
# test, MPI tests on one rank, plus the tests that launch mpirun or submit
# SLURM jobs themselves), then the MPI tests on 2, 3 and 4 ranks (an odd
# size finds what even ones hide: virtual nodes of unequal sizes, sums of
# more than two in another order), after ruff.  pyproject.toml passes pytest-mpi's
# --with-mpi (without it every MPI test is skipped); python -m mpi4py aborts
# the job when one rank fails instead of leaving the others hanging.
#
# The serial pass runs beside a one-node SLURM on this machine
# (scripts/slurm.sh, which installs slurm-wlm and munge when missing), started
# here and stopped after the pass unless it was running already.  Where it
# cannot start (not root, no apt) tests/test_slurm.py skips and says why;
# HPCNET_SLURM=off skips starting it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
echo "=== ruff (lint, import order, docstrings: pyproject.toml) ==="
ruff check hpcnet tests scripts
slurm_started=0
if [ "${HPCNET_SLURM:-on}" != off ] && ! scripts/slurm.sh status >/dev/null 2>&1; then
    if scripts/slurm.sh start; then
        slurm_started=1
        trap 'scripts/slurm.sh stop' EXIT
    else
        echo "test.sh: the local SLURM did not start; the SLURM tests will be skipped" >&2
    fi
fi
python -m pytest "$@"
if [ "$slurm_started" = 1 ]; then
    scripts/slurm.sh stop
    trap - EXIT
fi
for n in 2 3 4; do
    echo "=== MPI tests on $n ranks ==="
    timeout 900 mpiexec -n "$n" python -m mpi4py -m pytest -m mpi -q "$@"
done
