"""hpcnet.agree: the one protocol by which ranks agree (here: ``ranks_differing``)."""

import pytest

from hpcnet.agree import ranks_differing

pytestmark = pytest.mark.timeout(60)


@pytest.mark.mpi
def test_ranks_differing_names_the_same_ranks_on_every_rank(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    assert ranks_differing(comm, ("same", 1)) == []
    odd = ranks_differing(comm, "x" if rank % 2 == 0 else "y")
    assert odd == list(range(1, size, 2))
    assert comm.allgather(odd) == [odd] * size
    assert ranks_differing(comm, rank) == list(range(1, size))  # measured against rank 0's value
