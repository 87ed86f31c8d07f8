"""Tests of hpcnet.data.user: map-style and protocol datasets from an import path, and their errors."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcnet.data.info import DatasetInfo
from hpcnet.data.loader import open_dataset
from hpcnet.data.user import TorchDatasetSplit
from hpcnet.errors import DatasetError


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n=10, kind="image", **attrs):
        self.n, self.kind = n, kind
        self.__dict__.update(attrs)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.kind == "image":
            return torch.full((2, 3), float(i)), i % 4
        return torch.arange(5) + i, torch.arange(5) + i + 1


def pairs_factory(split, **options):
    return Pairs(**options)


def protocol_factory(split, *, rows=6):
    class Protocol:
        info = DatasetInfo("tokens", (3,), 10)

        def __len__(self):
            return rows

        def read(self, indices):
            x = torch.as_tensor(np.asarray(indices)).view(-1, 1).repeat(1, 3) % 10
            return x, (x + 1) % 10
    return Protocol()


def bad_protocol_factory(split):
    split = protocol_factory(split)
    split.info = DatasetInfo("tokens", (4,), 10)  # disagrees with what read returns
    return split


def failing_factory(split):
    raise RuntimeError("no such bucket")


def junk_factory(split):
    return 42


def test_map_style_dataset_is_adapted():
    split = open_dataset(f"{__name__}:pairs_factory", "train", directory=".", comm=MPI.COMM_SELF, options={"n": 10})
    assert isinstance(split, TorchDatasetSplit)
    assert split.info == DatasetInfo("image", (2, 3), 4) and len(split) == 10
    inputs, targets = split.read(np.array([3, 1]))
    assert inputs.dtype == torch.float32 and inputs[:, 0, 0].tolist() == [3.0, 1.0]
    assert targets.tolist() == [3, 1]
    tokens = open_dataset(f"{__name__}:pairs_factory", "eval", directory=".", comm=MPI.COMM_SELF,
                          options={"kind": "tokens", "vocab_size": 100})
    assert tokens.info == DatasetInfo("tokens", (5,), 100)
    scanned = TorchDatasetSplit(Pairs(kind="tokens"), "x")
    assert scanned.info.num_classes == 15  # largest token (9 + 5) + 1
    override = TorchDatasetSplit(Pairs(info=DatasetInfo("image", (2, 3), 50)), "x")
    assert override.info.num_classes == 50


def test_protocol_object_is_used_as_is():
    split = open_dataset(f"{__name__}:protocol_factory", "train", directory=".", comm=MPI.COMM_SELF, options={})
    assert split.info.kind == "tokens" and len(split) == 6


@pytest.mark.parametrize(("factory", "fragment"), [
    ("failing_factory", "RuntimeError: no such bucket"),
    ("junk_factory", "returned a int"),
    ("bad_protocol_factory", "read([0]) gave inputs"),
])
def test_user_dataset_errors_name_the_option(factory, fragment):
    with pytest.raises(DatasetError, match="data.dataset") as error:
        open_dataset(f"{__name__}:{factory}", "train", directory=".", comm=MPI.COMM_SELF, options={})
    assert fragment in str(error.value)



def rank_failing_factory(split):
    world = MPI.COMM_WORLD
    if world.Get_rank() == world.Get_size() - 1:
        raise RuntimeError("only the last rank fails")
    return Pairs()


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_failure_on_one_rank_is_raised_on_all(comm):
    with pytest.raises(DatasetError) as error:
        open_dataset(f"{__name__}:rank_failing_factory", "train", directory=".", comm=comm)
    message = str(error.value)
    assert "data.dataset" in message and "only the last rank fails" in message
    assert comm.allgather(message) == [message] * comm.Get_size()
    assert ("only)" in message) == (comm.Get_size() > 1)
