"""run.tensorboard: rank 0's event files, read back as TensorBoard reads them."""

import errno
import json
import logging
import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

from hpcnet.errors import ConfigError
from hpcnet.observe.tensorboard import TensorBoardWriter, scalars
from hpcnet.paths import TENSORBOARD_DIR, checkpoint_name
from hpcnet.train import run
from tests.helpers.data import tiny_images
from tests.helpers.train import train_config

# Logs at 2, 4, 6, evaluations and saves at 3 and 6.
SHORT = ("train.steps=6", "run.log_every=2", "train.eval_every=3", "checkpoint.every_steps=3", "model.name=mlp",
         "model.options.hidden=[16]", "run.tensorboard=true")


def _dataset(comm, directory):
    return tiny_images(comm, directory, "tb-images.h5", num_train=256, num_eval=64, seed=5)


def _scalars(directory):
    """Tag -> [(step, value)] of the event files in ``directory``, as TensorBoard shows them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _lines(run_dir, rank=0):
    return [json.loads(line) for line in (run_dir / f"metrics.rank{rank}.jsonl").read_text().splitlines()]


def _f32(value):
    """What TensorBoard keeps of a float: a float32."""
    return float(np.float32(value))


def _without_tensorboard(monkeypatch):
    """Imports of tensorboard fail in this process until the test ends, as where it is not installed."""
    for name in [n for n in sys.modules if n.startswith("tensorboard.")] + ["tensorboard"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_a_run_writes_every_tag_and_the_loss_of_its_metrics_lines(tmp_path):
    from hpcnet.report.build import main as report

    cfg = train_config(tmp_path, _dataset(MPI.COMM_SELF, tmp_path), "tb", *SHORT)
    result = run(cfg, MPI.COMM_SELF)
    run_dir = tmp_path / "runs" / "tb"
    assert result.summary["steps"] == 6
    (events,) = (run_dir / TENSORBOARD_DIR).iterdir()
    assert events.name.startswith("events.out.tfevents.")
    found = _scalars(run_dir / TENSORBOARD_DIR)
    lines = _lines(run_dir)
    logged = [r for r in lines if "global_loss" in r]
    assert found["train/loss"] == [(r["step"], _f32(r["global_loss"])) for r in logged]
    assert [s for s, _ in found["train/loss"]] == [2, 4, 6]
    assert found["train/lr"] == [(r["step"], _f32(r["lr"])) for r in logged]
    evaluations = [r for r in lines if "eval_loss" in r]
    for name in ("loss", "accuracy"):
        assert found[f"eval/{name}"] == [(r["step"], _f32(r[f"eval_{name}"])) for r in evaluations]
    assert [s for s, _ in found["eval/loss"]] == [3, 6]
    saves = [r for r in lines if "checkpoint" in r]
    # each asynchronous save twice: what it blocked, at the save; every time of it once committed (with io_s)
    assert [(r["step"], "io_s" in r["checkpoint"]) for r in saves] == [(3, False), (3, True), (6, False), (6, True)]
    assert found["checkpoint/blocking_s"] == [(r["step"], _f32(r["checkpoint"]["blocking_s"])) for r in saves]
    assert found["checkpoint/io_s"] == [(r["step"], _f32(r["checkpoint"]["io_s"])) for r in saves[1::2]]
    phases = {f"time/phase/{name}" for name in logged[0]["phases_s"]}
    assert {"time/phase/comm", "time/phase/forward", "time/phase/checkpoint"} <= phases <= set(found)
    assert {"train/samples_per_s", "time/step_s", "time/slowest_step_s", "time/comm_share", "memory/rss_mb",
            "checkpoint/snapshot_s"} <= set(found)
    assert "memory/cuda_mb" not in found  # on CPU: none
    # The report reads the run directory beside its tensorboard/ folder.
    assert report([str(run_dir)]) == 0 and (run_dir / "report" / "report.md").exists()


def test_the_scalars_of_a_log_line_are_per_step_and_any_metric_of_the_objective_is_kept():
    line = {"step": 4, "loss": 2.0, "global_loss": 1.5, "lr": 0.1, "samples_per_s": 100.0, "epoch": 0,
            "step_s": [0.3, 0.1, 0.2, 0.2], "phases_s": {"forward": 0.4, "comm": 0.2}, "rss_mb": 10.0,
            "cuda_mb": 20.0, "slowest_step_s": 0.25, "train_mae": 0.5, "buckets": [{"bucket": 0}], "time": 1.0}
    assert scalars(line) == {
        "train/loss": 1.5, "train/lr": 0.1, "train/samples_per_s": 100.0, "train/epoch": 0.0, "train/mae": 0.5,
        "time/step_s": 0.2, "time/slowest_step_s": 0.25, "time/phase/forward": 0.1, "time/phase/comm": 0.05,
        "time/comm_share": 0.25, "memory/rss_mb": 10.0, "memory/cuda_mb": 20.0}
    assert scalars({"step": 3, "eval_loss": 1.0, "eval_mae": 0.25, "eval_note": "text", "time": 1.0}) == {
        "eval/loss": 1.0, "eval/mae": 0.25}
    assert scalars({"step": 3, "checkpoint": {"blocking_s": 0.5, "bytes": 1024}}) == {
        "checkpoint/blocking_s": 0.5, "checkpoint/bytes": 1024.0}
    assert scalars({"step": 1, "note": "nothing to plot"}) == {}


def test_a_resumed_run_adds_a_file_and_hides_what_the_first_logged_after_the_resumed_step(tmp_path):
    dataset = _dataset(MPI.COMM_SELF, tmp_path)
    run(train_config(tmp_path, dataset, "tb", *SHORT), MPI.COMM_SELF)
    run_dir = tmp_path / "runs" / "tb"
    first = {p.name for p in (run_dir / TENSORBOARD_DIR).iterdir()}
    # As after a crash at step 6 whose last save was step 3's: steps 4 to 6 run again, then on to 8.
    resumed = run(train_config(tmp_path, dataset, "tb", *SHORT, "train.steps=8", "checkpoint.every_steps=0",
                               f"checkpoint.resume={tmp_path / 'ckpt' / 'tb' / checkpoint_name(3)}"), MPI.COMM_SELF)
    assert (resumed.summary["start_step"], resumed.summary["steps"]) == (3, 8)
    files = {p.name for p in (run_dir / TENSORBOARD_DIR).iterdir()}
    assert len(files) == 2 and first < files
    second_run = [r for r in _lines(run_dir) if "global_loss" in r][3:]  # appended after the first run's 2, 4, 6
    assert [r["step"] for r in second_run] == [4, 6, 8]
    found = _scalars(run_dir / TENSORBOARD_DIR)
    assert found["train/loss"][0][0] == 2  # the first run's, before the resumed step
    assert found["train/loss"][1:] == [(r["step"], _f32(r["global_loss"])) for r in second_run]
    assert [s for s, _ in found["eval/loss"]] == [3, 6, 8]


def test_a_tensorboard_folder_that_cannot_be_made_is_one_warning_and_the_run_trains_on(tmp_path):
    run_dir = tmp_path / "runs" / "tb"
    run_dir.mkdir(parents=True)
    (run_dir / TENSORBOARD_DIR).write_text("a file in the way")
    result = run(train_config(tmp_path, _dataset(MPI.COMM_SELF, tmp_path), "tb", *SHORT), MPI.COMM_SELF)
    assert result.summary["steps"] == 6 and result.exit_code == 0
    warnings = [line for line in (run_dir / "rank0.log").read_text().splitlines() if "cannot write" in line]
    assert len(warnings) == 1 and str(run_dir / TENSORBOARD_DIR) in warnings[0], warnings
    assert [r["step"] for r in _lines(run_dir) if "global_loss" in r] == [2, 4, 6]  # the metrics lines are whole
    assert sorted(p.name for p in (tmp_path / "ckpt" / "tb").glob("ckpt-*")) == [checkpoint_name(3),
                                                                                  checkpoint_name(6)]


def test_a_full_disk_drops_events_with_one_warning_and_leaves_whole_records(tmp_path, caplog, monkeypatch):
    writer = TensorBoardWriter(tmp_path / TENSORBOARD_DIR)
    writer.write({"step": 1, "global_loss": 1.0, "time": 1.0})
    real_write, calls = os.write, []

    def short_then_full(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:7]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", short_then_full)
    with caplog.at_level(logging.WARNING, logger="hpcnet"):
        writer.write({"step": 2, "global_loss": 2.0, "time": 2.0})
        writer.write({"step": 3, "global_loss": 3.0, "time": 3.0})
    monkeypatch.setattr(os, "write", real_write)
    writer.write({"step": 4, "global_loss": 4.0, "time": 4.0})
    writer.close()
    writer.close()  # twice is fine
    warnings = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1 and str(writer.path) in warnings[0] and "No space left" in warnings[0]
    assert _scalars(tmp_path / TENSORBOARD_DIR)["train/loss"] == [(1, 1.0), (4, 4.0)]


def test_without_the_tensorboard_package_the_command_stops_at_start_with_one_line(tmp_path, monkeypatch, capsys):
    from hpcnet.errors import ExitCode
    from hpcnet.train import main

    _without_tensorboard(monkeypatch)
    code = main([f"run.dir={tmp_path / 'run'}", "run.dir_exact=true", "run.tensorboard=true", "dist.probe=false"])
    assert code == ExitCode.USAGE_ERROR
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("hpcnet: error: run.tensorboard=true needs the tensorboard package")
    assert line.endswith("pip install 'hpcnet[tensorboard]'")
    assert not (tmp_path / "run").exists()  # stopped before the run directory


@pytest.mark.mpi
def test_only_rank_0_writes_events(comm, data_plane, mpi_tmp_path):
    dataset = _dataset(comm, mpi_tmp_path)
    cfg = train_config(mpi_tmp_path, dataset, "tb", *SHORT, "run.metrics=all", "checkpoint.every_steps=0")
    run(cfg, comm, plane=data_plane)
    run_dir = mpi_tmp_path / "runs" / "tb"
    pids = comm.allgather(os.getpid())
    if comm.Get_rank() == 0:
        (events,) = (run_dir / TENSORBOARD_DIR).iterdir()
        assert f".{pids[0]}." in events.name
        found = _scalars(run_dir / TENSORBOARD_DIR)
        for rank in range(comm.Get_size()):  # the global loss, the same in every rank's lines
            assert found["train/loss"] == [(r["step"], _f32(r["global_loss"])) for r in _lines(run_dir, rank)
                                           if "global_loss" in r]
    comm.Barrier()


@pytest.mark.mpi
def test_tensorboard_missing_where_rank_0_runs_stops_every_rank(comm, data_plane, mpi_tmp_path, monkeypatch):
    if comm.Get_rank() == 0:  # only rank 0 writes events, and only it looks: the others learn of it
        _without_tensorboard(monkeypatch)
    cfg = train_config(mpi_tmp_path, _dataset(comm, mpi_tmp_path), "no-tb", *SHORT)
    with pytest.raises(ConfigError, match=r"run\.tensorboard=true needs .*pip install 'hpcnet\[tensorboard\]'"):
        run(cfg, comm, plane=data_plane)
