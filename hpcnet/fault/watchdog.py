"""Deadlines on the blocking waits that are not collectives (the last resort that needs no Python:
``hpcnet.fault.native``).

The flight recorder times the training loop's collectives (``hpcnet.fault.flightrec``);
the other waits a job can hang in are guarded here, each with a deadline:

- checkpoint I/O (``checkpoint.timeout_s``): a save's blocking part, the
  background write, the wait for it, a load.  Its duration grows with the
  model and the file system, so the deadline is generous (``io_timeout_s``);
- start-up (``monitor.startup_timeout_s``): from the monitor's start to the
  first step, minus the time spent in checkpoint loads (they have their own);
- the start-up phases on the network once MPI is up (``dist.startup_timeout_s`` each,
  ``STARTUP_PHASES``): the topology probe, the torch.distributed rendezvous, its first
  collective, and the process groups and first collectives of the transport.  They are
  collective, so when one expires the report says which ranks are in the phase (waiting)
  and which never arrived (``analyze_phase``).

A ``Guard`` is opened around the wait (``with deadlines.guard(...)``) by the
thread that waits.  The monitor thread ends the job when one outlives its
deadline, as it does for a stall: every rank dumps its stacks and flight
recorder, the lowest detecting rank writes ``failure.json`` (kind
``checkpoint`` or ``startup``) and aborts with status 75.

A guard around calls that hold the GIL (``quiet``: the structure calls of a
checkpoint file, ``checkpoint.structure``) is announced in this rank's
heartbeats before the calls, and the rank's watchers allow it to be silent
until that deadline: a rank in slow structure calls is not declared dead
while its monitor thread cannot beat (``hpcnet.fault.heartbeat``).  Only that
guard is quiet, and it covers no call that waits for a peer (the collective
create runs with the GIL released: ``hpcnet.ckpt.h5nogil``): a quiet guard
hides a partition from the watchers until its deadline, while a rank stopped
or cut off anywhere else is found in seconds.
"""

import contextlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

STARTUP_PHASES: dict[str, str] = {
    "dist.probe": "the topology probe",
    "dist.rendezvous": "the rendezvous",
    "dist.first": "the first collective on the data plane",
    "dist.groups": "the transport's process groups and first collectives",
}
"""The collective start-up phases under ``dist.startup_timeout_s``, in the order a rank goes through them."""
STARTUP_OPTION = "dist.startup_timeout_s"

GUARDS: tuple[str, ...] = ("none", "startup", "checkpoint.save", "checkpoint.write", "checkpoint.create",
                           "checkpoint.meet", "checkpoint.wait", "checkpoint.load", *STARTUP_PHASES,
                           "checkpoint.structure")
"""Names of guarded waits; a beat carries the index, so the table is the same on every rank.
``checkpoint.meet``: a writer waiting for the others before the collective create
(``hpcnet.ckpt.collective.wait_for_peers``)."""
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

    __slots__ = ("args", "deadlines", "guard", "options")

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
            raise ValueError(f"unknown guard {name!r}; add it to hpcnet.fault.watchdog.GUARDS")
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"guard {name}: the timeout must be a positive number of seconds, got {timeout_s}")
        guard = Guard(name, what or name, kind, timeout_s, option, time.monotonic(), quiet)
        with self._lock:
            self._open.append(guard)
        if self.on_change is not None:
            self.on_change()
        else:
            guard.announced.set()  # no monitor to announce it: nobody to wait for
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


def startup_phase(deadlines: Any, name: str, timeout_s: float, what: str = "") -> Any:
    """``with startup_phase(...)``: the block is start-up phase ``name`` (a key of ``STARTUP_PHASES``), bounded by
    ``timeout_s`` (``dist.startup_timeout_s``); on expiry the job ends with status 75 (kind 'startup')."""
    return deadlines.guard(name, timeout_s, kind="startup", option=STARTUP_OPTION,
                           what=what or STARTUP_PHASES[name])


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


def analyze_phase(states: dict[int, dict[str, Any] | None], phase: str,
                  hostnames: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """Say which ranks a start-up phase waits for (pure).

    Args:
        states: per rank, its answer (``guard``: its innermost guarded wait, ``guard_s``), or None when it did not
            answer.
        phase: the expired phase (a key of ``STARTUP_PHASES``).
        hostnames: the host of every rank.

    Returns ``behind`` (ranks that answered from before the phase: they never arrived), ``silent`` (no answer),
    ``mismatched`` (empty) and ``lines``: one per rank, then a verdict naming the missing ranks and their hosts.
    """
    order = list(STARTUP_PHASES)
    at = order.index(phase)
    name = STARTUP_PHASES[phase]
    silent = sorted(r for r, s in states.items() if s is None)
    behind, waiting, lines = [], [], []
    for r in sorted(states):
        s = states[r]
        if s is None:
            lines.append(f"rank {r} on {hostnames[r]}: no answer (hung, dead, or its monitor thread is blocked)")
            continue
        guard = s["guard"]
        if guard == phase:
            waiting.append(r)
            lines.append(f"rank {r} on {hostnames[r]}: in {name} for {s['guard_s']:.1f} s")
        elif guard in STARTUP_PHASES and order.index(guard) > at:
            lines.append(f"rank {r} on {hostnames[r]}: past it, in {STARTUP_PHASES[guard]}")
        else:
            behind.append(r)
            where = "not in a start-up phase" if guard in ("none", "startup") else f"in {guard}"
            lines.append(f"rank {r} on {hostnames[r]}: did not arrive ({where}; its log says why)")
    missing = sorted(behind + silent)
    if missing:
        hosts = sorted({hostnames[r] for r in missing})
        verdict = (f"{name} ({phase}) waits for ranks {missing} on {', '.join(hosts)}: "
                   f"{'they' if len(missing) > 1 else 'it'} did not arrive")
    elif waiting:
        verdict = (f"every rank is in {name} ({phase}): they cannot reach each other "
                   "(network interfaces, routes, firewalls: see docs/communication.md)")
    else:
        verdict = f"no rank is in {name} any more"
    lines.append(verdict)
    return {"behind": behind, "mismatched": [], "silent": silent, "lines": lines}
