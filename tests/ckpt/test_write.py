"""hpcnet.ckpt.write and collective: a failed write fails every rank alike, with its errno."""

import errno
import os
import re

import pytest
import torch

from hpcnet.ckpt.manager import CheckpointManager
from tests.helpers.dirs import fresh_dir

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
            assert re.search(r"ckpt-0000000002\.h5\.[0-9a-f]{16}\.tmp", str(info.value))
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


@pytest.mark.mpi
@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_follows_no_link_planted_at_a_temporary_name(comm, mpi_tmp_path, async_save):
    """Issue 27, item 13: ``ckpt-<step>.h5.tmp`` (opened with O_TRUNC) and ``latest.tmp`` were fixed names,
    written through any link found there: another user of a group-writable checkpoint directory could make a
    save truncate (and fill with HDF5) a file of their choosing.  Now each save's names are its own."""
    from hpcnet.ckpt.load import load_checkpoint

    directory = fresh_dir(comm, mpi_tmp_path / f"links-{async_save}")
    victims = {name: mpi_tmp_path / f"victim-{async_save}-{name}" for name in ("ckpt-0000000001.h5.tmp", "latest.tmp")}
    if comm.Get_rank() == 0:
        directory.mkdir()
        for name, victim in victims.items():
            victim.write_text("precious")
            (directory / name).symlink_to(victim)
    comm.Barrier()
    tensors = {"model/w": torch.ones(1024, 300), "model/b": torch.ones(3)}
    with CheckpointManager(comm, directory, full_every=1, async_save=async_save) as manager:
        path = manager.save(1, tensors, {}, {})
        manager.wait()
    comm.Barrier()
    loaded = load_checkpoint(comm, str(path))
    assert torch.equal(loaded.tensors["model/w"], tensors["model/w"])
    assert all(victim.read_text() == "precious" for victim in victims.values())
    assert not path.is_symlink() and not (directory / "latest").is_symlink()
    assert (directory / "latest").read_text() == "ckpt-0000000001.h5\n"
    comm.Barrier()


@pytest.mark.mpi
def test_a_save_refuses_a_link_at_its_own_temporary_name(comm, mpi_tmp_path, monkeypatch):
    """The temporary file is created exclusively, never through a link: one planted at its very name (here made
    known in advance) fails the save on every rank, and the file it names stays untouched."""
    import uuid

    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=0xABCDEF))
    directory = fresh_dir(comm, mpi_tmp_path / "own-name")
    victim = mpi_tmp_path / "victim-own-name"
    if comm.Get_rank() == 0:
        directory.mkdir()
        victim.write_text("precious")
        (directory / f"ckpt-0000000001.h5.{uuid.UUID(int=0xABCDEF).hex[:16]}.tmp").symlink_to(victim)
    comm.Barrier()
    with CheckpointManager(comm, directory, full_every=1, async_save=False) as manager:
        with pytest.raises(OSError) as info:
            manager.save(1, {"model/w": torch.ones(4, 3)}, {}, {})
    comm.Barrier()
    assert info.value.errno == errno.EEXIST, info.value
    assert "cannot create checkpoint file" in str(info.value) and victim.read_text() == "precious"
    comm.Barrier()


@pytest.fixture
def small_fs(comm, mpi_tmp_path):
    """A 16 MiB tmpfs that every rank sees (rank 0 mounts it; skipped on every rank where mounting is refused)."""
    import subprocess

    mount = fresh_dir(comm, mpi_tmp_path / "small-fs")
    refused = None
    if comm.Get_rank() == 0:
        mount.mkdir(parents=True)
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True,
                             text=True)
        refused = out.stderr.strip() or f"status {out.returncode}" if out.returncode else None
    refused = comm.bcast(refused, root=0)
    if refused:
        pytest.skip(f"needs a tmpfs mount (root): {refused}")
    unseen = [r for r, seen in enumerate(comm.allgather(os.path.ismount(mount))) if not seen]
    if unseen:  # ranks on another host (their own mount namespace on the local cluster) see a plain directory
        comm.Barrier()
        if comm.Get_rank() == 0:
            subprocess.run(["umount", str(mount)], check=True)
        pytest.skip(f"the tmpfs rank 0 mounted is not seen by ranks {unseen} (on another host)")
    try:
        yield mount
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            subprocess.run(["umount", str(mount)], check=True)


def _fill_and_fail(comm, small_fs, phase, *, full_every, direct_writes=True):
    """Save at step 1, fill ``small_fs`` but for 3 MiB (in ``phase`` of the next save: the file needs 5), and
    save at step 2; then free it and save at step 3.  Returns the error of the second save, the directory's
    files and ``latest`` after it, and the tensors of step 1 as loaded afterwards."""
    from hpcnet.fault.inject import FILL_NAME, fill_disk

    directory = small_fs / "ckpt"

    def fault(name, step):
        if name == phase and step == 2 and comm.Get_rank() == 0:
            fill_disk(small_fs, leave_bytes=3 << 20)

    torch.manual_seed(0)
    tensors = {"model/w": torch.randn(1024, 1024), "model/b": torch.randn(3)}  # 4 MiB, split across ranks
    with CheckpointManager(comm, directory, full_every=full_every, async_save=True, fault=fault,
                           direct_writes=direct_writes) as manager:
        manager.save(1, tensors, {}, {})
        saved = tensors["model/w"].clone()
        tensors["model/w"] += 1  # every block changes: the increment is as large as the full checkpoint
        with pytest.raises(OSError) as info:
            manager.save(2, tensors, {}, {})
            manager.wait()
        comm.Barrier()
        names = sorted(p.name for p in directory.iterdir() if p.name != FILL_NAME)
        latest = (directory / "latest").read_text().strip()
        comm.Barrier()
        if comm.Get_rank() == 0:
            (small_fs / FILL_NAME).unlink()
        comm.Barrier()
        manager.save(3, tensors, {}, {})  # HDF5 is sound: the next save and the loads work
        manager.wait()
        assert manager.load("auto").step == 3
        first = manager.load(str(directory / "ckpt-0000000001.h5"))
    assert torch.equal(first.tensors["model/w"], saved)
    return info.value, names, latest


@pytest.mark.mpi
@pytest.mark.parametrize("full_every", [1, 4])
def test_a_save_that_finds_no_room_for_its_file_fails_with_enospc_before_writing(comm, small_fs, full_every):
    """The disk fills between the free-space check and the write: the allocation of the file's space fails
    with its errno, before anything is written, on every rank; nothing is lost and the process goes on."""
    from hpcnet.errors import exit_code_of

    error, names, latest = _fill_and_fail(comm, small_fs, "reserve", full_every=full_every)
    assert error.errno == errno.ENOSPC and exit_code_of(error) == 2, error
    assert re.search(r"ckpt-0000000002\.h5\.[0-9a-f]{16}\.tmp", str(error)) and "allocating" in str(error)
    assert names == ["ckpt-0000000001.h5", "latest"] and latest == "ckpt-0000000001.h5"


@pytest.mark.mpi
@pytest.mark.parametrize("full_every, direct_writes", [(1, True), (1, False), (4, True)])
def test_a_disk_that_fills_inside_the_write_fails_it_on_every_rank_and_the_process_goes_on(
        comm, small_fs, monkeypatch, full_every, direct_writes):
    """Where the file system cannot allocate ahead, a full disk fails the writes themselves (HDF5 and MPI-IO
    keep no errno): ENOSPC on every rank, nothing lost, and HDF5 still works afterwards.  HDF5's close of such
    a file used to fail as well and leave it half torn down: SIGSEGV when its objects were released."""
    from hpcnet.ckpt import direct
    from hpcnet.errors import exit_code_of

    monkeypatch.setattr(direct, "allocate", lambda fd, offset, nbytes: False, raising=False)
    # Filled where rank 0 would allocate (the file's create, collective): before any rank writes, whichever
    # thread writes and whenever it starts.
    error, names, latest = _fill_and_fail(comm, small_fs, "reserve", full_every=full_every,
                                          direct_writes=direct_writes)
    assert error.errno == errno.ENOSPC and exit_code_of(error) == 2, error
    assert re.search(r"ckpt-0000000002\.h5\.[0-9a-f]{16}\.tmp", str(error))
    assert names == ["ckpt-0000000001.h5", "latest"] and latest == "ckpt-0000000001.h5"


@pytest.mark.mpi
@pytest.mark.parametrize("full_every", [1, 4])
def test_the_free_space_check_counts_every_dataset_of_the_file(comm, mpi_tmp_path, monkeypatch, full_every):
    """What the check asks for covers every dataset the file holds (/hashes, /blocks, /rank_state too) and
    HDF5's own structures, of a full checkpoint and of an increment."""
    import h5py

    import hpcnet.ckpt.write as write

    asked = []
    monkeypatch.setattr(write, "check_free_space", lambda directory, needed: asked.append(needed))
    directory = fresh_dir(comm, mpi_tmp_path / f"needed-{full_every}")
    # Rows of 4 bytes: 1 KiB blocks of 256 rows, so /hashes (and an increment's /blocks) hold 8 bytes a block.
    tensors = {"model/v": torch.zeros(1 << 20), "model/b": torch.zeros(3)}
    with CheckpointManager(comm, directory, full_every=full_every, async_save=False) as manager:
        manager.save(1, tensors, {"note": "x" * 1000}, {"rank": "y" * 100})
        tensors["model/v"] += 1
        manager.save(2, tensors, {}, {})
    comm.Barrier()
    if comm.Get_rank() == 0:
        for step, needed in zip((1, 2), asked):
            with h5py.File(directory / f"ckpt-{step:010d}.h5", "r") as f:
                stored = []
                f.visititems(lambda name, obj, stored=stored: stored.append(obj.id.get_storage_size())
                             if isinstance(obj, h5py.Dataset) else None)
            allocated = os.stat(directory / f"ckpt-{step:010d}.h5").st_blocks * 512
            assert needed >= sum(stored) + (1 << 20) and needed >= allocated, (step, needed, sum(stored), allocated)
    comm.Barrier()
