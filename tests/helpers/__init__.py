"""Helpers shared by the tests, one copy of each, by area (fixtures are in the ``conftest.py`` files):
``launch`` (paths, child mpirun environments, polling), ``dirs`` (directories the ranks share, folders a pytest
run fills once), ``data`` (small dataset files), ``train`` (small training runs), ``comm`` (communication),
``fault`` (stall reports) and ``ckpt`` (checkpoint states and saves)."""
