"""hpcnet.ckpt.load: which checkpoint a load takes, past damaged ones, and what is not damage."""

import errno
import logging
import os

import pytest
import torch

from hpcnet.ckpt.manager import CheckpointManager
from hpcnet.errors import UsageError
from tests.helpers.ckpt import checkpoint_names, flip_bytes_in, save_steps, saved_run
from tests.helpers.dirs import fresh_dir

pytestmark = pytest.mark.timeout(120)


@pytest.mark.mpi
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_and_uncommitted_checkpoints_are_skipped(comm, mpi_tmp_path, caplog, damage):
    directory = fresh_dir(comm, mpi_tmp_path / f"corrupt-{damage}")
    tensors = {"model/w": torch.arange(512 * 300, dtype=torch.float32).reshape(512, 300), "model/b": torch.ones(3)}
    with CheckpointManager(comm, directory, full_every=1, async_save=False) as manager:
        good = manager.save(1, tensors, {}, {})
        tensors["model/w"][0] = -1
        bad = manager.save(2, tensors, {}, {})
        if comm.Get_rank() == 0:
            if damage == "flip":
                flip_bytes_in(bad, "tensors/model/w")
            else:
                os.truncate(bad, os.path.getsize(bad) // 2)
            (directory / "ckpt-0000000003.h5.tmp").write_bytes(b"\x89HDF half written")
        comm.Barrier()
        with caplog.at_level(logging.WARNING, logger="hpcnet.checkpoint"):
            loaded = manager.load("auto")
        assert loaded.path == good and loaded.tensors["model/w"][0, 0] == 0
        assert len(loaded.skipped) == 1 and str(bad) in loaded.skipped[0]
        if damage == "flip":
            assert "/tensors/model/w" in loaded.skipped[0] and "checksum mismatch" in loaded.skipped[0]
        text = caplog.text
        assert "ckpt-0000000003.h5.tmp" in text and "uncommitted" in text and f"skipping checkpoint {bad}" in text
        with pytest.raises(UsageError, match=str(bad)):
            manager.load(str(bad))
        with pytest.raises(UsageError, match="uncommitted"):
            manager.load(str(directory / "ckpt-0000000003.h5.tmp"))
        comm.Barrier()
        if comm.Get_rank() == 0:  # a save's own temporary name (hpcnet.paths.checkpoint_tmp_name)
            (directory / "ckpt-0000000003.h5.tmp").rename(directory / "ckpt-0000000003.h5.0123456789abcdef.tmp")
        comm.Barrier()
        with pytest.raises(UsageError, match="was never committed"):
            manager.load(str(directory / "ckpt-0000000003.h5"))


@pytest.mark.mpi
def test_when_no_checkpoint_loads_resume_stops_and_lists_each_one(comm, mpi_tmp_path):
    directory, _ = saved_run(comm, mpi_tmp_path / "all-bad", [1, 2], shape=(512, 300), keep=5, full_every=1)
    if comm.Get_rank() == 0:
        flip_bytes_in(directory / "ckpt-0000000002.h5", "tensors/model/w")
        os.truncate(directory / "ckpt-0000000001.h5", 4000)
    comm.Barrier()
    with CheckpointManager(comm, directory, async_save=False) as manager:
        with pytest.raises(UsageError) as info:
            manager.resume("auto")
    message = str(info.value)
    assert "none of the 2 committed checkpoint(s)" in message and str(directory) in message
    assert "ckpt-0000000002.h5 (step 2): dataset /tensors/model/w: checksum mismatch" in message
    assert "ckpt-0000000001.h5" in message and "truncated" in message
    assert checkpoint_names(directory) == ["ckpt-0000000001.h5", "ckpt-0000000002.h5"]  # nothing moved or lost
    comm.Barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("failure", ["EIO", "ENOENT", "MemoryError"])
def test_an_io_error_while_loading_is_not_corruption(comm, mpi_tmp_path, failure):
    from hpcnet.errors import exit_code_of

    directory = fresh_dir(comm, mpi_tmp_path / f"io-{failure}")
    tensors = {"model/w": torch.zeros(512, 300)}
    with CheckpointManager(comm, directory, keep=5, full_every=1, async_save=False) as manager:
        save_steps(manager, [1, 2], tensors)
    last = comm.Get_size() - 1

    def fault(phase, step):
        if phase == "read" and comm.Get_rank() == last:
            if failure == "MemoryError":
                raise MemoryError()
            raise OSError(getattr(errno, failure), os.strerror(getattr(errno, failure)))

    with CheckpointManager(comm, directory, async_save=False, fault=fault) as manager:
        with pytest.raises((OSError, MemoryError, RuntimeError)) as info:
            manager.resume("auto")  # not skipped for the older checkpoint: the disk, not the file, failed
    error = info.value
    if failure == "MemoryError":
        assert isinstance(error, MemoryError) or "MemoryError" in str(error)
        assert exit_code_of(error) == 1
    else:
        assert error.errno == getattr(errno, failure) and "ckpt-0000000002.h5" in str(error)
        assert exit_code_of(error) == (75 if failure == "EIO" else 2)
    assert checkpoint_names(directory) == ["ckpt-0000000001.h5", "ckpt-0000000002.h5"]
    comm.Barrier()
