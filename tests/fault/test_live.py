"""hpcnet.fault.live's decisions, one process with a stand-in communicator (the jobs are in tests/test_live.py):
where the survivors' state comes from, what a loss record says, which errors are a loss."""

import types

import numpy as np
import pytest
import torch

from hpcnet.agree import is_agreed
from hpcnet.config import Config
from hpcnet.data.sampler import GlobalBatchSampler
from hpcnet.errors import RestartableError, exit_code_of
from hpcnet.fault import live as live_module
from hpcnet.fault.live import Carried, Live, _digest
from hpcnet.fault.mirror import Mirror, layout, nbytes, views
from hpcnet.fault.survive import Shrunk
from hpcnet.stateful import Entries


class Survivors:
    """The survivors' communicator as one rank sees it: every rank's contribution to an allgather is given."""

    def __init__(self, rank, reached, held=None, originals=None):
        self.rank, self.reached, self.held, self.bcast_root = rank, reached, held, None
        self.originals = len(reached) if originals is None else originals
        """How many of the survivors are first ranks of the job (not replacements)."""

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return len(self.reached)

    def allgather(self, mine):
        assert mine == self.reached[self.rank]
        return list(self.reached)

    def allreduce(self, mine):
        assert mine in (0, 1)
        return self.originals

    def bcast(self, obj, root):
        self.bcast_root = root
        return obj if root == self.rank else self.held


class Old:
    def __init__(self, size):
        self.size = size

    def Get_size(self):
        return self.size


def _live(zero=0, compression="none"):
    cfg = Config()
    cfg.dist.zero, cfg.dist.compression = zero, compression
    live = Live(cfg, mode="shrink")
    live.world = types.SimpleNamespace(hostnames=("a", "a", "b", "b"))
    return live


def _carried(step, value, rng):
    return Carried(step, Entries(tensors={"model/w": torch.full((2,), float(value))}, meta={"sampler": {"at": step}},
                                 rank_state={"rng": rng}), last_saved_step=4)


def _recover(monkeypatch, live, survivors, lost=(3,)):
    monkeypatch.setattr(live_module, "shrink", lambda comm: Shrunk(survivors, lost, 0.01))
    return live.recover(Old(len(survivors.reached) + len(lost)), RuntimeError("peer gone"))


def test_survivors_at_one_step_keep_their_own_state_and_the_global_batch(monkeypatch):
    live = _live()
    live.keep(types.SimpleNamespace(entries=lambda: _carried(7, 1, "mine").entries, last_saved_step=4), 7)
    same = _digest(_carried(7, 1, "mine").entries)
    survivors = Survivors(1, [(7, 7, same, None)] * 3)
    assert _recover(monkeypatch, live, survivors) is survivors
    assert live.carried.step == 7 and live.carried.entries.rank_state == {"rng": "mine"} and not live.reload
    assert survivors.bcast_root is None  # nothing moved
    assert live.global_batch == Config().train.batch_size * 4 and live.generation == 1
    [record] = live.recoveries
    assert record["lost"] == [{"rank": 3, "host": "b"}] and record["world_size"] == 3 and record["step"] == 7
    assert record["state"] == "memory" and record["from_world_size"] == 4


def test_a_survivor_behind_the_interrupted_update_takes_the_furthest_ones_state_but_keeps_its_generators(
        monkeypatch):
    live = _live()
    live.carried, live.failed_step = _carried(6, 1, "mine"), 6
    ahead = _carried(7, 2, "theirs")
    mine, theirs = _digest(live.carried.entries), _digest(ahead.entries)
    survivors = Survivors(0, [(6, 6, mine, None), (7, 7, theirs, None), (7, 7, theirs, None)], held=ahead)
    _recover(monkeypatch, live, survivors)
    assert survivors.bcast_root == 1  # the lowest rank of those furthest
    assert live.carried.step == 7 and torch.equal(live.carried.entries.tensors["model/w"], torch.full((2,), 2.0))
    assert live.carried.entries.rank_state == {"rng": "mine"}
    assert live.recoveries[0]["step"] == 7


@pytest.mark.parametrize("zero, compression", [(1, "none"), (2, "none"), (3, "none"), (0, "int8")])
def test_a_loss_of_sharded_or_per_rank_state_reloads_the_newest_checkpoint(monkeypatch, zero, compression):
    live = _live(zero, compression)
    live.keep(types.SimpleNamespace(entries=lambda: pytest.fail("no entries taken: they are not the whole state"),
                                    last_saved_step=4), 9)
    _recover(monkeypatch, live, Survivors(0, [(-1, 9, 0, None), (-1, 9, 0, None)]), lost=(2, 3))
    assert live.carried is None and live.reload
    assert live.recoveries[0]["state"] == "checkpoint" and live.recoveries[0]["lost"][1] == {"rank": 3, "host": "b"}


@pytest.mark.parametrize("keeper_step, state", [(7, "mirror"), (-1, "checkpoint")])
def test_a_sharded_state_goes_on_from_the_mirrors_where_the_lost_rank_s_keeper_holds_it(monkeypatch, keeper_step,
                                                                                         state):
    """fault.replicas=1, stage 2, 2 hosts x 2 (keepers 0->2->1->3->0): rank 3 is lost after step 7 and this rank, 0,
    its keeper, holds its shard. From the mirrors, rank 3's shard is held by rank 0 of the survivors; with the
    keeper's mirror still being received when the loss came (-1), every survivor reloads the checkpoint."""
    live = _live(zero=2)
    live.cfg.fault.replicas = 1
    live.mirror = mirror = Mirror()
    mirror.attach(types.SimpleNamespace(rank=0, hostnames=("a", "a", "b", "b")))
    mine, lost_shard = torch.full((3,), 1.5), torch.arange(4, dtype=torch.float64)
    mirror.own = Entries({"model/w": torch.ones(2), "optim/0": mine,
                          "optim/3": torch.empty(4, dtype=torch.float64, device="meta")},
                         holders={"optim/0": 0, "optim/3": 3}, meta={"step": 7}, rank_state={"rng": "mine"})
    mirror._ward_layout = layout(mirror.own, 3)
    mirror._ward_buffer = torch.zeros(nbytes(mirror._ward_layout), dtype=torch.uint8)
    views(mirror._ward_buffer, mirror._ward_layout)["optim/3"].copy_(lost_shard)
    mirror.own_step, mirror.ward_step, mirror.last_saved_step, live.failed_step = 7, keeper_step, 4, 7
    same = _digest(mirror.own)
    theirs = {"optim/0": torch.empty(3, device="meta"), "optim/3": torch.empty(4, dtype=torch.float64, device="meta")}
    assert same == _digest(Entries({"model/w": torch.ones(2), **theirs}, holders=mirror.own.holders))  # rank 1's
    _recover(monkeypatch, live, Survivors(0, [(-1, 7, 0, (7, keeper_step, 3, same)), (-1, 7, 0, (7, 7, 2, same)),
                                              (-1, 7, 0, (7, 7, 0, same))]))
    assert live.recoveries[0]["state"] == state and mirror.own is None  # the lost world's mirror forgotten
    if state == "checkpoint":
        assert live.reload and live.carried is None and not live.from_mirrors
        return
    carried = live.carried
    assert live.from_mirrors and not live.reload and (carried.step, carried.last_saved_step) == (7, 4)
    assert carried.entries.holders == {"optim/0": 0, "optim/3": 0}
    assert torch.equal(carried.entries.tensors["optim/3"], lost_shard) and carried.entries.tensors["optim/0"] is mine
    assert carried.entries.rank_state == {"rng": "mine"}


def test_survivors_of_whom_one_had_not_started_the_loop_reload(monkeypatch):
    live = _live()
    live.carried, live.failed_step = _carried(7, 1, "mine"), 7
    _recover(monkeypatch, live, Survivors(0, [(7, 7, _digest(live.carried.entries), None), (-1, -1, 0, None)]))
    assert live.reload and live.carried is None


def test_survivors_whose_memories_differ_at_one_step_reload_rather_than_trust_either(monkeypatch):
    """A collective that a dead peer left half done can complete on one survivor with its part missing: states
    that should be equal and are not are never carried on."""
    live = _live()
    live.carried, live.failed_step = _carried(7, 1, "mine"), 7
    other = _digest(_carried(7, 3, "theirs").entries)
    _recover(monkeypatch, live, Survivors(0, [(7, 7, _digest(live.carried.entries), None), (7, 7, other, None)]))
    assert live.reload and live.carried is None and live.recoveries[0]["state"] == "checkpoint"


def test_survivors_whose_batch_norm_statistics_differ_go_on_from_memory_and_a_parameter_still_decides():
    """A model's buffers differ between ranks at a step's end (each rank's slice updated them) until the next step
    broadcasts rank 0's: the survivors of a batch-norm model go on from memory, whatever their statistics; a
    parameter that differs still sends them to the checkpoint."""
    from hpcnet.ckpt.parts import ModelState

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    models[1](torch.randn(8, 3))  # training mode: its running statistics move, its parameters do not
    mine, theirs = (ModelState(m).state_entries() for m in models)
    assert mine.synced == {"model/1.running_mean", "model/1.running_var", "model/1.num_batches_tracked"}
    assert not torch.equal(mine.tensors["model/1.running_mean"], theirs.tensors["model/1.running_mean"])
    assert _digest(mine) == _digest(theirs)
    with torch.no_grad():
        models[1][0].weight.add_(1e-3)
    assert _digest(mine) != _digest(ModelState(models[1]).state_entries())


def test_a_revoke_that_lost_nobody_raises_the_error_again(monkeypatch):
    live = _live()
    monkeypatch.setattr(live_module, "shrink", lambda comm: Shrunk(Survivors(0, [(-1, -1, 0)] * 4), (), 0.01))
    error = RuntimeError("a bug of this rank")
    with pytest.raises(RuntimeError) as raised:
        live.recover(Old(4), error)
    assert raised.value is error and not live.recoveries


def test_only_shrink_mode_survives_and_an_agreed_error_is_never_a_loss(monkeypatch):
    from hpcnet.agree import mark_agreed

    monkeypatch.setattr(live_module, "peers_lost", lambda comm: True)
    assert _live().survives(RuntimeError("x"), comm=None)
    assert not _live().survives(mark_agreed(RuntimeError("everyone's verdict")), comm=None)
    restart = _live()
    restart.mode = "restart"
    assert not restart.survives(RuntimeError("x"), comm=None)
    monkeypatch.setattr(live_module, "peers_lost", lambda comm: False)
    assert not _live().survives(RuntimeError("a bug"), comm=None)


@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 7])
def test_survivors_split_the_same_global_batches_as_equally_as_they_divide(ranks):
    """32 samples a step (4 ranks of 8) taken over by other rank counts: the same global batches in the same order
    as one rank of 32 takes them, slices differing by one sample at most, past an epoch's end."""
    one = GlobalBatchSampler(96, 32, rank=0, world_size=1, seed=3)
    shrunk = [GlobalBatchSampler(96, 8, rank=r, world_size=ranks, seed=3, global_batch=32) for r in range(ranks)]
    sizes = shrunk[0].sizes
    assert sum(sizes) == 32 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert [s.local_batch_size for s in shrunk] == sizes
    for _ in range(5):
        assert np.array_equal(np.concatenate([s.next_indices() for s in shrunk]), one.next_indices())


def test_a_global_batch_smaller_than_the_ranks_is_refused():
    with pytest.raises(ValueError, match="at least one sample a rank"):
        GlobalBatchSampler(96, 8, rank=0, world_size=5, global_batch=4)


@pytest.mark.parametrize("option, value", [("hierarchical", "on"), ("compression", "int8")])
def test_after_a_shrink_an_option_the_survivors_nodes_cannot_keep_falls_back_to_auto(option, value):
    from hpcnet.errors import UsageError

    def agree():
        calls.append(getattr(live.cfg.dist, option))
        if getattr(live.cfg.dist, option) == value:
            raise UsageError(f"dist.{option}={value} needs as many ranks on every node")
        return "route"

    world = types.SimpleNamespace(is_main=True)
    live, calls = _live(), []
    setattr(live.cfg.dist, option, value)
    with pytest.raises(UsageError):  # the job's first world: the user's option is an error, as ever
        live.route(agree, world)
    live.generation = 1
    assert live.route(agree, world) == "route" and getattr(live.cfg.dist, option) == "auto"
    assert calls == [value, value, "auto"]
    live.cfg.dist.hierarchical, live.cfg.dist.compression = "off", "none"

    def refused():
        raise UsageError("another option")
    with pytest.raises(UsageError, match="another option"):
        live.route(refused, world)


def test_replacements_left_without_any_first_rank_end_the_job_for_a_restart(monkeypatch):
    """Open MPI's abort (the monitor's verdict on a hung rank) ends the ranks mpirun started but not the
    replacements they spawned: replacements that find every first rank gone at once stop with 75 on every one of
    them, where they would otherwise train on alone beside the restarted job."""
    live = _live()
    live.original = False
    with pytest.raises(RestartableError, match="every rank that the job started with is gone") as raised:
        _recover(monkeypatch, live, Survivors(0, [(-1, 9, 0)], originals=0), lost=(0, 1))
    assert is_agreed(raised.value) and exit_code_of(raised.value) == 75
    assert not live.recoveries


def test_a_replacement_receives_the_survivors_recovery_state_and_their_options():
    sent = {"cfg": Config(), "mode": "shrink", "generation": 2, "global_batch": 48, "killed": {3, 7}, "size": 4}
    comm = types.SimpleNamespace(bcast=lambda obj, root: sent)
    live = Live(Config())
    assert live.receive(comm) is sent["cfg"]
    assert (live.generation, live.global_batch, live.killed, live.size) == (2, 48, {3, 7}, 4)
    assert live.handover and not live.original  # the state comes from the ranks; not one of the first ranks
