"""Tests of hpcnet.data.sampler: sampling maths, every world size in one process."""

import numpy as np
import pytest

from hpcnet.data.sampler import GlobalBatchSampler, eval_indices
from hpcnet.errors import DatasetError


def samplers(num_samples, batch_size, world_size, **kwargs):
    return [GlobalBatchSampler(num_samples, batch_size, rank=r, world_size=world_size, **kwargs)
            for r in range(world_size)]


def global_batch(ranks):
    """One step on every rank, concatenated in rank order."""
    return np.concatenate([s.next_indices() for s in ranks])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_sampler_covers_every_sample_once_per_epoch(world_size):
    ranks = samplers(50, 3, world_size, seed=7)
    steps = ranks[0].steps_per_epoch
    assert steps == 50 // (3 * world_size)
    for epoch in range(2):
        seen = []
        for step in range(steps):
            for rank in ranks:
                indices = rank.next_indices()
                assert indices.shape == (3,) and indices.dtype == np.int64
                assert rank.epoch == epoch and rank.samples_in_epoch == (step + 1) * 3 * world_size
                seen.append(indices)
        seen = np.concatenate(seen)
        assert len(np.unique(seen)) == len(seen) == steps * 3 * world_size  # the tail is dropped, nothing repeats
        assert seen.min() >= 0 and seen.max() < 50


def test_epochs_differ_and_seed_is_deterministic():
    a = GlobalBatchSampler(100, 10, rank=0, world_size=1, seed=3)
    b = GlobalBatchSampler(100, 10, rank=0, world_size=1, seed=3)
    c = GlobalBatchSampler(100, 10, rank=0, world_size=1, seed=4)
    assert np.array_equal(a.epoch_order(0), b.epoch_order(0))
    assert not np.array_equal(a.epoch_order(0), a.epoch_order(1))
    assert not np.array_equal(a.epoch_order(0), c.epoch_order(0))
    assert sorted(a.epoch_order(5)) == list(range(100))
    stream_a = [a.next_indices() for _ in range(25)]
    stream_b = [b.next_indices() for _ in range(25)]
    assert all(np.array_equal(x, y) for x, y in zip(stream_a, stream_b))
    ordered = GlobalBatchSampler(100, 10, rank=0, world_size=1, shuffle=False)
    assert np.array_equal(ordered.epoch_order(3), np.arange(100))
    assert np.array_equal(ordered.next_indices(), np.arange(10))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_global_batch_equals_one_rank_batch(world_size):
    ranks = samplers(103, 4, world_size, seed=11)
    single = GlobalBatchSampler(103, 4 * world_size, rank=0, world_size=1, seed=11)
    for _ in range(3 * single.steps_per_epoch + 1):  # across epoch boundaries
        assert np.array_equal(global_batch(ranks), single.next_indices())


def sample_stream(ranks, num_samples):
    out = []
    while sum(len(x) for x in out) < num_samples:
        out.append(global_batch(ranks))
    return np.concatenate(out)[:num_samples]


@pytest.mark.parametrize(("new_batch", "new_world"), [(4, 2), (2, 4), (8, 1), (1, 8), (2, 2), (16, 1)])
def test_resume_mid_epoch_at_any_world_size(new_batch, new_world):
    # 48 samples: every global batch size here divides it, so epochs drop no tail and streams can be compared.
    reference = samplers(48, 4, 2, seed=5)
    for _ in range(2):
        global_batch(reference)  # 16 samples into epoch 0
    state = reference[0].state_dict()
    assert state == {"epoch": 0, "samples_consumed_in_epoch": 16, "seed": 5}
    resumed = samplers(48, new_batch, new_world, seed=999)  # the saved seed wins
    for s in resumed:
        s.load_state_dict(state)
    assert np.array_equal(sample_stream(resumed, 80), sample_stream(reference, 80))


def advance(ranks, steps):
    for _ in range(steps):
        global_batch(ranks)
    return ranks[0].state_dict()


@pytest.mark.parametrize("saved_world, new_world", [(2, 3), (4, 3), (3, 2), (1, 5), (2, 2)])
@pytest.mark.parametrize("new_batch", [4, 5])
def test_resume_in_another_batch_grid_continues_the_same_order(saved_world, new_world, new_batch):
    """A position that is no whole number of the new global batches: same order on, new grid, tail dropped."""
    n = 101  # a prime: no global batch divides it, every epoch drops a tail
    state = advance(samplers(n, 4, saved_world, seed=3), 3)
    position = 3 * 4 * saved_world
    assert state == {"epoch": 0, "samples_consumed_in_epoch": position, "seed": 3}
    resumed = samplers(n, new_batch, new_world, seed=0)
    for s in resumed:
        s.load_state_dict(state)
    order, g = resumed[0].epoch_order(0), new_batch * new_world
    left = (n - position) // g
    for k in range(left):
        assert np.array_equal(global_batch(resumed), order[position + k * g:position + (k + 1) * g])
        assert resumed[0].epoch == 0 and resumed[0].samples_in_epoch == position + (k + 1) * g
    # Fewer than g samples are left: dropped, as at any epoch end; a save now names the next epoch.
    assert n - (position + left * g) < g
    assert resumed[0].state_dict() == {"epoch": 1, "samples_consumed_in_epoch": 0, "seed": 3}
    fresh = samplers(n, new_batch, new_world, seed=3)
    advance(fresh, fresh[0].steps_per_epoch)  # epoch 0 from its start
    for _ in range(fresh[0].steps_per_epoch + 1):  # epoch 1 and into epoch 2 are a fresh run's
        assert np.array_equal(global_batch(resumed), global_batch(fresh))
    assert resumed[0].epoch == 2


@pytest.mark.parametrize("world_size, batch", [(1, 7), (2, 4), (3, 5)])
def test_resume_at_the_same_grid_is_exact_from_any_step(world_size, batch):
    """Saved after any step (epoch ends and dropped tails included) and resumed alike: the same batches."""
    n = 61
    straight = samplers(n, batch, world_size, seed=2)
    stream = [global_batch(straight) for _ in range(4 * straight[0].steps_per_epoch)]
    steps, g = straight[0].steps_per_epoch, batch * world_size
    for i, got in enumerate(stream):  # the grid of a fresh run: batch k of an epoch is perm[k*G:(k+1)*G]
        assert np.array_equal(got, straight[0].epoch_order(i // steps)[i % steps * g:(i % steps + 1) * g])
    for stop in range(len(stream) - straight[0].steps_per_epoch):
        state = advance(samplers(n, batch, world_size, seed=2), stop)
        resumed = samplers(n, batch, world_size, seed=2)
        for s in resumed:
            s.load_state_dict(state)
        for expected in stream[stop:stop + straight[0].steps_per_epoch]:
            assert np.array_equal(global_batch(resumed), expected)


def test_resume_with_less_than_a_batch_left_starts_the_next_epoch():
    state = {"epoch": 4, "samples_consumed_in_epoch": 90, "seed": 1}  # 10 left of 100
    (sampler,) = samplers(100, 16, 1)
    sampler.load_state_dict(state)
    assert sampler.state_dict() == {"epoch": 5, "samples_consumed_in_epoch": 0, "seed": 1}
    assert np.array_equal(sampler.next_indices(), sampler.epoch_order(5)[:16]) and sampler.epoch == 5
    exact_end = samplers(100, 16, 1)[0]
    exact_end.load_state_dict({**state, "samples_consumed_in_epoch": 100})
    assert np.array_equal(exact_end.next_indices(), sampler.epoch_order(5)[:16])


def test_resume_rejects_a_bad_state():
    sampler = GlobalBatchSampler(64, 16, rank=0, world_size=1)
    with pytest.raises(ValueError, match="lacks"):
        sampler.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="non-negative integers"):
        sampler.load_state_dict({"epoch": 0, "samples_consumed_in_epoch": -8, "seed": 0})
    with pytest.raises(ValueError, match="has only 10 here"):
        GlobalBatchSampler(10, 2, rank=0, world_size=1).load_state_dict(
            {"epoch": 1, "samples_consumed_in_epoch": 16, "seed": 0})


def test_finished_epoch_is_saved_as_the_next_one():
    ranks = samplers(20, 3, 2, seed=1)  # 3 steps of 6, 2 samples dropped
    for _ in range(3):
        global_batch(ranks)
    assert ranks[0].epoch == 0
    state = ranks[0].state_dict()
    assert state == {"epoch": 1, "samples_consumed_in_epoch": 0, "seed": 1}
    resumed = samplers(20, 7, 1)  # a global batch of 7 could not resume at 18 samples, but can at 0
    resumed[0].load_state_dict(state)
    assert np.array_equal(resumed[0].next_indices(), ranks[0].epoch_order(1)[:7])


def test_sampler_rejects_bad_arguments():
    with pytest.raises(DatasetError, match=r"10 samples.*batch size 4 x world size 3"):
        GlobalBatchSampler(10, 4, rank=0, world_size=3)
    with pytest.raises(ValueError, match="rank"):
        GlobalBatchSampler(10, 1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seed"):
        GlobalBatchSampler(10, 1, rank=0, world_size=1, seed=-1)
    with pytest.raises(ValueError, match="batch_size"):
        GlobalBatchSampler(10, 0, rank=0, world_size=1)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_eval_indices_shard_every_sample_once(size):
    for n in range(0, 14):
        shards = [eval_indices(n, rank, size) for rank in range(size)]
        assert np.array_equal(np.concatenate(shards), np.arange(n))
        lengths = [len(s) for s in shards]
        assert max(lengths) - min(lengths) <= 1
