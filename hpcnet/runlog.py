"""The run directory, logging and metrics.

Rank 0 talks to the console; every rank logs to ``rank<r>.log`` in the run
directory; metrics go to ``metrics.rank<r>.jsonl``, one JSON object a line.
"""

import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from hpcnet.errors import UsageError
from hpcnet.agree import agree_on_error
from hpcnet.layout import rank_log, run_dir_path

_FORMAT = "%(asctime)s rank %(rank)s %(levelname)s %(name)s: %(message)s"


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


class MetricsWriter:
    """Append metrics as JSON lines; a writer for a rank that does not write is a no-op."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1) if path is not None else None

    def write(self, **record: Any) -> None:
        if self._file is not None:
            record.setdefault("time", round(time.time(), 3))
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
