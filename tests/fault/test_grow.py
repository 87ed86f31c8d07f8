"""hpcnet.fault.grow's hand-over: the state goes from the survivors that hold each entry to every rank of the grown
job that reads it, bit for bit, whatever its dtype (the jobs that grow are in tests/test_live.py)."""

import pytest
import torch

from hpcnet.fault.grow import hand_over
from hpcnet.stateful import Entries


def _entries(rank: int, from_size: int) -> Entries:
    """A survivor's entries: a replicated tensor of each kind, and one shard per survivor held by it alone."""
    tensors = {"model/w": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7,
               "model/half": torch.linspace(-1, 1, 5).to(torch.bfloat16),
               "loader/step": torch.tensor(9), "model/mask": torch.tensor([True, False, True]),
               "model/empty": torch.empty(0, 3)}
    holders = {}
    for holder in range(from_size):
        name = f"optim/shard{holder}"
        shard = torch.full((2, 2), float(holder) + 0.5, dtype=torch.float64)
        tensors[name] = shard if holder == rank else torch.empty(shard.shape, dtype=shard.dtype, device="meta")
        holders[name] = holder
    return Entries(tensors, holders, meta={"step": 9}, rank_state={"rng": f"rank {rank}"})


@pytest.mark.mpi(min_size=2)
def test_each_rank_gets_what_it_reads_from_the_survivor_that_holds_it(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    from_size = size - 1  # the last rank is the replacement
    entries = _entries(rank, from_size) if rank < from_size else None
    mine = f"optim/shard{rank % from_size}"
    metas = []

    def before_read(meta):
        metas.append(meta)
        return lambda name: not name.startswith("optim/") or name == mine

    saved, last_saved = hand_over(comm, entries, 9, 8, from_size, before_read)
    assert metas == [{"step": 9}] and (saved.step, last_saved, saved.saved_world_size) == (9, 8, from_size)
    assert saved.rank_state == ({"rng": f"rank {rank}"} if rank < from_size else None)
    expected = _entries(rank % from_size, from_size)
    assert sorted(saved.tensors) == sorted(name for name in expected.tensors
                                           if not name.startswith("optim/") or name == mine)
    for name, tensor in saved.tensors.items():
        assert tensor.dtype == expected.tensors[name].dtype and torch.equal(tensor, expected.tensors[name]), name
