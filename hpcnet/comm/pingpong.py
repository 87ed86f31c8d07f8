"""The topology probe's ping-pong: which rank pairs meet in which round (pure), and the timing of one pair.

Pairs are played in rounds of a round-robin tournament so disjoint pairs run at the same time; each round
has a time slot, so the whole probe takes about its budget at any size (docs/topology.md).  The bandwidth of a
pair is timed in each direction (a large message one way, a 1-byte answer back), so a link that is slow one way
only shows which way.
"""

import statistics
import time
from typing import Any

from hpcnet.world import wait_sleeping

# Ping-pong tags.  The responder answers every message until STOP (PING: the
# same message back; PUSH: one byte back; PULL: a large message back), so the
# initiator alone decides (by the clock) how many repetitions to time.
_HELLO, _PING, _PONG, _STOP, _PUSH, _PULL = 11, 12, 13, 14, 15, 16
# Repetition caps per pair: enough for stable figures; the time slot usually
# ends the loop first on slow links.
_LATENCY_WARMUP, _LATENCY_REPS = 20, 1000
_BANDWIDTH_WARMUP, _BANDWIDTH_REPS = 1, 25
"""Of each direction.  A repetition of both (a message out and its answer, a request and the message back) hands
the turn between the two ranks four times, a ping-pong twice: 25 of each cost as many hand-overs as 50 ping-pongs
(each one a wait for the other rank to be scheduled, on a busy machine)."""
INTRA_SAMPLES = 3
"""Local ranks each node leader is timed against: the first, middle and last."""


def pair_key(i: int, j: int) -> str:
    """The key of a rank pair in ``Topology.latency_us``/``bandwidth_gbps``."""
    return f"{min(i, j)}-{max(i, j)}"


def direction_key(source: int, target: int) -> str:
    """The key of one direction of a pair in ``Topology.directed_gbps``: ``"source->target"``."""
    return f"{source}->{target}"


def tournament(players: list[int]) -> list[list[tuple[int, int]]]:
    """Round-robin rounds (circle method): every pair once, nobody twice in a round.

    ``len(players) - 1`` rounds for an even count, ``len(players)`` for an odd
    one (one player rests each round).  Pairs are ``(low, high)``.
    """
    circle: list[int | None] = list(players)
    if len(circle) % 2:
        circle.append(None)
    n = len(circle)
    rounds = []
    for _ in range(n - 1):
        pairs = [(circle[i], circle[n - 1 - i]) for i in range(n // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        circle.insert(1, circle.pop())  # the first player stays, the others turn
    return [r for r in rounds if r]


def intra_samples(local_size: int, count: int = INTRA_SAMPLES) -> list[int]:
    """Local ranks a node leader is timed against: up to ``count``, evenly spread from 1 to the last."""
    others = local_size - 1
    if others <= 0 or count <= 0:
        return []
    if others <= count:
        return list(range(1, local_size))
    # First, last and evenly between: neighbours and the far side of the node
    # (another socket or PCIe switch) both show up.
    picks = {1 + round(k * (others - 1) / (count - 1)) for k in range(count)} if count > 1 else {1}
    return sorted(picks)


def pair_rounds(nodes: list[list[int]], samples: int = INTRA_SAMPLES) -> list[list[tuple[int, int]]]:
    """The probe's schedule: rounds of disjoint ``(low, high)`` rank pairs (pure logic).

    Args:
        nodes: the global ranks of each node, leader first.
        samples: how many local ranks each leader is timed against.

    Every pair of node leaders appears once (a round-robin tournament); then
    each leader meets ``intra_samples`` of its node's ranks, placed in the
    first round where neither rank is busy (a leader resting in an odd
    tournament takes one there), so different nodes measure at the same time.
    """
    rounds = tournament([members[0] for members in nodes])
    busy = [{r for pair in rnd for r in pair} for rnd in rounds]
    # Sample order first, so node A's k-th pair and node B's k-th pair share a round.
    intra = sorted((order, members[0], members[local])
                   for members in nodes for order, local in enumerate(intra_samples(len(members), samples)))
    for _, *pair in intra:
        free = next((i for i, taken in enumerate(busy) if not taken.intersection(pair)), None)
        if free is None:
            free = len(rounds)
            rounds.append([])
            busy.append(set())
        rounds[free].append((min(pair), max(pair)))
        busy[free].update(pair)
    return rounds


def time_pair(comm: Any, peer: int, small: Any, large: Any, end: float) -> tuple[float, float, float, float]:
    """Initiator side of one pair, done by ``end`` (MPI.Wtime): ``(latency_us, bandwidth_gbps, out_gbps,
    in_gbps)``.

    ``latency_us``: half the round trip of ``small``, the median.  ``out_gbps`` / ``in_gbps``: ``large`` sent
    to ``peer`` / received from it, each answered by one byte, its size over the median time.
    ``bandwidth_gbps``: the size over the mean of the two directions' mean times (what a ping-pong of
    ``large`` measures).  At least one repetition of each runs, even when ``end`` has passed.
    """
    from mpi4py import MPI

    wtime = MPI.Wtime
    hello = bytearray(1)
    wait_sleeping(comm.Irecv(hello, peer, _HELLO))  # the responder has finished its earlier rounds
    begin = wtime()
    # A quarter of what is left for latency (small messages are cheap), the rest for bandwidth.
    deadline = begin + 0.25 * (end - begin)
    for i in range(_LATENCY_WARMUP):
        if i and wtime() > deadline:
            break
        comm.Send(small, peer, _PING)
        comm.Recv(small, peer, _PONG)
    half_trips: list[float] = []
    while not half_trips or (len(half_trips) < _LATENCY_REPS and wtime() < deadline):
        t0 = wtime()
        comm.Send(small, peer, _PING)
        comm.Recv(small, peer, _PONG)
        half_trips.append((wtime() - t0) / 2)
    # Latency: the median, the typical small message on a busy machine.
    latency_s = statistics.median(half_trips)

    def push() -> float:  # large out, one byte back
        t0 = wtime()
        comm.Send(large, peer, _PUSH)
        comm.Recv(hello, peer, _PONG)
        return wtime() - t0

    def pull() -> float:  # one byte out, large back
        t0 = wtime()
        comm.Send(hello, peer, _PULL)
        comm.Recv(large, peer, _PONG)
        return wtime() - t0

    for _ in range(_BANDWIDTH_WARMUP):
        push()
        pull()
    # Alternated, so both directions see the same moments of a busy machine.
    outs: list[float] = []
    ins: list[float] = []
    while not outs or (len(outs) < _BANDWIDTH_REPS and wtime() < end):
        outs.append(push())
        ins.append(pull())
    comm.Send(hello, peer, _STOP)
    bits = len(large) * 8
    # The pair's figure: bytes over the mean time (total bytes over total
    # time), the throughput a stream of buckets gets, as mpi4py.bench and
    # nccl-tests define it.  Each direction's: over the median time, the
    # link's typical rate, which a rank descheduled for a moment on a busy
    # machine does not drag down (links are compared with each other).
    pair_s = (statistics.fmean(outs) + statistics.fmean(ins)) / 2
    out_s, in_s = statistics.median(outs), statistics.median(ins)
    return latency_s * 1e6, bits / pair_s / 1e9, bits / out_s / 1e9, bits / in_s / 1e9


def echo_pair(comm: Any, peer: int, buf: Any) -> None:
    """Responder side of one pair: answer every message until STOP (``buf``: the large message's size)."""
    from mpi4py import MPI

    comm.Send(bytearray(1), peer, _HELLO)
    status = MPI.Status()
    # Sleep until the first message: the initiator may still be busy elsewhere.
    wait_sleeping(comm.Irecv(buf, peer, MPI.ANY_TAG), status=status)
    while (tag := status.Get_tag()) != _STOP:
        count = {_PING: status.Get_count(MPI.BYTE), _PUSH: 1, _PULL: len(buf)}[tag]
        comm.Send([buf, count, MPI.BYTE], peer, _PONG)
        comm.Recv(buf, peer, MPI.ANY_TAG, status)


def play_rounds(comm: Any, rounds: list[list[tuple[int, int]]], small: Any, large: Any, *,
                budget_s: float) -> tuple[dict[str, tuple[float, float, float, float]], float]:
    """Collective: play this rank's pairs of ``rounds``; its ``{pair_key: time_pair's figures}`` (the pairs it
    initiated, the lower rank of each: ``out`` is from it to the higher) and the wall time of the whole
    measurement, seconds.
    """
    from mpi4py import MPI

    slot_s = budget_s / max(1, len(rounds))
    rank = comm.Get_rank()
    measured: dict[str, tuple[float, float, float, float]] = {}
    wait_sleeping(comm.Ibarrier())  # start the clocks together (within a latency)
    start = time.perf_counter()
    wtime_start = MPI.Wtime()
    # No barrier between rounds: each rank plays its own pairs in round
    # order, which cannot deadlock, and disjoint pairs overlap in time.
    # Round r ends at start + (r + 1) * slot on the initiator's clock, so
    # a late pair takes less time instead of pushing every later round.
    for index, rnd in enumerate(rounds):
        for low, high in rnd:
            if rank == low:
                end = wtime_start + (index + 1) * slot_s
                measured[pair_key(low, high)] = time_pair(comm, high, small, large, end)
            elif rank == high:
                echo_pair(comm, low, large)
    wait_sleeping(comm.Ibarrier())
    return measured, time.perf_counter() - start
