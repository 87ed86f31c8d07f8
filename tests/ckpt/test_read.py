"""hpcnet.ckpt.read: the verified read of a chain, at any world size."""

import os

import pytest
import torch
from mpi4py import MPI

from hpcnet.ckpt.manager import CheckpointManager
from tests.helpers.ckpt import save_steps, saved_run

pytestmark = pytest.mark.timeout(120)


@pytest.mark.mpi
def test_a_checkpoint_replaced_between_listing_and_reading_is_an_error(comm, mpi_tmp_path):
    from hpcnet.errors import RestartableError

    directory, _ = saved_run(comm, mpi_tmp_path / "replaced", [1, 2], shape=(64, 256), keep=5, full_every=1)
    other = directory / "other"
    if comm.Get_rank() == 0:
        other.mkdir()
        with CheckpointManager(MPI.COMM_SELF, other, full_every=1, async_save=False) as alone:
            save_steps(alone, [2], {"model/w": torch.ones(64, 256)})
    comm.Barrier()
    done = []

    def fault(phase, step):  # rank 0 swaps the file under the readers once it has been listed
        if phase == "read" and comm.Get_rank() == 0 and not done:
            os.replace(other / "ckpt-0000000002.h5", directory / "ckpt-0000000002.h5")
            done.append(1)
        comm.Barrier()

    with CheckpointManager(comm, directory, async_save=False, fault=fault) as manager:
        with pytest.raises(RestartableError, match="ckpt-0000000002.h5 was replaced after it was listed"):
            manager.load("auto")
    comm.Barrier()
