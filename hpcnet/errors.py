"""Exceptions and process exit statuses shared by every hpcnet module."""

import enum
import errno
import os
import re


class ExitCode(enum.IntEnum):
    """Exit statuses of ``python -m hpcnet.train``; documented in docs/fault-tolerance.md.

    A supervisor or job script decides from these whether a restart can help.
    """

    OK = 0
    """Training finished."""
    CODE_ERROR = 1
    """An unexpected exception (a bug, or a bug in user code): do not restart."""
    USAGE_ERROR = 2
    """Bad configuration, bad data or a bad path: fix the input, do not restart."""
    DIVERGED = 65
    """The loss, gradients or state became non-finite (train.nonfinite): a restart would diverge again."""
    RESTARTABLE = 75
    """A peer died, hung, or a collective failed: restarting may succeed."""
    PREEMPTED = 76
    """Stopped by SIGTERM/SIGUSR2 (preemption) after saving: resume later."""
    INTERRUPTED = 130
    """Stopped by Ctrl-C (SIGINT) on request."""


class UsageError(ValueError):
    """A user input (option, file, dataset, path) is wrong; the message names it."""

    exit_code = ExitCode.USAGE_ERROR


class ConfigError(UsageError):
    """A configuration option is unknown or has a bad value."""


class DatasetError(UsageError):
    """A dataset file is missing or malformed."""


class RestartableError(RuntimeError):
    """A failure of the machine or the network that a restart may get past."""

    exit_code = ExitCode.RESTARTABLE


class CheckpointCorrupt(UsageError):
    """A checkpoint failed verification (a checksum, or its structure); the message names file and dataset.

    Only damage to the file itself: an I/O error while reading is an ``OSError``
    with its errno, and not enough memory a ``MemoryError``.
    """


USAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT,
                          errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG})
"""Errors of the file system that stay on a restart: a full disk or quota, permissions, a wrong path."""
RESTARTABLE_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                                errno.ENETDOWN, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENOTCONN,
                                errno.EHOSTDOWN})
"""Errors of the storage or the network that a restart (maybe on other nodes) may get past."""

# How HDF5 and MPI-IO say it when the errno itself does not survive into the exception:
# h5py quotes the C library's "errno = N" or its message; MPI names an error class.
_ERRNO_TEXT = re.compile(r"errno\s*=\s*(\d+)")
_ERRNO_WORDS = {os.strerror(errno.ENOSPC): errno.ENOSPC, os.strerror(errno.EDQUOT): errno.EDQUOT,
                os.strerror(errno.EIO): errno.EIO, "MPI_ERR_NO_SPACE": errno.ENOSPC, "MPI_ERR_QUOTA": errno.EDQUOT}


def errno_of(error: BaseException) -> int | None:
    """The errno an OSError carries, or that an HDF5/MPI-IO error message names; None if none."""
    if not isinstance(error, OSError):
        return None
    if error.errno:
        return error.errno
    text = str(error)
    match = _ERRNO_TEXT.search(text)
    if match and int(match.group(1)) > 0:
        return int(match.group(1))
    return next((code for words, code in _ERRNO_WORDS.items() if words in text), None)


def error_text(error: BaseException) -> str:
    """The text of an error without OSError's ``[Errno N]`` prefix (for messages that add their own)."""
    if isinstance(error, OSError) and error.errno and error.strerror and not error.filename:
        return error.strerror
    return str(error)


def os_error(code: int | None, message: str) -> OSError:
    """An OSError with ``message`` that keeps ``code`` (None: no errno) for ``exit_code_of``."""
    return OSError(code, message) if code else OSError(message)


def exit_code_of(error: BaseException) -> int:
    """The documented exit status for an exception (see ``ExitCode`` and docs/fault-tolerance.md)."""
    if isinstance(error, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    code = errno_of(error)
    if code in USAGE_ERRNOS:
        return ExitCode.USAGE_ERROR
    if code in RESTARTABLE_ERRNOS:
        return ExitCode.RESTARTABLE
    return int(getattr(error, "exit_code", ExitCode.CODE_ERROR))
