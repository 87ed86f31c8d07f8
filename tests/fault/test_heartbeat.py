"""Heartbeats (pure): the ring, a beat's encoding, how long a watched rank may be silent."""

import numpy as np
import pytest

from hpcnet.fault.failure import heartbeat_report
from hpcnet.fault.heartbeat import FIELDS, LEAVING, RUNNING, PeerTracker, decode, encode, ring_peers


@pytest.mark.parametrize("size", [1, 2, 3, 5, 1000])
def test_ring_every_rank_is_watched_by_its_successors(size):
    peers = [ring_peers(r, size) for r in range(size)]
    for rank, (send_to, watch) in enumerate(peers):
        assert len(send_to) == len(watch) == min(2, size - 1)  # O(1) messages per rank, whatever the size
        assert rank not in send_to and rank not in watch
        for dest in send_to:
            assert rank in peers[dest][1]  # whoever I beat to watches me
    watchers = [[w for w in range(size) if r in peers[w][1]] for r in range(size)]
    assert all(len(w) == min(2, size - 1) for w in watchers)


def test_two_adjacent_failures_are_both_watched_by_a_live_rank():
    size = 6
    for first in range(size):
        failed = {first, (first + 1) % size}
        named = {r for w in range(size) if w not in failed for r in ring_peers(w, size)[1] if r in failed}
        assert named == failed


def test_beat_round_trip():
    vector = encode(session=12345, rank=3, state=RUNNING, step=17, seq=99, op="allreduce.bucket", bucket=2,
                    cseq=98, cop="reducer.outcome", digest=2**52 - 1, open_seq=98, open_op="reducer.outcome",
                    open_bucket=-1, open_s=1.5, wall=1.7e9, pid=4242, kind="stall", guard="checkpoint.create",
                    guard_s=0.25, guard_left_s=119.5)
    assert vector.shape == (len(FIELDS),) and vector.nbytes == 160
    beat = decode(vector)
    assert beat["guard"] == "checkpoint.create" and beat["guard_s"] == 0.25 and beat["guard_left_s"] == 119.5
    assert beat["rank"] == 3 and beat["step"] == 17 and beat["op"] == "allreduce.bucket" and beat["bucket"] == 2
    assert beat["cop"] == "reducer.outcome" and beat["cseq"] == 98 and beat["digest"] == 2**52 - 1  # exact
    assert beat["open_op"] == "reducer.outcome" and beat["open_s"] == 1.5 and beat["kind"] == "stall"
    assert decode(encode(op=200))["op"] == "op#200"


def test_peer_tracker_deadlines():
    tracker = PeerTracker([1, 2], interval_s=2.0, misses=3, now=0.0, startup_deadline_s=100.0)
    running = decode(encode(state=RUNNING, step=5))
    for t in np.arange(0.05, 5.0, 0.05):
        tracker.tick(t)
    assert tracker.overdue(5.0) == []  # nothing heard yet, still starting up: startup deadline
    tracker.heard(1, running, 5.0)
    tracker.heard(2, running, 5.0)
    for t in np.arange(5.05, 11.0, 0.05):
        tracker.tick(t)
    assert tracker.overdue(10.9) == []  # 5.9 s < 3 x 2 s
    tracker.tick(11.1)
    assert tracker.overdue(11.1) == [1, 2]
    tracker.heard(2, decode(encode(state=LEAVING, step=5)), 11.1)  # said goodbye: not a failure
    assert tracker.overdue(11.2) == [1]


def test_peer_tracker_forgives_its_own_pause():
    tracker = PeerTracker([1], interval_s=1.0, misses=3, now=0.0)
    tracker.heard(1, decode(encode(step=3)), 0.0)
    tracker.tick(0.1)
    tracker.tick(1.5)  # this rank was starved for 1.4 s: it cannot tell whether rank 1 beat meanwhile
    assert tracker.overdue(1.5) == [] and tracker.last_heard[1] == 1.5 and not tracker.judging_paused(1.5)
    tracker.tick(10.0)  # stopped for 8.5 s, longer than a peer may be silent: its watchers judged it
    assert tracker.judging_paused(10.0) and tracker.judging_paused(15.9) and not tracker.judging_paused(16.1)


def test_watchers_allow_the_silence_of_an_announced_create():
    tracker = PeerTracker([1, 2], interval_s=2.0, misses=3, now=0.0, guard_slack_s=8.0)
    tracker.heard(1, decode(encode(step=5, guard="checkpoint.create", guard_s=0.1, guard_left_s=100.0)), 0.0)
    tracker.heard(2, decode(encode(step=5, guard="checkpoint.write", guard_s=0.1)), 0.0)  # not quiet
    for t in np.arange(0.05, 30.0, 0.05):
        tracker.tick(t)
    assert tracker.overdue(30.0) == [2]  # a rank that may not be silent is found as fast as ever
    for t in np.arange(30.0, 113.9, 0.05):
        tracker.tick(t)
    assert tracker.overdue(113.9) == [2]  # 100 s announced + 3 x 2 s + 8 s for its peers' own report
    tracker.tick(114.1)
    assert tracker.overdue(114.1) == [1, 2]
    silent_past_deadline = heartbeat_report({1: (114.1, tracker.last_beat[1])}, ("h",) * 3, detector=0,
                                            interval_s=2.0, misses=3)
    assert silent_past_deadline["kind"] == "checkpoint"  # its checkpoint I/O, not a heartbeat, is what hung
    assert "in checkpoint.create for 0.1 s" in silent_past_deadline["message"]
    plain = heartbeat_report({2: (6.1, tracker.last_beat[2])}, ("h",) * 3, detector=0, interval_s=2.0, misses=3)
    assert plain["kind"] == "heartbeat" and plain["failed"][0]["guard"] == "checkpoint.write"


def test_proof_of_life_resets_the_silence_and_never_moves_it_back():
    tracker = PeerTracker([1, 2], interval_s=2.0, misses=3, now=0.0)
    tracker.heard(2, decode(encode(state=RUNNING, step=1)), 5.0)
    assert tracker.overdue(7.0, own_step=1) == [1]
    tracker.alive_at(4.0)  # rank 1 was in a collective that ended here: alive at 4 s
    assert tracker.overdue(7.0, own_step=1) == [] and tracker.silent_s(1, 7.0) == 3.0
    assert tracker.silent_s(2, 7.0) == 2.0  # heard later than the proof: unchanged
    assert tracker.overdue(10.5, own_step=1) == [1] and tracker.overdue(11.5, own_step=1) == [1, 2]
