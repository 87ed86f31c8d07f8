"""Failure detection while training: heartbeats, stalls, desyncs and memory leaks.

One ``Monitor`` per rank owns a background thread on a private duplicate of
the job's communicator: it beats to its ring successors and watches its
predecessors (``hpcnet.fault.heartbeat``), compares their positions with its
own flight recorder (``hpcnet.fault.flightrec``: desyncs), watches its oldest
unfinished collective (stalls) and its guarded waits
(``hpcnet.fault.watchdog``: checkpoint I/O, start-up).  What it declares, how
the ranks agree on who reports, and what ``failure.json`` says: docs/fault-tolerance.md.

Why abort and not a clean exit: when a rank hangs, the others are usually
blocked inside a collective waiting for it.  No Python code runs on those
ranks' main threads until the collective completes, which it never will, so
they cannot agree on anything; only ``MPI_Abort`` (from the monitor thread,
which MPI_THREAD_MULTIPLE allows) ends them.

Threads: the monitor thread calls MPI (Isend, Irecv, Test) while the
training thread, and the MPI transport's worker, are inside MPI calls, which
needs ``MPI_THREAD_MULTIPLE``.  With ``MPI_THREAD_SERIALIZED`` every call
would take one global lock, and a training thread blocked in an all-reduce
with a hung peer would hold it forever: the monitor would freeze exactly when
it is needed.  mpi4py asks for MULTIPLE by default; a library that grants
less turns the monitor thread off with a warning.

The reports and dumps it writes, and the stacks signal: ``hpcnet.fault.failure``.
"""

import contextlib
import json
import logging
import os
import random
import select
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hpcnet.config import MonitorConfig
from hpcnet.errors import ExitCode
from hpcnet.fault.failure import (
    DUMP_SIGNAL,
    heartbeat_report,
    native_report,
    register_dump_signal,
    stall_report,
    write_dump,
    write_failure,
)
from hpcnet.fault.flightrec import (
    FLOOR_SCALED_MAX_S,
    NULL_RECORDER,
    FlightRecorder,
    StallClock,
    describe_op,
    desync,
    oversubscription,
    stall_floor,
    stall_timeout,
    warmup_timeout,
)
from hpcnet.fault.heartbeat import (
    LEAVING,
    RUNNING,
    TAG_ACK,
    TAG_BEAT,
    TAG_NOTICE,
    HeartbeatLink,
    PeerTracker,
    encode,
    position,
    ring_peers,
)
from hpcnet.fault.liveness import LocalLiveness, halted, name_this_thread, process_threads, start_time
from hpcnet.fault.memwatch import MemoryWatch, merge_summaries
from hpcnet.fault.native import NativeWatchdog
from hpcnet.fault.survive import is_process_failure, revoke_all, track
from hpcnet.fault.watchdog import NULL_DEADLINES, Deadlines, Guard
from hpcnet.paths import FAILURE_FILE, stall_dump
from hpcnet.world import World, machine_id, sharing, usable_cores

MERGE_WAIT_S = 0.5
"""The longest a rank that declared silent peers waits for their other watchers' view in ``failure.json``."""

log = logging.getLogger(__name__)


class Monitor:
    """Heartbeats, flight recorder, stall/desync watchdog and memory watch for one rank.

    Args:
        cfg: the ``monitor`` options.
        comm: the job's communicator (``start`` duplicates it; ``summary`` gathers on it).
        world: its layout (hosts name the failed ranks).
        run_dir: where reports and dumps go.
        device: the training device (GPU memory is watched on CUDA).
        on_failure: called with the report once a failure is declared; the
            default aborts the job with status 75, and the native watchdog
            ends a rank whose Python cannot run.  A caller that passes one
            (tests pass a recorder) ends the job itself: neither happens.
    """

    def __init__(self, cfg: MonitorConfig, comm: Any, world: World, run_dir: Path, *, device: Any = None,
                 on_failure: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.cfg = cfg
        self.comm = comm
        self.world = world
        self.run_dir = Path(run_dir)
        self.on_failure = on_failure
        self.recorder: FlightRecorder | Any = FlightRecorder() if cfg.enabled else NULL_RECORDER
        self.memory = (MemoryWatch(cfg.memory_every_steps, cfg.memory_window, cfg.memory_growth_mb, device=device,
                                   run_dir=self.run_dir, rank=world.rank)
                       if cfg.enabled and cfg.memory_every_steps > 0 else None)
        self.failure: dict[str, Any] | None = None
        """The report, once this rank declared a failure."""
        self.send_to, self.watch = ring_peers(world.rank, world.size)
        self._tick_s = min(0.05, max(0.01, cfg.heartbeat_interval_s / 10))
        self._step_times: deque[float] = deque(maxlen=100)
        self._last_step_at: float | None = None
        self.floor_s = cfg.stall_floor_s
        """``monitor.stall_floor_s`` times this machine's ranks per core, capped (``stall_floor``), set at start."""
        self._timeout_s = stall_timeout(cfg.stall_timeout_s, self.floor_s, [])
        self._timeout_at = 0.0
        self._link: HeartbeatLink | None = None
        self._tracker: PeerTracker | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        """A byte written here makes the monitor thread act now rather than at its next tick (a guard was opened
        or closed).  A pipe, not an Event: the thread then sleeps in ``select``, not on a futex, which a watcher
        on this host would take for a wait for the GIL (``hpcnet.fault.liveness``)."""
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._muted = False  # tests: stop beating, as a hung rank would
        self._next_beat = 0.0
        self._peer_latest: dict[int, dict[str, Any]] = {}
        self._dumped = False
        self._doomed_at: float | None = None
        self._coordinating = ""  # the kind of failure this rank is collecting answers for
        self.deadlines: Deadlines | Any = NULL_DEADLINES
        """This rank's guarded waits (``hpcnet.fault.watchdog``); real once the monitor thread runs."""
        self._startup: Guard | None = None
        self._native: NativeWatchdog | None = None
        self._beat_now = False
        self._pids: tuple[int, ...] = ()
        self._local = LocalLiveness({})
        self._stall_clock = StallClock(cfg.heartbeat_interval_s)  # time observed, outside checkpoint I/O
        self._coordination_s = max(2.0, 2 * cfg.heartbeat_interval_s)
        """How long a rank that reports waits for the others' answers."""
        misses_s = cfg.heartbeat_misses * cfg.heartbeat_interval_s
        self.native_grace_s = misses_s + 2 * self._coordination_s + 10.0
        """How long after a deadline the native watchdog waits for the monitor (here or on a peer) to act:
        beyond a peer's allowance for this rank's silence, its report and the abort."""

    # -- life cycle (training thread) --------------------------------------------
    def start(self) -> "Monitor":
        """Start the monitor thread (collective: duplicates the communicator)."""
        from mpi4py import MPI

        if not self.cfg.enabled:
            return self
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            log.warning("MPI was initialised without MPI_THREAD_MULTIPLE: heartbeats and stall detection are off")
            return self
        hb_comm = track(self.comm.Dup())
        session = hb_comm.bcast(random.getrandbits(48) if self.world.rank == 0 else None, root=0)
        ids = hb_comm.allgather((os.getpid(), start_time(os.getpid()), machine_id(), usable_cores()))
        self._pids = tuple(pid for pid, *_ in ids)  # whom to ask for stacks on this host
        # The ranks whose /proc a watcher reads: its host's, and those of other hosts of this machine it can see.
        here = [r for r in range(self.world.size) if self.world.hostnames[r] == self.world.hostname]
        machine = ids[self.world.rank][2]
        beside = [r for r in self.watch if r not in here and ids[r][2] == machine and ids[r][1] is not None
                  and start_time(ids[r][0]) == ids[r][1]]
        self._local = LocalLiveness({r: ids[r][:2] for r in self.watch if (r in here or r in beside)
                                     and r != self.world.rank},
                                    idle_s=self.cfg.heartbeat_misses * self.cfg.heartbeat_interval_s, remote=beside)
        # Ranks per core on this machine: hosts that are namespaces or containers of one machine share its cores.
        ranks, cores = sharing([(machine, cpus) for _, _, machine, cpus in ids], self.world.rank)
        factor = oversubscription(ranks, cores)
        self.floor_s = stall_floor(self.cfg.stall_floor_s, factor)
        self._timeout_s = stall_timeout(self.cfg.stall_timeout_s, self.floor_s, [])
        if factor > 1 and self.world.rank == 0 and self.cfg.stall_timeout_s <= 0:
            log.info("%d ranks share %d core(s) on %s's machine: the stall floor is %.0f s (monitor.stall_floor_s x "
                     "%.1f ranks per core, at most %.0f s), %.0f s before the first step", ranks, cores,
                     self.world.hostname, self.floor_s, factor, FLOOR_SCALED_MAX_S, warmup_timeout(self.floor_s))
        self._link = HeartbeatLink(hb_comm, session)
        self._tracker = PeerTracker(self.watch, self.cfg.heartbeat_interval_s, self.cfg.heartbeat_misses,
                                    time.monotonic(), startup_deadline_s=warmup_timeout(self.floor_s),
                                    guard_slack_s=2 * self._coordination_s)
        register_dump_signal()
        self._native = NativeWatchdog(int(ExitCode.RESTARTABLE))
        self.deadlines = Deadlines(on_change=self._guards_changed)
        self._startup = self.deadlines.open("startup", self.cfg.startup_timeout_s, kind="startup",
                                            what="start-up (before the first step)",
                                            option="monitor.startup_timeout_s")
        self._thread = threading.Thread(target=self._run, name="hpcnet-monitor", daemon=True)
        self._thread.start()
        return self

    def step(self, step: int) -> None:
        """Call at each step boundary with the number of steps completed (cheap)."""
        if self._startup is not None:
            self.deadlines.close(self._startup)  # started: the start-up deadline no longer applies
            self._startup = None
        self.recorder.step = step
        now = time.monotonic()
        if self._last_step_at is not None:
            self._step_times.append(now - self._last_step_at)
        self._last_step_at = now
        if self.memory is not None:
            self.memory.maybe_sample(step)

    def collective(self, name: str, bucket: int = -1, nbytes: int = 0) -> contextlib.AbstractContextManager:
        """Record the collective run in the block in the flight recorder."""
        return self.recorder.op(name, bucket, nbytes)

    def stop(self) -> None:
        """Stop the thread after a goodbye beat, and every deadline; local, never waits for a peer.

        The stacks signal stays registered (see the module docstring).
        """
        self._stop.set()
        self._nudge()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._thread is None or not self._thread.is_alive():
            self._close_pipe()  # a thread that outlived the join still selects on it
        self._thread = None
        native, self._native = self._native, None
        if native is not None:
            native.close()
        self.deadlines = NULL_DEADLINES
        self._startup = None

    def __enter__(self) -> "Monitor":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def summary(self) -> dict[str, Any]:
        """The monitor's part of summary.json, on rank 0 (collective: gathers every rank's memory trend)."""
        mine = {"memory": self.memory.summary() if self.memory else None,
                "sent": self._link.sent if self._link else 0, "received": self._link.received if self._link else 0}
        every = self.comm.gather(mine, root=0)
        if self.world.rank != 0:
            return {}
        result: dict[str, Any] = {"enabled": self.cfg.enabled}
        if not self.cfg.enabled:
            return result
        times = list(self._step_times)
        result.update(
            heartbeat_interval_s=self.cfg.heartbeat_interval_s, heartbeat_misses=self.cfg.heartbeat_misses,
            watchers_per_rank=len(self.watch), beats_sent=sum(e["sent"] for e in every),
            beats_received=sum(e["received"] for e in every), collectives_recorded=self.recorder.seq,
            median_step_s=round(statistics.median(times), 6) if times else None,
            stall_timeout_s=round(stall_timeout(self.cfg.stall_timeout_s, self.floor_s, times), 3))
        if self.memory is not None:
            result["memory"] = merge_summaries([e["memory"] for e in every], self.cfg.memory_every_steps)
        return result

    # -- the monitor thread -------------------------------------------------------
    def _run(self) -> None:
        name_this_thread()
        try:
            while not self._stop.is_set():
                self._once(time.monotonic())
                self._sleep()
        except Exception as exc:
            if is_process_failure(exc):  # a fault-tolerant MPI: a peer died; wake every survivor (hpcnet.fault.live)
                log.info("the monitor saw a peer fail (%s): every communicator of the job is revoked", exc)
                revoke_all()
            else:
                log.exception("the monitor thread failed: heartbeats and stall detection are off for this rank")
        finally:
            self._leave()

    def _sleep(self) -> None:
        """Until the next tick, or a nudge."""
        if select.select([self._wake_r], [], [], self._tick_s)[0]:
            with contextlib.suppress(OSError):
                os.read(self._wake_r, 4096)

    def _close_pipe(self) -> None:
        fds, (self._wake_r, self._wake_w) = (self._wake_r, self._wake_w), (-1, -1)
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def _nudge(self) -> None:
        with contextlib.suppress(OSError):  # full (a nudge is pending already) or closed (stopped)
            os.write(self._wake_w, b"!")

    def _once(self, now: float) -> None:
        assert self._tracker is not None
        # Checkpoint I/O has its own deadline: that time does not count towards a stall (StallClock).
        self._stall_clock.tick(now, counting=not self.deadlines.any_open("checkpoint"))
        self._tracker.tick(now)
        self._receive(now)
        if self.recorder.all_alive_at is not None:
            self._tracker.alive_at(self.recorder.all_alive_at)  # proof of life without beats (flightrec)
        self._beat_if_due(now)
        if self.failure is not None:
            return  # declared (tests go on running): keep answering, judge no more
        if self._tracker.judging_paused(now):
            return  # this rank itself was away (stopped, starved): its view is stale
        overdue = self._local.failed(self._tracker.overdue(now, self.recorder.step),
                                     lambda r: self._tracker.silent_s(r, now), self._timeout_s)
        if overdue:
            self._declare_silent(overdue, now)
            return
        if self._doomed_at is not None:
            # Another rank is reporting a stall or desync; if it never ends the job, this one does.
            if now > self._doomed_at:
                self._declare(stall_report("stall", "the rank that asked for dumps did not end the job",
                                           {self.world.rank: self._state()}, self.world.hostnames,
                                           detector=self.world.rank))
            return
        self._check_desync()
        expired = self.deadlines.expired(now)
        if expired is not None:
            self._coordinate(expired.kind, f"{expired.what} has not finished after {expired.elapsed_s(now):.1f} s "
                                           f"({expired.option} = {expired.timeout_s:.0f} s)", phase=expired.name)
            return
        self._check_stall(now)

    def _receive(self, now: float) -> None:
        assert self._link is not None and self._tracker is not None
        for tag, source, fields in self._link.poll():
            self._tracker.heard(source, fields, now)
            self._local.heard(source)
            if tag == TAG_BEAT:
                self._peer_latest[source] = fields
            elif tag == TAG_NOTICE:
                self._answer(source, fields)

    def _beat_if_due(self, now: float) -> None:
        due = now >= self._next_beat
        if not (due or self._beat_now) or self._muted:
            return
        self._beat_now = False
        guards = self.deadlines.guards()
        if due:  # an extra beat (a guard opened or closed) leaves the schedule alone: it must not delay the next
            interval = self.cfg.heartbeat_interval_s
            self._next_beat = self._next_beat + interval if self._next_beat + interval > now else now + interval
        self._link.send_beat(self.send_to, self._vector())
        for guard in guards:
            guard.announced.set()

    def _guards_changed(self) -> None:
        """A guard opened or closed (any thread): beat at the next tick, re-arm the native watchdog."""
        native = self._native
        if native is None:
            return  # stopped
        self._beat_now = True
        self._nudge()  # announce it now: a thread may be waiting for the announcement
        if self._thread is not None and not self._thread.is_alive():
            for guard in self.deadlines.guards():
                guard.announced.set()  # nobody beats any more: nothing to wait for
        first = self.deadlines.earliest()
        if first is None or self.on_failure is not None:
            native.disarm()
            return
        message, report = native_report(first, rank=self.world.rank, host=self.world.hostname,
                                        step=self.recorder.step, grace_s=self.native_grace_s)
        native.arm(first.deadline + self.native_grace_s, message=message,
                   failure_path=self.run_dir / FAILURE_FILE, report=report)

    def _leave(self) -> None:
        if self._link is None or self._link.closed:
            return
        with contextlib.suppress(Exception):  # MPI may already be finalized or the job aborted
            self._link.send_beat(self.send_to, self._vector(state=LEAVING))
            self._link.flush(0.5)
            self._link.close()

    def _state(self) -> dict[str, Any]:
        return position(self.recorder, self.deadlines, time.monotonic())

    def _vector(self, state: int = RUNNING, kind: str = "") -> np.ndarray:
        return encode(session=self._link.session, rank=self.world.rank, state=state, wall=time.time(),
                      pid=os.getpid(), kind=kind, **self._state())

    # -- detection ------------------------------------------------------------------
    def _check_desync(self) -> None:
        for source, beat in list(self._peer_latest.items()):
            if beat["cseq"] == 0 or self.recorder.seq < beat["cseq"]:
                continue  # compare when this rank gets there
            del self._peer_latest[source]
            detail = desync(self.recorder.entry(beat["cseq"]), beat["cseq"], beat["cop"], -1, beat["digest"])
            if detail:
                self._coordinate("desync", f"rank {source} and rank {self.world.rank} disagree on collective "
                                           f"#{beat['cseq']}: {detail}", mismatched=(source, self.world.rank))
                return

    def _check_stall(self, now: float) -> None:
        if now >= self._timeout_at:  # the median is not worth recomputing every tick
            self._timeout_s = stall_timeout(self.cfg.stall_timeout_s, self.floor_s, list(self._step_times))
            self._timeout_at = now + 1.0
        oldest = self.recorder.oldest_open()
        if oldest is None:
            self._stall_clock.open_for(0, now, now)
            return
        if self._stall_clock.open_for(oldest.seq, oldest.start, now) > self._timeout_s:
            self._coordinate("stall", f"{describe_op(oldest.op, oldest.bucket, oldest.seq)} at step {oldest.step} "
                                      f"has not finished after {now - oldest.start:.1f} s "
                                      f"(stall timeout {self._timeout_s:.1f} s)")

    def _declare_silent(self, ranks: list[int], now: float) -> None:
        """Declare overdue ranks failed, with any other watched rank that has missed all but one beat.

        Two adjacent ranks that stop together (one node) go silent within an
        interval of each other; naming both in one report, at once, beats
        waiting for the second verdict while the first rank's report ends the job.
        """
        tracker = self._tracker
        nearly = max(1, self.cfg.heartbeat_misses - 1) * self.cfg.heartbeat_interval_s
        nearly_silent = [r for r in tracker.last_heard
                         if r not in tracker.left and tracker.silent_s(r, now) > nearly
                         and tracker.deadline_of(r, self.recorder.step) == tracker.deadline_s]
        ranks = sorted(set(ranks) | set(self._local.failed(nearly_silent, lambda r: tracker.silent_s(r, now),
                                                           self._timeout_s)))
        report = heartbeat_report({r: (tracker.silent_s(r, now), tracker.last_beat[r]) for r in ranks},
                                  self.world.hostnames, detector=self.world.rank,
                                  interval_s=self.cfg.heartbeat_interval_s, misses=self.cfg.heartbeat_misses,
                                  detector_step=self.recorder.step)
        self._declare(report)

    def _wait_for_other_watchers(self, silent: list[int], failed: set[int]) -> None:
        """Give the other live watchers of the silent ranks a moment (``MERGE_WAIT_S`` at most) to add what they
        saw to ``failure.json`` before this rank's abort ends them.

        The watchers of a rank see its silence from the same beats, so they declare within a tick of each
        other; each names the silent ranks it watches. Two adjacent ranks that stop together are then named
        together whoever declares first, instead of by whichever rank's abort wins the race."""
        size = self.world.size
        others = {w for r in silent for w in ring_peers(r, size)[0]} - failed - {self.world.rank}
        deadline = time.monotonic() + MERGE_WAIT_S
        while others and time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                merged = json.loads((self.run_dir / FAILURE_FILE).read_text())
                others -= {merged.get("detected_by"), *merged.get("also_detected_by", [])}
            time.sleep(self._tick_s)

    def _signal_local_peers(self, ranks: list[int]) -> bool:
        """Ask silent ranks on this host to print their stacks (works while they hold the GIL); can any answer?
        A stopped one (SIGSTOP, a debugger) is asked too, but holds the signal until it resumes: no wait for it."""
        answering = False
        for rank in ranks:
            if self.world.hostnames[rank] == self.world.hostname and rank < len(self._pids) and rank != self.world.rank:
                with contextlib.suppress(OSError):
                    os.kill(self._pids[rank], DUMP_SIGNAL)
                    answering = answering or not halted(process_threads(self._pids[rank], None))
        return answering

    def _coordinate(self, kind: str, detail: str, mismatched: tuple[int, ...] = (), phase: str = "") -> None:
        """Ask every rank for its dump and state, wait a little for answers, report (monitor thread).

        Several ranks may see the same stall at once; only the lowest of them
        reports.  A rank that answered a notice does not start its own
        (``_doomed_at``), and a coordinator steps back when a lower rank's
        notice arrives or a lower rank's answer says it is coordinating too.
        """
        rank, size = self.world.rank, self.world.size
        self._coordinating = kind
        self._dump(kind, detail)
        notice = self._vector(kind=kind)
        for dest in range(size):
            if dest != rank:
                self._link.send(dest, TAG_NOTICE, notice)
        states: dict[int, dict[str, Any] | None] = {r: None for r in range(size)}
        states[rank] = self._state()
        deadline = time.monotonic() + self._coordination_s
        while any(s is None for s in states.values()) and time.monotonic() < deadline:
            now = time.monotonic()
            self._tracker.tick(now)
            for tag, source, fields in self._link.poll():
                self._tracker.heard(source, fields, now)
                if tag == TAG_ACK:
                    states[source] = {k: fields[k] for k in ("step", "seq", "op", "bucket", "cseq", "cop", "digest",
                                                             "open_seq", "open_op", "open_bucket", "open_s",
                                                             "guard", "guard_s")}
                elif tag == TAG_NOTICE:
                    self._answer(source, fields)
                if tag in (TAG_ACK, TAG_NOTICE) and fields["kind"] and source < rank:
                    self._step_back()  # a lower rank detected it too and reports for everyone
                    return
            self._beat_if_due(now)
            time.sleep(self._tick_s)
        self._declare(stall_report(kind, detail, states, self.world.hostnames, detector=rank, mismatched=mismatched,
                                   phase=phase))

    def _answer(self, source: int, notice: dict[str, Any]) -> None:
        """Another rank saw a stall or desync: dump, and tell it where this rank is (and whether it reports too)."""
        self._dump(notice["kind"] or "stall", f"asked by rank {source}")
        self._link.send(source, TAG_ACK, self._vector(kind=self._coordinating))
        if not self._coordinating:
            self._step_back()

    def _step_back(self) -> None:
        """Leave the report to another rank; end the job here only if it never does."""
        self._coordinating = ""
        if self._doomed_at is None:
            self._doomed_at = time.monotonic() + self._coordination_s + 15.0

    def _dump(self, kind: str, detail: str) -> None:
        """Write this rank's stacks and flight recorder to ``stall.rank<r>.txt`` (once)."""
        if self._dumped:
            return
        self._dumped = True
        w = self.world
        path = self.run_dir / stall_dump(w.rank)
        header = (f"hpcnet {kind} dump: rank {w.rank} of {w.size} on {w.hostname}, pid {os.getpid()}, "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n{detail}\n"
                  f"step {self.recorder.step}; stall timeout {self._timeout_s:.1f} s")
        try:
            write_dump(path, header, self.recorder, self.deadlines)
        except OSError as exc:
            log.error("cannot write %s: %s", path, exc)

    def _declare(self, report: dict[str, Any]) -> None:
        """Record, print and act on a failure this rank detected."""
        w = self.world
        report = {**report, "exit_code": int(ExitCode.RESTARTABLE), "detected_by": w.rank,
                  "detected_host": w.hostname, "detected_wall": time.time()}
        self.failure = report
        try:
            path = write_failure(self.run_dir, report)
            where_to = f" ({path})"
        except OSError as exc:
            where_to = f" (cannot write {FAILURE_FILE}: {exc})"
        # To stderr through the hpcnet logger (every rank prints errors there) and to rank<r>.log.
        log.error("hpcnet: %s%s", report["message"], where_to)
        if self.on_failure is not None:
            self.on_failure(report)
            return
        silent = [f["rank"] for f in report["failed"] if f.get("why", "silent") == "silent"]
        if silent and self._signal_local_peers(silent):
            # A moment for a silent peer to print its stacks, and for its other
            # watcher to add what it saw to failure.json, before the abort.
            time.sleep(0.5)
        elif silent and report["kind"] == "heartbeat":
            self._wait_for_other_watchers(silent, {f["rank"] for f in report["failed"]})
        for handler in logging.getLogger("hpcnet").handlers:
            handler.flush()
        self.comm.Abort(ExitCode.RESTARTABLE)
