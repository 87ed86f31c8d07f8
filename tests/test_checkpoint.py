"""Checkpoints: pure layout logic on one process; save, load, chains and errors under MPI at any size."""

import errno
import io
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import threading

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

from hpcnet.ckpt.manager import (CheckpointManager, flatten_state, load_checkpoint, restore_state, rng_state,
                                 set_rng_state)
from hpcnet.ckpt.format import (BLOCK_BYTES, CheckpointInfo, block_hashes, check_names_nest, check_tensor_name,
                                make_spec, plan_ownership, plan_retention, resolve_chain, write_pieces)
from hpcnet.errors import UsageError

from tests.helpers import clean_env

pytestmark = pytest.mark.timeout(120)


# --- pure logic --------------------------------------------------------------

def _random_specs(rng: random.Random, n: int):
    specs = []
    for i in range(n):
        shape = rng.choice([(), (rng.randint(0, 5),), (rng.randint(1, 3000), rng.randint(1, 700)),
                            (rng.randint(1, 50), 3, 3, 3), (rng.randint(1, 200000),)])
        specs.append(make_spec(f"t{i}", rng.choice(["float32", "bfloat16", "int64", "bool"]), shape))
    return specs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 64])
def test_plan_ownership_covers_every_block_once_and_balances(world_size):
    rng = random.Random(world_size)
    specs = _random_specs(rng, 60)
    plan = plan_ownership(specs, world_size, split_min_bytes=256 << 10)
    assert plan == plan_ownership(specs, world_size, split_min_bytes=256 << 10)  # deterministic
    loads = [0] * world_size
    for spec, pieces, split in zip(specs, plan.pieces, plan.split):
        covered = [b for p in pieces for b in range(p.block_lo, p.block_hi)]
        assert covered == list(range(spec.n_blocks))
        if split:  # a collective write: every rank must own at least one block
            assert [p.rank for p in pieces] == list(range(world_size)) and all(p.block_hi > p.block_lo for p in pieces)
        for p in pieces:
            lo, hi = spec.block_range_rows(p.block_lo, p.block_hi)
            loads[p.rank] += (hi - lo) * spec.row_bytes
    assert tuple(loads) == plan.rank_bytes
    largest_whole = max([s.nbytes for s, split in zip(specs, plan.split) if not split] or [0])
    assert max(loads) <= sum(loads) / world_size + largest_whole  # greedy bound


def test_plan_ownership_is_even_on_a_resnet():
    model = nn.Sequential(*[nn.Conv2d(c, c, 3) for c in (64, 128, 256, 512)], nn.Linear(4096, 1000))
    specs = [make_spec(k, "float32", tuple(v.shape)) for k, v in model.state_dict().items()]
    for n in (2, 4):
        loads = plan_ownership(specs, n).rank_bytes
        assert max(loads) / (sum(loads) / n) < 1.05


def test_make_spec_blocks():
    assert make_spec("e", "float32", (100, 256)).block_rows == 1  # a 1 KiB row is its own block
    assert make_spec("e", "float32", (100, 64)).block_rows == 4
    assert make_spec("b", "float32", (1000,)).block_rows == BLOCK_BYTES // 4
    scalar = make_spec("s", "int64", ())
    assert (scalar.rows, scalar.n_blocks, scalar.nbytes) == (1, 1, 8)
    assert make_spec("z", "float32", (0, 5)).n_blocks == 0 and make_spec("z", "float32", (5, 0)).n_blocks == 0
    with pytest.raises(ValueError, match="complex64"):
        make_spec("c", "complex64", (3,))


def test_tensor_names_are_validated():
    check_tensor_name("model/layer1.0.conv1.weight")
    for bad in ["", "a//b", "../x", "a/./b", "a b", "x" * 2000, "a\x00"]:
        with pytest.raises(ValueError):
            check_tensor_name(bad)
    with pytest.raises(ValueError, match="also a group"):
        check_names_nest(["a/b", "a/b/c"])


def test_write_pieces():
    assert write_pieces([10, 10], 100) == 1
    assert write_pieces([1000, 998], 100) == 10
    assert write_pieces([1000, 3], 100) == 3  # never an empty selection


def test_block_hashes_localise_a_change():
    data = np.arange(4096, dtype=np.float32)
    before = block_hashes(data, 1024)
    data[600] += 1
    after = block_hashes(data, 1024)
    assert len(before) == 16 and list(np.flatnonzero(before != after)) == [2]


def _info(step, kind, parent=None, base=None):
    uid = f"{step:032x}"
    return CheckpointInfo(step=step, path=f"/c/ckpt-{step:010d}.h5", kind=kind, uid=uid,
                          parent=None if parent is None else f"ckpt-{parent:010d}.h5",
                          parent_uid="" if parent is None else f"{parent:032x}",
                          base=None if base is None else f"ckpt-{base:010d}.h5",
                          base_uid="" if base is None else f"{base:032x}")


def test_chains_and_retention():
    infos = [_info(1, "full"), _info(2, "incremental", 1, 1), _info(3, "incremental", 2, 1),
             _info(4, "full"), _info(5, "incremental", 4, 4), _info(6, "full"), _info(7, "incremental", 6, 6)]
    assert [i.step for i in resolve_chain(infos, infos[2])] == [1, 2, 3]
    assert [i.step for i in plan_retention(infos, 2)] == [1, 2, 3]
    assert [i.step for i in plan_retention(infos, 1)] == [1, 2, 3, 4, 5]
    assert plan_retention(infos, 3) == []
    # a rollback mixed chains: 8 builds on 2, so 1 and 2 stay
    mixed = [*infos, _info(8, "incremental", 2, 1)]
    assert [i.step for i in plan_retention(mixed, 1)] == [3, 4, 5]
    with pytest.raises(ValueError, match="missing"):
        resolve_chain([i for i in infos if i.step != 2], infos[2])
    replaced = [CheckpointInfo(step=1, path=infos[0].path, kind="full", uid="f" * 32), infos[1], infos[2]]
    with pytest.raises(ValueError, match="replaced"):
        resolve_chain(replaced, infos[2])


def test_rng_state_round_trips_through_json():
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    state = json.loads(json.dumps(rng_state()))
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    set_rng_state(state)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], got[0]) and np.array_equal(expected[1], got[1]) and expected[2] == got[2]
    state["torch"] = state["torch"][:-2]
    with pytest.raises(ValueError, match="torch"):
        set_rng_state(state)


def _model_and_optimizers(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(300, 16), nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))
    model.register_buffer("bf16", torch.randn(7, 5).to(torch.bfloat16))
    model.register_buffer("mask", torch.rand(9) > 0.5)
    model.register_buffer("nothing", torch.zeros(0, 3))  # zero-size: a dataset nobody writes
    sgd = torch.optim.SGD(list(model[0].parameters()) + list(model[1].parameters()), lr=0.1, momentum=0.9)
    adamw = torch.optim.AdamW(list(model[2].parameters()) + list(model[3].parameters()), lr=1e-3)
    return model, sgd, adamw


def _train(model, optimizers, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 300, (24,), generator=gen)
        for opt in optimizers:
            opt.zero_grad()
        model(x).square().mean().backward()
        for opt in optimizers:
            opt.step()


def _state(model, sgd, adamw):
    tensors, meta = flatten_state(model, sgd)
    more, meta2 = flatten_state(model, adamw)
    tensors.update({k.replace("optim/", "adamw/", 1): v for k, v in more.items() if k.startswith("optim/")})
    return tensors, {"sgd": meta, "adamw": meta2}


def _restore(model, sgd, adamw, tensors, meta):
    restore_state(model, sgd, tensors, meta["sgd"])
    adam = {k.replace("adamw/", "optim/", 1): v for k, v in tensors.items() if k.startswith("adamw/")}
    restore_state(model, adamw, {**{k: v for k, v in tensors.items() if k.startswith("model/")}, **adam},
                  meta["adamw"])


def _assert_same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8) if a[k].numel() else a[k],
                           b[k].view(-1).view(torch.uint8) if b[k].numel() else b[k]), k


def test_flatten_restore_round_trip_in_memory():
    model, sgd, adamw = _model_and_optimizers()
    _train(model, [sgd, adamw], 3)
    tensors, meta = _state(model, sgd, adamw)
    assert "optim/0/momentum_buffer" in tensors and "adamw/0/step" in tensors
    copy = {k: v.clone() for k, v in tensors.items()}
    model2, sgd2, adamw2 = _model_and_optimizers(seed=5)
    _restore(model2, sgd2, adamw2, copy, json.loads(json.dumps(meta)))
    _train(model, [sgd, adamw], 2)
    _train(model2, [sgd2, adamw2], 2)
    _assert_same(_state(model, sgd, adamw)[0], _state(model2, sgd2, adamw2)[0])
    with pytest.raises(UsageError, match="does not match the model"):
        restore_state(nn.Linear(2, 2), None, copy, meta["sgd"])


# --- under MPI -----------------------------------------------------------------

def _fresh_dir(comm, path):
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    comm.Barrier()
    return path


@pytest.mark.mpi
def test_round_trip_bit_exact_and_reshard(comm, mpi_tmp_path):
    directory = _fresh_dir(comm, mpi_tmp_path / "roundtrip")
    model, sgd, adamw = _model_and_optimizers()
    _train(model, [sgd, adamw], 3)
    tensors, meta = _state(model, sgd, adamw)
    expected = {k: v.clone() for k, v in tensors.items()}  # ``tensors`` are views of the live state
    torch.manual_seed(100 + comm.Get_rank())
    rank_state = rng_state()
    with CheckpointManager(comm, directory, async_save=False) as manager:
        path = manager.save(7, tensors, {"state": meta, "sampler": {"epoch": 1, "offset": 96}}, rank_state)
        loaded = manager.load("auto")
    assert loaded.path == path and loaded.step == 7 and loaded.saved_world_size == comm.Get_size()
    _assert_same(tensors, loaded.tensors)
    assert loaded.rank_state == json.loads(json.dumps(rank_state))
    assert loaded.meta["sampler"] == {"epoch": 1, "offset": 96}
    assert loaded.meta["checkpoint"]["world_size"] == comm.Get_size()
    assert set(loaded.meta["checkpoint"]["versions"]) >= {"hpcnet", "torch", "h5py", "hdf5"}
    # exact resume: restore into a fresh model and train on, side by side
    model2, sgd2, adamw2 = _model_and_optimizers(seed=9)
    _restore(model2, sgd2, adamw2, loaded.tensors, loaded.meta["state"])
    set_rng_state(loaded.rank_state)
    assert torch.equal(torch.rand(4), (torch.manual_seed(100 + comm.Get_rank()), torch.rand(4))[1])
    _train(model, [sgd, adamw], 2)
    _train(model2, [sgd2, adamw2], 2)
    _assert_same(_state(model, sgd, adamw)[0], _state(model2, sgd2, adamw2)[0])
    # reshard: N ranks wrote it, each rank alone reads it whole
    alone = load_checkpoint(MPI.COMM_SELF, str(path))
    _assert_same(expected, alone.tensors)
    assert alone.rank_state == comm.bcast(loaded.rank_state, root=0)  # COMM_SELF's rank 0 gets row 0


@pytest.mark.mpi
def test_one_rank_saves_every_rank_loads(comm, mpi_tmp_path):
    directory = _fresh_dir(comm, mpi_tmp_path / "one-to-n")
    model, sgd, adamw = _model_and_optimizers()
    tensors, meta = _state(model, sgd, adamw)
    if comm.Get_rank() == 0:
        with CheckpointManager(MPI.COMM_SELF, directory, async_save=False) as manager:
            manager.save(1, tensors, {"state": meta}, {"rank": 0})
    comm.Barrier()
    loaded = load_checkpoint(comm, "auto", directory)
    _assert_same(tensors, loaded.tensors)
    assert loaded.rank_state == ({"rank": 0} if comm.Get_rank() == 0 else None)  # beyond the saved world size


def _embedding_step(model, rows):
    """Update only ``rows`` of the embedding (plain SGD leaves the others bit-identical)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.zero_grad()
    model(rows).sum().backward()
    opt.step()


@pytest.mark.mpi
def test_incremental_chain_equals_live_state_and_is_small(comm, mpi_tmp_path):
    directory = _fresh_dir(comm, mpi_tmp_path / "incremental")
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
            _assert_same(tensors, loaded.tensors)
        kinds = [(i.step, i.kind, i.base) for i in manager.committed()]
    assert kinds == [(1, "full", None), (2, "incremental", "ckpt-0000000001.h5"),
                     (3, "incremental", "ckpt-0000000001.h5"), (4, "full", None),
                     (5, "incremental", "ckpt-0000000004.h5")]
    full, increment = os.path.getsize(paths[0]), os.path.getsize(paths[1])
    assert increment <= 0.06 * full, (increment, full)


@pytest.mark.mpi
def test_retention_never_breaks_a_chain(comm, mpi_tmp_path):
    directory = _fresh_dir(comm, mpi_tmp_path / "retention")
    tensors = {"w": torch.zeros(64, 256)}
    with CheckpointManager(comm, directory, keep=1, full_every=3, async_save=False) as manager:
        for step in range(1, 8):
            tensors["w"][step] = step
            manager.save(step, tensors, {}, {})
            infos = manager.committed()
            fulls = [i for i in infos if i.kind == "full"]
            assert len(fulls) == 1 and infos[0] == fulls[0]  # the one kept full and its increments
            for info in infos:
                assert torch.equal(manager.load(info.path).tensors["w"][info.step], torch.full((256,), float(info.step)))
    assert [i.step for i in infos] == [7]


def _flip_bytes_in(path, dataset):
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as handle:
        handle.seek(offset + 10)
        byte = handle.read(1)
        handle.seek(offset + 10)
        handle.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.mpi
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_and_uncommitted_checkpoints_are_skipped(comm, mpi_tmp_path, caplog, damage):
    directory = _fresh_dir(comm, mpi_tmp_path / f"corrupt-{damage}")
    tensors = {"model/w": torch.arange(512 * 300, dtype=torch.float32).reshape(512, 300), "model/b": torch.ones(3)}
    with CheckpointManager(comm, directory, full_every=1, async_save=False) as manager:
        good = manager.save(1, tensors, {}, {})
        tensors["model/w"][0] = -1
        bad = manager.save(2, tensors, {}, {})
        if comm.Get_rank() == 0:
            if damage == "flip":
                _flip_bytes_in(bad, "tensors/model/w")
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


@pytest.mark.mpi
def test_bad_paths_give_the_same_error_on_every_rank(comm, mpi_tmp_path):
    directory = _fresh_dir(comm, mpi_tmp_path / "errors")
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
    directory = _fresh_dir(comm, mpi_tmp_path / "async")
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
    _assert_same(live, a.tensors)
    _assert_same(live, b.tensors)
    assert a.rank_state == b.rank_state == {"r": comm.Get_rank()}


# --- tools, single process ---------------------------------------------------------

@pytest.fixture
def single_process():
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("runs single-process tools; covered by the serial pass")


def _ckpt(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hpcnet.ckpt", *map(str, args)], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=60)


def test_ckpt_tool_and_h5ls(single_process, tmp_path, capsys):
    model, sgd, _ = _model_and_optimizers()
    _train(model, [sgd], 1)
    directory = tmp_path / "ckpts"
    with CheckpointManager(MPI.COMM_SELF, directory, full_every=2, async_save=False) as manager:
        for step in (10, 20):
            tensors, meta = flatten_state(model, sgd)
            manager.save(step, tensors, {"state": meta}, rng_state())
            _train(model, [sgd], 1)
    out = _ckpt("list", directory, cwd=tmp_path)
    assert out.returncode == 0 and "incremental" in out.stdout and "ckpt-0000000010.h5" in out.stdout
    out = _ckpt("inspect", directory, cwd=tmp_path)
    assert out.returncode == 0 and "model/0.weight" in out.stdout and "bfloat16" in out.stdout
    assert "ckpt-0000000010.h5 -> ckpt-0000000020.h5" in out.stdout
    assert _ckpt("verify", directory, cwd=tmp_path).returncode == 0
    out = _ckpt("export", directory, "-o", tmp_path / "model.pt", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    newest = load_checkpoint(MPI.COMM_SELF, str(directory)).tensors
    _assert_same({f"model/{k}": v for k, v in state.items()}, {k: v for k, v in newest.items() if k.startswith("model/")})
    if shutil.which("h5ls"):
        listing = subprocess.run(["h5ls", "-r", directory / "ckpt-0000000010.h5"], capture_output=True, text=True)
        assert listing.returncode == 0 and "/tensors/model/0.weight" in listing.stdout
        assert "Dataset {300, 16}" in listing.stdout
    with h5py.File(directory / "ckpt-0000000010.h5", "r") as f:  # plain serial h5py
        assert f["tensors/model/0.weight"].shape == (300, 16) and f["tensors/model/bf16"].attrs["dtype"] == "bfloat16"
    # the error paths in-process (a subprocess costs seconds of imports)
    from hpcnet.ckpt.tool import main as ckpt_main

    _flip_bytes_in(directory / "ckpt-0000000010.h5", "tensors/model/0.weight")
    out = io.StringIO()
    assert ckpt_main(["verify", str(directory)], out=out) == 1
    assert "FAILED ckpt-0000000010.h5" in out.getvalue() and "/tensors/model/0.weight" in out.getvalue()
    assert ckpt_main(["inspect", str(tmp_path / "nowhere")], out=out) == 2
    assert "nowhere" in capsys.readouterr().err


# --- which checkpoints a run continues from, keeps and sets aside (issue 9) ------------

def _seq_info(step, seq, kind="full", parent=None):
    import dataclasses

    return dataclasses.replace(_info(step, kind, parent, parent), seq=seq, created_unix=1e9 + seq)


def test_retention_goes_by_commit_order_not_step():
    # Steps 40, 50, 60 of an earlier run, then 10, 20, 30 of a fresh one in the same directory:
    # keeping the three highest steps would delete the new run's own checkpoints.
    infos = [_seq_info(40, 1), _seq_info(50, 2), _seq_info(60, 3), _seq_info(10, 4), _seq_info(20, 5),
             _seq_info(30, 6)]
    assert [i.step for i in plan_retention(infos, 3)] == [40, 50, 60]
    assert [i.step for i in sorted(infos, key=lambda i: i.commit_order)][-1] == 30
    # files of hpcnet before seq existed (seq 0) are older than any that has one, ordered by creation time
    old = CheckpointInfo(step=99, path="/c/ckpt-0000000099.h5", kind="full", uid="9" * 32, created_unix=5.0)
    assert sorted([infos[0], old], key=lambda i: i.commit_order)[0] is old
    unreadable = CheckpointInfo(step=1, path="/c/ckpt-0000000001.h5", kind="unreadable", error="bad")
    assert sorted([unreadable, *infos], key=lambda i: i.commit_order)[-1] is unreadable
    assert unreadable not in plan_retention([unreadable, *infos], 1)  # never deleted


def _save_steps(manager, steps, tensors):
    for step in steps:
        tensors["model/w"][0] = step
        manager.save(step, tensors, {}, {"step": step})


def _names(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("ckpt-"))


@pytest.mark.mpi
def test_a_fresh_run_into_a_used_directory_is_refused_or_moves_the_old_run_aside(comm, mpi_tmp_path):
    directory = _fresh_dir(comm, mpi_tmp_path / "used")
    tensors = {"model/w": torch.zeros(64, 256)}
    with CheckpointManager(comm, directory, keep=3, full_every=1, async_save=False) as manager:
        manager.start_fresh()
        _save_steps(manager, [10, 20, 30, 40, 50, 60], tensors)
    with CheckpointManager(comm, directory, keep=3, full_every=1, async_save=False) as manager:
        with pytest.raises(UsageError) as info:
            manager.start_fresh()
    message = str(info.value)
    for words in (str(directory), "step 60", "--resume auto", "run.name", "checkpoint.dir", "checkpoint.move_aside"):
        assert words in message
    assert _names(directory) == ["ckpt-0000000040.h5", "ckpt-0000000050.h5", "ckpt-0000000060.h5"]
    with CheckpointManager(comm, directory, keep=3, full_every=1, async_save=False, move_aside=True) as manager:
        manager.start_fresh()
        _save_steps(manager, [10, 20, 30], tensors)
        assert manager.load("auto").step == 30
    assert _names(directory) == ["ckpt-0000000010.h5", "ckpt-0000000020.h5", "ckpt-0000000030.h5"]
    assert (directory / "latest").read_text().strip() == "ckpt-0000000030.h5"
    aside = [p for p in directory.iterdir() if p.name.startswith("aside-")]
    assert len(aside) == 1 and aside[0].name.endswith("-fresh-run")
    assert sorted(p.name for p in aside[0].glob("ckpt-*")) == ["ckpt-0000000040.h5", "ckpt-0000000050.h5",
                                                                 "ckpt-0000000060.h5"]
    assert load_checkpoint(comm, str(aside[0] / "ckpt-0000000060.h5")).tensors["model/w"][0, 0] == 60
    comm.Barrier()


@pytest.mark.mpi
def test_a_rollback_is_not_undone_by_a_later_resume_auto(comm, mpi_tmp_path):
    directory = _fresh_dir(comm, mpi_tmp_path / "rollback")
    tensors = {"model/w": torch.zeros(64, 256)}
    with CheckpointManager(comm, directory, keep=10, full_every=2, async_save=False) as manager:
        _save_steps(manager, [10, 20, 30, 40, 50, 60], tensors)
    with CheckpointManager(comm, directory, keep=10, full_every=2, async_save=False) as manager:
        loaded = manager.resume(str(directory / "ckpt-0000000030.h5"))  # an increment: its chain stays
        assert loaded.step == 30 and loaded.tensors["model/w"][0, 0] == 30
        assert _names(directory) == ["ckpt-0000000010.h5", "ckpt-0000000020.h5", "ckpt-0000000030.h5"]
        assert (directory / "latest").read_text().strip() == "ckpt-0000000030.h5"
        tensors["model/w"][1] = -1  # the continued run differs from the abandoned one
        _save_steps(manager, [40], tensors)
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
    directory = _fresh_dir(comm, mpi_tmp_path / "passed-over")
    tensors = {"model/w": torch.zeros(512, 300)}
    with CheckpointManager(comm, directory, keep=2, full_every=1, async_save=False) as manager:
        _save_steps(manager, [10, 20], tensors)
    if comm.Get_rank() == 0:
        _flip_bytes_in(directory / "ckpt-0000000020.h5", "tensors/model/w")
    comm.Barrier()
    with CheckpointManager(comm, directory, keep=1, full_every=1, async_save=False) as manager:
        assert manager.resume("auto").step == 10
        _save_steps(manager, [15], tensors)  # keep=1: by step, the damaged 20 would stay and 15 go
        assert [(i.step, i.kind) for i in manager.committed()] == [(15, "full")]
        assert manager.resume("auto").step == 15
    comm.Barrier()


@pytest.mark.mpi
def test_when_no_checkpoint_loads_resume_stops_and_lists_each_one(comm, mpi_tmp_path):
    directory = _fresh_dir(comm, mpi_tmp_path / "all-bad")
    tensors = {"model/w": torch.zeros(512, 300)}
    with CheckpointManager(comm, directory, keep=5, full_every=1, async_save=False) as manager:
        _save_steps(manager, [1, 2], tensors)
    if comm.Get_rank() == 0:
        _flip_bytes_in(directory / "ckpt-0000000002.h5", "tensors/model/w")
        os.truncate(directory / "ckpt-0000000001.h5", 4000)
    comm.Barrier()
    with CheckpointManager(comm, directory, async_save=False) as manager:
        with pytest.raises(UsageError) as info:
            manager.resume("auto")
    message = str(info.value)
    assert "none of the 2 committed checkpoint(s)" in message and str(directory) in message
    assert "ckpt-0000000002.h5 (step 2): dataset /tensors/model/w: checksum mismatch" in message
    assert "ckpt-0000000001.h5" in message and "truncated" in message
    assert _names(directory) == ["ckpt-0000000001.h5", "ckpt-0000000002.h5"]  # nothing moved or lost
    comm.Barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("failure", ["EIO", "ENOENT", "MemoryError"])
def test_an_io_error_while_loading_is_not_corruption(comm, mpi_tmp_path, failure):
    from hpcnet.errors import exit_code_of

    directory = _fresh_dir(comm, mpi_tmp_path / f"io-{failure}")
    tensors = {"model/w": torch.zeros(512, 300)}
    with CheckpointManager(comm, directory, keep=5, full_every=1, async_save=False) as manager:
        _save_steps(manager, [1, 2], tensors)
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
    assert _names(directory) == ["ckpt-0000000001.h5", "ckpt-0000000002.h5"]
    comm.Barrier()


@pytest.mark.mpi
def test_a_checkpoint_replaced_between_listing_and_reading_is_an_error(comm, mpi_tmp_path):
    from hpcnet.errors import RestartableError

    directory = _fresh_dir(comm, mpi_tmp_path / "replaced")
    tensors = {"model/w": torch.zeros(64, 256)}
    with CheckpointManager(comm, directory, keep=5, full_every=1, async_save=False) as manager:
        _save_steps(manager, [1, 2], tensors)
    other = directory / "other"
    if comm.Get_rank() == 0:
        other.mkdir()
        with CheckpointManager(MPI.COMM_SELF, other, full_every=1, async_save=False) as alone:
            _save_steps(alone, [2], {"model/w": torch.ones(64, 256)})
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


@pytest.mark.mpi
def test_every_rank_must_see_the_same_checkpoints(comm, mpi_tmp_path, monkeypatch):
    if comm.Get_size() == 1:
        pytest.skip("needs ranks that can disagree")
    import hpcnet.ckpt.tool.manager as checkpoint

    directory = _fresh_dir(comm, mpi_tmp_path / "node-local")
    with CheckpointManager(comm, directory, async_save=False) as manager:
        _save_steps(manager, [1], {"model/w": torch.zeros(64, 256)})
        if comm.Get_rank() == 1:  # as a node-local directory on another node would look
            monkeypatch.setattr(checkpoint, "listing", lambda folder: [])
        for attempt in (manager.start_fresh, lambda: manager.resume("auto")):
            with pytest.raises(UsageError, match=r"rank 1 on .* sees 0 committed checkpoint\(s\), rank 0 sees 1"):
                attempt()
    comm.Barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT", "EIO"])
def test_an_error_inside_the_write_keeps_its_errno_on_every_rank(comm, mpi_tmp_path, code):
    from hpcnet.errors import exit_code_of

    directory = _fresh_dir(comm, mpi_tmp_path / f"write-{code}")
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
            assert info.value.errno == getattr(errno, code)
            assert exit_code_of(info.value) == (75 if code == "EIO" else 2)
            assert "ckpt-0000000002.h5.tmp" in str(info.value)
            assert sorted(p.name for p in (directory / str(async_save)).iterdir()) == ["ckpt-0000000001.h5", "latest"]
            assert manager.load("auto").step == 1
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


# --- untrusted files (issue 9) -------------------------------------------------------------

def _checkpoint_file(directory):
    with CheckpointManager(MPI.COMM_SELF, directory, full_every=1, async_save=False) as manager:
        return manager.save(1, {"model/w": torch.ones(8, 256), "model/b": torch.ones(4)}, {}, {})


def _rewrite_index(path, edit):
    """Change a checkpoint's /index and fix up its checksum, as someone crafting a file would."""
    from hpcnet.ckpt.format import sha256_hex

    with h5py.File(path, "r+") as f:
        index = json.loads(f["index"][()].tobytes())
        edit(f, index)
        raw = json.dumps(index, separators=(",", ":")).encode()
        del f["index"]
        f["index"] = np.frombuffer(raw, np.uint8)
        f.attrs["index_sha256"] = sha256_hex(raw)


def _run_limited(args, cwd, limit_bytes=3 << 30):
    """A tool run whose address space is capped: allocating what a crafted file declares would fail."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, "-m", "hpcnet.ckpt", *map(str, args)], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=120, preexec_fn=cap)


def test_a_file_declaring_a_64_gib_tensor_is_rejected_without_allocating_it(single_process, tmp_path):
    path = _checkpoint_file(tmp_path / "crafted")

    def huge(f, index):
        rows = 64 << 20  # 64 Mi rows of 1 KiB: 64 GiB
        entry = next(e for e in index if e["name"] == "model/w")
        entry["shape"] = [rows, 256]
        shift = rows - 8
        for later in index[index.index(entry) + 1:]:
            later["hash_offset"] += shift
        entry["n_hashes"] = rows
        del f["tensors/model/w"], f["hashes"]
        f.create_dataset("tensors/model/w", shape=(rows, 256), dtype="<f4")  # declared, never stored
        f.create_dataset("hashes", shape=(rows + 1,), dtype="<u8")

    _rewrite_index(path, huge)
    assert os.path.getsize(path) < 1 << 20
    out = _run_limited(["verify", path], tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAILED" in out.stdout and "declares 68719476752 bytes of tensors" in out.stdout
    assert "MemoryError" not in out.stdout + out.stderr
    out = _run_limited(["export", path, "-o", tmp_path / "x.pt"], tmp_path)
    assert out.returncode == 1 and "declares" in out.stderr and not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("trick", ["external-link", "soft-link", "external-storage", "unstored"])
def test_files_that_read_elsewhere_or_declare_more_than_they_hold_are_rejected(single_process, tmp_path, trick):
    from hpcnet.ckpt.tool import main as ckpt_main

    path = _checkpoint_file(tmp_path / "crafted")
    donor = tmp_path / "donor.h5"
    with h5py.File(donor, "w") as f:
        f["w"] = np.ones((8, 256), np.float32)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.ones((8, 256), np.float32).tobytes())
    with h5py.File(path, "r+") as f:
        offset = f["tensors/model/w"].id.get_offset()
        del f["tensors/model/w"]
        if trick == "external-link":
            f["tensors/model/w"] = h5py.ExternalLink(str(donor), "w")
        elif trick == "soft-link":
            f["elsewhere"] = np.ones((8, 256), np.float32)
            f["tensors/model/w"] = h5py.SoftLink("/elsewhere")
        elif trick == "external-storage":
            f.create_dataset("tensors/model/w", shape=(8, 256), dtype="<f4", external=[(str(raw), 0, 8192)])
        else:
            f.create_dataset("tensors/model/w", shape=(8, 256), dtype="<f4")
    out = io.StringIO()
    assert ckpt_main(["verify", str(path)], out=out) == 1
    expected = {"external-link": "/tensors/model/w is an external link", "soft-link": "/tensors/model/w is a soft link",
                "external-storage": "external", "unstored": "declares 8192 bytes but the file stores 0"}[trick]
    assert expected in out.getvalue(), out.getvalue()
