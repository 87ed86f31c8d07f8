"""hpcnet.ckpt.schedule: when a run saves, on rank 0's clock, decided alike on every rank."""

import pytest

from hpcnet.ckpt.schedule import NONFINITE_GRAD, NONFINITE_LOSS, SavePolicy, should_save
from hpcnet.config.load import load_config

pytestmark = pytest.mark.timeout(120)


class FakeClock:
    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now


@pytest.mark.parametrize("step, every_steps, time_due, stopping, at_end, expected", [
    (10, 5, False, False, False, True), (11, 5, False, False, False, False), (10, 0, False, False, False, False),
    (11, 5, True, False, False, True), (11, 5, False, True, False, True), (11, 0, False, False, True, True),
])
def test_should_save(step, every_steps, time_due, stopping, at_end, expected):
    assert should_save(step, every_steps=every_steps, time_due=time_due, stopping=stopping, at_end=at_end) is expected


def test_the_policy_owns_its_clock():
    clock = FakeClock()
    policy = SavePolicy(every_steps=0, every_s=30.0, at_end=False, total_steps=100, clock=clock)
    assert not policy.time_due()
    clock.now += 29.9
    assert not policy.time_due()
    clock.now += 0.1
    assert policy.time_due()
    policy.saved()
    assert not policy.time_due() and policy.last_save == clock.now
    never = SavePolicy(every_steps=0, every_s=0.0, at_end=False, total_steps=100, clock=clock)
    clock.now += 1e9
    assert not never.time_due()


def test_from_config_reads_the_checkpoint_options():
    cfg = load_config(overrides=["checkpoint.every_steps=7", "checkpoint.every_s=12.5", "checkpoint.at_end=false",
                                 "train.steps=40"])
    policy = SavePolicy.from_config(cfg)
    assert (policy.every_steps, policy.every_s, policy.at_end, policy.total_steps) == (7, 12.5, False, 40)


@pytest.mark.mpi
def test_every_rank_decides_alike_on_rank_0s_clock(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    clock = FakeClock()
    policy = SavePolicy(every_steps=5, every_s=60.0, at_end=True, total_steps=20, clock=clock)
    assert policy.agree(comm, 1, 0)[:3] == (0, False, 0)
    assert policy.agree(comm, 5, 0)[:3] == (0, True, 0)  # every_steps
    assert policy.agree(comm, 20, 0)[:3] == (0, True, 0)  # at the end
    clock.now += 0 if rank == 0 else 1000  # only rank 0's clock counts
    assert policy.agree(comm, 6, 0)[:3] == (0, False, 0)
    clock.now += 60 if rank == 0 else 0
    assert policy.agree(comm, 6, 0)[:3] == (0, True, 0)
    policy.saved()
    signum = 15 if rank == size - 1 else 0  # a stop on one rank is a stop, and a save, on all
    assert policy.agree(comm, 7, signum)[:3] == (15, True, 0)
    bits = NONFINITE_LOSS if rank == 0 else 0
    bits |= NONFINITE_GRAD if rank == size - 1 else 0
    assert policy.agree(comm, 8, 0, nonfinite=bits)[:3] == (0, False, NONFINITE_LOSS | NONFINITE_GRAD)
    assert policy.agree(comm, 9, 0).writing is False
    assert policy.agree(comm, 9, 0, writing=rank == size - 1).writing is True  # one busy writer holds every rank
