"""hpcnet.fault.mirror (``fault.replicas=1``): who keeps whose state, when the survivors restore from the mirrors,
the buffers' layout, the exchange at any size (the jobs that lose a rank are in tests/test_live.py)."""

import contextlib
import logging
import types

import pytest
import torch

from hpcnet.agree import is_agreed
from hpcnet.config import Config
from hpcnet.config.load import load_config
from hpcnet.errors import ConfigError
from hpcnet.fault.mirror import (
    ALIGN,
    Mirror,
    buffer_sizes,
    keepers,
    layout,
    mirrored_step,
    nbytes,
    new_holders,
    snapshot,
    views,
)
from hpcnet.stateful import Entries
from hpcnet.world import discover


def _is_one_ring(keeper):
    """Whether following keepers from rank 0 visits every rank once and comes back."""
    seen, rank = [], 0
    while rank not in seen:
        seen.append(rank)
        rank = keeper[rank]
    return rank == 0 and sorted(seen) == list(range(len(keeper)))


@pytest.mark.parametrize("hostnames, expected", [
    (("a", "a", "b", "b"), [2, 3, 1, 0]),  # 0 -> 2 -> 1 -> 3 -> 0: every pair across the hosts
    (("a", "a", "a"), [1, 2, 0]),  # one host: r -> r + 1
    (("a", "b", "a", "b"), [1, 2, 3, 0]),  # ranks interleaved by the launcher: still across
    (("a", "a", "a", "b"), [3, 2, 0, 1]),  # unequal hosts: across where there is another host's rank to take it
    (("a", "b", "b", "c"), [1, 3, 0, 2]),
])
def test_a_rank_s_keeper_is_the_next_in_a_ring_that_interleaves_the_hosts(hostnames, expected):
    keeper = keepers(hostnames)
    assert keeper == expected and _is_one_ring(keeper)


@pytest.mark.parametrize("per_host", [(1, 1), (2, 2), (3, 3), (4, 4), (2, 5), (1, 4)])
def test_equal_hosts_keep_every_rank_on_another_host(per_host):
    hostnames = tuple(host for host, count in zip("ab", per_host) for _ in range(count))
    keeper = keepers(hostnames)
    assert _is_one_ring(keeper)
    across = sum(hostnames[r] != hostnames[k] for r, k in enumerate(keeper))
    assert across == (len(hostnames) if per_host[0] == per_host[1] else 2 * min(per_host))


def _offers(steps, mirrors, wards, digests=None):
    return [(s, m, w, 7 if digests is None else digests[i]) for i, (s, m, w) in enumerate(zip(steps, mirrors, wards))]


def test_survivors_restore_from_the_mirrors_where_each_lost_rank_s_keeper_holds_it_at_their_step():
    """4 ranks on 2 hosts (keepers 0->2->1->3->0), rank 3 lost: its keeper, rank 0, holds it at step 7."""
    survivors_wards = [3, 2, 0]  # old ranks 0, 1, 2 keep 3, 2, 0
    assert mirrored_step(_offers([7] * 3, [7] * 3, survivors_wards), (3,)) == 7
    # two lost on one host (1 and 3): their keepers 2 and 0 survive
    assert mirrored_step(_offers([7, 7], [7, 7], [3, 1]), (1, 3)) == 7


@pytest.mark.parametrize("case, offers, lost", [
    ("a rank lost with its keeper", _offers([7, 7], [7, 7], [3, 2]), (1, 3)),
    ("the keeper's mirror still being received (a loss inside the exchange)", _offers([7] * 3, [-1, 7, 7],
                                                                                      [3, 2, 0]), (3,)),
    ("the keeper's mirror a step behind", _offers([7] * 3, [6, 7, 7], [3, 2, 0]), (3,)),
    ("snapshots of different steps", _offers([7, 6, 7], [7] * 3, [3, 2, 0]), (3,)),
    ("no snapshot yet (a loss before the loop)", _offers([-1] * 3, [-1] * 3, [3, 2, 0]), (3,)),
    ("unheld tensors that differ at one step", _offers([7] * 3, [7] * 3, [3, 2, 0], digests=[7, 8, 7]), (3,)),
    ("a survivor without a mirror", [None, *_offers([7] * 2, [7] * 2, [2, 0])], (3,)),
])
def test_anything_else_goes_to_the_checkpoint(case, offers, lost):
    assert mirrored_step(offers, lost) is None, case


def test_a_lost_rank_s_tensors_are_held_by_its_keeper_s_new_rank_and_the_survivors_by_their_places():
    holders = {"optim/a": 0, "optim/b": 1, "optim/c": 2, "optim/d": 3}
    offers = _offers([7] * 3, [7] * 3, [3, 2, 0])  # old ranks 0, 1, 2; 3 lost, kept by 0
    assert new_holders(holders, offers, (3,), 4) == {"optim/a": 0, "optim/b": 1, "optim/c": 2, "optim/d": 0}
    offers = _offers([7] * 2, [7] * 2, [3, 1])  # old ranks 0 and 2; 1 (kept by 2) and 3 (kept by 0) lost
    assert new_holders(holders, offers, (1, 3), 4) == {"optim/a": 0, "optim/b": 1, "optim/c": 1, "optim/d": 0}


def _entries(rank, size, scale=1):
    """Every kind of tensor, each rank holding some (the others' as ``meta``), and some that every rank holds."""
    tensors = {"model/w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "schedule/n": torch.tensor(3)}
    holders = {}
    kinds = [torch.tensor(2.5, dtype=torch.float64), torch.linspace(-1, 1, 3 * scale).to(torch.bfloat16),
             torch.tensor([True, False, True]), torch.empty(0, 4), torch.arange(5, dtype=torch.int8)]
    for holder in range(size):
        for k, value in enumerate(kinds):
            name = f"optim/{holder}/{k}"
            value = value + holder if value.dtype != torch.bool else value
            tensors[name] = value if holder == rank else torch.empty(value.shape, dtype=value.dtype, device="meta")
            holders[name] = holder
    return Entries(tensors, holders, meta={"sampler": {"at": 4}}, rank_state={"rng": rank})


def test_a_buffer_lays_a_rank_s_tensors_out_aligned_and_views_them_bit_for_bit():
    mine, theirs = _entries(1, 3), _entries(0, 3)
    tensors = layout(theirs, 1)  # as another rank, from its meta tensors
    assert tensors == layout(mine, 1) and [name for name, *_ in tensors] == [f"optim/1/{k}" for k in range(5)]
    assert all(offset % ALIGN == 0 for _, offset, _, _ in tensors)
    assert buffer_sizes(theirs, 3) == [nbytes(layout(theirs, rank)) for rank in range(3)]
    buffer = torch.empty(nbytes(tensors), dtype=torch.uint8)
    copied = snapshot(mine, views(buffer, tensors))
    unpacked = views(buffer.clone(), tensors)  # what the keeper receives
    for name, value in unpacked.items():
        assert value.dtype == mine.tensors[name].dtype and torch.equal(value, mine.tensors[name]), name
        assert not value.numel() or copied.tensors[name].data_ptr() != mine.tensors[name].data_ptr()  # a copy
    assert copied.tensors["optim/0/1"].is_meta and copied.meta == mine.meta


def test_a_snapshot_is_a_copy_that_training_does_not_change():
    entries = _entries(0, 2)
    entries.meta["sampler"]["at"] = 4
    copied = snapshot(entries)
    entries.tensors["model/w"].add_(1)
    entries.meta["sampler"]["at"] = 5
    assert torch.equal(copied.tensors["model/w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert copied.meta == {"sampler": {"at": 4}}
    again = snapshot(entries, dict(copied.tensors))  # the buffers reused where they fit
    assert again.tensors["model/w"].data_ptr() == copied.tensors["model/w"].data_ptr()


class _State:
    def __init__(self, entries):
        self.value, self.last_saved_step = entries, 4

    def entries(self):
        return self.value


_MONITOR = types.SimpleNamespace(collective=lambda name, nbytes=0: contextlib.nullcontext())


@pytest.mark.mpi(min_size=2)
def test_each_rank_keeps_its_ward_s_tensors_and_restores_them_for_the_survivors(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    mirror = Mirror()
    mirror.attach(discover(comm))
    for step in (3, 4):  # the second capture reuses the buffers
        mirror.capture(_State(_entries(rank, size, scale=step)), step, comm, _MONITOR)
    assert (mirror.own_step, mirror.ward_step, mirror.last_saved_step) == (4, 4, 4)
    ward = mirror.ward
    [world] = mirror.worlds  # the largest of the captures (the second's: longer tensors)
    unheld = 6 * 4 + 8
    assert world["ward_bytes"][rank] == nbytes(layout(_entries(ward, size, scale=4), ward))
    assert world["snapshot_bytes"][rank] == unheld + nbytes(layout(_entries(rank, size, scale=4), rank))
    assert mirror.keeper[ward] == rank and ward != rank
    offers = comm.allgather(mirror.offer(0))
    lost = (comm.allgather(ward)[0],)  # rank 0's ward is lost
    if rank in lost:
        return
    survivors = [r for r in range(size) if r not in lost]
    restored = mirror.restored([offers[r] for r in survivors], lost, size)
    expected = _entries(lost[0], size, scale=4)
    for k in range(5):
        name = f"optim/{lost[0]}/{k}"
        assert restored.holders[name] == survivors.index(mirror.keeper[lost[0]])
        if mirror.ward in lost:
            assert torch.equal(restored.tensors[name], expected.tensors[name]), name
    assert restored.rank_state == {"rng": rank}  # its own generators


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("scale", [2, 40])
def test_a_mirror_laid_out_otherwise_than_the_entries_say_is_the_same_error_on_every_rank(comm, scale):
    """Rank 0 takes every rank's bfloat16 tensor for longer than the others do: its keeper receives more than it
    expects (40), or as many bytes in other shapes (2: the alignment pads both to one size)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    mirror = Mirror()
    mirror.attach(discover(comm))
    entries = _entries(rank, size, scale=scale if rank == 0 else 1)
    with pytest.raises(Exception, match="the ranks' state entries differ") as raised:
        mirror.capture(_State(entries), 5, comm, _MONITOR)
    assert is_agreed(raised.value) and mirror.ward_step == -1


def test_replicas_takes_0_or_1_and_needs_a_recovery_that_shrinks():
    assert load_config().fault.replicas == 0
    assert load_config(overrides=["fault.replicas=1"]).fault.replicas == 1
    with pytest.raises(ConfigError, match=r"^fault.replicas must be 0 or 1 .*got 2$"):
        load_config(overrides=["fault.replicas=2"])
    with pytest.raises(ConfigError, match="fault.replicas=1 needs fault.recovery=shrink or auto: with "
                                          "fault.recovery=restart"):
        load_config(overrides=["fault.replicas=1", "fault.recovery=restart"])


def _live(mode, zero, size=4):
    from hpcnet.fault.live import Live
    from hpcnet.fault.ulfm import FaultTolerance

    cfg = Config()
    cfg.fault.replicas, cfg.dist.zero = 1, zero
    live = Live(cfg, mode=mode, mpi=FaultTolerance(True, mode == "shrink", "Open MPI 5.0.11",
                                                   "" if mode == "shrink" else "the job was not started with it"))
    world = types.SimpleNamespace(rank=0, is_main=True, size=size, hostnames=("a", "a", "b", "b")[:size])
    live._attach_mirror(world)
    return live


@pytest.mark.parametrize("mode, zero, level, says", [
    ("restart", 2, logging.WARNING, "no mirror is kept: fault.recovery=auto restarts the job from the newest "
                                    "checkpoint here (no ULFM: the job was not started with it)"),
    ("shrink", 0, logging.INFO, "no mirror is kept: every rank holds the whole state"),
])
def test_where_nothing_is_mirrored_rank_0_says_why_once(caplog, mode, zero, level, says):
    with caplog.at_level(logging.INFO, logger="hpcnet.fault.live"):
        live = _live(mode, zero)
        live._attach_mirror(types.SimpleNamespace(rank=0, is_main=True, size=3, hostnames=("a", "a", "b")))
    assert live.mirror is None
    [record] = [r for r in caplog.records if "fault.replicas" in r.getMessage()]
    assert record.levelno == level and says in record.getMessage()


def test_a_shrinking_job_at_a_sharded_stage_keeps_a_mirror_on_the_keeper_ring_of_each_world():
    live = _live("shrink", 2)
    assert live.mirror is not None and live.mirror.keeper == [2, 3, 1, 0] and live.mirror.ward == 3
