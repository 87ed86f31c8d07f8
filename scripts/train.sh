#!/usr/bin/env bash
# Set up (if needed), then train the built-in default: NP ranks (default 2)
# under mpirun on this machine.  Extra arguments are hpcnet options, e.g.
#   scripts/train.sh train.steps=500 model.name=mlp
# It continues the run of the same run.name from its last checkpoint
# (--resume auto), so running it again never starts over a finished or
# interrupted run's checkpoints; a new run.name starts a new run.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
np="${NP:-2}"
exec mpirun -np "$np" python -m mpi4py -m hpcnet.train --resume auto "$@"
