"""Benchmarks: ``python -m hpcnet.bench <name> [args]`` runs ``hpcnet.bench.<name>.main(args)``.

``python -m hpcnet.bench`` alone lists them.  The communication and
checkpoint benchmarks run under MPI, for example::

    mpirun -np 2 python -m mpi4py -m hpcnet.bench allreduce --json allreduce.json
"""

__all__: list[str] = []  # the benchmarks are commands, not an API
