"""Fixtures of the checkpoint tests (the shared ones are in ``tests/conftest.py``)."""

import pytest
from mpi4py import MPI


@pytest.fixture
def single_process():
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("runs single-process tools; covered by the serial pass")
