"""One protocol for agreeing on errors: every rank learns whether any rank failed, and raises alike.

``agree_on_error`` is the collective (``agree_on_first_error`` its variant where every rank raises the
first failure, one message); ``shared_errors`` wraps a block in it;
``mark_agreed`` marks an error every rank raises by itself after a collective check.
Torch-free: the supervisor and the tools import it.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

from hpcnet.errors import (
    CheckpointCorrupt,
    ConfigError,
    DatasetError,
    ExitCode,
    RestartableError,
    UsageError,
    errno_of,
    error_text,
    exit_code_of,
    os_error,
)


class PeerError(RuntimeError):
    """An error raised on another rank, re-raised here so every rank stops alike."""

    def __init__(self, rank: int, kind: str, message: str, exit_code: int) -> None:
        super().__init__(f"rank {rank}: {kind}: {message}")
        self.rank = rank
        self.exit_code = exit_code


_SHARED_KINDS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (UsageError, ConfigError, DatasetError, CheckpointCorrupt)}
"""hpcnet's own errors, re-created as themselves (same message) on the ranks that did not raise them."""


def _echo(rank: int, kind: str, message: str, code: int, errno_: int | None) -> BaseException:
    """The error a rank raises for a peer's failure: the same kind where it matters to a caller."""
    if kind in _SHARED_KINDS:
        return _SHARED_KINDS[kind](message)
    if errno_:
        return os_error(errno_, f"rank {rank}: {message}")  # the errno decides the exit status
    if code == ExitCode.USAGE_ERROR:
        return UsageError(message)
    if code == ExitCode.RESTARTABLE:
        return RestartableError(f"rank {rank}: {message}")
    return PeerError(rank, kind, message, code)


def agree_on_error(comm: Any, error: BaseException | None) -> None:
    """Collective: raise on every rank if any rank of ``comm`` has an error.

    The rank that failed re-raises its own exception; the others raise the
    same hpcnet error class with the same message (``UsageError``,
    ``CheckpointCorrupt``, ...), an ``OSError`` with the same errno, or a
    ``PeerError`` naming the first failed rank, so every rank reaches the same
    verdict and exit status and none is left waiting in a later collective.
    """
    report = None
    if error is not None:
        report = (type(error).__name__, error_text(error), exit_code_of(error), errno_of(error))
    reports = comm.allgather(report)
    failed = [(rank, rep) for rank, rep in enumerate(reports) if rep is not None]
    if not failed:
        return
    if error is None:
        rank, (kind, message, code, errno_) = failed[0]
        error = _echo(rank, kind, message, code, errno_)
    # Every rank now raises: the entry point may exit cleanly instead of aborting.
    error.hpcnet_agreed = True  # type: ignore[attr-defined]
    raise error


def mark_agreed(error: BaseException) -> BaseException:
    """Mark an error that every rank raises by itself after a collective check."""
    error.hpcnet_agreed = True  # type: ignore[attr-defined]
    return error


def is_agreed(error: BaseException) -> bool:
    """True when every rank raised ``error`` (or its echo) through ``agree_on_error``."""
    return bool(getattr(error, "hpcnet_agreed", False))


@contextlib.contextmanager
def shared_errors(comm: Any) -> Iterator[None]:
    """Run a block on every rank and share its outcome (collective on exit).

    Use it around work that may fail on some ranks only (opening a file,
    parsing a dataset) before the next collective.
    """
    try:
        yield
    except Exception as exc:
        agree_on_error(comm, exc)
        raise
    agree_on_error(comm, None)


def _shared_kind(error: BaseException) -> str:
    """The name of the nearest class of ``error`` that peers re-create as itself, else its own class name."""
    shared = (cls.__name__ for cls in type(error).__mro__ if _SHARED_KINDS.get(cls.__name__) is cls)
    return next(shared, type(error).__name__)


def agree_on_first_error(comm: Any, error: BaseException | None) -> None:
    """Collective: raise one error, the first failed rank's, on every rank if any rank of ``comm`` has one.

    Unlike ``agree_on_error``, where each failed rank raises its own, every rank here raises the first
    failure's class and message, so the user reads the same verdict from any rank; a failure on some
    ranks only says which: ``"... (on ranks [3] of 4 only)"``. A subclass of an hpcnet error is raised
    as that error (a ``DatasetError`` subclass as ``DatasetError``); other classes are echoed as
    ``agree_on_error`` echoes them. A rank raises its own exception where it is exactly that error,
    otherwise the echo, chained to its own error.
    """
    report = None
    if error is not None:
        report = (_shared_kind(error), error_text(error), exit_code_of(error), errno_of(error))
    reports = comm.allgather(report)
    failed = [rank for rank, rep in enumerate(reports) if rep is not None]
    if not failed:
        return
    kind, message, code, errno_ = reports[failed[0]]
    if len(failed) < len(reports):
        message += f" (on ranks {failed} of {len(reports)} only)"
    if error is not None and error_text(error) == message and (
            type(error) is _SHARED_KINDS[kind] if kind in _SHARED_KINDS else type(error).__name__ == kind):
        raise mark_agreed(error)
    raise mark_agreed(_echo(failed[0], kind, message, code, errno_)) from error


def ranks_differing(comm: Any, value: Any) -> list[int]:
    """Collective: the ranks whose ``value`` differs from rank 0's, the same list on every rank.

    For checks that every rank sees the same thing (the same files, the same
    arguments): each passes a small picklable value, such as a digest; an empty
    list means all agree, otherwise every rank can raise the same ``agreed`` error.
    """
    values = comm.allgather(value)
    return [rank for rank, seen in enumerate(values) if seen != values[0]]
