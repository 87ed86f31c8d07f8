"""hpcnet.observe.runlog: the run directory, each rank's log, metrics lines."""

import errno
import io
import json
import logging
import os

import pytest

from hpcnet.errors import UsageError
from hpcnet.observe import runlog
from hpcnet.observe.runlog import (
    MetricsWriter,
    OptionalFile,
    close_logging,
    format_duration,
    make_run_dir,
    setup_logging,
)
from tests.helpers.data import shared_data_dir


@pytest.mark.mpi
def test_every_rank_gets_rank_0s_run_directory(comm, mpi_tmp_path):
    parent = comm.bcast(str(mpi_tmp_path / "runs"), root=0)
    path = make_run_dir(comm, parent, "exp")
    assert comm.allgather(str(path)) == [str(path)] * comm.Get_size()
    assert path.is_dir() and str(path.parent) == parent
    assert path.name.startswith("exp-")
    exact = make_run_dir(comm, str(path / "here"), "ignored", exact=True)
    assert exact == path / "here" and exact.is_dir()


@pytest.mark.mpi
def test_an_uncreatable_run_directory_fails_on_every_rank(comm, mpi_tmp_path):
    blocker = mpi_tmp_path / "a-file"
    if comm.Get_rank() == 0:
        blocker.write_text("not a directory")
    comm.Barrier()
    parent = comm.bcast(str(blocker), root=0)
    with pytest.raises(UsageError, match=r"run\.dir: cannot create run directory"):
        make_run_dir(comm, parent, "exp", exact=True)


def test_the_write_test_of_a_shared_run_directory_follows_no_link_planted_there(tmp_path):
    """Issue 27, item 13: the probe was a fixed name, ``.write-test``, written through any link found there:
    another user of a shared run.dir could make a run truncate a file of theirs' choosing."""
    from mpi4py import MPI

    run_dir = tmp_path / "shared"
    run_dir.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (run_dir / ".write-test").symlink_to(victim)
    assert make_run_dir(MPI.COMM_SELF, str(run_dir), "x", exact=True) == run_dir
    assert victim.read_text() == "precious" and (run_dir / ".write-test").is_symlink()
    assert sorted(p.name for p in run_dir.iterdir()) == [".write-test"]  # its own probe is gone


def test_strict_json_writes_no_bare_nan():
    from hpcnet.observe.runlog import strict_json

    value = {"loss": float("nan"), "rates": [1.5, float("inf")], "nested": {"x": -float("inf"), "n": 3}}
    assert json.loads(json.dumps(strict_json(value), allow_nan=False)) == {
        "loss": None, "rates": [1.5, None], "nested": {"x": None, "n": 3}}


def _log_as(rank, run_dir):
    """What rank ``rank``'s console shows of one record of each level; its file is in ``run_dir``."""
    console = io.StringIO()
    try:
        setup_logging(run_dir, rank, console=console)
        for level in (logging.DEBUG, logging.INFO, logging.ERROR):
            logging.getLogger("hpcnet.test").log(level, "said at %s", logging.getLevelName(level))
    finally:
        close_logging()
    return console.getvalue()


def test_rank_0_talks_to_the_console_every_rank_to_its_file(tmp_path):
    assert _log_as(0, tmp_path) == "said at INFO\nsaid at ERROR\n"
    assert _log_as(3, tmp_path) == "[rank 3] said at ERROR\n"
    for rank in (0, 3):
        text = (tmp_path / f"rank{rank}.log").read_text()
        for level in ("DEBUG", "INFO", "ERROR"):
            assert f"rank {rank} {level} hpcnet.test: said at {level}" in text


def test_metrics_are_json_lines_and_a_writer_without_a_path_writes_nothing(tmp_path):
    path = tmp_path / "metrics.rank0.jsonl"
    writer = MetricsWriter(path)
    writer.write(step=1, loss=2.5)
    writer.write(step=2, loss=2.25, time=7.0)
    writer.close()
    writer.close()  # twice is fine
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in lines] == [(1, 2.5), (2, 2.25)]
    assert "time" in lines[0] and lines[1]["time"] == 7.0
    silent = MetricsWriter(None)
    silent.write(step=1)
    silent.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.rank0.jsonl"]


def _unwritten(caplog, path):
    return [r for r in caplog.records if r.levelno == logging.WARNING and f"cannot write {path}" in r.getMessage()]


def test_a_full_disk_under_the_metrics_drops_lines_with_one_warning_and_leaves_whole_lines(tmp_path, caplog,
                                                                                          monkeypatch):
    full = tmp_path / "metrics.rank0.jsonl"
    full.symlink_to("/dev/full")  # every write: ENOSPC
    writer = MetricsWriter(full)
    with caplog.at_level(logging.WARNING, logger="hpcnet"):
        for step in range(3):
            writer.write(step=step, loss=1.0)
    writer.close()
    (warning,) = _unwritten(caplog, full)
    assert "No space left on device" in warning.getMessage()
    # A disk that fills in the middle of a line: the part written is cut off; the next line is tried again.
    path = tmp_path / "metrics.rank1.jsonl"
    writer = MetricsWriter(path)
    writer.write(step=1)
    real_write, calls = os.write, []

    def short_then_full(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:5]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(runlog.os, "write", short_then_full)
    with caplog.at_level(logging.WARNING, logger="hpcnet"):
        writer.write(step=2)
    monkeypatch.setattr(runlog.os, "write", real_write)
    writer.write(step=3)
    writer.close()
    assert calls[1] == calls[0] - 5 and len(_unwritten(caplog, path)) == 1
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 3]


def test_an_optional_file_in_the_way_is_one_warning_and_written_once_the_way_is_clear(tmp_path, caplog):
    path = tmp_path / "owners.json"
    (tmp_path / "owners.json.tmp").mkdir()  # a directory where the temporary file goes
    optional = OptionalFile(path)
    with caplog.at_level(logging.WARNING, logger="hpcnet"):
        assert not optional.write_text("1\n") and not optional.write_text("2\n")
    assert len(_unwritten(caplog, path)) == 1 and not path.exists()
    (tmp_path / "owners.json.tmp").rmdir()
    assert optional.write_text("3\n") and path.read_text() == "3\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["owners.json"]


# What stands in the way of each file that describes a run, and the options that make the run write it.
BLOCKED = {
    "trace": ("trace.json.tmp", "directory", ["train.trace_steps=9:10"]),  # merged right after step 10's save
    "owners": ("owners.json", "directory", ["dist.zero=1"]),
    "metrics": ("metrics.rank0.jsonl", "full disk", []),
    "topology": ("topology.json", "directory", ["dist.probe=true"]),
    "summary": ("summary.json", "directory", []),
}


@pytest.mark.launch
def test_a_descriptive_file_that_cannot_be_written_is_a_warning_not_a_failure(launch, tmp_path):
    """Mpirun -np 2, every file of ``BLOCKED`` blocked at once (one job: each file's write is its own try): the
    run trains to the end with status 0, rank 0 warns once for each, naming the file, and every checkpoint is
    committed."""
    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "ckpt"
    run_dir.mkdir()
    for blocked, how, _ in BLOCKED.values():
        if how == "directory":
            (run_dir / blocked).mkdir()
        else:
            (run_dir / blocked).symlink_to("/dev/full")  # every write: ENOSPC
    extra = [option for _, _, options in BLOCKED.values() for option in options]
    out = launch(2, f"data.dir={shared_data_dir(tmp_path)}", f"run.dir={run_dir}", "run.dir_exact=true",
                 f"checkpoint.dir={ckpt_dir}", "train.steps=12", "checkpoint.every_steps=5", "run.log_every=1",
                 "train.eval_every=0", "model.name=mlp", "train.batch_size=16", *extra, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    logged = (run_dir / "rank0.log").read_text().splitlines()
    for name, (blocked, _, _) in BLOCKED.items():
        target = run_dir / blocked.removesuffix(".tmp")
        warnings = [line for line in logged if f"cannot write {target}" in line]
        assert len(warnings) == 1, (name, warnings)
        assert f"cannot write {target}" in out.stderr, name
    assert sorted(p.name for p in ckpt_dir.iterdir() if p.name.startswith("ckpt-")) == [
        "ckpt-0000000005.h5", "ckpt-0000000010.h5", "ckpt-0000000012.h5"]
    assert (ckpt_dir / "latest").read_text().strip() == "ckpt-0000000012.h5"


def test_durations_read_as_hours_minutes_seconds():
    assert format_duration(0) == "0:00:00"
    assert format_duration(3725.2) == "1:02:05"
    assert format_duration(-4) == "0:00:00"
    assert format_duration(59.6) == "0:01:00"
