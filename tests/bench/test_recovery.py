"""bench recovery's command line: the defaults that depend on ``--cluster`` and ``--live`` and the options it refuses;
``--live``'s figures from the runs' logs and its table."""

import datetime
import json
import os
import re

import pytest

from hpcnet.bench.recovery import _checked, _parser, main
from hpcnet.bench.recovery_live import first_step_after, grow_figures, live_figures, report
from hpcnet.bench.recovery_restart import job_options, step_gap_s


def _args(*argv):
    parser = _parser()
    args = parser.parse_args(list(argv))
    return args, _checked(parser, args)


def test_the_defaults_are_the_single_host_ones_or_the_cluster_ones():
    args, modes = _args()
    assert (args.np, args.steps, args.kill_at, args.trials, args.settle_s) == (2, 40, 25, 5, 10.0)
    assert modes == ["cold", "warm"]
    args, _ = _args("--cluster")
    assert (args.np, args.steps, args.kill_at, args.trials, args.settle_s) == (4, 80, 13, 2, 3.0)
    args, modes = _args("--cluster", "--np", "3", "--modes", "warm")
    assert args.np == 3 and modes == ["warm"]  # what is given is kept


def test_every_run_trains_the_same_job_with_the_extra_options_last():
    args, _ = _args("--steps", "30", "--settle-s", "0", "dist.probe=false")
    options = job_options(args)
    assert "train.steps=30" in options and options[-1] == "dist.probe=false"
    assert not any(o.startswith("fault.sleep") for o in options)  # --settle-s 0: no sleep at step 2
    args, _ = _args("--live")
    assert "fault.sleep_at_step=2" in job_options(args) and "fault.sleep_s=20.0" in job_options(args)
    assert not any(o.startswith("fault.sleep") for o in job_options(args, settle=False))  # live: no standby to wait for


def test_live_runs_four_ranks_in_three_rounds_of_its_own_contenders():
    args, modes = _args("--live")
    assert (args.np, args.steps, args.kill_at, args.every_steps, args.rounds, args.settle_s) == (4, 40, 25, 10, 3,
                                                                                                20.0)
    assert modes == [] and args.trials is None  # live, warm and cold: no --modes, no --trials
    args, _ = _args("--live", "--rounds", "1", "--np", "6")
    assert (args.rounds, args.np) == (1, 6)


@pytest.mark.parametrize("argv, message", [
    (["--kill-at", "50"], "need 2 < --every-steps < --kill-at < --steps"),
    (["--modes", "hot"], "--modes takes cold, warm or both"),
    (["--trials", "0"], "--trials must be at least 1"),
    (["--live", "--cluster"], "--cluster and --live are two benchmarks: give one"),
    (["--live", "--trials", "2"], "--trials is not an option of --live, which runs live, warm and cold in --rounds"),
    (["--live", "--modes", "warm"], "--modes is not an option of --live"),
    (["--rounds", "2"], "--rounds is an option of --live only"),
    (["--cluster", "--rounds", "2"], "--rounds is an option of --live only"),
    (["--live", "--rounds", "0"], "--live needs --np of at least 2 and --rounds of at least 1"),
    (["--live", "--np", "1"], "--live needs --np of at least 2"),
    (["--live", "--kill-at", "37"], "--live needs --kill-at + 3 < --steps: the replacement joins 3 steps after the "
                                    "kill"),
])
def test_a_bad_option_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _args(*argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_live_without_a_running_cluster_is_refused_in_one_line_with_status_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HPCNET_CLUSTER_DIR", str(tmp_path / "no-cluster"))  # cluster.sh status: not running
    assert main(["--live", "--dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench recovery --live: needs a running local cluster: scripts/cluster.sh start")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()


def test_live_without_a_fault_tolerant_mpi_is_refused_naming_it(monkeypatch, tmp_path, capsys):
    bin_dir = tmp_path / "bin"  # an mpirun without ompi_info beside it, and no venv copy: scripts/ftmpirun has none
    bin_dir.mkdir()
    (bin_dir / "mpirun").write_text("#!/bin/sh\necho 'mpirun (Open MPI) 4.1.4'\n")
    (bin_dir / "mpirun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HPCNET_VENV", str(tmp_path / "no-venv"))
    assert main(["--live"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench recovery --live: ") and "no fault-tolerant MPI (ftmpirun: no Open MPI >= 5" in err
    assert "run scripts/setup.sh" in err and len(err.strip().splitlines()) == 1


def test_the_next_step_after_a_kill_is_one_past_the_killed_step_logged_after_it():
    times = {23: 10.0, 24: 10.2, 25: 10.6, 26: 12.0, 27: 12.1}
    assert first_step_after(times, 25, 10.4) == (26, 12.0)  # step 25, done before the kill, logged after it
    assert first_step_after(times, 27, 10.4) is None
    gaps = {1: 0.0, 2: 0.1, 3: 0.2, 4: 0.3, 5: 9.0, 6: 9.1}  # 5: a checkpoint's or a sleep's step
    assert step_gap_s(gaps, 6) == pytest.approx(0.1) and step_gap_s(gaps, 2) is None


def _log_line(stamp, rank, level, logger, message):
    when = datetime.datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    return f"{when} rank {rank} {level} {logger}: {message}\n"


def test_a_live_run_is_read_from_the_victims_kill_line_rank_0s_rebuilt_line_metrics_and_record(tmp_path):
    t0 = 1_796_651_600.0
    (tmp_path / "rank3.log").write_text(_log_line(t0 - 5, 3, "INFO", "hpcnet.train", "model mlp: 10 parameters")
                                        + _log_line(t0, 3, "ERROR", "hpcnet.fault.inject", "fault injection: rank 3 "
                                                    "kills itself (SIGKILL) at step 25"))
    (tmp_path / "rank0.log").write_text(_log_line(t0 + 1.5, 0, "WARNING", "hpcnet.fault.live", "lost rank 3 (hpcb) at "
                                                  "step 25: the 3 survivors shrank the job in 0.100 s and rebuilt it"))
    steps = {23: t0 - 0.4, 24: t0 - 0.2, 25: t0 + 0.05, 26: t0 + 2.0, 27: t0 + 2.1}  # 25: logged after the kill
    (tmp_path / "metrics.rank0.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "time": t}) + "\n"
                                                          for s, t in steps.items()))
    record = {"lost": [{"rank": 3, "host": "hpcb"}], "world_size": 3, "step": 25, "state": "memory", "shrink_s": 0.1,
              "rebuild_s": 1.2, "rebuild_phases_s": {"monitor": 0.5}, "resumed_step": 25, "recomputed_steps": 0}
    (tmp_path / "summary.json").write_text(json.dumps({"recovery": {"recoveries": [record]}}))
    figures = live_figures(tmp_path, 25, 3)
    assert figures["next_step"] == 26 and figures["kill_to_next_step_s"] == pytest.approx(2.0, abs=2e-3)
    assert figures["seen_s"] == pytest.approx(0.2, abs=2e-3)  # the rebuilt line, less shrink and rebuild
    assert figures["ready_to_step_s"] == pytest.approx(0.5, abs=2e-3)
    assert (figures["steps_recomputed"], figures["world_size_after"], figures["state"]) == (0, 3, "memory")
    assert figures["step_time_before_s"] == pytest.approx(0.2)
    (tmp_path / "summary.json").write_text(json.dumps({"recovery": {"recoveries": []}}))  # the job never shrank
    with pytest.raises(RuntimeError, match="0 recoveries"):
        live_figures(tmp_path, 25, 3)


def test_a_live_runs_grow_back_is_read_from_its_last_grow_record_and_must_end_at_the_first_size(tmp_path):
    grow = {"joined": 1, "world_size": 4, "from_world_size": 3, "step": 28, "started_after_step": 26, "spawn_s": 1.15,
            "ready_s": 1.4, "pause_s": 0.95, "hosts": ["hpcb"], "resumed_step": 28}
    (tmp_path / "summary.json").write_text(json.dumps({"world_size": 4, "recovery": {"grows": [grow]}}))
    assert grow_figures(tmp_path, 4) == {"grow_pause_s": 0.95, "grow_spawn_s": 1.15, "grow_ready_s": 1.4,
                                         "grow_step": 28, "grow_hosts": ["hpcb"], "world_size_end": 4}
    (tmp_path / "summary.json").write_text(json.dumps({"world_size": 3, "recovery": {"grows": []}}))
    with pytest.raises(RuntimeError, match="no grow back to 4 ranks \\(0 grows, 3 ranks at the end\\)"):
        grow_figures(tmp_path, 4)  # the replacement never joined: the run ended at the shrunk size
    (tmp_path / "summary.json").write_text(json.dumps({"world_size": 3, "recovery": {"grows": [grow]}}))
    with pytest.raises(RuntimeError, match="1 grows, 3 ranks at the end"):
        grow_figures(tmp_path, 4)  # grew back, then lost a rank again


def _live_figures():
    """Two rounds; cold's second run failed."""
    def live(round_, total, step_s):
        return {"round": round_, "kill_to_next_step_s": total, "kill_to_new_step_s": total, "steps_recomputed": 0,
                "seen_s": 0.2, "ready_to_step_s": total - 0.6, "world_size_after": 3, "step_time_before_s": step_s,
                "lost": [{"rank": 3, "host": "hpcb"}],
                "shrink_s": 0.012, "rebuild_s": 0.4, "grow_pause_s": total + 0.5, "grow_spawn_s": 1.1,
                "grow_ready_s": 1.3 + round_, "grow_hosts": ["hpcb"], "world_size_end": 4}

    def restart(round_, total, new, standby):
        return {"round": round_, "kill_to_next_step_s": total, "kill_to_new_step_s": new, "steps_recomputed": 5,
                "seen_s": 1.0, "ready_to_step_s": 0.5, "world_size_after": 4, "step_time_before_s": 0.07,
                "standby_used": standby}

    results = {"live": [live(0, 1.0, 0.060), live(1, 1.4, 0.064)],
               "warm": [restart(0, 4.0, 5.0, True), restart(1, 4.9, 6.0, False)],
               "cold": [restart(0, 9.0, 10.0, False), {"round": 1, "error": "cold-1: status 1:\nboom"}],
               "ulfm": [{"round": 0, "step_time_s": 0.1}, {"round": 1, "step_time_s": 0.2}],
               "ompi4": [{"round": 0, "step_time_s": 0.096}, {"round": 1, "step_time_s": 0.194}]}
    return {"hosts": ["hpca", "hpcb"], "np": 4, "steps": 40, "kill_at": 25, "every_steps": 10, "rounds": 2,
            "versions": {"ftmpirun": "mpirun (Open MPI) 5.0.11", "mpirun": "mpirun (Open MPI) 4.1.4",
                         "torch": "2.13.0+cpu", "mpi4py": "4.1.2"},
            "environment": {"OMPI_MCA_mpi_yield_when_idle": "1"}, "job": [], "runs": "/tmp/x",
            "load_average_start": (2.5, 3.0, 3.5), "load_average_end": (4.0, 4.25, 4.5), "results": results}


def test_the_live_table_gives_each_contender_median_and_range_and_the_targets_paired_by_round():
    text = report(_live_figures())
    lines = text.splitlines()
    assert lines[0].startswith("live recovery against restarts on the local cluster (hpca, hpcb): 4 ranks, the mlp at "
                               "dist.zero=0, rank 3 (hpcb) killed (-9) after step 25, a checkpoint every 10 steps; "
                               "live grows back (fault.grow=spawn fault.grow_after_steps=2: a replacement started at "
                               "the first boundary after the loss, called in 2 steps later); 2 round(s)")
    assert lines[1] == ("live: mpirun (Open MPI) 5.0.11 (scripts/ftmpirun); warm, cold: hpcnet.launch over mpirun "
                        "(Open MPI) 4.1.4; torch 2.13.0+cpu, mpi4py 4.1.2; OMPI_MCA_mpi_yield_when_idle=1")
    assert lines[3].split() == ["live", "(n=2)", "warm", "(n=2)", "cold", "(n=1)"]
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in lines[5:19])}
    assert rows == {"kill -> next step done (s)": ["1.20 (1.00-1.40)", "4.45 (4.00-4.90)", "9.00"],
                    "kill -> failure seen (s)": ["0.20", "1.00", "1.00"],
                    "ready -> next step done (s)": ["0.60 (0.40-0.80)", "0.50", "0.50"],
                    "kill -> first step past the kill's (s)": ["1.20 (1.00-1.40)", "5.50 (5.00-6.00)", "10.00"],
                    "steps computed again": ["0", "5", "5"], "world size after": ["3", "4", "4"],
                    "step time before the kill (ms)": ["62 (60-64)", "70", "70"],
                    "shrink (s, the survivors' record)": ["0.012", "-", "-"],
                    "rebuild (s, the survivors' record)": ["0.40", "-", "-"],
                    "grow back: the survivors' pause, join (s)": ["1.70 (1.50-1.90)", "-", "-"],
                    "the survivors' pause, spawn (s)": ["1.10", "-", "-"],
                    "replacement started -> ready (s)": ["1.80 (1.30-2.30)", "-", "-"],
                    "world size at the end": ["4", "-", "-"],  # the restarts relaunch at the first size: no grow
                    "standby used": ["-", "1/2", "-"]}
    assert "live, kill -> next step: target <= 0.5 s and 0 steps computed again: not met" in lines
    assert "live / warm, kill -> next step, paired by round: 0.27 (0.25-0.29); target <= 0.3: met" in lines
    assert ("grow back, the survivors' pause at the join (s): live 1.70 (1.50-1.90); target <= 2.0 s: met (the pause "
            "for the spawn besides, s: live 1.10); the replacements ran on hpcb (2)") in lines
    assert ("failure-free step time (ms), the same job without the kill: ULFM (cluster.sh ftmpirun) 150.0 "
            "(100.0-200.0), Open MPI 4.1 (cluster.sh mpirun) 145.0 (96.0-194.0); Open MPI 4.1 / ULFM, paired by "
            "round: 0.96 (0.96-0.97); target >= 0.95: met") in lines
    assert "load average (1, 5, 15 min): 2.50, 3.00, 3.50 at the start, 4.00, 4.25, 4.50 at the end; runs in /tmp/x" \
        in lines
    assert lines[-2:] == ["1 run(s) failed:", "cold round 2: cold-1: status 1: ... boom"]


def test_the_mirrored_contender_has_its_column_and_the_mirrors_target_its_lines():
    figures = _live_figures()
    results = figures["results"]
    results["mirrored"] = [{**run, "state": "mirror", "world_size_after": 3} for run in results["live"]]
    mib = 2**20
    results["plain2"] = [{"round": 0, "step_time_s": 0.1}, {"round": 1, "step_time_s": 0.2}]
    results["mirrored2"] = [{"round": 0, "step_time_s": 0.105, "snapshot_bytes": 14 * mib, "ward_bytes": 7 * mib,
                             "capture_s": 0.004},
                            {"round": 1, "step_time_s": 0.25, "snapshot_bytes": 14 * mib, "ward_bytes": 7 * mib,
                             "capture_s": 0.006}]
    results["mirrored"][1]["grow_pause_s"] = 2.5
    lines = report(figures).splitlines()
    assert lines[0].endswith("; mirrored: live at dist.zero=2 with fault.replicas=1")
    assert ("grow back, the survivors' pause at the join (s): live 1.70 (1.50-1.90); mirrored 2.00 (1.50-2.50); "
            "target <= 2.0 s: met (the pause for the spawn besides, s: live 1.10; mirrored 1.10); the replacements "
            "ran on hpcb (4)") in lines
    results["mirrored"][0]["grow_pause_s"] = 2.2  # mirrored's median over the target: not met for both
    assert "mirrored 2.35 (2.20-2.50); target <= 2.0 s: not met" in report(figures)
    assert lines[3].split() == ["live", "(n=2)", "mirrored", "(n=2)", "warm", "(n=2)", "cold", "(n=1)"]
    assert ("failure-free step time (ms) at dist.zero=2 under ULFM: without mirrors 150.0 (100.0-200.0), with "
            "(fault.replicas=1) 177.5 (105.0-250.0); with / without, paired by round: 1.15 (1.05-1.25); target <= 1.1: "
            "not met") in lines
    assert ("mirrors' host memory a rank (the largest rank's, MiB): snapshot 14.00, ward's shards 7.00; a capture "
            "(copy and exchange, rank 0's median) 5.0 (4.0-6.0) ms") in lines
