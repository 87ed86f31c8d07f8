"""The last resort when no Python can run: a POSIX timer that ends the process at a deadline without the GIL.

Why a second, native line of defence.  h5py holds the GIL inside a
collective file create (``H5Fcreate`` with the MPI-IO driver; writes, flushes
and closes release it), and a rank whose writer waits there
for a stuck file system never gives it back: no Python code runs in that
process again, its monitor thread included.  The ranks that wait for it
inside the same call are frozen the same way, so on a stuck file system
there may be no Python left anywhere in the job.  What still runs is native:
faulthandler's C watchdog thread (prints every thread's stack) and threads
that glibc starts for a POSIX timer (``SIGEV_THREAD``).  ``NativeWatchdog``
arms such a timer at every deadline plus a grace period; when the Python
side did not end the job by then, the timer's thread writes ``failure.json``
(through ``system()``, with the report rendered when the guard was opened)
and calls ``_exit(75)``: ``mpirun`` then ends the other ranks and exits
with 75 too.  A rank whose GIL is free never gets there: its monitor acts at
the deadline itself.
"""

import ctypes
import faulthandler
import json
import logging
import os
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class _SigVal(ctypes.Union):
    _fields_ = [("sival_int", ctypes.c_int), ("sival_ptr", ctypes.c_void_p)]


class _SigEvent(ctypes.Structure):
    """glibc's ``struct sigevent`` (64 bytes on LP64) for ``SIGEV_THREAD``."""

    _fields_ = [("sigev_value", _SigVal), ("sigev_signo", ctypes.c_int), ("sigev_notify", ctypes.c_int),
                ("sigev_notify_function", ctypes.c_void_p), ("sigev_notify_attributes", ctypes.c_void_p),
                ("_pad", ctypes.c_byte * 32)]


class _TimeSpec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("it_interval", _TimeSpec), ("it_value", _TimeSpec)]


_SIGEV_THREAD = 2
_CLOCK_MONOTONIC = 1
_COMMAND_BYTES = 1 << 16
NATIVE_STEPS_S = (0.0, 0.5, 1.5)
"""After the native deadline: say why and write failure.json, print the stacks, exit."""


class NativeWatchdog:
    """End this process at a deadline without the GIL: stacks to stderr, ``failure.json``, ``_exit(75)``.

    Two POSIX timers whose expiry runs a libc function in a thread glibc
    creates (``SIGEV_THREAD``), so nothing needs the interpreter: ``system()``
    on a command rendered at ``arm`` time (a line to stderr, and
    ``failure.json`` unless one exists), and ``_exit(exit_code)``; between
    them faulthandler's own C watchdog thread prints every thread's stack.
    Each runs in its own thread: a write that blocks on the file system does
    not keep the others from acting.
    Where POSIX timers cannot be created (not glibc), faulthandler alone ends
    the process after the stacks, with status 1.

    Args:
        exit_code: the status of the process when it fires.
    """

    def __init__(self, exit_code: int) -> None:
        self.exit_code = exit_code
        self._lock = threading.Lock()
        self._armed = False
        self._command = ctypes.create_string_buffer(_COMMAND_BYTES)  # the timer keeps its address: never freed
        self._timers: list[ctypes.c_void_p] = []
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            self._settime = libc.timer_settime
            self._settime.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_ITimerSpec), ctypes.c_void_p]
            for function, value in ((libc.system, _SigVal(sival_ptr=ctypes.addressof(self._command))),
                                    (libc._exit, _SigVal(sival_int=exit_code))):
                event = _SigEvent(sigev_value=value, sigev_notify=_SIGEV_THREAD,
                                  sigev_notify_function=ctypes.cast(function, ctypes.c_void_p).value)
                timer = ctypes.c_void_p()
                if libc.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
                    raise OSError(ctypes.get_errno(), "timer_create failed")
                self._timers.append(timer)
        except (AttributeError, OSError) as exc:
            log.warning("no native watchdog (%s): a rank whose Python is blocked ends with status 1 instead of %d",
                        exc, exit_code)
            self._timers = []

    @property
    def native(self) -> bool:
        """Whether POSIX timers are armed (status ``exit_code``), not only faulthandler (status 1)."""
        return bool(self._timers)

    def arm(self, at: float, *, message: str, failure_path: Path | None = None,
            report: dict[str, Any] | None = None) -> None:
        """Act at ``at`` (time.monotonic()) unless re-armed or disarmed before; replaces any earlier arming.

        Args:
            message: printed to stderr (one line) before exiting.
            failure_path: where to write ``report`` as JSON, unless a file is already there.
        """
        command = f"printf '%s\\n' {shlex.quote(message)} >&2"
        if failure_path is not None and report is not None:
            final, tmp = shlex.quote(str(failure_path)), shlex.quote(f"{failure_path}.{os.getpid()}.native.tmp")
            body = shlex.quote(json.dumps(report, indent=2))
            command += f"; [ -e {final} ] || {{ printf '%s\\n' {body} > {tmp} && mv -f {tmp} {final}; }}"
        encoded = command.encode(errors="replace")
        if len(encoded) >= _COMMAND_BYTES:
            encoded = f"printf '%s\\n' {shlex.quote(message)} >&2".encode(errors="replace")[:_COMMAND_BYTES - 1]
        with self._lock:
            self._disarm_locked()
            delay = max(0.01, at - time.monotonic())
            stderr = sys.__stderr__
            faulthandler.dump_traceback_later(delay + NATIVE_STEPS_S[1], exit=not self._timers,
                                              file=stderr if stderr is not None else sys.stderr)
            if self._timers:
                ctypes.memmove(self._command, encoded + b"\0", len(encoded) + 1)
                for timer, step_s in zip(self._timers, NATIVE_STEPS_S[::2]):
                    self._set(timer, delay + step_s)
            self._armed = True

    def disarm(self) -> None:
        with self._lock:
            self._disarm_locked()

    def close(self) -> None:
        """Disarm and delete the timers (idempotent)."""
        with self._lock:
            self._disarm_locked()
            timers, self._timers = self._timers, []
        if timers:
            libc = ctypes.CDLL(None)
            for timer in timers:
                libc.timer_delete(timer)

    def _disarm_locked(self) -> None:
        if not self._armed:
            return
        for timer in self._timers:
            self._set(timer, 0.0)
        faulthandler.cancel_dump_traceback_later()
        self._armed = False

    def _set(self, timer: ctypes.c_void_p, after_s: float) -> None:
        """Arm ``timer`` to fire once after ``after_s`` seconds; 0 disarms it."""
        spec = _ITimerSpec()
        spec.it_value.tv_sec = int(after_s)
        spec.it_value.tv_nsec = int((after_s - int(after_s)) * 1e9)
        if self._settime(timer, 0, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timer_settime failed")
