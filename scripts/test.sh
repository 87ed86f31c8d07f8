#!/usr/bin/env bash
# Set up (if needed), then run the whole test suite: a serial pass (every
# test, MPI tests on one rank, plus the tests that launch mpirun themselves),
# then the MPI tests on 2 and on 4 ranks.  pytest-mpi needs --with-mpi, or it
# silently skips every MPI test; python -m mpi4py aborts the job when one rank
# fails instead of leaving the others hanging.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -m pytest --with-mpi "$@"
for n in 2 4; do
    echo "=== MPI tests on $n ranks ==="
    timeout 900 mpiexec -n "$n" python -m mpi4py -m pytest --with-mpi -m mpi -q "$@"
done
