"""hpcnet.runlog: the run directory, each rank's log, metrics lines."""

import io
import json
import logging

import pytest

from hpcnet.errors import UsageError
from hpcnet.runlog import MetricsWriter, close_logging, format_duration, make_run_dir, setup_logging


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


def test_rank_0_talks_to_the_console_every_rank_to_its_file(tmp_path):
    try:
        console = io.StringIO()
        setup_logging(tmp_path, 0, console=console)
        logging.getLogger("hpcnet.test").info("hello")
        logging.getLogger("hpcnet.test").debug("detail")
        close_logging()
        assert console.getvalue() == "hello\n"
        text = (tmp_path / "rank0.log").read_text()
        assert "rank 0 INFO hpcnet.test: hello" in text and "rank 0 DEBUG hpcnet.test: detail" in text

        console = io.StringIO()
        setup_logging(tmp_path, 3, console=console)
        logging.getLogger("hpcnet.test").info("quiet")
        logging.getLogger("hpcnet.test").error("loud")
        close_logging()
        assert console.getvalue() == "[rank 3] loud\n"
        assert "rank 3 INFO hpcnet.test: quiet" in (tmp_path / "rank3.log").read_text()
    finally:
        close_logging()


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


def test_durations_read_as_hours_minutes_seconds():
    assert format_duration(0) == "0:00:00"
    assert format_duration(3725.2) == "1:02:05"
    assert format_duration(-4) == "0:00:00"
    assert format_duration(59.6) == "0:01:00"
