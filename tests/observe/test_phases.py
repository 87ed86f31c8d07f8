"""Where each step's time goes: the phase clock (pure), the step statistics (pure), and what a run writes
(metrics lines whose phases add up to their steps, summary.json's step_stats) under MPI."""

import json
import time

import pytest

from hpcnet.fault.flightrec import Collective
from hpcnet.observe.phases import PHASES, PhaseClock, bucket_times, overhead_s
from hpcnet.observe.stats import cv_pct, jitter_pct, job_step_stats, percentile, rank_step_stats
from hpcnet.paths import SUMMARY_FILE, metrics_file
from tests.helpers.data import tiny_images
from tests.helpers.train import train_config


def test_phases_partition_each_step_and_a_split_moves_the_tail_to_the_next():
    clock = PhaseClock()
    clock.mark("data")  # outside a step: ignored
    for _ in range(3):
        clock.start_step()
        time.sleep(0.002)
        clock.mark("forward")
        clock.mark("backward")
    clock.split()  # a log point: three steps end here
    steps, phases = clock.take_interval()
    assert len(steps) == 3 and sum(phases.values()) == pytest.approx(sum(steps), abs=1e-9)
    assert phases["forward"] >= 0.006 and set(phases) == set(PHASES)
    time.sleep(0.002)
    clock.mark("eval")  # after the log point: the next step's
    clock.start_step()  # begun at the split already
    clock.mark("data")
    clock.end()
    steps, phases = clock.take_interval()
    assert len(steps) == 1 and phases["eval"] >= 0.002
    assert sum(phases.values()) == pytest.approx(sum(steps), abs=1e-9)
    assert len(clock.step_s) == 4 and sum(clock.totals.values()) == pytest.approx(sum(clock.step_s), abs=1e-9)


def test_the_run_s_last_tail_joins_its_last_step():
    clock = PhaseClock()
    clock.start_step()
    clock.mark("forward")
    clock.split()
    clock.mark("checkpoint")  # after the last log line, before the loop ends
    clock.end()
    assert len(clock.step_s) == 1 and clock.totals["checkpoint"] > 0
    assert sum(clock.totals.values()) == pytest.approx(clock.step_s[0], abs=1e-9)


def test_a_mark_costs_microseconds():
    assert overhead_s(20_000) < 20e-6  # about 0.3 us here; a step is milliseconds at least


def test_jitter_is_the_seed_s_half_p5_p95_range_over_the_median():
    values = [1.0] * 90 + [1.5] * 10
    assert percentile(values, 50) == 1.0
    assert jitter_pct(values) == pytest.approx(100 * (percentile(values, 95) - percentile(values, 5)) / 2)
    assert jitter_pct([2.0] * 5) == 0.0 and cv_pct([2.0] * 5) == 0.0
    assert cv_pct([1.0, 3.0]) == pytest.approx(50.0)


def test_the_slowest_rank_and_the_straggler_share():
    fast = rank_step_stats([1.0] * 10, {"comm": 3.0, "forward": 7.0})  # computes 0.7 s of its 1 s step
    slow = rank_step_stats([1.0] * 10, {"comm": 0.0, "forward": 10.0})  # computes the whole step
    slower = rank_step_stats([1.2] * 10, {"comm": 0.0, "forward": 12.0})
    job = job_step_stats([fast, slow, slower, rank_step_stats([], {})])
    assert job["slowest_rank"] == 2 and job["slowest_over_median"] == pytest.approx(1.2)
    # Computing 0.7, 1.0 and 1.2 s: the ranks wait (1.2 - 0.967) s on average, over a 1 s median step.
    assert job["straggler_share"] == pytest.approx((1.2 - (0.7 + 1.0 + 1.2) / 3) / 1.0)
    assert [r["rank"] for r in job["per_rank"]] == [0, 1, 2, 3] and job["per_rank"][3]["steps"] == 0


def test_bucket_times_take_the_median_of_the_interval():
    entries = [Collective(1, "allreduce.bucket", 0, 100, 3, 10.0, end=10.5),
               Collective(2, "allreduce.bucket", 0, 100, 4, 11.0, end=11.1),
               Collective(3, "allreduce.bucket", 0, 100, 4, 12.0, end=12.2),
               Collective(4, "allreduce.bucket", 1, 50, 4, 12.0, end=None),  # still running
               Collective(5, "step_boundary", -1, 0, 4, 12.0, end=12.1)]
    # Steps 5 and 6 (entries stamped 4 and 5: the steps completed when each started): after step 4.
    assert bucket_times(entries, since_step=4) == [{"bucket": 0, "bytes": 100, "seconds": pytest.approx(0.2)}]


@pytest.mark.mpi
def test_every_rank_writes_phases_that_add_up_to_its_steps(comm, data_plane, mpi_tmp_path):
    from hpcnet.train import run

    dataset = tiny_images(comm, mpi_tmp_path, "phases.h5", num_train=256, num_eval=32, seed=2)
    result = run(train_config(mpi_tmp_path, dataset, "phases", "model.name=mlp", "train.steps=12",
                              "run.log_every=4", "run.metrics=all", "train.eval_every=8",
                              "checkpoint.every_steps=6"), comm, plane=data_plane)
    run_dir = mpi_tmp_path / "runs" / "phases"
    lines = [json.loads(x) for x in (run_dir / metrics_file(comm.Get_rank())).read_text().splitlines()]
    logs = [x for x in lines if "phases_s" in x]
    assert [x["step"] for x in logs] == [4, 8, 12]
    for line in logs:
        assert line["steps"] == 4 == len(line["step_s"]) and set(line["phases_s"]) == set(PHASES)
        # Rounded to microseconds field by field.
        assert sum(line["phases_s"].values()) == pytest.approx(sum(line["step_s"]), abs=2e-5)
        assert 0 <= line["slowest_rank"] < comm.Get_size() and line["rss_mb"] > 0
        assert line["buckets"] and all(b["bytes"] > 0 for b in line["buckets"])
    assert logs[1]["phases_s"]["checkpoint"] > 0  # the save after step 6
    assert logs[2]["phases_s"]["eval"] > 0  # the evaluation after step 8, charged to step 9
    if comm.Get_rank() == 0:
        stats = json.loads((run_dir / SUMMARY_FILE).read_text())["step_stats"]
        assert len(stats["per_rank"]) == comm.Get_size() and 0 <= stats["slowest_rank"] < comm.Get_size()
        assert stats["slowest_over_median"] >= 1.0 and 0 <= stats["straggler_share"] < 1
        assert all(r["steps"] == 11 for r in stats["per_rank"])  # the first step left out
        assert result.summary["step_stats"] == stats
    comm.Barrier()
