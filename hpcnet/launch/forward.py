"""Stop signals in the supervisor (docs/fault-tolerance.md, "Signals"): passed on to the job when its ranks can
take them, and the status of a job that one ended before any attempt could.

SIGTERM, SIGUSR2, SIGINT and SIGHUP end the restarts whenever they come. ``python -m hpcnet.launch`` blocks them
from its first line until ``Forwarder.install``, so one that comes while the supervisor starts is handled rather
than killing it; the supervisor starts no attempt after one; and it passes a first one on to a running attempt
only once every rank has reported that it handles it (``hpcnet.launch.stop``), since until then the default action
would kill a rank, and a launcher still starting would die of it or start ranks after passing it on.
"""

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcnet.errors import ExitCode
from hpcnet.launch.processes import say
from hpcnet.launch.stop import READY, SUPERVISOR_SIGNALS, reported_ranks


class Forwarder:
    """Signal handlers that pass SIGTERM/SIGUSR2/SIGINT/SIGHUP on to the running launcher (and end the restarts).

    A first signal waits while ``ready`` says that the attempt's ranks are still starting: until a rank has
    installed its stop handler (``hpcnet.launch.stop``) the signal's default action would kill it, and a launcher that
    is starting would die of it or start ranks after it passed it on; ``run_attempt`` passes it on once they are
    ready. A second signal is passed on at once (stop now).
    """

    SIGNALS = SUPERVISOR_SIGNALS

    def __init__(self, mpirun: bool) -> None:
        self.mpirun = mpirun
        self.received = 0
        self.count = 0
        self.sent = 0
        """How many of the signals received were passed on to ``proc``."""
        self.held = False
        self.proc: subprocess.Popen | None = None
        self.ready: Callable[[], bool] | None = None
        self.wake = threading.Event()
        self._previous: dict[int, Any] = {}
        self._mask: set[int] | None = None

    def install(self) -> "Forwarder":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        # python -m hpcnet.launch blocks them from its first line: one that came meanwhile is handled now.
        self._mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)
        return self

    def restore(self) -> None:
        if self._mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum
        self.count += 1
        self.wake.set()
        self.pass_on()

    def stopping(self) -> bool:
        """Whether a stop signal came: no attempt starts after it."""
        return bool(self.received)

    @property
    def pending(self) -> bool:
        """A signal was received and not yet passed on to the running launcher."""
        return self.proc is not None and self.sent < self.count

    def attach(self, proc: subprocess.Popen, ready: Callable[[], bool] | None) -> None:
        """``proc`` is the running launcher; ``ready`` says whether its ranks handle stop signals (None: always)."""
        self.proc, self.ready, self.sent, self.held = proc, ready, 0, False
        self.pass_on()  # a signal came as it started

    def detach(self) -> None:
        self.proc, self.ready = None, None

    def pass_on(self) -> None:
        """Send what was received to the running launcher, unless it is a first signal and its ranks are not
        ready (then it stays pending: ``run_attempt`` calls this again)."""
        proc = self.proc
        if proc is None or self.sent >= self.count or proc.poll() is not None:
            return
        name = signal.Signals(self.received).name
        if self.count == 1 and self.ready is not None and not self.ready():
            if not self.held:
                self.held = True
                say(f"got {name}; the job's ranks are still starting: it reaches them once every rank handles it; "
                    "no restart after it")
            return
        # A hang-up is a request to stop, as SIGTERM is (which the ranks save on).
        forward = signal.SIGTERM if self.received == signal.SIGHUP else self.received
        # mpirun kills the ranks ~1 s after SIGTERM/SIGINT (no time to save)
        # but forwards SIGUSR2; a second signal means "now".
        if self.mpirun:
            forward = signal.SIGUSR2 if self.count == 1 else signal.SIGTERM
        self.sent = self.count
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(proc.pid, forward)
        say(f"got {name}, sent {signal.Signals(forward).name} to the job; no restart after it")


def ranks_ready(directory: Path, started_up: threading.Event) -> bool:
    """Whether every rank of an attempt has reported that it handles stop signals (``hpcnet.launch.stop``), or, for
    ranks that cannot say how many they are, the attempt has logged its first step (they are all past start-up)."""
    count, size = reported_ranks(directory, READY)
    return (size is not None and count >= size) or started_up.is_set()


def ranks_started(directory: Path, started_up: threading.Event) -> bool:
    """Whether an attempt's ranks are past their launch, for ``--start-timeout-s``: every rank reported ready, or,
    where the ranks cannot say how many they are, one of them did, or the attempt logged its first step."""
    count, size = reported_ranks(directory, READY)
    return (count >= size if size is not None else count > 0) or started_up.is_set()


def stop_status(received: int) -> int:
    """The status of a job that a stop signal ended before an attempt could stop and save: 130 for Ctrl-C,
    else 76 (preempted: requeue; nothing was lost, no attempt ran since the last one's checkpoints)."""
    return ExitCode.INTERRUPTED if received == signal.SIGINT else ExitCode.PREEMPTED
