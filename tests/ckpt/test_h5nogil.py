"""The collective checkpoint file create with the GIL released (hpcnet.ckpt.h5nogil)."""

import threading
import time
from pathlib import Path

import h5py
import pytest

from hpcnet.ckpt import h5nogil


class Ticker(threading.Thread):
    """Counts its own wake-ups every 10 ms: a thread that cannot get the GIL counts none."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.ticks = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.01):
            self.ticks += 1


@pytest.mark.mpi(min_size=2)
def test_the_ranks_waiting_in_the_create_keep_running_python(comm, mpi_tmp_path):
    """h5py's own create would freeze every Python thread of the ranks that wait in it for a late rank (their
    heartbeat monitors included); the ranks here wait 1 s for rank 0 and their other thread keeps ticking."""
    ticker = Ticker()
    ticker.start()
    comm.Barrier()
    if comm.Get_rank() == 0:
        time.sleep(1.0)
    before = ticker.ticks
    f = h5nogil.create_file(mpi_tmp_path / "late.h5", comm, alignment_threshold=1 << 16, alignment_interval=1 << 16)
    ticked = ticker.ticks - before
    f.create_dataset("x", (4,), "u1", fill_time="never")
    f.close()
    ticker.done.set()
    ticks = comm.gather(ticked, root=0)
    if comm.Get_rank() == 0:
        assert min(ticks[1:]) >= 20, f"ticks of the waiting ranks' other thread during the create: {ticks[1:]}"


@pytest.mark.mpi
def test_the_file_is_hdf5s_over_mpi_io_aligned_and_closes(comm, mpi_tmp_path):
    path = mpi_tmp_path / "made.h5"
    f = h5nogil.create_file(path, comm, alignment_threshold=1, alignment_interval=1 << 16)
    assert f.driver == "mpio" and f.mode == "r+"
    assert f.id.get_access_plist().get_alignment() == (1, 1 << 16)
    d = f.create_dataset("x", (1000,), "<u8", fill_time="never")
    assert d.id.get_offset() % (1 << 16) == 0
    f.close()
    # Nothing of it left open (other tests' files may be, until the collector frees a failed run's traceback).
    still_open = [Path(fid.name.decode()) for fid in h5py.h5f.get_obj_ids(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)]
    assert not f.id.valid and path not in still_open, still_open
    comm.Barrier()
    with h5py.File(path, "r") as g:
        assert g["x"].shape == (1000,)


@pytest.mark.mpi
def test_a_failed_create_raises_on_every_rank_naming_the_file_and_why(comm, mpi_tmp_path):
    path = mpi_tmp_path / "no-such-dir" / "x.h5"
    with pytest.raises(OSError, match="unable to create .*no-such-dir/x.h5 over MPI-IO .*(no such file|No such file)"):
        h5nogil.create_file(path, comm, alignment_threshold=1, alignment_interval=1)
