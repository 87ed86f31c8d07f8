"""Tests of hpcnet.data.loader: choosing how data.dataset is read, the background loader, and collective opening."""

import os
import threading

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcnet.data.h5 import H5Split, open_split
from hpcnet.data.info import DatasetInfo
from hpcnet.data.loader import BatchLoader, open_dataset
from hpcnet.data.sampler import GlobalBatchSampler
from hpcnet.errors import ConfigError, DatasetError
from tests.helpers.data import write_dataset


def test_bad_specs(tmp_path):
    with pytest.raises(ConfigError, match="data.dataset"):
        open_dataset("no_such_module_xyz:fn", "train", directory=".", comm=MPI.COMM_SELF)
    with pytest.raises(DatasetError, match="data.dataset: file .*nothing.h5 does not exist"):
        open_dataset(str(tmp_path / "nothing.h5"), "train", directory=".", comm=MPI.COMM_SELF)
    with pytest.raises(ValueError, match="split"):
        open_dataset("synthetic-images", "test", directory=".", comm=MPI.COMM_SELF)
    path = write_dataset(tmp_path / "ok.h5")
    assert isinstance(open_dataset(str(path), "eval", directory=".", comm=MPI.COMM_SELF), H5Split)


# ---------------------------------------------------------------------------
# prefetching


def test_loader_yields_what_direct_reads_yield(tokens):
    split = open_split(tokens, "train")
    direct = GlobalBatchSampler(len(split), 16, rank=0, world_size=2, seed=3)
    for prefetch in (True, False):
        sampler = GlobalBatchSampler(len(split), 16, rank=0, world_size=2, seed=3)
        direct.load_state_dict({"epoch": 0, "samples_consumed_in_epoch": 0, "seed": 3})
        with BatchLoader(split, sampler, prefetch=prefetch) as loader:
            for step in range(30):  # 12 steps per epoch: crosses two epoch boundaries
                inputs, targets = next(loader)
                expected = split.read(direct.next_indices())
                assert torch.equal(inputs, expected[0]) and torch.equal(targets, expected[1])
                # What the caller consumed, not what the thread has already fetched.
                assert loader.state_dict() == direct.state_dict()
                assert loader.epoch == step // 12


def test_loader_resumes_from_its_state(tokens):
    split = open_split(tokens, "train")
    loader = BatchLoader(split, GlobalBatchSampler(len(split), 10, rank=0, world_size=1, seed=1))
    for _ in range(5):
        loader.next()
    state = loader.state_dict()
    following = [loader.next() for _ in range(3)]
    loader.load_state_dict(state)
    again = [loader.next() for _ in range(3)]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(following, again))
    loader.close()
    loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        loader.next()


class FailingSplit:
    info = DatasetInfo("tokens", (2,), 10)

    def __init__(self, fail_at):
        self.calls, self.fail_at, self.threads = 0, fail_at, set()

    def __len__(self):
        return 100

    def read(self, indices):
        self.threads.add(threading.get_ident())
        self.calls += 1
        if self.calls == self.fail_at:
            raise OSError("disk went away")
        return torch.zeros(len(indices), 2, dtype=torch.int64), torch.zeros(len(indices), 2, dtype=torch.int64)


def test_loader_reraises_a_read_error_in_the_caller():
    split = FailingSplit(fail_at=3)
    loader = BatchLoader(split, GlobalBatchSampler(100, 4, rank=0, world_size=1))
    loader.next()
    loader.next()
    with pytest.raises(OSError, match="disk went away"):
        loader.next()
    with pytest.raises(RuntimeError, match="failed earlier"):
        loader.next()
    loader.close()
    assert threading.get_ident() not in split.threads  # the reads ran in the background thread


# ---------------------------------------------------------------------------
# collective: any number of ranks


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_bad_file_fails_alike_on_every_rank(comm, mpi_tmp_path):
    path = mpi_tmp_path / "shared-bad.h5"
    if comm.Get_rank() == 0:
        write_dataset(path, attrs={"num_classes": 2})  # image targets go up to 2
    comm.Barrier()
    with pytest.raises(DatasetError) as error:
        open_dataset(str(path), "train", directory=mpi_tmp_path, comm=comm)
    message = str(error.value)
    assert "shared-bad.h5" in message and comm.allgather(message) == [message] * comm.Get_size()


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_ranks_read_slices_of_one_global_batch(comm, mpi_tmp_path):
    path = mpi_tmp_path / "shared-ok.h5"
    if comm.Get_rank() == 0:
        write_dataset(path, n=64)
    comm.Barrier()
    split = open_dataset(str(path), "train", directory=mpi_tmp_path, comm=comm)
    size, rank = comm.Get_size(), comm.Get_rank()
    sampler = GlobalBatchSampler(len(split), 2, rank=rank, world_size=size, seed=9)
    single = GlobalBatchSampler(len(split), 2 * size, rank=0, world_size=1, seed=9)
    with BatchLoader(split, sampler) as loader:
        for _ in range(5):
            _, targets = loader.next()
            gathered = np.concatenate(comm.allgather(targets.numpy()))
            assert np.array_equal(gathered, split.read(single.next_indices())[1].numpy())
    assert os.path.exists(path)
