"""The architectures benchmark's arithmetic and report (pure; the runs themselves are too slow for CI)."""

import argparse
import json
import time

import pytest

from hpcnet.bench.architectures import SEED, recovery_time, report, step_statistics
from hpcnet.observe.stats import percentile


def test_percentile_interpolates():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_step_statistics_of_steady_steps():
    # Steps of 100 ms, but every 10th takes 200 ms (a checkpoint): seen in p99, not in p50.
    times, t = {0: 1000.0}, 1000.0
    for step in range(1, 101):
        t += 0.2 if step % 10 == 0 else 0.1
        times[step] = t
    stats = step_statistics(times, 0, 100, global_batch=64)
    assert stats["steps"] == 100
    assert stats["samples_per_s"] == pytest.approx(64 * 100 / 11.0)
    assert stats["step_p50_s"] == pytest.approx(0.1)
    assert stats["step_p99_s"] == pytest.approx(0.2)
    assert stats["jitter_pct"] == pytest.approx(50.0)  # p5 0.1, p95 0.2: ±half the range over the median
    assert stats["cv_pct"] == pytest.approx(100 * 0.03 / 0.11, rel=1e-6)
    even = step_statistics({s: 0.25 * s for s in range(21)}, 5, 20, global_batch=8)
    assert even["jitter_pct"] == pytest.approx(0.0) and even["cv_pct"] == pytest.approx(0.0, abs=1e-9)
    assert even["samples_per_s"] == pytest.approx(32.0)
    with pytest.raises(ValueError, match="completion times"):
        step_statistics({0: 0.0, 1: 1.0}, 0, 1, global_batch=1)


def _log(path, stamp, message):
    clock = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) + f",{int(stamp * 1000) % 1000:03d}"
    path.write_text(f"{clock} rank 0 INFO hpcnet.x: {message}\n")


def test_recovery_time_from_the_run_records(tmp_path):
    first, second = tmp_path / "attempt-1", tmp_path / "attempt-2"
    first.mkdir()
    second.mkdir()
    _log(first / "rank1.log", 1000.5, "fault injection: rank 1 kills itself (SIGKILL) at step 30")
    _log(second / "rank0.log", 1010.0, "resumed from /x/ckpt-0000000020.h5 at step 20 (saved by 2 rank(s))")
    (second / "metrics.rank0.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "loss": 1.0, "time": 1010.0 + s - 20}) for s in (21, 22)) + "\n")
    assert recovery_time(tmp_path, victim=1) == {"recovery_s": pytest.approx(10.5, abs=1e-3), "resumed_at_step": 20}
    (second / "metrics.rank0.jsonl").write_text("")
    with pytest.raises(RuntimeError, match="no step after resuming at step 20"):
        recovery_time(tmp_path, victim=1)


def test_report_sets_ours_beside_the_seed():
    ours = {"samples_per_s": 900.0, "jitter_pct": 3.2, "step_p50_s": 0.07, "step_p99_s": 0.2, "cv_pct": 9.5,
            "recovery_s": 12.3, "wall_s": 40.0}
    text = report({"single": {**ours, "recovery_s": None}, "mpirun": ours,
                   "slurm": {"skipped": "no SLURM answers here"}}, argparse.Namespace(np=2))
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["architecture", "samples/s", "jitter"]
    single, mpirun, slurm = lines[2:5]
    assert "N/A" in single and "312" in single and "±2%" in single
    assert "900" in mpirun and "±3.2%" in mpirun and "70 / 200" in mpirun and "12.3 s" in mpirun
    assert "2408" in mpirun and "83 s" in mpirun
    assert "no SLURM answers here" in slurm and "1987" in slurm and "17 s" in slurm
    assert set(SEED) == {"single", "mpirun", "slurm"}
