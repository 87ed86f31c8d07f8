"""Deadlines on the blocking waits that are not collectives, and a last resort that needs no Python.

The flight recorder times the training loop's collectives (``hpcnet.flightrec``);
the other waits a job can hang in are guarded here, each with a deadline:

- checkpoint I/O (``checkpoint.timeout_s``): a save's blocking part, the
  background write, the wait for it, a load.  Its duration grows with the
  model and the file system, so the deadline is generous (``io_timeout_s``);
- start-up (``monitor.startup_timeout_s``): from the monitor's start to the
  first step, minus the time spent in checkpoint loads (they have their own).

A ``Guard`` is opened around the wait (``with deadlines.guard(...)``) by the
thread that waits.  The monitor thread ends the job when one outlives its
deadline, as it does for a stall: every rank dumps its stacks and flight
recorder, the lowest detecting rank writes ``failure.json`` (kind
``checkpoint`` or ``startup``) and aborts with status 75.

Why a second, native line of defence.  h5py holds the GIL inside a
collective file create (``H5Fcreate`` with the MPI-IO driver; writes, flushes
and closes release it, measured here), and a rank whose writer waits there
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

A guard around a call that holds the GIL (``quiet``: the collective file
create and the structure calls after it, ``checkpoint.create``) is announced
in this rank's heartbeats before the call, and the rank's watchers allow it
to be silent until that deadline: a rank in a slow create is not declared
dead while its monitor thread cannot beat (``hpcnet.heartbeat``).  Only that
guard is quiet: a rank stopped anywhere else is still found in seconds.
"""

import contextlib
import ctypes
import faulthandler
import json
import logging
import math
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GUARDS: tuple[str, ...] = ("none", "startup", "checkpoint.save", "checkpoint.write", "checkpoint.create",
                           "checkpoint.meet", "checkpoint.wait", "checkpoint.load")
"""``checkpoint.meet``: a writer waiting for the others before the collective create (``ckpt_io.wait_for_peers``)."""
"""Names of guarded waits; a beat carries the index, so the table is the same on every rank."""
GUARD_CODES: dict[str, int] = {name: code for code, name in enumerate(GUARDS)}

IO_TIMEOUT_FLOOR_S = 120.0
"""The least deadline a checkpoint operation gets when ``checkpoint.timeout_s`` is 0."""
IO_TIMEOUT_FACTOR = 10.0
"""... and this many times the duration of the last save."""
IO_SLOWEST_BYTES_PER_S = 10 * 2**20
"""... and at least its bytes at this rate: a first save or a load has no previous duration to scale."""


def io_timeout_s(configured_s: float, last_save_s: float | None, nbytes: int = 0) -> float:
    """The deadline of one checkpoint operation (pure): ``checkpoint.timeout_s``, or derived when it is 0."""
    if configured_s > 0:
        return configured_s
    derived = max(IO_TIMEOUT_FLOOR_S, nbytes / IO_SLOWEST_BYTES_PER_S)
    if last_save_s is not None:
        derived = max(derived, IO_TIMEOUT_FACTOR * last_save_s)
    return derived


def guard_name(code: int) -> str:
    return GUARDS[code] if 0 <= code < len(GUARDS) else f"guard#{code}"


@dataclass(slots=True, eq=False)
class Guard:
    """One guarded wait of this rank."""

    name: str
    """An entry of ``GUARDS``."""
    what: str
    """For people: ``checkpoint.write (step 20)``."""
    kind: str
    """``failure.json`` kind when it expires: 'checkpoint' or 'startup'."""
    timeout_s: float
    option: str
    """The option that sets the timeout, named in the report."""
    started: float
    """time.monotonic() when it was opened."""
    quiet: bool
    """Its thread holds the GIL in a call that may wait (h5py): watchers allow silence until the deadline."""
    extra_s: float = 0.0
    """Time added after opening (start-up does not count checkpoint loads)."""
    announced: threading.Event = field(default_factory=threading.Event)
    """Set once a heartbeat has told this rank's watchers about it."""

    @property
    def deadline(self) -> float:
        return self.started + self.timeout_s + self.extra_s

    def elapsed_s(self, now: float) -> float:
        return now - self.started


class _Guarded:
    """``with deadlines.guard(...)``: a class, not a generator, because saves open several."""

    __slots__ = ("deadlines", "args", "options", "guard")

    def __init__(self, deadlines: "Deadlines", args: tuple[str, float], options: dict[str, Any]) -> None:
        self.deadlines, self.args, self.options, self.guard = deadlines, args, options, None

    def __enter__(self) -> Guard:
        self.guard = self.deadlines.open(*self.args, **self.options)
        return self.guard

    def __exit__(self, *exc: Any) -> None:
        self.deadlines.close(self.guard)


class Deadlines:
    """The open guards of this rank (thread-safe); ``on_change`` is called after each open and close."""

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self.on_change = on_change
        self._open: list[Guard] = []
        self._lock = threading.Lock()

    def open(self, name: str, timeout_s: float, *, what: str = "", kind: str = "checkpoint",
             option: str = "checkpoint.timeout_s", quiet: bool = False) -> Guard:
        if name not in GUARD_CODES:
            raise ValueError(f"unknown guard {name!r}; add it to hpcnet.watchdog.GUARDS")
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"guard {name}: the timeout must be a positive number of seconds, got {timeout_s}")
        guard = Guard(name, what or name, kind, timeout_s, option, time.monotonic(), quiet)
        with self._lock:
            self._open.append(guard)
        if self.on_change is not None:
            self.on_change()
        return guard

    def close(self, guard: Guard | None) -> None:
        """Close ``guard`` (None, or closed already: ignored); a checkpoint guard stops the start-up clock."""
        if guard is None:
            return
        with self._lock:
            if guard not in self._open:
                return
            self._open.remove(guard)
            if guard.kind == "checkpoint":
                spent = time.monotonic() - guard.started
                for other in self._open:
                    if other.kind == "startup" and other.started <= guard.started:
                        other.extra_s += spent
        if self.on_change is not None:
            self.on_change()

    def guard(self, name: str, timeout_s: float, **options: Any) -> _Guarded:
        """Guard the ``with`` block (closed also when it raises); options as for ``open``."""
        return _Guarded(self, (name, timeout_s), options)

    def guards(self) -> list[Guard]:
        with self._lock:
            return list(self._open)

    def innermost(self) -> Guard | None:
        """The guard opened last: where this rank is (its beats carry it).

        ``checkpoint.wait`` only waits for this rank's own write: while that is open, its guards tell more.
        """
        with self._lock:
            others = [g for g in self._open if g.name != "checkpoint.wait"] or self._open
            return max(others, key=lambda g: g.started, default=None)

    def earliest(self) -> Guard | None:
        """The open guard whose deadline comes first."""
        with self._lock:
            return min(self._open, key=lambda g: g.deadline, default=None)

    def expired(self, now: float) -> Guard | None:
        """The open guard past its deadline that expired first, if any."""
        guard = self.earliest()
        return guard if guard is not None and now > guard.deadline else None

    def quiet(self) -> Guard | None:
        """The open quiet guard with the latest deadline: how long this rank's watchers must allow silence."""
        with self._lock:
            return max((g for g in self._open if g.quiet), key=lambda g: g.deadline, default=None)

    def any_open(self, kind: str) -> bool:
        with self._lock:
            return any(g.kind == kind for g in self._open)


class NullDeadlines:
    """The deadlines when monitoring is off: nothing is timed."""

    def open(self, name: str, timeout_s: float, **options: Any) -> None:
        return None

    def close(self, guard: Guard | None) -> None:
        return None

    def guard(self, name: str, timeout_s: float, **options: Any) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def guards(self) -> list[Guard]:
        return []

    def earliest(self) -> None:
        return None

    def innermost(self) -> None:
        return None

    def expired(self, now: float) -> None:
        return None

    def quiet(self) -> None:
        return None

    def any_open(self, kind: str) -> bool:
        return False


NULL_DEADLINES = NullDeadlines()


# --- the native last resort ------------------------------------------------------

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


def analyze_io(states: dict[int, dict[str, Any] | None]) -> dict[str, Any]:
    """Say which ranks a checkpoint deadline waits for (pure): like ``flightrec.analyze_stall``.

    Args:
        states: per rank, its answer (``step``, ``guard``: its innermost guarded
            wait, ``guard_s``), or None when it did not answer.

    Returns a dict with ``behind`` (ranks in checkpoint I/O that the ranks in
    ``checkpoint.meet`` wait for), ``silent`` and ``lines``: one per rank, then a verdict.
    """
    silent = sorted(r for r, s in states.items() if s is None)
    known = {r: s for r, s in states.items() if s is not None}
    meeting = sorted(r for r, s in known.items() if s["guard"] == "checkpoint.meet")
    in_io = sorted(r for r, s in known.items() if s["guard"].startswith("checkpoint.") and r not in meeting)
    behind = in_io if meeting else []
    lines = []
    for r in sorted(states):
        s = states[r]
        if s is None:
            lines.append(f"rank {r}: no answer (hung, dead, or its monitor thread is blocked: a thread holding "
                         f"the GIL in a C call)")
            continue
        where = f"in {s['guard']} for {s['guard_s']:.1f} s" if s["guard"] != "none" else "not in checkpoint I/O"
        tag = " <- the others wait for it" if r in behind else ""
        lines.append(f"rank {r}: step {s['step']}, {where}{tag}")
    if behind:
        verdict = f"ranks {behind} did not reach the collective file create the others wait at"
    elif silent:
        verdict = f"ranks {silent} did not answer"
    elif in_io:
        verdict = "every rank is inside checkpoint I/O: the file system (or MPI-IO) is stuck"
    else:
        verdict = "no rank is in checkpoint I/O any more"
    lines.append(verdict)
    return {"behind": behind, "mismatched": [], "silent": silent, "lines": lines}
