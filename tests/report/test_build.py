"""``python -m hpcnet.report``: finished, crashed, old-format and launch directories from fixture files, a real run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcnet.report.build import main
from tests.helpers.launch import ROOT

PLOTS = ("loss", "samples_per_s", "step_times", "phases", "memory", "busbw")
T0 = 1_800_000_000.0


def _line(step: int, rank: int, *, new: bool, t: float, log_every: int) -> dict:
    """A log line of metrics.rank<rank>.jsonl; ``new``: with the per-step fields, else only the original ones."""
    line = {"step": step, "time": t, "loss": 2.0 - 0.01 * step + 0.001 * rank, "global_loss": 2.0 - 0.01 * step,
            "lr": 0.1, "samples_per_s": 100.0 + step, "epoch": 0}
    if new:
        step_s = [0.1 + 0.01 * rank + 0.001 * (i % 3) for i in range(log_every)]
        share = {"data": 0.05, "forward": 0.3, "backward": 0.4, "comm": 0.15, "optimizer": 0.05, "checkpoint": 0.0,
                 "eval": 0.0, "other": 0.05}
        line.update(steps=log_every, step_s=step_s, phases_s={k: v * sum(step_s) for k, v in share.items()},
                    rss_mb=400.0 + step, buckets=[{"bucket": 0, "bytes": 2**20, "seconds": 0.002},
                                                  {"bucket": 1, "bytes": 25 * 2**20, "seconds": 0.02 + 0.001 * rank}],
                    slowest_rank=1, slowest_step_s=0.111)
    return line


def write_run(path: Path, *, ranks: int = 2, world_size: int = 2, steps: int = 12, log_every: int = 3,
              new: bool = True, finished: bool = True, t0: float = T0) -> Path:
    """A run directory as the trainer leaves it: config.toml, metrics of ``ranks`` ranks, summary.json when
    ``finished``, eval lines every 6 steps."""
    path.mkdir(parents=True)
    (path / "config.toml").write_text("[train]\nsteps = 12\n")
    for rank in range(ranks):
        lines = []
        for step in range(log_every, steps + 1, log_every):
            t = t0 + 0.1 * step
            lines.append(_line(step, rank, new=new, t=t, log_every=log_every))
            if step % 6 == 0:
                lines.append({"step": step, "time": t + 0.01, "eval_loss": 2.1 - 0.01 * step,
                              "eval_accuracy": 0.25 + 0.01 * step})
        (path / f"metrics.rank{rank}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if finished:
        summary = {"steps": steps, "start_step": 0, "final_loss": 1.9, "samples_per_s": 105.0, "wall_s": 12.5,
                   "world_size": world_size, "eval": {"eval_loss": 2.0, "eval_accuracy": 0.37}}
        if new:
            summary["step_stats"] = {
                "per_rank": [{"rank": r, "steps": steps - 1, "median_s": 0.1 + 0.01 * r, "p95_s": 0.12 + 0.01 * r,
                              "cv_pct": 3.0, "jitter_pct": 5.0,
                              "phases_s": {"forward": 0.4 * steps, "backward": 0.6 * steps}}
                             for r in range(world_size)],
                "slowest_rank": world_size - 1, "slowest_median_s": 0.1 + 0.01 * (world_size - 1),
                "slowest_over_median": 1.05, "straggler_share": 0.04, "median_s": 0.105, "jitter_pct": 5.0,
                "cv_pct": 3.0}
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def _report(tmp_path: Path, source: Path) -> str:
    out = tmp_path / "out"
    assert main([str(source), "--out", str(out)]) == 0
    return (out / "report.md").read_text()


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_finished_run_gives_every_plot_and_a_report_naming_them(tmp_path):
    run_dir = write_run(tmp_path / "run")
    (run_dir / "trace.json").write_text('{"traceEvents": []}')
    assert main([str(run_dir)]) == 0  # default --out: RUN_DIR/report
    out = run_dir / "report"
    text = (out / "report.md").read_text()
    for name in PLOTS:
        assert _is_png(out / f"{name}.png"), name
        assert f"]({name}.png)" in text
    assert "Not drawn" not in text
    assert "finished: 12 steps" in text and "| straggler share | 4.0 % |" in text
    assert "x1.050 the median rank" in text and "| eval accuracy | 0.3700 |" in text
    assert "[trace.json](../trace.json)" in text
    assert "| 1 | 110.0 ms | 130.0 ms | 3.0 % | ±5.0 % |" in text  # rank 1 from step_stats


def test_crashed_run_with_a_partial_last_line_and_failure_json(tmp_path):
    run_dir = write_run(tmp_path / "run", finished=False)
    with open(run_dir / "metrics.rank1.jsonl", "a") as f:
        f.write('{"step": 15, "time": 1800000001.5, "loss": 1.8, "step_s": [0.1, 0.')  # cut by the crash
    (run_dir / "failure.json").write_text(json.dumps({
        "kind": "heartbeat", "failed": [{"rank": 1, "host": "node7", "last_step": 12}],
        "message": "rank 1 on node7 missed 3 heartbeats", "detected_by": 0}))
    text = _report(tmp_path, run_dir)
    for name in PLOTS:
        assert (tmp_path / "out" / f"{name}.png").exists(), name
    assert "failed (last logged step 12): heartbeat: rank 1 on node7 at step 12" in text
    assert "1 incomplete metrics line(s) left out" in text
    assert "From metrics lines" in text  # no summary.json: per-rank figures computed from step_s
    assert "rank 1 on node7 missed 3 heartbeats" in text


def test_running_run_with_only_a_config_is_reported_with_every_plot_skipped(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text("")
    (run_dir / "metrics.rank0.jsonl").write_text('{"step": 1, "loss"')
    text = _report(tmp_path, run_dir)
    assert "still running, or it ended without one (no step logged yet)" in text
    assert "- loss: no log lines yet" in text and "- phases: no phases_s" in text


def test_old_run_without_the_new_fields_skips_those_plots_and_says_why(tmp_path):
    text = _report(tmp_path, write_run(tmp_path / "run", ranks=1, new=False))
    out = tmp_path / "out"
    assert _is_png(out / "loss.png") and _is_png(out / "samples_per_s.png")
    assert not (out / "step_times.png").exists() and not (out / "busbw.png").exists()
    assert "- step times: the metrics lines have no step_s" in text
    assert "- memory: the metrics lines have no rss_mb" in text
    assert "- busbw: no bucket timings" in text


def test_rank_0_metrics_only_says_how_to_get_every_rank(tmp_path):
    text = _report(tmp_path, write_run(tmp_path / "run", ranks=1, world_size=4))
    assert "only rank 0 of 4 wrote metrics: run with run.metrics=all to get every rank" in text
    # summary.json has every rank's phase totals even so
    assert "source: summary.json step_stats" in text


def write_launch(path: Path) -> Path:
    """A launch directory: attempt 1 killed at step 7, attempt 2 resumed from step 6 and finished, 3 s later."""
    path.mkdir()
    write_run(path / "attempt-1", steps=6, finished=False, t0=T0)
    write_run(path / "attempt-2", steps=12, t0=T0 + 20)
    for rank in range(2):  # attempt 2 resumed from the checkpoint of step 6: its lines start after it
        file = path / "attempt-2" / f"metrics.rank{rank}.jsonl"
        file.write_text("".join(line + "\n" for line in file.read_text().splitlines()
                                if json.loads(line)["step"] > 6))
    attempts = [
        {"attempt": 1, "run_dir": str(path / "attempt-1"), "start_unix": T0 - 5, "end_unix": T0 + 10,
         "duration_s": 15.0, "status": 137, "cause": "rank 1 on node7 died of signal 9 (SIGKILL)",
         "restartable": True, "failure": {"kind": "rank died", "source": "launcher", "rank": 1, "host": "node7",
                                          "signal": 9}},
        {"attempt": 2, "run_dir": str(path / "attempt-2"), "start_unix": T0 + 11, "end_unix": T0 + 22,
         "duration_s": 11.0, "status": 0, "cause": "", "restartable": False, "failure": None}]
    (path / "launch.json").write_text(json.dumps({"command": ["mpirun"], "launch_dir": str(path),
                                                  "attempts": attempts, "final_status": 0, "message": ""}))
    return path


def test_launch_directory_gives_the_attempts_timeline_with_cause_and_recovery(tmp_path):
    text = _report(tmp_path, write_launch(tmp_path / "launch"))
    assert _is_png(tmp_path / "out" / "attempts.png")
    assert "](attempts.png)" in text
    assert "2 attempt(s); final status 0 (finished)" in text
    # Attempt 2's first line is step 9 at T0 + 20.9 with 3 steps of 0.1xx s: its first step (7) ended
    # 0.2 s of steps earlier, T0 + 20.698; attempt 1 ended at T0 + 10.
    assert ("| 1 | 0.0 | 15.0 | 137 (killed by signal 9 (SIGKILL)) | rank 1 on node7 died of signal 9 (SIGKILL) | "
            "1 (at 5.1) | 6 | - |") in text
    assert "| 2 | 16.0 | 27.0 | 0 (finished) | - | 7 (at 25.7) | 12 | 10.7 |" in text
    for name in PLOTS:
        assert (tmp_path / "out" / f"{name}.png").exists(), name


def test_an_attempt_running_now_is_shown_before_launch_json_records_it(tmp_path):
    launch = write_launch(tmp_path / "launch")
    write_run(launch / "attempt-3", steps=3, finished=False, t0=T0 + 30)
    text = _report(tmp_path, launch)
    assert "| 3 | - | 35.3 | running | - | 1 (at 35.1) | 3 | - |" in text


def test_missing_or_wrong_run_dir_is_a_clear_error_with_status_2(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"hpcnet.report: error: {tmp_path / 'nowhere'}: no such directory\n"
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    out = subprocess.run([sys.executable, "-m", "hpcnet.report", str(tmp_path / "nowhere")], capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "no such directory" in out.stderr


def test_imports_neither_torch_nor_mpi4py(tmp_path):
    run_dir = write_run(tmp_path / "run")
    code = ("import sys; from hpcnet.report.build import main; rc = main([sys.argv[1]]); "
            "bad = {'torch', 'mpi4py'} & set(sys.modules); assert not bad, bad; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr


def test_missing_matplotlib_is_one_line_naming_the_fix(tmp_path):
    run_dir = write_run(tmp_path / "run")
    code = ("import sys; sys.modules['matplotlib'] = None; from hpcnet.report.build import main; "
            "sys.exit(main([sys.argv[1]]))")
    out = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 2
    assert out.stderr == ("hpcnet.report: error: matplotlib is not installed; the report needs it: "
                          "pip install -e '.[report]' (or run scripts/setup.sh)\n")


def _strip_new_fields(run_dir: Path) -> None:
    """Rewrite a real run's files as a run from before per-step phases wrote them."""
    old = {"step", "time", "loss", "global_loss", "lr", "samples_per_s", "epoch", "eval_loss", "eval_accuracy"}
    for file in run_dir.glob("metrics.rank*.jsonl"):
        lines = [json.loads(line) for line in file.read_text().splitlines()]
        file.write_text("".join(json.dumps({k: v for k, v in line.items() if k in old}) + "\n" for line in lines))
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.pop("step_stats", None)
    (run_dir / "summary.json").write_text(json.dumps(summary))


@pytest.mark.timeout(180)
def test_report_of_a_real_run_with_and_without_the_new_fields(tmp_path):
    from mpi4py import MPI

    from hpcnet.train import run
    from tests.helpers.data import tiny_images
    from tests.helpers.train import train_config

    dataset = tiny_images(MPI.COMM_SELF, tmp_path, "tiny.h5", num_train=128, num_eval=32, seed=5)
    cfg = train_config(tmp_path, dataset, "real", "train.steps=6", "run.log_every=2", "run.metrics=all",
                       "train.eval_every=3", "model.name=mlp", "model.options.hidden=[16]")
    run(cfg, MPI.COMM_SELF)
    run_dir = tmp_path / "runs" / "real"
    text = _report(tmp_path, run_dir)
    for name in ("loss", "samples_per_s", "memory"):
        assert _is_png(tmp_path / "out" / f"{name}.png"), name
    assert "finished: 6 steps" in text and "](loss.png)" in text
    if '"step_s"' in (run_dir / "metrics.rank0.jsonl").read_text():  # the trainer writes the new fields
        assert "](step_times.png)" in text and "](phases.png)" in text
        assert "| median step (median rank) |" in text and "| 0 |" in text  # summary and per-rank table
    assert "busbw: one rank, no gradient communication" in text
    _strip_new_fields(run_dir)
    (tmp_path / "out" / "report.md").unlink()
    text = _report(tmp_path, run_dir)
    assert "](loss.png)" in text and "- step times: the metrics lines have no step_s" in text
    assert not (tmp_path / "out" / "step_times.png").exists()  # the first report's, removed
