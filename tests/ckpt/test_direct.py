"""hpcnet.ckpt.direct: data moved at the datasets' offsets and hashed in threads, equal to the serial path."""

import hashlib

import numpy as np
import pytest
import torch
import xxhash

from hpcnet.ckpt import direct
from hpcnet.ckpt.schema import block_hashes
from tests.helpers.dirs import fresh_dir

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("nbytes,block_bytes,chunk_bytes", [(0, 16, 64), (1, 16, 64), (100, 16, 64), (128, 16, 64),
                                                            (1000, 300, 100), (10, 1, 3)])
def test_chunks_are_whole_blocks_and_cover_the_bytes(nbytes, block_bytes, chunk_bytes):
    bounds = direct.chunk_bounds(nbytes, block_bytes, chunk_bytes)
    assert [lo for lo, _ in bounds] == [0, *[hi for _, hi in bounds[:-1]]][:len(bounds)]
    assert (bounds[-1][1] if bounds else 0) == nbytes and all(lo < hi for lo, hi in bounds)
    assert all(lo % block_bytes == 0 for lo, _ in bounds)


@pytest.mark.parametrize("nbytes,block_bytes", [(0, 1024), (1000, 1024), (5 << 20, 1024), ((9 << 20) + 7, 16384),
                                                ((17 << 20) + 3, 1 << 20)])
@pytest.mark.parametrize("hash_name", ["xxh3-64", "sha256-64"])
def test_threaded_hashes_equal_the_serial_ones(nbytes, block_bytes, hash_name):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    with direct.pool() as pool:
        threaded = direct.collect(direct.submit_hash(pool, data, block_bytes, hash_name))
    serial = block_hashes(data, block_bytes, hash_name)
    assert np.array_equal(threaded, serial)
    if nbytes:  # the documented definitions: XXH3-64, and sha256's first 8 bytes read little-endian
        first = data[:block_bytes].tobytes()
        assert int(serial[0]) == (xxhash.xxh3_64_intdigest(first) if hash_name == "xxh3-64" else
                                  int.from_bytes(hashlib.sha256(first).digest()[:8], "little"))


def test_parallel_write_and_read_move_equal_bytes_and_hash_them(tmp_path):
    import os

    data = np.random.default_rng(1).standard_normal((3000, 1000)).astype("<f4")  # 12 MB: several chunks
    block_bytes = 4000 * 3
    path = tmp_path / "raw"
    path.write_bytes(b"x" * 4096)
    fd = os.open(path, os.O_RDWR)
    try:
        with direct.pool() as pool:
            written = direct.collect(direct.submit_write(pool, fd, data, 4096, block_bytes))
            back = np.empty_like(data)
            read = direct.collect(direct.submit_read(pool, fd, back, 4096, block_bytes))
            with pytest.raises(ValueError, match="truncated"):  # beyond the end: an error, never a short read
                direct.collect(direct.submit_read(pool, fd, np.empty(100, np.uint8), path.stat().st_size - 10, 64))
    finally:
        os.close(fd)
    assert path.read_bytes()[:4096] == b"x" * 4096
    assert np.array_equal(back, data)
    assert np.array_equal(written, block_hashes(data, block_bytes)) and np.array_equal(read, written)


def _state():
    gen = torch.Generator().manual_seed(3)
    return {"model/big": torch.randn(3000, 700, generator=gen),  # 8.4 MB: split, several chunks per rank
            "model/mid": torch.randn(400, 1000, generator=gen).to(torch.bfloat16),
            "model/mask": torch.rand(300, 5, generator=gen) > 0.5, "model/b": torch.randn(7, generator=gen),
            "model/scalar": torch.tensor(2.5), "model/empty": torch.zeros(0, 4)}


@pytest.mark.mpi
def test_direct_writes_store_what_h5py_writes_store_aligned(comm, mpi_tmp_path):
    import h5py

    from hpcnet.ckpt.manager import CheckpointManager

    directory = fresh_dir(comm, mpi_tmp_path / "direct")
    state = _state()
    paths = {}
    for direct_writes in (True, False):
        with CheckpointManager(comm, directory / str(direct_writes), full_every=1, async_save=False,
                               direct_writes=direct_writes) as manager:
            paths[direct_writes] = manager.save(1, state, {}, {"rank": comm.Get_rank()})
    with h5py.File(paths[True], "r") as a, h5py.File(paths[False], "r") as b:
        assert np.array_equal(a["hashes"][()], b["hashes"][()])  # the threaded hashes are the serial ones
        for name in state:
            assert np.array_equal(a[f"tensors/{name}"][()], b[f"tensors/{name}"][()]), name
        assert a["tensors/model/big"].id.get_offset() % direct.ALIGN_BYTES == 0
    comm.Barrier()


@pytest.mark.mpi
def test_parallel_load_reads_equal_bytes_into_new_or_given_tensors(comm, mpi_tmp_path):
    from hpcnet.ckpt.manager import CheckpointManager

    directory = fresh_dir(comm, mpi_tmp_path / "parallel-load")
    state = _state()
    with CheckpointManager(comm, directory, full_every=1, async_save=False) as manager:
        manager.save(1, state, {}, {})
        fresh = manager.load()
        into = {k: torch.empty_like(v) for k, v in state.items()}
        into["model/b"] = torch.empty(8)  # does not fit: a new tensor instead
        in_place = manager.load(into=into)
    for name, tensor in state.items():
        assert torch.equal(fresh.tensors[name], tensor) and torch.equal(in_place.tensors[name], tensor), name
        assert fresh.tensors[name].dtype == tensor.dtype
    assert in_place.tensors["model/big"].data_ptr() == into["model/big"].data_ptr()
    assert torch.equal(into["model/big"], state["model/big"])
    assert in_place.tensors["model/b"].data_ptr() != into["model/b"].data_ptr()


@pytest.mark.mpi
@pytest.mark.parametrize("full_every,hash_name", [(1, "xxh3-64"), (2, "xxh3-64"), (2, "sha256-64")])
def test_a_corrupted_block_far_inside_a_parallel_read_is_detected(comm, mpi_tmp_path, monkeypatch, full_every,
                                                                  hash_name):
    """Also for files checksummed with sha256-64, as hpcnet wrote them before xxh3-64: they read and verify."""
    import h5py

    from hpcnet.ckpt import schema, write
    from hpcnet.ckpt.load import load_checkpoint
    from hpcnet.ckpt.manager import CheckpointManager
    from hpcnet.ckpt.schema import BLOCK_BYTES, LARGE_BLOCK_BYTES, make_spec
    from hpcnet.errors import CheckpointCorrupt

    directory = fresh_dir(comm, mpi_tmp_path / f"corrupt-direct-{full_every}-{hash_name}")
    state = _state()
    with monkeypatch.context() as patch:
        patch.setattr(schema, "HASH_NAME", hash_name)
        patch.setattr(write, "HASH_NAME", hash_name)
        with CheckpointManager(comm, directory, full_every=full_every, async_save=False) as manager:
            path = manager.save(1, state, {}, {"rank": comm.Get_rank()})
    with h5py.File(path, "r") as f:
        assert f.attrs["hash"] == hash_name
    intact = load_checkpoint(comm, str(path))
    assert all(torch.equal(intact.tensors[name], tensor) for name, tensor in state.items())
    assert intact.rank_state == {"rank": comm.Get_rank()}
    comm.Barrier()
    # Large blocks only where no increment follows (full_every=1); either kind reads back.
    block_bytes = LARGE_BLOCK_BYTES if full_every == 1 else BLOCK_BYTES
    block_rows = make_spec("b", "float32", (3000, 700), block_bytes).block_rows
    row = 2345  # inside the last rank's share at up to 4 ranks, and past the first chunk
    if comm.Get_rank() == 0:
        with h5py.File(path, "r") as f:
            assert f'"block_rows":{block_rows}' in f["index"][()].tobytes().decode()
            offset = f["tensors/model/big"].id.get_offset() + row * 700 * 4 + 5
        with open(path, "r+b") as handle:
            handle.seek(offset)
            byte = handle.read(1)
            handle.seek(offset)
            handle.write(bytes([byte[0] ^ 0x01]))
    comm.Barrier()
    lo = row // block_rows * block_rows
    with pytest.raises(CheckpointCorrupt, match=f"/tensors/model/big: checksum mismatch in 1 block.*rows {lo}-"
                                                f"{min(lo + block_rows, 3000) - 1}"):
        load_checkpoint(comm, str(path))
    comm.Barrier()
