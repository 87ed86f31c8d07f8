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


def test_shared_reads_take_every_piece_of_the_wanted_tensors_own_stretch_first():
    from hpcnet.ckpt.read import shared_reads
    from hpcnet.ckpt.schema import TensorSpec, assign_readers

    specs = [TensorSpec(f"model/w{i}", "float32", (256, 1024), 64) for i in range(3)]
    wanting = [{0, 1, 2}, {1}, {0, 1, 2}]  # w1 is rank 1's alone
    assignment = assign_readers(specs, wanting, 3)
    own, others = shared_reads(assignment, wanting, 1)
    assert own == [(i, p) for i, p in assignment.of_rank(1)]
    assert {i for i, _ in own + others} == {0, 1, 2}
    assert all(p.rank != 1 for _, p in others)
    assert [p.rank for _, p in others] == sorted((p.rank for _, p in others), key=lambda r: (r - 1) % 3)
    # every block of every wanted tensor exactly once
    for i in (0, 1, 2):
        blocks = sorted(b for j, p in own + others if j == i for b in range(p.block_lo, p.block_hi))
        assert blocks == list(range(specs[i].n_blocks))
    own0, others0 = shared_reads(assignment, wanting, 0)
    assert 1 not in {i for i, _ in own0 + others0}  # not wanted: not read


def _read_one(comm, path, **kwargs):
    from hpcnet.ckpt.read import read_chain

    return read_chain(comm, [path], **kwargs)


@pytest.mark.mpi
@pytest.mark.parametrize("page_cache", [True, False])
def test_both_ways_of_reading_give_every_rank_the_tensors_it_wants(comm, mpi_tmp_path, page_cache):
    from tests.helpers.dirs import fresh_dir

    directory = fresh_dir(comm, mpi_tmp_path / f"both-{page_cache}")
    tensors = {f"model/w{i}": torch.arange(300 * 1000, dtype=torch.float32).reshape(300, 1000) + i
               for i in range(3)}
    tensors["model/b"] = torch.ones(7)
    tensors["optim/mine"] = torch.full((4,), 5.0)
    with CheckpointManager(comm, directory, full_every=1, async_save=False) as manager:
        path = manager.save(1, tensors, {}, {})
    rank = comm.Get_rank()
    into = {"model/w1": torch.zeros(300, 1000)}
    result = _read_one(comm, path, page_cache=page_cache, into=into,
                       wanted=lambda name: name != "optim/mine" or rank == 0)
    assert sorted(result.tensors) == sorted(n for n in tensors if n != "optim/mine" or rank == 0)
    for name, tensor in result.tensors.items():
        assert torch.equal(tensor, tensors[name]), name
    assert torch.equal(into["model/w1"], tensors["model/w1"])  # read in place
    if page_cache:
        assert result.timings["exchange_large_s"] == 0.0  # nothing exchanged


@pytest.mark.mpi
@pytest.mark.parametrize("page_cache", [True, False])
@pytest.mark.parametrize("damage", ["last byte", "truncate"])
def test_damage_anywhere_is_found_on_every_rank_with_the_file_named(comm, mpi_tmp_path, page_cache, damage):
    """A flipped byte in the last rank's stretch, or a file cut short there, fails every rank alike."""
    from hpcnet.errors import CheckpointCorrupt
    from tests.helpers.dirs import fresh_dir

    directory = fresh_dir(comm, mpi_tmp_path / f"damage-{page_cache}-{damage.replace(' ', '-')}")
    tensors = {"model/w": torch.rand(512, 1024), "model/v": torch.rand(512, 1024)}
    with CheckpointManager(comm, directory, full_every=1, async_save=False) as manager:
        path = manager.save(1, tensors, {}, {})
    if comm.Get_rank() == 0:
        import h5py

        with h5py.File(path, "r") as f:
            d = f["tensors/model/v"]
            end = d.id.get_offset() + d.id.get_storage_size()
        if damage == "truncate":
            os.truncate(path, end - 4096)
        else:
            with open(path, "r+b") as handle:
                handle.seek(end - 1)
                byte = handle.read(1)
                handle.seek(end - 1)
                handle.write(bytes([byte[0] ^ 0xFF]))
    comm.Barrier()
    with pytest.raises(CheckpointCorrupt) as caught:
        _read_one(comm, path, page_cache=page_cache)
    assert str(path) in str(caught.value)
    if damage == "last byte":
        assert "/tensors/model/v" in str(caught.value) and "checksum mismatch" in str(caught.value)
    comm.Barrier()


@pytest.mark.mpi
def test_one_node_reads_through_the_page_cache_unless_the_pages_would_not_fit(comm, monkeypatch):
    from hpcnet.ckpt import read
    from hpcnet.world import discover

    one_node = discover(comm).num_nodes == 1  # the suite's 4-rank pass runs on 2 hosts of the local cluster
    assert read._reads_through_page_cache(comm, 1 << 20) == (comm.Get_size() > 1 and one_node)
    assert not read._reads_through_page_cache(comm, 0)
    monkeypatch.setattr(read, "_available_memory_bytes", lambda: 1 << 20)
    assert not read._reads_through_page_cache(comm, 1 << 20)
