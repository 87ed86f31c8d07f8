"""Exceptions and process exit statuses shared by every hpcnet module."""

import enum


class ExitCode(enum.IntEnum):
    """Exit statuses of ``python -m hpcnet.train``; documented in the README.

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
