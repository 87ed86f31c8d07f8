"""run.tensorboard: rank 0's metrics as TensorBoard scalars, in ``<run directory>/tensorboard/``.

``MetricsWriter`` hands every record the loop writes to a ``TensorBoardWriter``
(whatever run.metrics says), which turns it into scalars (``scalars``, pure)
and appends them to an event file of its own, one a run: a resumed run in the
same run directory adds a file whose steps go on from the resumed step, and
hides what earlier runs logged from its own first logged step on, which it
logs again (a ``SessionLog.START`` at that step, as torch's
``SummaryWriter(purge_step=...)`` writes).

The events are written in the training thread, straight to the file: a record
is on disk when ``write`` returns, so a live TensorBoard sees every log
interval as it is written, with no writer thread, queue or flush to wait for.
Best effort as the metrics lines: an event that cannot be written (a full
disk) is dropped with one warning, cut off again so the file stays whole
records; later records are tried again.  Only ``tensorboard``'s protocol
buffers and record framing are used (the ``tensorboard`` extra); torch is not.

The tags, by step:

    train/loss                         the global loss of the log step (all ranks' batches), as metrics' global_loss
    train/lr, train/samples_per_s, train/epoch
    time/step_s, time/slowest_step_s   the interval's median step, rank 0's and the slowest rank's
    time/phase/<phase>                 mean seconds a step spent in each phase over the interval
    time/comm_share                    exposed communication (the ``comm`` phase) over the step time
    memory/rss_mb, memory/cuda_mb      resident memory; the CUDA peak allocation on GPU
    train/<name>, eval/<name>          every ``train_<name>``, ``eval_<name>`` the objective, the evaluation return
    checkpoint/<what>                  a save's timings (``snapshot_s``, ``blocking_s``, ...) and ``bytes``
"""

import io
import itertools
import os
import socket
import statistics
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hpcnet.errors import ConfigError
from hpcnet.observe.runlog import append_whole, warn_unwritten

EXTRA = "pip install 'hpcnet[tensorboard]'"
_files = itertools.count()  # a run's own file name, also for two runs of one process in the same second


def require_tensorboard() -> None:
    """Raise ``ConfigError`` naming run.tensorboard where the ``tensorboard`` package cannot be imported."""
    try:
        _tensorboard()
    except ImportError as exc:
        raise ConfigError(f"run.tensorboard=true needs the tensorboard package, which cannot be imported ({exc}): "
                          f"{EXTRA}") from exc


def _tensorboard() -> tuple[Any, Any, Any, Any]:
    """TensorBoard's ``Event``, ``SessionLog``, ``Summary`` and ``RecordWriter``, imported at the first use."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.record_writer import RecordWriter

    return Event, SessionLog, Summary, RecordWriter


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars (tag -> value) of one metrics record; empty for a record with none (pure).

    A log line (it has ``global_loss``) gives the train/, time/ and memory/
    tags; each ``eval_<name>`` and ``train_<name>`` key of any record
    ``eval/<name>`` and ``train/<name>``, whatever the objective and the
    evaluation return; a save's ``checkpoint`` timings ``checkpoint/<what>``.
    A value that is not a number is left out; a non-finite one is kept (a diverged loss).
    """
    out: dict[str, float] = {}

    def put(tag: str, value: Any) -> None:
        if _number(value):
            out[tag] = float(value)

    for key, value in record.items():  # the objective's own figures, whatever their names
        if key.startswith(("train_", "eval_")):
            put(key.replace("_", "/", 1), value)
    if "global_loss" in record:
        put("train/loss", record["global_loss"])
        for key in ("lr", "samples_per_s", "epoch"):
            put(f"train/{key}", record.get(key))
        step_s = [s for s in record.get("step_s") or () if _number(s)]
        if step_s:
            put("time/step_s", statistics.median(step_s))
        put("time/slowest_step_s", record.get("slowest_step_s"))
        phases = record.get("phases_s")
        if isinstance(phases, Mapping) and step_s:
            # Sums over the interval's steps, as the line has them: per step, to read beside time/step_s.
            for phase, seconds in phases.items():
                if _number(seconds):
                    put(f"time/phase/{phase}", seconds / len(step_s))
            if _number(phases.get("comm")) and sum(step_s) > 0:
                put("time/comm_share", phases["comm"] / sum(step_s))
        put("memory/rss_mb", record.get("rss_mb"))
        put("memory/cuda_mb", record.get("cuda_mb"))
    timings = record.get("checkpoint")
    if isinstance(timings, Mapping):
        for what, value in timings.items():
            put(f"checkpoint/{what}", value)
    return out


class TensorBoardWriter:
    """Metrics records as scalars in an event file of this run under ``directory``, created at the first record.

    Args:
        directory: where the event files go: ``<run directory>/tensorboard``.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.path: Path | None = None
        """The event file, once the first record has a step and scalars."""
        self.warned = False
        self._fd: int | None = None
        self._head = b""  # the file's first events (its version, the purge), until they are written

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record``'s scalars at its ``step``, at its ``time``; a record without either adds nothing."""
        values = scalars(record)
        step = record.get("step")
        if not values or not isinstance(step, int) or isinstance(step, bool):
            return
        wall_time = float(record["time"]) if _number(record.get("time")) else time.time()
        Event, _, Summary, _ = _tensorboard()
        event = Event(wall_time=wall_time, step=step, summary=Summary(
            value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()]))
        try:
            if self._fd is None:
                self._open(step, wall_time)
            assert self._fd is not None
            append_whole(self._fd, self._head + _framed([event]))
            self._head = b""
        except OSError as exc:
            self._failed(exc)

    def _failed(self, error: OSError) -> None:
        if not self.warned:
            self.warned = True
            warn_unwritten(self.path or self.directory, error)

    def _open(self, step: int, wall_time: float) -> None:
        """Create this run's event file; its head hides the earlier runs' events from ``step`` on (a resume)."""
        Event, SessionLog, _, _ = _tensorboard()
        self.directory.mkdir(parents=True, exist_ok=True)
        # TensorBoard reads the files of a folder in name order: the time first puts a resumed run's after.
        name = f"events.out.tfevents.{int(wall_time):010d}.{socket.gethostname()}.{os.getpid()}.{next(_files)}"
        fd = os.open(self.directory / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
        self._fd, self.path = fd, self.directory / name
        self._head = _framed([Event(wall_time=wall_time, file_version="brain.Event:2"),
                              Event(wall_time=wall_time, step=step, session_log=SessionLog(status=SessionLog.START))])

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError as exc:  # a network file system may report a failed write only here
                self._failed(exc)
            self._fd = None


def _framed(events: Iterable[Any]) -> bytes:
    """``events`` as TFRecords (length, checksums), the framing of an event file."""
    *_, RecordWriter = _tensorboard()
    buffer = io.BytesIO()
    writer = RecordWriter(buffer)
    for event in events:
        writer.write(event.SerializeToString())
    return buffer.getvalue()
