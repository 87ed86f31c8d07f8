"""hpcnet.ckpt.schema: who writes and reads which pieces, specs, names, blocks, hashes, chains and retention (pure,
one process)."""

import random

import numpy as np
import pytest
from torch import nn

from hpcnet.ckpt.schema import (
    BLOCK_BYTES,
    CheckpointInfo,
    Piece,
    assign_readers,
    assign_writers,
    block_hashes,
    check_names_nest,
    check_tensor_name,
    checkpoints_to_prune,
    make_spec,
    resolve_chain,
    write_pieces,
)

pytestmark = pytest.mark.timeout(120)


def _random_specs(rng: random.Random, n: int):
    specs = []
    for i in range(n):
        shape = rng.choice([(), (rng.randint(0, 5),), (rng.randint(1, 3000), rng.randint(1, 700)),
                            (rng.randint(1, 50), 3, 3, 3), (rng.randint(1, 200000),)])
        specs.append(make_spec(f"t{i}", rng.choice(["float32", "bfloat16", "int64", "bool"]), shape))
    return specs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 64])
def test_the_writers_cover_every_block_once_and_balance(world_size):
    rng = random.Random(world_size)
    specs = _random_specs(rng, 60)
    assignment = assign_writers(specs, world_size, split_min_bytes=256 << 10)
    assert assignment == assign_writers(specs, world_size, split_min_bytes=256 << 10)  # deterministic
    loads = [0] * world_size
    for spec, pieces, split in zip(specs, assignment.pieces, assignment.split):
        covered = [b for p in pieces for b in range(p.block_lo, p.block_hi)]
        assert covered == list(range(spec.n_blocks))
        if split:  # a collective write: every rank must own at least one block
            assert [p.rank for p in pieces] == list(range(world_size)) and all(p.block_hi > p.block_lo for p in pieces)
        for p in pieces:
            lo, hi = spec.block_range_rows(p.block_lo, p.block_hi)
            loads[p.rank] += (hi - lo) * spec.row_bytes
    assert tuple(loads) == assignment.rank_bytes
    largest_whole = max([s.nbytes for s, split in zip(specs, assignment.split) if not split] or [0])
    assert max(loads) <= sum(loads) / world_size + largest_whole  # greedy bound


def test_the_writers_are_even_on_a_resnet():
    model = nn.Sequential(*[nn.Conv2d(c, c, 3) for c in (64, 128, 256, 512)], nn.Linear(4096, 1000))
    specs = [make_spec(k, "float32", tuple(v.shape)) for k, v in model.state_dict().items()]
    for n in (2, 4):
        loads = assign_writers(specs, n).rank_bytes
        assert max(loads) / (sum(loads) / n) < 1.05


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 64])
def test_the_readers_each_read_one_stretch_and_what_one_rank_wants_there(world_size):
    rng = random.Random(100 + world_size)
    specs = _random_specs(rng, 80)
    everyone = set(range(world_size))
    wanting = [rng.choice([everyone, everyone, everyone, set(), {rng.randrange(world_size)},
                           set(rng.sample(range(world_size), min(2, world_size)))]) for _ in specs]
    assignment = assign_readers(specs, wanting, world_size)
    assert assignment == assign_readers(specs, wanting, world_size)  # deterministic
    loads = [0] * world_size
    last_rank = 0
    for spec, ranks, pieces in zip(specs, wanting, assignment.pieces):
        if not ranks or spec.n_blocks == 0:
            assert pieces == ()  # nobody wants it: not read
            continue
        covered = [b for p in pieces for b in range(p.block_lo, p.block_hi)]
        assert covered == list(range(spec.n_blocks))
        if len(ranks) == 1:
            assert [p.rank for p in pieces] == list(ranks)  # read by the one rank that wants it
        else:
            ranks_in_order = [p.rank for p in pieces]
            assert ranks_in_order == sorted(set(ranks_in_order)) and ranks_in_order[0] >= last_rank
            last_rank = ranks_in_order[-1]  # the shared tensors are one stream, cut in rank order
        for p in pieces:
            lo, hi = spec.block_range_rows(p.block_lo, p.block_hi)
            loads[p.rank] += (hi - lo) * spec.row_bytes
    assert tuple(loads) == assignment.rank_bytes
    shared_blocks = [s.block_rows * s.row_bytes for s, r in zip(specs, wanting) if len(r) > 1 and s.n_blocks]
    own = [sum(s.nbytes for s, r in zip(specs, wanting) if r == {k}) for k in range(world_size)]
    even = sum(loads) / world_size
    # Each rank reads its even share, give or take a block at each end of its stretch, unless the tensors only
    # it wants already exceed that share.
    for k in range(world_size):
        assert loads[k] <= max(even, own[k]) + 2 * max(shared_blocks, default=0)


def test_the_readers_cut_a_model_into_contiguous_halves():
    specs = [make_spec(f"layer{i}", "float32", (1024, 4096)) for i in range(4)]
    assignment = assign_readers(specs, [{0, 1}] * 4, 2)
    assert [[(p.rank, p.block_lo, p.block_hi) for p in pieces] for pieces in assignment.pieces] == [
        [(0, 0, specs[0].n_blocks)], [(0, 0, specs[1].n_blocks)], [(1, 0, specs[2].n_blocks)],
        [(1, 0, specs[3].n_blocks)]]
    # Three ranks: the middle one reads the end of layer 1 and the start of layer 2.
    assignment = assign_readers(specs, [{0, 1, 2}] * 4, 3)
    assert [[p.rank for p in pieces] for pieces in assignment.pieces] == [[0], [0, 1], [1, 2], [2]]
    # What rank 1 alone wants (its optimizer state) counts towards its share.
    state = make_spec("optim/0/exp_avg", "float32", (1024, 4096))
    assignment = assign_readers([*specs, state], [{0, 1}] * 4 + [{1}], 2)
    assert assignment.pieces[4] == (Piece(1, 0, state.n_blocks),)
    assert abs(assignment.rank_bytes[0] - assignment.rank_bytes[1]) <= 2 * specs[0].block_rows * specs[0].row_bytes
    assert [p.rank for p in assignment.pieces[2]] == [0, 1]  # rank 0 reads 2.5 layers, rank 1 1.5 and its state
    with pytest.raises(ValueError, match="rank 5"):
        assign_readers(specs, [{5}] * 4, 2)


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
    assert [i.step for i in checkpoints_to_prune(infos, 2)] == [1, 2, 3]
    assert [i.step for i in checkpoints_to_prune(infos, 1)] == [1, 2, 3, 4, 5]
    assert checkpoints_to_prune(infos, 3) == []
    # a rollback mixed chains: 8 builds on 2, so 1 and 2 stay
    mixed = [*infos, _info(8, "incremental", 2, 1)]
    assert [i.step for i in checkpoints_to_prune(mixed, 1)] == [3, 4, 5]
    with pytest.raises(ValueError, match="missing"):
        resolve_chain([i for i in infos if i.step != 2], infos[2])
    replaced = [CheckpointInfo(step=1, path=infos[0].path, kind="full", uid="f" * 32), infos[1], infos[2]]
    with pytest.raises(ValueError, match="replaced"):
        resolve_chain(replaced, infos[2])


def _seq_info(step, seq, kind="full", parent=None):
    import dataclasses

    return dataclasses.replace(_info(step, kind, parent, parent), seq=seq, created_unix=1e9 + seq)


def test_retention_goes_by_commit_order_not_step():
    # Steps 40, 50, 60 of an earlier run, then 10, 20, 30 of a fresh one in the same directory:
    # keeping the three highest steps would delete the new run's own checkpoints.
    infos = [_seq_info(40, 1), _seq_info(50, 2), _seq_info(60, 3), _seq_info(10, 4), _seq_info(20, 5),
             _seq_info(30, 6)]
    assert [i.step for i in checkpoints_to_prune(infos, 3)] == [40, 50, 60]
    assert [i.step for i in sorted(infos, key=lambda i: i.commit_order)][-1] == 30
    # files of hpcnet before seq existed (seq 0) are older than any that has one, ordered by creation time
    old = CheckpointInfo(step=99, path="/c/ckpt-0000000099.h5", kind="full", uid="9" * 32, created_unix=5.0)
    assert sorted([infos[0], old], key=lambda i: i.commit_order)[0] is old
    unreadable = CheckpointInfo(step=1, path="/c/ckpt-0000000001.h5", kind="unreadable", error="bad")
    assert sorted([unreadable, *infos], key=lambda i: i.commit_order)[-1] is unreadable
    assert unreadable not in checkpoints_to_prune([unreadable, *infos], 1)  # never deleted
