"""hpcnet.ckpt.manager: save and load round trips, increments, retention, async saves, fresh starts and resumes."""

import json
import os
import threading
from typing import ClassVar

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

from hpcnet.ckpt.load import load_checkpoint
from hpcnet.ckpt.manager import CheckpointManager
from hpcnet.ckpt.state import rng_state, set_rng_state
from hpcnet.errors import UsageError
from tests.helpers.ckpt import (
    assert_same_tensors,
    checkpoint_names,
    flip_bytes_in,
    model_and_optimizers,
    restore_split_state,
    save_steps,
    saved_run,
    split_state,
    train_steps,
)
from tests.helpers.dirs import fresh_dir

pytestmark = pytest.mark.timeout(120)


@pytest.mark.mpi
def test_round_trip_bit_exact_and_reshard(comm, mpi_tmp_path):
    directory = fresh_dir(comm, mpi_tmp_path / "roundtrip")
    model, sgd, adamw = model_and_optimizers()
    train_steps(model, [sgd, adamw], 3)
    tensors, meta = split_state(model, sgd, adamw)
    expected = {k: v.clone() for k, v in tensors.items()}  # ``tensors`` are views of the live state
    torch.manual_seed(100 + comm.Get_rank())
    rank_state = rng_state()
    with CheckpointManager(comm, directory, async_save=False) as manager:
        path = manager.save(7, tensors, {"state": meta, "sampler": {"epoch": 1, "offset": 96}}, rank_state)
        loaded = manager.load("auto")
    assert loaded.path == path and loaded.step == 7 and loaded.saved_world_size == comm.Get_size()
    assert_same_tensors(tensors, loaded.tensors)
    assert loaded.rank_state == json.loads(json.dumps(rank_state))
    assert loaded.meta["sampler"] == {"epoch": 1, "offset": 96}
    assert loaded.meta["checkpoint"]["world_size"] == comm.Get_size()
    assert set(loaded.meta["checkpoint"]["versions"]) >= {"hpcnet", "torch", "h5py", "hdf5"}
    # exact resume: restore into a fresh model and train on, side by side
    model2, sgd2, adamw2 = model_and_optimizers(seed=9)
    restore_split_state(model2, sgd2, adamw2, loaded.tensors, loaded.meta["state"])
    set_rng_state(loaded.rank_state)
    assert torch.equal(torch.rand(4), (torch.manual_seed(100 + comm.Get_rank()), torch.rand(4))[1])
    train_steps(model, [sgd, adamw], 2)
    train_steps(model2, [sgd2, adamw2], 2)
    assert_same_tensors(split_state(model, sgd, adamw)[0], split_state(model2, sgd2, adamw2)[0])
    # reshard: N ranks wrote it, each rank alone reads it whole
    alone = load_checkpoint(MPI.COMM_SELF, str(path))
    assert_same_tensors(expected, alone.tensors)
    assert alone.rank_state == comm.bcast(loaded.rank_state, root=0)  # COMM_SELF's rank 0 gets row 0


@pytest.mark.mpi
def test_one_rank_saves_every_rank_loads(comm, mpi_tmp_path):
    directory = fresh_dir(comm, mpi_tmp_path / "one-to-n")
    model, sgd, adamw = model_and_optimizers()
    tensors, meta = split_state(model, sgd, adamw)
    if comm.Get_rank() == 0:
        with CheckpointManager(MPI.COMM_SELF, directory, async_save=False) as manager:
            manager.save(1, tensors, {"state": meta}, {"rank": 0})
    comm.Barrier()
    loaded = load_checkpoint(comm, "auto", directory)
    assert_same_tensors(tensors, loaded.tensors)
    assert loaded.rank_state == ({"rank": 0} if comm.Get_rank() == 0 else None)  # beyond the saved world size


def _embedding_step(model, rows):
    """Update only ``rows`` of the embedding (plain SGD leaves the others bit-identical)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.zero_grad()
    model(rows).sum().backward()
    opt.step()


@pytest.mark.mpi
def test_incremental_chain_equals_live_state_and_is_small(comm, mpi_tmp_path):
    directory = fresh_dir(comm, mpi_tmp_path / "incremental")
    torch.manual_seed(0)
    model = nn.Embedding(4096, 256)  # 4 MiB, rows of 1 KiB
    gen = torch.Generator().manual_seed(1)
    with CheckpointManager(comm, directory, keep=2, full_every=3, async_save=True) as manager:
        paths = []
        for step in range(1, 6):
            if step > 1:
                _embedding_step(model, torch.randperm(4096, generator=gen)[:205])  # 5% of rows
            tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
            paths.append(manager.save(step, tensors, {}, {}))
            loaded = manager.load("auto")
            assert loaded.step == step
            assert_same_tensors(tensors, loaded.tensors)
        kinds = [(i.step, i.kind, i.base) for i in manager.committed()]
    assert kinds == [(1, "full", None), (2, "incremental", "ckpt-0000000001.h5"),
                     (3, "incremental", "ckpt-0000000001.h5"), (4, "full", None),
                     (5, "incremental", "ckpt-0000000004.h5")]
    full, increment = os.path.getsize(paths[0]), os.path.getsize(paths[1])
    assert increment <= 0.06 * full, (increment, full)


@pytest.mark.mpi
def test_retention_never_breaks_a_chain(comm, mpi_tmp_path):
    directory = fresh_dir(comm, mpi_tmp_path / "retention")
    tensors = {"w": torch.zeros(64, 256)}
    with CheckpointManager(comm, directory, keep=1, full_every=3, async_save=False) as manager:
        for step in range(1, 8):
            tensors["w"][step] = step
            manager.save(step, tensors, {}, {})
            infos = manager.committed()
            fulls = [i for i in infos if i.kind == "full"]
            assert len(fulls) == 1 and infos[0] == fulls[0]  # the one kept full and its increments
            for info in infos:
                loaded = manager.load(info.path).tensors["w"][info.step]
                assert torch.equal(loaded, torch.full((256,), float(info.step)))
    assert [i.step for i in infos] == [7]


@pytest.mark.mpi
def test_bad_paths_give_the_same_error_on_every_rank(comm, mpi_tmp_path):
    directory = fresh_dir(comm, mpi_tmp_path / "errors")
    if comm.Get_rank() == 0:
        directory.mkdir()
        (directory / "a-file").write_text("not a directory")
        (directory / "empty").mkdir()
        (directory / "ckpt-0000000001.h5").write_text("not HDF5")
    comm.Barrier()
    with pytest.raises(UsageError, match="cannot write to checkpoint directory .*a-file/ckpt"):
        CheckpointManager(comm, directory / "a-file" / "ckpt")
    with CheckpointManager(comm, directory / "empty") as manager:
        assert manager.load("auto") is None
        with pytest.raises(UsageError, match="does not exist"):
            manager.load(str(directory / "missing.h5"))
        with pytest.raises(UsageError, match="no loadable checkpoint in .*empty"):
            manager.load(str(directory / "empty"))
        with pytest.raises(UsageError, match="ckpt-0000000001.h5.*cannot be read"):
            manager.load(str(directory / "ckpt-0000000001.h5"))
        with pytest.raises(ValueError, match="not supported"):
            manager.save(1, {"c": torch.zeros(2, dtype=torch.complex64)}, {}, {})
        if comm.Get_size() > 1:
            with pytest.raises(ValueError, match="different step, tensor list or meta"):
                manager.save(1, {"w": torch.zeros(2)}, {"rank": comm.Get_rank()}, {})
        manager.save(1, {"w": torch.zeros(2)}, {}, {})  # still usable after the errors
        manager.wait()


def _read_hdf5_in_a_loop(path, stop, counter):
    while not stop.is_set():
        with h5py.File(path, "r") as f:
            counter.append(float(f["x"][:].sum()))


@pytest.mark.mpi
def test_async_save_equals_sync_while_other_threads_use_hdf5_and_mpi(comm, mpi_tmp_path, tmp_path):
    directory = fresh_dir(comm, mpi_tmp_path / "async")
    torch.manual_seed(0)
    tensors = {"model/big": torch.randn(1536, 512), "model/small": torch.randn(10),
               "model/bf16": torch.randn(33, 40).to(torch.bfloat16), "optim/0/step": torch.tensor(5.0)}
    data_file = tmp_path / "loader.h5"
    with h5py.File(data_file, "w") as f:
        f["x"] = np.ones(1 << 16)
    stop, reads = threading.Event(), []
    reader = threading.Thread(target=_read_hdf5_in_a_loop, args=(data_file, stop, reads))
    reader.start()
    try:
        with CheckpointManager(comm, directory / "sync", async_save=False) as sync, \
                CheckpointManager(comm, directory / "async", async_save=True) as background:
            assert background.async_save == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
            sync.save(3, tensors, {"k": 1}, {"r": comm.Get_rank()})
            background.save(3, tensors, {"k": 1}, {"r": comm.Get_rank()})
            live = {k: v.clone() for k, v in tensors.items()}
            for v in tensors.values():  # the snapshot is taken: changing the state now must not matter
                v.zero_()
            for _ in range(20):  # the training loop's own collectives meanwhile
                assert comm.allreduce(1) == comm.Get_size()
            background.wait()
            a, b = sync.load("auto"), background.load("auto")
    finally:
        stop.set()
        reader.join()
    assert reads and all(r == float(1 << 16) for r in reads)
    assert_same_tensors(live, a.tensors)
    assert_same_tensors(live, b.tensors)
    assert a.rank_state == b.rank_state == {"r": comm.Get_rank()}


_COLLECTIVES = ("Allgather", "allgather", "Allreduce", "allreduce", "Bcast", "bcast", "Gatherv", "gather",
                "Barrier", "Ibarrier", "alltoall", "Dup", "Free", "Split_type")


class _ThreadRecordingComm(MPI.Intracomm):
    """The communicator a manager gets: notes every MPI call made by a thread other than the main one.
    ``Dup`` keeps the class, so the manager's own communicator (and h5py's) records too."""

    calls: ClassVar[list] = []


def _recording(name):
    def call(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            _ThreadRecordingComm.calls.append((threading.current_thread().name, name))
        return getattr(MPI.Intracomm, name)(self, *args, **kwargs)
    return call


for _name in _COLLECTIVES:
    setattr(_ThreadRecordingComm, _name, _recording(_name))


@pytest.mark.mpi
def test_a_background_save_leaves_mpi_and_hdf5_to_the_training_thread(comm, mpi_tmp_path):
    """Issue 27 item 12: a rank with two threads inside blocking collectives (the writer's, the training
    loop's) stopped progressing in Open MPI 4.1.  The writer thread now makes no MPI call and opens no parallel
    HDF5 file:
    its collective stretches run in the training thread, at a boundary that every rank's writer has reached."""
    directory = fresh_dir(comm, mpi_tmp_path / "one-thread")
    recording = _ThreadRecordingComm(comm)
    _ThreadRecordingComm.calls = []
    h5py_calls = []

    def profile(frame, event, arg):  # a parallel HDF5 file opened (rank 0's pruning reads attributes serially)
        if event == "call" and threading.current_thread() is not threading.main_thread() \
                and frame.f_code.co_filename.endswith(f"h5py{os.sep}_hl{os.sep}files.py") \
                and frame.f_code.co_name == "__init__" and frame.f_locals.get("driver") == "mpio":
            h5py_calls.append((threading.current_thread().name, frame.f_code.co_name))

    torch.manual_seed(0)
    tensors = {"model/big": torch.randn(1536, 512), "model/small": torch.randn(10), "optim/0/step": torch.tensor(5.0)}
    saved = {}
    threading.setprofile(profile)  # the threads started from here on: the writer's and its I/O pool's
    try:
        with CheckpointManager(recording, directory, full_every=2, async_save=True) as manager:
            for step in range(1, 5):  # full, incremental, full, incremental
                tensors["model/big"][step] += 1
                manager.save(step, tensors, {"k": step}, {"r": comm.Get_rank()})
                saved[step] = {k: v.clone() for k, v in tensors.items()}
                for _ in range(50):  # the training loop's own collectives, and its step boundaries
                    recording.Bcast(np.zeros(4096, np.uint8), root=0)
                    busy = recording.allreduce(int(manager.busy()), op=MPI.MAX)
                    if manager.in_flight and not busy:
                        manager.advance()
            manager.wait()
            loaded = {step: manager.load(str(directory / f"ckpt-{step:010d}.h5")) for step in (3, 4)}
    finally:
        threading.setprofile(None)
    assert _ThreadRecordingComm.calls == [] and h5py_calls == []
    for step in (3, 4):
        assert_same_tensors(saved[step], loaded[step].tensors)
        assert loaded[step].rank_state == {"r": comm.Get_rank()}


@pytest.mark.mpi
def test_a_fresh_run_into_a_used_directory_is_refused_or_moves_the_old_run_aside(comm, mpi_tmp_path):
    directory = fresh_dir(comm, mpi_tmp_path / "used")
    tensors = {"model/w": torch.zeros(64, 256)}
    with CheckpointManager(comm, directory, keep=3, full_every=1, async_save=False) as manager:
        manager.start_fresh()
        save_steps(manager, [10, 20, 30, 40, 50, 60], tensors)
    with CheckpointManager(comm, directory, keep=3, full_every=1, async_save=False) as manager:
        with pytest.raises(UsageError) as info:
            manager.start_fresh()
    message = str(info.value)
    for words in (str(directory), "step 60", "--resume auto", "run.name", "checkpoint.dir", "checkpoint.move_aside"):
        assert words in message
    assert checkpoint_names(directory) == ["ckpt-0000000040.h5", "ckpt-0000000050.h5", "ckpt-0000000060.h5"]
    with CheckpointManager(comm, directory, keep=3, full_every=1, async_save=False, move_aside=True) as manager:
        manager.start_fresh()
        save_steps(manager, [10, 20, 30], tensors)
        assert manager.load("auto").step == 30
    assert checkpoint_names(directory) == ["ckpt-0000000010.h5", "ckpt-0000000020.h5", "ckpt-0000000030.h5"]
    assert (directory / "latest").read_text().strip() == "ckpt-0000000030.h5"
    aside = [p for p in directory.iterdir() if p.name.startswith("aside-")]
    assert len(aside) == 1 and aside[0].name.endswith("-fresh-run")
    assert sorted(p.name for p in aside[0].glob("ckpt-*")) == ["ckpt-0000000040.h5", "ckpt-0000000050.h5",
                                                                 "ckpt-0000000060.h5"]
    assert load_checkpoint(comm, str(aside[0] / "ckpt-0000000060.h5")).tensors["model/w"][0, 0] == 60
    comm.Barrier()


@pytest.mark.mpi
def test_a_rollback_is_not_undone_by_a_later_resume_auto(comm, mpi_tmp_path):
    directory, tensors = saved_run(comm, mpi_tmp_path / "rollback", [10, 20, 30, 40, 50, 60],
                                   shape=(64, 256), keep=10, full_every=2)
    with CheckpointManager(comm, directory, keep=10, full_every=2, async_save=False) as manager:
        loaded = manager.resume(str(directory / "ckpt-0000000030.h5"))  # an increment: its chain stays
        assert loaded.step == 30 and loaded.tensors["model/w"][0, 0] == 30
        assert checkpoint_names(directory) == ["ckpt-0000000010.h5", "ckpt-0000000020.h5", "ckpt-0000000030.h5"]
        assert (directory / "latest").read_text().strip() == "ckpt-0000000030.h5"
        tensors["model/w"][1] = -1  # the continued run differs from the abandoned one
        save_steps(manager, [40], tensors)
    with CheckpointManager(comm, directory, keep=10, full_every=2, async_save=False) as manager:
        again = manager.resume("auto")
    assert again.step == 40 and again.tensors["model/w"][1, 0] == -1  # not the abandoned 60, nor its 40
    aside = [p for p in directory.iterdir() if p.name.startswith("aside-")]
    assert len(aside) == 1 and aside[0].name.endswith("rollback-to-step-30")
    assert sorted(p.name for p in aside[0].glob("ckpt-*")) == ["ckpt-0000000040.h5", "ckpt-0000000050.h5",
                                                                 "ckpt-0000000060.h5"]
    comm.Barrier()


@pytest.mark.mpi
def test_damaged_checkpoints_passed_over_are_set_aside_and_never_outlive_good_ones(comm, mpi_tmp_path):
    directory, tensors = saved_run(comm, mpi_tmp_path / "passed-over", [10, 20], shape=(512, 300), keep=2, full_every=1)
    if comm.Get_rank() == 0:
        flip_bytes_in(directory / "ckpt-0000000020.h5", "tensors/model/w")
    comm.Barrier()
    with CheckpointManager(comm, directory, keep=1, full_every=1, async_save=False) as manager:
        assert manager.resume("auto").step == 10
        save_steps(manager, [15], tensors)  # keep=1: by step, the damaged 20 would stay and 15 go
        assert [(i.step, i.kind) for i in manager.committed()] == [(15, "full")]
        assert manager.resume("auto").step == 15
    comm.Barrier()


@pytest.mark.mpi
def test_each_rank_loads_only_the_tensors_it_wants(comm, mpi_tmp_path):
    """A sharded optimizer's state reaches its owner only: large tensors (split across the readers) are gathered
    to the one rank that wants them, small ones copied; what every rank wants is all-gathered as before."""
    from hpcnet.ckpt.schema import SPLIT_MIN_BYTES

    rank, size = comm.Get_rank(), comm.Get_size()
    directory = fresh_dir(comm, mpi_tmp_path / "wanted")
    gen = torch.Generator().manual_seed(5)
    rows = SPLIT_MIN_BYTES // (4 * 64) + 3  # a little over the split size: read in pieces by every rank
    tensors = {"model/w": torch.randn(rows, 64, generator=gen), "model/b": torch.randn(7, generator=gen)}
    for index in range(5):
        tensors[f"optim/{index}/exp_avg"] = torch.randn(rows, 64, generator=gen)
        tensors[f"optim/{index}/step"] = torch.tensor(float(index))
    owner = {index: (index * 3) % size for index in range(5)}
    with CheckpointManager(comm, directory, async_save=False) as manager:
        manager.save(1, tensors, {}, {})
        owned = {str(i) for i, r in owner.items() if r == rank}
        loaded = manager.load("auto", wanted=lambda name: not name.startswith("optim/") or name.split("/")[1] in owned)
    want = {name for name in tensors if not name.startswith("optim/") or name.split("/")[1] in owned}
    assert set(loaded.tensors) == want
    assert_same_tensors({name: tensors[name] for name in want}, loaded.tensors)
    comm.Barrier()


@pytest.mark.mpi
def test_a_choice_of_tensors_that_fails_on_one_rank_fails_on_every_rank(comm, mpi_tmp_path):
    directory = fresh_dir(comm, mpi_tmp_path / "wanted-fails")
    last = comm.Get_size() - 1

    def wanted(name):
        if comm.Get_rank() == last:
            raise KeyError(f"no owner for {name}")
        return True

    with CheckpointManager(comm, directory, async_save=False) as manager:
        manager.save(1, {"model/w": torch.ones(3)}, {}, {})
        with pytest.raises(Exception, match="no owner for model/w"):
            manager.load("auto", wanted=wanted)
    comm.Barrier()
