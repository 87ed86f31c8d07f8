"""The probe's pair schedule (pure) and its rounds played under MPI at any size."""

import itertools

import numpy as np
import pytest

from hpcnet.comm.pingpong import intra_samples, pair_key, pair_rounds, play_rounds, tournament
from tests.helpers.comm import nodes_of


def _check_schedule(nodes: list[list[int]], rounds: list[list[tuple[int, int]]], samples: int = 3) -> None:
    leaders = [m[0] for m in nodes]
    required = {(a, b) for a, b in itertools.combinations(sorted(leaders), 2)}
    required |= {(m[0], m[k]) for m in nodes for k in intra_samples(len(m), samples)}
    played = [pair for rnd in rounds for pair in rnd]
    assert sorted(played) == sorted(required), "every required pair exactly once"
    assert all(a < b for a, b in played)
    for rnd in rounds:
        ranks = [r for pair in rnd for r in pair]
        assert len(ranks) == len(set(ranks)), f"a rank twice in round {rnd}"
        assert rnd, "no empty round"


@pytest.mark.parametrize("local_sizes", [[1], [2], [8], [1, 1], [2, 2], [2, 2, 1], [4] * 8, [8] * 4, [1] * 32,
                                         [1] * 7, [3, 1, 5, 2, 2], [16, 16]])
def test_schedule_covers_required_pairs_once(local_sizes):
    nodes = nodes_of(local_sizes)
    rounds = pair_rounds(nodes)
    _check_schedule(nodes, rounds)
    # Optimal for the leaders: n-1 rounds (n even) or n (odd); then one round per
    # intra-node sample, shared by all nodes (a resting leader may take one earlier).
    n = len(nodes)
    leader_rounds = n - 1 if n % 2 == 0 else n
    assert len(rounds) <= leader_rounds + max(len(intra_samples(s)) for s in local_sizes)


def test_tournament_and_samples():
    for n in range(1, 12):
        rounds = tournament(list(range(n)))
        assert len(rounds) == (0 if n == 1 else n - 1 if n % 2 == 0 else n)
        assert sorted(p for r in rounds for p in r) == list(itertools.combinations(range(n), 2))
    assert intra_samples(1) == [] and intra_samples(2) == [1] and intra_samples(4) == [1, 2, 3]
    assert intra_samples(8) == [1, 4, 7] and intra_samples(8, 1) == [1]
    # virtual nodes of 2 ranks on 4 ranks: leaders 0 and 2 meet, then both nodes time their pair together
    assert pair_rounds(nodes_of([2, 2])) == [[(0, 2)], [(0, 1), (2, 3)]]
    assert pair_key(3, 1) == "1-3"


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_play_rounds_times_every_pair_once_at_any_size(comm):
    """Every rank plays its pairs of a schedule over all ranks; the initiators hold the figures."""
    size, rank = comm.Get_size(), comm.Get_rank()
    rounds = pair_rounds([[r] for r in range(size)])  # every rank a node of its own: all pairs
    small, large = np.ones(8, np.uint8), np.ones(1 << 16, np.uint8)
    measured, probe_s = play_rounds(comm, rounds, small, large, budget_s=0.3)
    assert set(measured) == {pair_key(a, b) for rnd in rounds for a, b in rnd if a == rank}
    for latency_us, bandwidth_gbps, out_gbps, in_gbps in measured.values():
        assert latency_us > 0 and bandwidth_gbps > 0 and out_gbps > 0 and in_gbps > 0
    everything = {k: v for part in comm.allgather(measured) for k, v in part.items()}
    assert sorted(everything) == sorted(pair_key(a, b) for a, b in itertools.combinations(range(size), 2))
    assert probe_s > 0
