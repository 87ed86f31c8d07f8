"""The flight recorder (pure): its ring, the stall timeout, desyncs, and who is behind in a stall."""

import time

import pytest

from hpcnet.fault.flightrec import (
    FLOOR_SCALED_MAX_S,
    WARMUP_MAX_S,
    FlightRecorder,
    StallClock,
    analyze_stall,
    desync,
    format_entries,
    oversubscription,
    stall_floor,
    stall_timeout,
    warmup_timeout,
)
from tests.helpers.fault import rank_state


def test_collectives_over_every_rank_are_proof_that_every_rank_was_alive():
    rec = FlightRecorder()
    with rec.op("loss.allreduce"):
        first = rec.entry(rec.seq).start
    assert rec.all_alive_at is None  # one ended: every rank entered it, maybe long before this one did
    with rec.op("broadcast.buffers"):  # only rank 0 must have entered a broadcast
        pass
    token = rec.start("allreduce.bucket")  # gradient buckets overlap (progress threads): no order to lean on
    rec.end(token)
    assert rec.all_alive_at is None
    with pytest.raises(RuntimeError):
        with rec.op("step_boundary"):  # one that raised proves nothing
            raise RuntimeError("transport failed")
    assert rec.all_alive_at is None
    with rec.op("reducer.outcome"):
        second = rec.entry(rec.seq).start
    assert rec.all_alive_at == first
    with rec.op("eval.allreduce"):
        pass
    assert rec.all_alive_at == second


def test_flight_recorder_ring():
    rec = FlightRecorder(capacity=4)
    tokens = [rec.start("allreduce.bucket", bucket=b, nbytes=100 * b) for b in range(3)]
    assert tokens == [1, 2, 3] and rec.oldest_open().seq == 1
    rec.end(tokens[0])
    rec.end(tokens[0])  # twice is harmless
    assert rec.oldest_open().seq == 2
    for token in tokens[1:]:
        rec.end(token)
    rec.step = 7
    with rec.op("step_boundary"):
        assert rec.oldest_open().op == "step_boundary"
    with pytest.raises(ValueError, match="unknown collective"):
        rec.start("allreduce.typo")
    for _ in range(3):
        with rec.op("loss.allreduce"):
            pass
    assert [e.seq for e in rec.entries()] == [4, 5, 6, 7]  # the last 4
    assert rec.entry(1) is None and rec.entry(4).step == 7 and rec.oldest_open() is None
    assert "step_boundary" in format_entries(rec.entries(), time.monotonic())


def test_stall_timeout_rules():
    assert stall_timeout(5.0, 30.0, [100.0]) == 5.0  # configured wins
    assert stall_timeout(0.0, 30.0, []) == 120.0  # no step time yet: 4 x floor
    assert stall_timeout(0.0, 30.0, [0.1, 0.2, 0.1]) == 30.0  # the floor
    assert stall_timeout(0.0, 30.0, [5.0, 6.0, 100.0]) == 60.0  # 10 x median, one slow step ignored


def test_oversubscription_is_ranks_per_core_and_never_below_one():
    assert oversubscription(32, 2) == 16.0
    assert oversubscription(3, 2) == 1.5
    assert oversubscription(1, 64) == oversubscription(8, 8) == 1.0
    assert oversubscription(4, 0) == 4.0  # no affinity known: one core


def test_the_stall_floor_scales_with_ranks_per_core_up_to_a_cap():
    assert stall_floor(30.0, 1.0) == 30.0  # a core a rank or more: the option as is
    assert stall_floor(30.0, 2.0) == 60.0
    assert stall_floor(30.0, 4.0) == FLOOR_SCALED_MAX_S == 120.0  # 8 ranks on 2 cores
    assert stall_floor(30.0, 16.0) == 120.0  # 32 ranks on 2 cores: not 480 s
    assert stall_floor(300.0, 16.0) == 300.0  # a floor configured above the cap is kept
    assert stall_floor(0.0, 16.0) == 0.0


def test_the_timeout_before_the_first_step_is_bounded():
    assert warmup_timeout(30.0) == 120.0  # 4 floors
    assert warmup_timeout(120.0) == WARMUP_MAX_S == 240.0  # not 480 s
    assert warmup_timeout(300.0) == 300.0  # never below the floor
    # Every rank per core the defaults can meet: a stall before the first step is declared within 240 s.
    assert max(stall_timeout(0.0, stall_floor(30.0, factor), []) for factor in (1, 2, 4, 8, 16, 64)) == 240.0
    assert stall_timeout(0.0, stall_floor(30.0, 16.0), [0.5]) == 120.0  # then the floor


def test_the_stall_clock_counts_a_starved_gap_as_frozen_s_and_checkpoint_time_not_at_all():
    clock = StallClock(frozen_s=2.0)
    now = 0.0
    clock.tick(now)
    assert clock.open_for(0, now, now) == 0.0
    opened = now
    for _ in range(10):  # a tick every 0.5 s, then the thread starved for 6 s: 5 + 2
        now += 0.5
        clock.tick(now)
    now += 6.0
    clock.tick(now)
    assert clock.open_for(7, opened, now) == pytest.approx(2.0)  # first seen now: at most frozen_s before
    for _ in range(10):
        now += 0.5
        clock.tick(now)
    now += 6.0
    clock.tick(now)
    assert clock.open_for(7, opened, now) == pytest.approx(2.0 + 5.0 + 2.0)
    for _ in range(4):  # checkpoint I/O: not counted
        now += 0.5
        clock.tick(now, counting=False)
    assert clock.open_for(7, opened, now) == pytest.approx(9.0)
    # A machine that starves the thread for 3 s in every 10 s still reaches any timeout: the count grows.
    for _ in range(100):
        for _ in range(14):
            now += 0.5
            clock.tick(now)
        now += 3.0
        clock.tick(now)
    assert clock.open_for(7, opened, now) == pytest.approx(9.0 + 100 * (7.0 + 2.0))
    now += 1.0
    clock.tick(now)
    assert clock.open_for(8, now - 0.2, now) == pytest.approx(0.2)  # the next collective starts from its start
    assert clock.open_for(0, now, now) == 0.0


def test_desync_compares_the_same_position():
    rec = FlightRecorder()
    rec.start("reducer.outcome")
    assert desync(rec.entry(1), 1, "reducer.outcome", -1) is None
    assert desync(rec.entry(1), 1, "loss.allreduce", -1) == \
        "loss.allreduce (#1) there, reducer.outcome (#1) here"
    assert desync(rec.entry(2), 2, "loss.allreduce", -1) is None  # not there yet
    # Gradient buckets may fall elsewhere between control collectives (find_unused): never compared.
    rec.start("allreduce.bucket", bucket=0)
    assert desync(rec.entry(2), 2, "reducer.outcome", -1) is None
    assert rec.latest_control().seq == 1 and rec.latest().seq == 2
    # Histories that differ earlier (a mismatch MPI matched silently) differ in the digest ever after.
    other = FlightRecorder()
    for op in ("loss.allreduce", "allreduce.bucket", "step_boundary"):
        other.start(op)
    rec.start("step_boundary")
    assert desync(rec.entry(3), 3, "step_boundary", -1, other.entry(3).digest).startswith(
        "both are at step_boundary (#3), but the collectives before it differ")
    twin = FlightRecorder()  # the same control collectives, the bucket elsewhere: no desync
    for op in ("allreduce.bucket", "reducer.outcome", "step_boundary"):
        twin.start(op)
    assert desync(rec.entry(3), 3, "step_boundary", -1, twin.entry(3).digest) is None


def test_analyze_stall_names_who_is_behind_mismatched_or_silent():
    waiting = rank_state(12, 105, "allreduce.bucket", 0, open_seq=105, open_op="allreduce.bucket", open_s=31.0)
    result = analyze_stall({0: waiting, 1: rank_state(11, 98), 2: waiting, 3: None})
    assert result["behind"] == [1] and result["silent"] == [3] and result["mismatched"] == []
    assert "rank 1: step 11, not in a collective" in result["lines"][1] and "BEHIND by 7" in result["lines"][1]
    assert "waiting in allreduce.bucket[0] (#105) for 31.0 s" in result["lines"][0]
    assert "no answer" in result["lines"][3]
    odd = rank_state(3, 9, "loss.allreduce", open_seq=9, open_op="loss.allreduce")
    result = analyze_stall({0: rank_state(3, 9), 1: odd, 2: rank_state(3, 9)})
    assert result["mismatched"] == [1] and "desync" in result["lines"][-1]
    assert analyze_stall({0: rank_state(3, 9), 1: odd})["mismatched"] == [0, 1]  # no majority of two
    moved_on = analyze_stall({0: rank_state(3, 12), 1: rank_state(3, 11)}, known_mismatch=(1, 0))
    assert moved_on["mismatched"] == [0, 1] and moved_on["behind"] == [] and "MISMATCHED" in moved_on["lines"][1]
    same = {r: waiting for r in range(3)}
    assert "network or the collective library" in analyze_stall(same)["lines"][-1]
