"""The run directory, logging and metrics.

Rank 0 talks to the console; every rank logs to ``rank<r>.log`` in the run
directory; metrics go to ``metrics.rank<r>.jsonl``, one JSON object a line.

The files that describe a run (metrics, ``owners.json``, ``trace.json``,
``topology.json``, ``summary.json``, TensorBoard's event files) are best effort
(``OptionalFile``, ``MetricsWriter``, ``hpcnet.observe.tensorboard``): where
one cannot be written (a full disk, a quota, no permission, a directory in the
way) the rank that writes it logs one warning
naming the file and the error and trains on.  Only that rank writes it and
nothing waits for it, so a failure stays local and needs no agreement; the
checkpoints, which the run cannot do without, are not held up by it.
"""

import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from hpcnet.agree import agree_on_error
from hpcnet.errors import UsageError
from hpcnet.paths import rank_log, run_dir_path

_FORMAT = "%(asctime)s rank %(rank)s %(levelname)s %(name)s: %(message)s"
log = logging.getLogger(__name__)


def make_run_dir(comm: Any, parent: str, name: str, *, exact: bool = False) -> Path:
    """Collective: rank 0 creates the run directory; every rank gets its path.

    Args:
        comm: the job's communicator.
        parent: ``run.dir``.
        name: ``run.name``; a UTC timestamp is appended unless ``exact``.
        exact: use ``parent`` itself as the run directory.
    """
    path = None
    error = None
    if comm.Get_rank() == 0:
        path = Path(parent)
        try:
            path = run_dir_path(parent, name, exact=exact)
            path.mkdir(parents=True, exist_ok=True)
            # A fresh name, created exclusively: a shared run.dir may hold a link planted at a fixed one.
            fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=path)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            error = UsageError(f"run.dir: cannot create run directory {str(path)!r}: {exc.strerror or exc}")
    agree_on_error(comm, error)
    path = Path(comm.bcast(str(path), root=0))
    if not path.is_dir():  # a node without the shared file system
        error = UsageError(f"run.dir: {str(path)!r} is not visible on this node; use a shared file system")
    else:
        error = None
    agree_on_error(comm, error)
    return path


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(run_dir: Path | None, rank: int, *, console: TextIO | None = None) -> logging.Logger:
    """Configure the ``hpcnet`` logger for this rank and return it.

    Rank 0 logs INFO to the console; other ranks print only errors there, so a
    failure on any rank is seen.  Every rank logs DEBUG to its own file.
    """
    logger = logging.getLogger("hpcnet")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    rank_filter = _RankFilter(rank)
    stream = logging.StreamHandler(console or sys.stderr)
    stream.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    stream.setFormatter(logging.Formatter("%(message)s" if rank == 0 else "[rank %(rank)s] %(message)s"))
    stream.addFilter(rank_filter)
    logger.addHandler(stream)
    if run_dir is not None:
        file_handler = logging.FileHandler(run_dir / rank_log(rank))
        file_handler.setLevel(logging.DEBUG)
        file_handler.setFormatter(logging.Formatter(_FORMAT))
        file_handler.addFilter(rank_filter)
        logger.addHandler(file_handler)
    return logger


def close_logging() -> None:
    """Flush and detach every handler of the ``hpcnet`` logger."""
    logger = logging.getLogger("hpcnet")
    for handler in list(logger.handlers):
        handler.flush()
        logger.removeHandler(handler)
        handler.close()


def warn_unwritten(path: Path, error: OSError) -> None:
    """The one warning of a best-effort file that cannot be written."""
    log.warning("cannot write %s: %s; training goes on without it (no further warning for this file)", path,
                error.strerror or error)


def append_whole(fd: int, data: bytes) -> None:
    """Append ``data`` to the file open as ``fd`` (``O_APPEND``), all of it or nothing.

    On an ``OSError`` (the disk filling up in the middle) the part that reached
    the file is cut off again before the error is raised, so a reader never
    meets half a record, and a later one that is written follows whole ones.
    """
    size = os.fstat(fd).st_size
    rest = memoryview(data)
    try:
        while rest:  # a short write (the disk filling up) leaves the rest to write
            rest = rest[os.write(fd, rest):]
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        raise


class OptionalFile:
    """A file of the run directory that training can do without, written whole: through ``<name>.tmp`` and a
    rename, so a reader never sees half of it.  A write that fails logs one warning (the first) and returns False.

    Args:
        path: where the file goes.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.warned = False

    def write_text(self, text: str) -> bool:
        """Replace the file with ``text``; whether it was written."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(text)
            tmp.replace(self.path)
            return True
        except OSError as exc:
            with contextlib.suppress(OSError):  # a half-written temporary file; a directory in the way stays
                tmp.unlink(missing_ok=True)
            if not self.warned:
                self.warned = True
                warn_unwritten(self.path, exc)
            return False


class MetricsWriter:
    """Append metrics as JSON lines; a writer for a rank that does not write is a no-op.

    Best effort: a line that cannot be written is dropped, with one warning for the file (the first failure),
    and any part of it that reached the file is cut off again, so the file stays whole lines; each later line is
    tried again (a full disk may be freed).

    Args:
        path: the JSON-lines file; None: no lines (this rank does not write them, or run.metrics=none).
        tensorboard: with run.tensorboard, on rank 0, a ``hpcnet.observe.tensorboard.TensorBoardWriter`` (not
            imported here: it imports this module): given every record as well (with or without ``path``) and
            closed with this writer.
    """

    def __init__(self, path: Path | None, *, tensorboard: Any = None) -> None:
        self.path = path
        self.tensorboard = tensorboard
        self._fd: int | None = None
        self.warned = False
        if path is not None:
            self._open()

    def _open(self) -> None:
        assert self.path is not None
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            self._failed(exc)

    def _failed(self, error: OSError) -> None:
        if not self.warned and self.path is not None:
            self.warned = True
            warn_unwritten(self.path, error)

    def write(self, **record: Any) -> None:
        record.setdefault("time", round(time.time(), 3))
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        if self.path is None:
            return
        if self._fd is None:
            self._open()
            if self._fd is None:
                return
        try:
            append_whole(self._fd, (json.dumps(record) + "\n").encode())
        except OSError as exc:
            self._failed(exc)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        if self.tensorboard is not None:
            self.tensorboard.close()


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, infinities) as None: JSON that strict readers take.

    Python's ``json`` writes a bare ``NaN``, which the JSON standard has no
    place for (a final loss of a run with nothing to train, a diverged one).
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def format_duration(seconds: float) -> str:
    """``3725.2`` -> ``'1:02:05'``."""
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
