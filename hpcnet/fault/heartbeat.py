"""Heartbeats in a ring: who beats to whom, what a beat carries, and when a peer is lost.

Why a ring.  Rank r sends a beat to its two successors r+1 and r+2 and
watches its two predecessors r-1 and r-2 (modulo the world size):

- every rank sends and receives two 160-byte messages per interval, whatever
  the size of the job: at 1,000 ranks and the default 2 s interval that is
  1,000 messages a second for the whole job, half a message a second per
  rank per direction, about 160 B/s per rank.  A star (every rank beats to
  rank 0) puts 500 messages a second and 1,000 deadlines on one rank, whose
  own failure then goes unseen; a tree needs its inner nodes to forward, so
  one hung inner node hides its subtree.
- a failure is noticed by a neighbour, which may be on the same node: the
  detection time does not grow with the job.
- the blind spot of a plain ring (one watcher each) is two adjacent ranks
  failing together (one node going down takes out consecutive ranks): r+2
  sees r+1 go silent, but r's only watcher is r+1, which is gone, so r would
  never be named.  With two watchers each, any run of failed ranks shorter
  than the whole job is named entirely, rank by rank, by the two live ranks
  after it: r+2 watches r and r+1.  A run of three or more adjacent failures
  is still detected (the live rank after it sees the last two) and ends the
  job, but only the last two are named.

A beat is a float64 vector (``FIELDS``): the session (so stale messages of an
earlier monitor on a reused communicator are ignored), the sender, its state
(running, or leaving: a rank that stops monitoring says goodbye so its
watchers do not mistake the end of the run for a failure), its step, its
latest collective (progress), the sequence number, operation and history
digest of its latest control-plane collective (for desync checks, see
``hpcnet.fault.flightrec``), the collective it is waiting in and for how long, its
wall-clock time and process id, and the guarded wait it is in
(``hpcnet.fault.watchdog``: checkpoint I/O or start-up) with how long it has run and,
for a guard whose thread may hold the GIL, how long until its deadline.  Stall
notices and their answers use the same vector.

A rank in such a guard (a collective checkpoint file create: h5py holds the
GIL inside it, so the monitor thread cannot beat) may fall silent; its
watchers allow it the silence until the deadline it announced, plus the
usual misses, plus the time its peers need to report an expired deadline
themselves.

Everything here is non-blocking (``Isend``/``Irecv`` + ``Test``), on a
private communicator: the monitor thread never waits for a peer, so a peer
that is stopped, hung or dead can never hang the monitor.
"""

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from hpcnet.fault.flightrec import OP_CODES, op_name
from hpcnet.fault.survive import passing_notice
from hpcnet.fault.watchdog import GUARD_CODES, guard_name

FIELDS: tuple[str, ...] = ("session", "rank", "state", "step", "seq", "op", "bucket", "cseq", "cop", "digest",
                           "open_seq", "open_op", "open_bucket", "open_s", "wall", "pid", "kind", "guard", "guard_s",
                           "guard_left_s")
"""The slots of a beat: ``seq``/``op``/``bucket`` the latest collective (progress), ``cseq``/``cop``/``digest``
the latest control-plane one (compared across ranks), ``open_*`` the oldest still running; operations are
indices into ``hpcnet.fault.flightrec.OPS``; ``guard`` (an index into ``hpcnet.fault.watchdog.GUARDS``) the guarded wait
with the earliest deadline, ``guard_s`` how long it has run, ``guard_left_s`` the time left to the latest
deadline of a guard that may hold the GIL (0: none)."""
_INDEX = {name: i for i, name in enumerate(FIELDS)}
_FLOATS = {"open_s", "wall", "guard_s", "guard_left_s"}

TAG_BEAT, TAG_NOTICE, TAG_ACK = 7101, 7102, 7103
RUNNING, LEAVING = 1, 2
"""Values of ``state``."""
KINDS = {0: "", 1: "stall", 2: "desync", 3: "checkpoint", 4: "startup"}
"""Values of ``kind`` in a notice: why the sender asks every rank for its dump."""
KIND_CODES = {name: code for code, name in KINDS.items()}
WATCHERS = 2
"""Each rank is watched by this many successors (see the module docstring)."""


def ring_peers(rank: int, size: int, depth: int = WATCHERS) -> tuple[list[int], list[int]]:
    """``(send_to, watch)``: the ranks this rank beats to and the ranks it watches (pure)."""
    send_to: list[int] = []
    watch: list[int] = []
    for k in range(1, min(depth, size - 1) + 1):
        send_to.append((rank + k) % size)
        watch.append((rank - k) % size)
    return send_to, watch


def encode(**values: Any) -> np.ndarray:
    """A beat vector from field values (missing fields are 0; operation names become codes)."""
    vector = np.zeros(len(FIELDS))
    for name, value in values.items():
        if name in ("op", "cop", "open_op") and isinstance(value, str):
            value = OP_CODES[value]
        elif name == "kind" and isinstance(value, str):
            value = KIND_CODES[value]
        elif name == "guard" and isinstance(value, str):
            value = GUARD_CODES[value]
        vector[_INDEX[name]] = value
    return vector


def position(recorder: Any, deadlines: Any, now: float) -> dict[str, Any]:
    """A rank's position, as its beats carry it: its flight recorder's and its guarded waits' (see ``FIELDS``)."""
    latest, control, oldest = recorder.latest(), recorder.latest_control(), recorder.oldest_open()
    guard, quiet = deadlines.innermost(), deadlines.quiet()
    return {"guard": guard.name if guard else "none", "guard_s": guard.elapsed_s(now) if guard else 0.0,
            "guard_left_s": max(0.0, quiet.deadline - now) if quiet else 0.0,
            "step": recorder.step, "seq": latest.seq if latest else 0, "op": latest.op if latest else "none",
            "bucket": latest.bucket if latest else -1, "cseq": control.seq if control else 0,
            "cop": control.op if control else "none", "digest": control.digest if control else 0,
            "open_seq": oldest.seq if oldest else 0,
            "open_op": oldest.op if oldest else "none", "open_bucket": oldest.bucket if oldest else -1,
            "open_s": now - oldest.start if oldest else 0.0}


def decode(vector: np.ndarray) -> dict[str, Any]:
    """The fields of a beat vector, with operation and kind names."""
    fields: dict[str, Any] = {name: (float(vector[i]) if name in _FLOATS else int(vector[i]))
                              for i, name in enumerate(FIELDS)}
    for name in ("op", "cop", "open_op"):
        fields[name] = op_name(fields[name])
    fields["kind"] = KINDS.get(fields["kind"], str(fields["kind"]))
    fields["guard"] = guard_name(fields["guard"])
    return fields


class PeerTracker:
    """When each watched rank was last heard from, and which ones are overdue (pure, clock passed in).

    A rank that has not completed a step yet gets ``startup_deadline_s``
    instead of ``misses`` intervals (unless this rank has: a step needs every
    rank, so the peer is past start-up too): while starting up, ranks open HDF5 files
    collectively (the dataset, a checkpoint to resume from), and h5py holds
    the GIL inside a collective ``H5Fopen``, so a rank that waits there for a
    slower one (rank 0 generating the dataset) cannot run its monitor thread
    until the slowest rank arrives.

    Args:
        watch: the ranks to watch.
        interval_s: the heartbeat interval.
        misses: beats in a row a rank may miss before it is declared failed.
        now: the current time.monotonic().
        startup_deadline_s: the silence allowed before a rank's first step.
        guard_slack_s: the silence allowed beyond a deadline a rank announced
            (``guard_left_s``): its peers' own report of that deadline comes first.
    """

    def __init__(self, watch: Iterable[int], interval_s: float, misses: int, now: float, *,
                 startup_deadline_s: float = 0.0, guard_slack_s: float = 0.0) -> None:
        self.deadline_s = misses * interval_s
        self.startup_deadline_s = max(self.deadline_s, startup_deadline_s)
        self.guard_slack_s = guard_slack_s
        self.frozen_s = interval_s
        self.last_heard = {r: now for r in watch}
        self.last_beat: dict[int, dict[str, Any] | None] = {r: None for r in self.last_heard}
        self.left: set[int] = set()
        self._last_tick = now
        self._away_until = 0.0

    def tick(self, now: float) -> None:
        """Call once per loop: a pause of this rank itself (stopped, starved) restarts every count.

        A rank cannot judge its neighbours over a period it did not observe:
        after being SIGSTOPped or starved of CPU, the silence it sees is its
        own.
        """
        gap = now - self._last_tick
        if gap > self.frozen_s:
            for rank in self.last_heard:
                self.last_heard[rank] = max(self.last_heard[rank], now)
        if gap > self.deadline_s:
            # Away longer than a peer may be silent: its watchers have judged
            # this rank, and the job is likely being torn down (mpirun
            # continues stopped ranks to end them). Judge nobody for a while.
            self._away_until = now + 2 * self.deadline_s
        self._last_tick = now

    def judging_paused(self, now: float) -> bool:
        """True for a while after this rank itself was away for longer than the deadline."""
        return now < self._away_until

    def heard(self, rank: int, beat: dict[str, Any], now: float) -> None:
        if rank not in self.last_heard:
            return
        self.last_heard[rank] = now
        self.last_beat[rank] = beat
        if beat["state"] == LEAVING:
            self.left.add(rank)

    def alive_at(self, when: float) -> None:
        """Every watched rank was alive at ``when`` (a collective over the whole job ended): as if heard then."""
        for rank, heard in self.last_heard.items():
            if when > heard:
                self.last_heard[rank] = when

    def deadline_of(self, rank: int, own_step: int = 0) -> float:
        """How long ``rank`` may be silent after its last beat."""
        beat = self.last_beat[rank]
        started = own_step > 0 or (beat is not None and beat["step"] > 0)
        deadline = self.deadline_s if started else self.startup_deadline_s
        if beat is not None and beat["guard_left_s"] > 0:
            deadline = max(deadline, beat["guard_left_s"] + self.deadline_s + self.guard_slack_s)
        return deadline

    def overdue(self, now: float, own_step: int = 0) -> list[int]:
        """Watched ranks silent for longer than their deadline (and not gone on purpose).

        Args:
            now: the current time.monotonic().
            own_step: steps this rank has completed.
        """
        return [r for r, t in self.last_heard.items()
                if r not in self.left and now - t > self.deadline_of(r, own_step)]

    def silent_s(self, rank: int, now: float) -> float:
        return now - self.last_heard[rank]


class HeartbeatLink:
    """Non-blocking messages between monitor threads on ``comm`` (a communicator of their own).

    One ``Irecv(ANY_SOURCE, ANY_TAG)`` is always posted; ``poll`` drains what
    has arrived.  A send to a rank whose previous beat has not left yet is
    skipped, so a stopped receiver never makes sends pile up.
    """

    def __init__(self, comm: Any, session: int) -> None:
        from mpi4py import MPI

        self.comm = comm
        self.session = session
        self._status = MPI.Status()
        self._buffer = np.zeros(len(FIELDS))
        self._recv = comm.Irecv(self._buffer, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
        self._beats_pending: dict[int, Any] = {}
        self._other_pending: list[tuple[Any, np.ndarray]] = []
        self.sent = 0
        self.received = 0
        self.closed = False

    def send_beat(self, dests: Iterable[int], vector: np.ndarray) -> None:
        for dest in dests:
            pending = self._beats_pending.get(dest)
            if pending is not None and not pending[0].Test():
                continue  # the last beat has not left: the receiver is not taking them
            buffer = vector.copy()
            self._beats_pending[dest] = (self.comm.Isend(buffer, dest=dest, tag=TAG_BEAT), buffer)
            self.sent += 1

    def send(self, dest: int, tag: int, vector: np.ndarray) -> None:
        """Send a notice or an answer (kept until it has left)."""
        self._other_pending = [(r, b) for r, b in self._other_pending if not r.Test()]
        buffer = vector.copy()
        self._other_pending.append((self.comm.Isend(buffer, dest=dest, tag=tag), buffer))

    def poll(self) -> list[tuple[int, int, dict[str, Any]]]:
        """Every message that has arrived, as ``(tag, source, fields)``; other sessions' are dropped."""
        from mpi4py import MPI

        messages = []
        while self._arrived():
            fields = decode(self._buffer)
            source, tag = self._status.Get_source(), self._status.Get_tag()
            self._recv = self.comm.Irecv(self._buffer, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
            if fields["session"] == self.session:
                messages.append((tag, source, fields))
                self.received += 1
        return messages

    def _arrived(self) -> bool:
        try:
            return bool(self._recv.Test(self._status))
        except Exception as exc:
            if passing_notice(self.comm, exc):  # no peer of this job lost: the receive is still posted
                return False
            raise

    def flush(self, timeout_s: float) -> None:
        """Give the last messages up to ``timeout_s`` to leave (never waits for longer)."""
        deadline = time.monotonic() + timeout_s
        pending = [r for r, _ in self._beats_pending.values()] + [r for r, _ in self._other_pending]
        while pending and time.monotonic() < deadline:
            pending = [r for r in pending if not r.Test()]
            if pending:
                time.sleep(0.005)

    def close(self) -> None:
        """Cancel the posted receive; never blocks.

        The communicator is deliberately not freed: a peer that stops after
        this rank still sends its goodbye beat, and a message that arrives
        for a freed communicator is delivered by Open MPI to the next one
        that reuses its context id, out of sequence, where it shadows a real
        message (a stall answer lost in the next monitor).  One
        idle communicator per monitor, with a few unread beats, is the cost.
        """
        self.closed = True
        self._recv.Cancel()
        self._recv.Wait()
