"""Flight recorder of collectives, and the rules that call a collective stalled or out of step.

Each rank records its recent collectives in a fixed ring: sequence number,
operation, bucket, bytes, step, start and end time.  Every rank issues the
same collectives in the same order, so the *n*-th collective must be the same
operation on every rank; the monitor compares sequence numbers and operations
across ranks (desync) and watches the oldest unfinished one (stall).

Each entry also carries a digest of the control-plane history up to it
(every collective but the gradient buckets, folded into 52 bits): two ranks
whose digests differ at the same position diverged at or before it, even
when the mismatched calls were matched by MPI (the same ``Allreduce`` for
two purposes corrupts silently instead of hanging) and have long finished.
Gradient buckets run on the transport's own communicator, in bucket order on
every rank (the reducer guarantees it), but where they fall between control
collectives may differ by rank (a bucket that a rank lacks a gradient for is
launched later there, inside ``finish``): so only
control collectives are compared across ranks, and beats carry the latest.

Only collectives that every rank issues identically are recorded (the
gradient buckets, stage 3's gather rounds, the reducer's agreement, buffer
broadcasts, the step boundary, the logged loss and the evaluation sum).  Checkpoint I/O is not:
its duration grows with the model and the file system, so a timeout derived
from the step time would abort good runs there; it has deadlines of its own
(``hpcnet.fault.watchdog``).

The hot path is ``start``/``end``: a lock, a counter and a slot in a list,
about a microsecond each, a dozen times a step.
"""

import contextlib
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

OPS: tuple[str, ...] = (
    "none",
    "allreduce.bucket",     # a gradient bucket (Reducer._launch ... the wait in finish)
    "reducer.outcome",      # finish(): agree on success, a transport failure or a missing gradient
    "broadcast.buffers",    # rank 0's BatchNorm statistics to every rank
    "step_boundary",        # stop/save agreement after every step
    "loss.allreduce",       # the logged global loss
    "eval.allreduce",       # the evaluation sums
    "state.is_finite",      # before a save: agree that the state is finite (train.nonfinite)
    "balance.allgather",    # data.balance=auto: each rank's time per sample, every data.balance_every steps
    "reassign.allgather",     # dist.reassign_every: each rank's speed probe
    "stats.gather",         # at the end of the loop: every rank's step-time figures to rank 0 (summary.json)
    "gather.round",         # dist.zero=3: one round of parameter gathers (hpcnet.comm.sharding.rounds)
    "mirror",               # fault.replicas=1: each rank's state to its keeper, its ward's in (a Sendrecv ring)
)
"""Operation names; a beat carries the index, so the table is the same on every rank."""
OP_CODES: dict[str, int] = {name: code for code, name in enumerate(OPS)}
DATA_PLANE_OPS = frozenset({"allreduce.bucket", "gather.round"})
"""Collectives on the data plane's own communicators, left out of cross-rank comparisons (see above): gather
rounds fall between the gradient buckets in an order that may differ by rank, as the buckets do."""
EVERY_RANK_OPS = frozenset(OPS) - DATA_PLANE_OPS - {"none", "broadcast.buffers", "stats.gather", "mirror"}
"""Control-plane collectives that end on a rank only once every rank has entered them (sums and agreements
over the whole job), issued one at a time by the training thread: each one that ends is proof of life
(``FlightRecorder.all_alive_at``)."""
DIGEST_MODULUS = 1 << 52
"""Digests stay below this, so a float64 beat carries them exactly."""

STALL_FACTOR = 10.0
"""A derived stall timeout is this many median step times (at least ``monitor.stall_floor_s``)."""
WARMUP_FACTOR = 4.0
"""Before any step time is known the timeout is this many ``stall_floor_s``: first steps initialise lazily."""
FLOOR_SCALED_MAX_S = 120.0
"""Scaling ``monitor.stall_floor_s`` by ranks per core stops here (``stall_floor``)."""
WARMUP_MAX_S = 240.0
"""... and the timeout before any step time is known stops here (``stall_timeout``), unless the floor is higher."""


def op_name(code: int) -> str:
    """The name of an operation code from a beat; unknown codes are shown as numbers."""
    return OPS[code] if 0 <= code < len(OPS) else f"op#{code}"


def describe_op(op: str, bucket: int, seq: int) -> str:
    """``allreduce.bucket[2] (#842)``."""
    return f"{op}{f'[{bucket}]' if bucket >= 0 else ''} (#{seq})"


@dataclass(slots=True)
class Collective:
    """One recorded collective; ``end`` is None while it runs."""

    seq: int
    op: str
    bucket: int
    nbytes: int
    step: int
    start: float
    """time.monotonic() when it started."""
    digest: int = 0
    """The digest of every control-plane (operation, bucket) up to and including this one."""
    end: float | None = None


class FlightRecorder:
    """The last ``capacity`` collectives of this rank (thread-safe).

    ``start`` may be called from autograd's threads (gradient hooks), ``end``
    from the training thread, and the monitor thread reads concurrently.
    """

    def __init__(self, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError("capacity must be greater than 0")
        self.capacity = capacity
        self.seq = 0
        """Collectives started so far; the sequence number of the latest."""
        self.step = 0
        """Steps completed, set by the monitor at each step boundary."""
        self._digest = 0
        self._last_control: Collective | None = None
        self._ring: list[Collective | None] = [None] * capacity
        self._open: dict[int, Collective] = {}
        self._lock = threading.Lock()
        self.all_alive_at: float | None = None
        """time.monotonic() at which every rank was last known to be alive: the start here of the
        ``EVERY_RANK_OPS`` collective before the latest one that ended.  That one ended, so every rank had
        entered it, having finished the one before; which no rank could finish before this one entered it.
        Heartbeats may be late on a starved host (many ranks a core) while the job demonstrably progresses."""
        self._done_start: float | None = None

    def start(self, op: str, bucket: int = -1, nbytes: int = 0) -> int:
        """Record the start of a collective; return the token for ``end``."""
        if op not in OP_CODES:
            raise ValueError(f"unknown collective {op!r}; add it to hpcnet.fault.flightrec.OPS")
        with self._lock:
            self.seq += 1
            if op not in DATA_PLANE_OPS:
                self._digest = (self._digest * 1_000_003 + OP_CODES[op] * 8191 + bucket + 2) % DIGEST_MODULUS
            entry = Collective(self.seq, op, bucket, nbytes, self.step, time.monotonic(), self._digest)
            if op not in DATA_PLANE_OPS:
                self._last_control = entry
            self._ring[self.seq % self.capacity] = entry
            self._open[self.seq] = entry
            return self.seq

    def end(self, token: int, completed: bool = True) -> None:
        """Record the end of a collective (a token already ended is ignored); ``completed=False``: it raised."""
        with self._lock:
            entry = self._open.pop(token, None)
            if entry is None:
                return
            entry.end = time.monotonic()
            if completed and entry.op in EVERY_RANK_OPS:
                if self._done_start is not None:
                    self.all_alive_at = self._done_start
                self._done_start = entry.start

    def op(self, name: str, bucket: int = -1, nbytes: int = 0) -> "_Op":
        """Record the collective run inside the ``with`` block (ended also when it raises)."""
        return _Op(self, name, bucket, nbytes)

    def entry(self, seq: int) -> Collective | None:
        """The collective with sequence number ``seq``, if still in the ring."""
        entry = self._ring[seq % self.capacity] if seq > 0 else None
        return entry if entry is not None and entry.seq == seq else None

    def latest(self) -> Collective | None:
        return self.entry(self.seq)

    def latest_control(self) -> Collective | None:
        """The latest collective other than a gradient bucket (the ones compared across ranks)."""
        return self._last_control

    def oldest_open(self) -> Collective | None:
        """The unfinished collective that started first (the one that holds up the rest)."""
        with self._lock:
            return min(self._open.values(), key=lambda e: e.seq, default=None)

    def entries(self) -> list[Collective]:
        """The recorded collectives, oldest first."""
        with self._lock:
            first = max(1, self.seq - self.capacity + 1)
            return [e for e in (self.entry(s) for s in range(first, self.seq + 1)) if e is not None]


class _Op:
    """``with recorder.op(...)``: a class, not a generator, because it runs on every step."""

    __slots__ = ("args", "recorder", "token")

    def __init__(self, recorder: FlightRecorder, name: str, bucket: int, nbytes: int) -> None:
        self.recorder, self.args, self.token = recorder, (name, bucket, nbytes), 0

    def __enter__(self) -> None:
        self.token = self.recorder.start(*self.args)

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.recorder.end(self.token, completed=exc_type is None)


class NullRecorder:
    """The recorder when monitoring is off: records nothing."""

    seq = 0
    step = 0

    def start(self, op: str, bucket: int = -1, nbytes: int = 0) -> int:
        return 0

    def end(self, token: int) -> None:
        return None

    def op(self, name: str, bucket: int = -1, nbytes: int = 0) -> contextlib.nullcontext:
        return contextlib.nullcontext()


NULL_RECORDER = NullRecorder()


def oversubscription(ranks_on_machine: int, cores: int) -> float:
    """Ranks per core on a machine (at least 1; pure).

    On a machine with more ranks than cores every collective waits for ranks
    that the scheduler has not run yet: an all-reduce can then take many times
    its usual time while every rank is alive and in it.  The stall floor is
    scaled by this factor there (``stall_floor``).  The ranks counted are
    those on one kernel (``hpcnet.world.machine_sharing``): hosts that are
    namespaces or containers of one machine share its cores.
    """
    return max(1.0, ranks_on_machine / max(1, cores))


def stall_floor(configured_s: float, factor: float, *, scaled_max_s: float = FLOOR_SCALED_MAX_S) -> float:
    """The stall floor (pure): ``monitor.stall_floor_s`` times the ranks per core, at most ``scaled_max_s``.

    The cap bounds the time to catch a real stall however many ranks share a
    core (16 a core would otherwise make it 8 minutes, 32 minutes before the
    first step); a floor configured above the cap is kept as it is.
    """
    return max(configured_s, min(configured_s * factor, scaled_max_s))


def warmup_timeout(floor_s: float, *, warmup_factor: float = WARMUP_FACTOR, max_s: float = WARMUP_MAX_S) -> float:
    """The stall timeout before any step time is known, and the silence allowed before a rank's first step
    (pure): ``warmup_factor`` floors, at most ``max_s`` unless the floor itself is higher."""
    return max(floor_s, min(warmup_factor * floor_s, max_s))


def stall_timeout(configured_s: float, floor_s: float, step_times: Sequence[float], *,
                  factor: float = STALL_FACTOR, warmup_factor: float = WARMUP_FACTOR) -> float:
    """How long a collective may run before it is a stall (pure).

    Args:
        configured_s: ``monitor.stall_timeout_s``; > 0 is used as is.
        floor_s: the stall floor (``stall_floor``), the least a derived timeout may be.
        step_times: recent step durations in seconds.
    """
    if configured_s > 0:
        return configured_s
    if not step_times:
        return warmup_timeout(floor_s, warmup_factor=warmup_factor)
    return max(floor_s, factor * statistics.median(step_times))


class StallClock:
    """How long the oldest open collective has been open, on time this rank observed (pure, clock passed in).

    The monitor thread looks every tick.  A gap longer than ``frozen_s``
    between two looks (the thread stopped, or starved of a core or of the GIL)
    counts as ``frozen_s``: a rank is not judged on time it did not observe,
    yet a machine busy enough to starve the thread for a few seconds now and
    then (many ranks a core) still gets its stalls declared, a little later.
    Time during which ``tick`` is told not to count (checkpoint I/O, which has
    its own deadline) does not count at all.
    """

    def __init__(self, frozen_s: float) -> None:
        self.frozen_s = frozen_s
        self.observed_s = 0.0
        self._last: float | None = None
        self._seq = 0
        self._since = 0.0

    def tick(self, now: float, counting: bool = True) -> None:
        if self._last is not None and counting:
            self.observed_s += min(max(0.0, now - self._last), self.frozen_s)
        self._last = now

    def open_for(self, seq: int, start: float, now: float) -> float:
        """Observed seconds collective ``seq`` (started at ``start``) has been open; 0 for no collective (seq 0)."""
        if seq == 0:
            self._seq = 0
            return 0.0
        if seq != self._seq:  # first seen now: count what passed since it started, up to frozen_s
            self._seq = seq
            self._since = self.observed_s - min(max(0.0, now - start), self.frozen_s)
        return self.observed_s - self._since


def desync(mine: Collective | None, seq: int, op: str, bucket: int, digest: int | None = None) -> str | None:
    """Compare a peer's collective ``seq`` with this rank's; a description when they differ (pure)."""
    if mine is None or mine.seq != seq or mine.op in DATA_PLANE_OPS or op in DATA_PLANE_OPS:
        return None
    if mine.op != op or mine.bucket != bucket:
        return f"{describe_op(op, bucket, seq)} there, {describe_op(mine.op, mine.bucket, seq)} here"
    if digest is not None and digest != mine.digest:
        return (f"both are at {describe_op(op, bucket, seq)}, but the collectives before it differ "
                f"(compare the flight recorders)")
    return None


def format_entries(entries: Sequence[Collective], now: float) -> str:
    """The flight recorder as a table, oldest first (``now`` = time.monotonic())."""
    lines = [f"{'seq':>8} {'step':>7} {'operation':<20} {'bucket':>6} {'bytes':>12} {'started':>10} {'took':>10}"]
    for e in entries:
        took = f"{e.end - e.start:.4f}s" if e.end is not None else "RUNNING"
        lines.append(f"{e.seq:>8} {e.step:>7} {e.op:<20} {e.bucket if e.bucket >= 0 else '':>6} {e.nbytes:>12} "
                     f"{e.start - now:>+9.3f}s {took:>10}")
    return "\n".join(lines)


def analyze_stall(states: dict[int, dict[str, Any] | None], known_mismatch: Sequence[int] = ()) -> dict[str, Any]:
    """Say which ranks are behind, out of step, or silent (pure).

    Args:
        states: per rank, its state from a beat or an answer (``step``; ``seq``,
            ``op``, ``bucket`` of its latest collective; optionally ``cseq``,
            ``cop``, ``digest`` of its latest control one; ``open_seq``,
            ``open_op``, ``open_bucket``, ``open_s``; optionally ``guard`` and
            ``guard_s``, its guarded wait), or None when it did not answer.
        known_mismatch: ranks already seen to disagree (a desync found by
            comparing beats), whatever their answers show now.

    Returns a dict with ``behind``, ``mismatched``, ``silent`` (rank lists)
    and ``lines``: one human-readable line per rank, then a verdict.
    """
    known = {r: s for r, s in states.items() if s is not None}
    silent = sorted(r for r, s in states.items() if s is None)
    lead = max((s["seq"] for s in known.values()), default=0)
    # Group by position among control collectives: ranks there must be in the same one, with the same history.
    by_seq: dict[int, dict[tuple[Any, ...], list[int]]] = {}
    for r, s in known.items():
        key = (s["cop"], s.get("digest")) if "cseq" in s else (s["op"], s["bucket"])
        by_seq.setdefault(s.get("cseq", s["seq"]), {}).setdefault(key, []).append(r)
    mismatched: list[int] = list(known_mismatch)
    for groups in by_seq.values():
        if len(groups) > 1:
            sizes = sorted((len(m) for m in groups.values()), reverse=True)
            # With no clear majority (two ranks disagreeing) every side is suspect.
            majority = max(groups.values(), key=len) if sizes[0] > sizes[1] else None
            mismatched += [r for members in groups.values() if members is not majority for r in members]
    mismatched = sorted(set(mismatched))
    behind = sorted(r for r, s in known.items() if s["seq"] < lead and r not in mismatched)
    lines = []
    for r in sorted(states):
        s = states[r]
        if s is None:
            lines.append(f"rank {r}: no answer (hung, dead, or its monitor thread is blocked)")
            continue
        where = (f"waiting in {describe_op(s['open_op'], s['open_bucket'], s['open_seq'])} for {s['open_s']:.1f} s"
                 if s["open_seq"] > 0 else
                 f"not in a collective (last: {describe_op(s['op'], s['bucket'], s['seq'])})")
        if s.get("guard", "none") != "none":
            where += f"; in {s['guard']} for {s['guard_s']:.1f} s"
        tag = ""
        if r in mismatched:
            tag = " <- MISMATCHED"
        elif r in behind:
            tag = f" <- BEHIND by {lead - s['seq']} collective(s)"
        lines.append(f"rank {r}: step {s['step']}, {where}{tag}")
    if mismatched:
        verdict = f"ranks {mismatched} issued a different collective at the same position (desync)"
    elif behind:
        verdict = f"ranks {behind} are behind: the others wait for them"
    elif silent:
        verdict = f"ranks {silent} did not answer"
    else:
        verdict = "every rank is in the same collective: the network or the collective library is stuck"
    lines.append(verdict)
    return {"behind": behind, "mismatched": sorted(mismatched), "silent": silent, "lines": lines}
