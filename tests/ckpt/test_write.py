"""hpcnet.ckpt.write and collective: a failed write fails every rank alike, with its errno."""

import errno
import os

import pytest
import torch

from hpcnet.ckpt.manager import CheckpointManager

from tests.helpers import fresh_dir

pytestmark = pytest.mark.timeout(120)


@pytest.mark.mpi
@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT", "EIO"])
def test_an_error_inside_the_write_keeps_its_errno_on_every_rank(comm, mpi_tmp_path, code):
    from hpcnet.errors import exit_code_of

    directory = fresh_dir(comm, mpi_tmp_path / f"write-{code}")
    last = comm.Get_size() - 1

    def fault(phase, step):
        if phase == "write" and step == 2 and comm.Get_rank() == last:
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    tensors = {"model/w": torch.zeros(512, 300), "model/b": torch.zeros(3)}
    for async_save in (False, True):
        with CheckpointManager(comm, directory / str(async_save), full_every=1, async_save=async_save,
                               fault=fault) as manager:
            manager.save(1, tensors, {}, {})
            with pytest.raises(OSError) as info:
                manager.save(2, tensors, {}, {})
                manager.wait()
            # Every rank takes part in the load before any assert: a rank whose assert failed would leave the
            # others in its collective (seen once at 4 ranks: the listing read before the .tmp was removed).
            comm.Barrier()
            names = sorted(p.name for p in (directory / str(async_save)).iterdir())
            loaded_step = manager.load("auto").step
            assert info.value.errno == getattr(errno, code)
            assert exit_code_of(info.value) == (75 if code == "EIO" else 2)
            assert "ckpt-0000000002.h5.tmp" in str(info.value)
            assert names == ["ckpt-0000000001.h5", "latest"]
            assert loaded_step == 1
    comm.Barrier()


def test_errno_survives_in_hdf5_and_mpi_io_messages():
    from hpcnet.errors import errno_of, exit_code_of

    h5 = OSError("Can't write data (file write failed: time = Thu, errno = 122, error message = 'Disk quota "
                 "exceeded', buf = 0x1, total write size = 4096)")
    assert errno_of(h5) == errno.EDQUOT and exit_code_of(h5) == 2
    assert errno_of(OSError("MPI_ERR_NO_SPACE: not enough space for file")) == errno.ENOSPC
    assert errno_of(OSError("Unable to open file (truncated file: eof = 3048)")) is None
    assert exit_code_of(OSError(errno.EIO, "Input/output error")) == 75
    assert errno_of(ValueError("errno = 5")) is None


@pytest.mark.mpi
def test_independent_writes_store_what_collective_writes_store(comm, mpi_tmp_path):
    from hpcnet.ckpt.load import load_checkpoint

    directory = fresh_dir(comm, mpi_tmp_path / "independent")
    torch.manual_seed(0)
    tensors = {"model/big": torch.randn(1024, 512), "model/b": torch.randn(3)}  # big is split across ranks
    loaded = {}
    for collective in (True, False):
        with CheckpointManager(comm, directory / str(collective), full_every=1, async_save=False,
                               collective_writes=collective) as manager:
            path = manager.save(1, tensors, {}, {"rank": comm.Get_rank()})
        loaded[collective] = load_checkpoint(comm, str(path))
    for name, tensor in tensors.items():
        assert torch.equal(loaded[True].tensors[name], tensor) and torch.equal(loaded[False].tensors[name], tensor)
    assert loaded[False].rank_state == {"rank": comm.Get_rank()}
