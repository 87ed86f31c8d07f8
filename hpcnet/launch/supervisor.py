"""Automatic restart: run an hpcnet job and, when it fails restartably, run it again from its newest checkpoint.

    python -m hpcnet.launch [--max-restarts 3] [--backoff-s 1] [--exclude-failed-hosts] -- \\
        mpirun -np 64 python -m mpi4py -m hpcnet.train run.name=big checkpoint.every_s=600 ...

Why a supervisor process outside MPI, not recovery inside the job: Open MPI 4
has no ULFM (user-level failure mitigation), so when one rank dies the
communicator is unusable and mpirun tears the whole job down within about a
second; a hung rank is worse: MPI never notices it, so the heartbeat monitor
ends the job itself (status 75).  Either way the only recovery is a fresh job,
and something that outlives the job must start it: this small process, which
holds no MPI state, imports no torch, and sits in front of the launcher.

This module is the policy (``supervise``): run the next attempt, through a warm standby when one is ready; from how
it ended, decide whether another follows, with which hosts; write ``launch.json``.  Each role it calls on has a
module of its own, as Horovod's elastic runner has: the command line (``hpcnet.launch.cli``); one attempt, its
record and how it ended (``hpcnet.launch.attempt``); the launcher's processes, found through /proc and reaped
(``hpcnet.launch.processes``); what the attempts share and ``launch.json`` (``hpcnet.launch.job``); the warm
standby (``hpcnet.launch.standby``); the hosts left out and let back in (``hpcnet.launch.exclusion``); the
launcher's command line (``hpcnet.launch.command``); whether to run another (``hpcnet.launch.restarts``); stop
signals (``hpcnet.launch.forward``).  docs/fault-tolerance.md describes the behaviour and the exit status.
"""

import contextlib
import functools
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hpcnet.ckpt.fence import Fence, write_fence
from hpcnet.errors import ExitCode
from hpcnet.launch.attempt import LAUNCHER_GRACE_S, START_TIMEOUT_S, Attempt, run_attempt, settle
from hpcnet.launch.command import (
    LAUNCHER_KINDS,
    CommandError,
    launcher_env,
    ranks_of,
    restart_from,
)
from hpcnet.launch.elastic import PROBE_EVERY_S, PROBE_TIMEOUT_S
from hpcnet.launch.forward import Forwarder, ranks_ready, ranks_started, stop_status
from hpcnet.launch.job import Job, attempt_setup, prepare
from hpcnet.launch.processes import say
from hpcnet.launch.restarts import (
    RestartBudget,
    backoff_s,
    committed_checkpoints,
    describe_status,
    new_checkpoints,
)
from hpcnet.launch.standby import TRIGGER, Standby, Standbys
from hpcnet.launch.stop import READY, clear_reports
from hpcnet.paths import FENCE_NAME, ready_dir


@dataclass(slots=True)
class _Outcome:
    """The supervision's status and what it says last, as they stand."""

    status: int = ExitCode.CODE_ERROR
    message: str = ""


def supervise(command: list[str], *, max_restarts: int = 3, backoff_base_s: float = 1.0,
              backoff_cap_s: float = 60.0, exclude_failed_hosts: bool = False, standby: str = "auto",
              launcher_grace_s: float = LAUNCHER_GRACE_S, environ: dict[str, str] | None = None,
              keep_signal_handlers: bool = False, min_ranks: int | None = None, probe_template: str | None = None,
              probe_every_s: float = PROBE_EVERY_S, probe_timeout_s: float = PROBE_TIMEOUT_S,
              start_timeout_s: float = START_TIMEOUT_S, launcher: str = "") -> int:
    """Run ``command`` until it succeeds, fails for good, or uses up ``max_restarts``; return its status.

    ``standby``: 'auto' (a warm standby when the launcher is mpirun or srun, the command runs hpcnet.train and a
    restart is allowed), 'on' (the same, an error where it cannot be), 'off'. ``keep_signal_handlers``: leave the
    stop-signal handlers installed on return (``python -m hpcnet.launch``: a signal as it exits then changes
    nothing, where the default action would end it with a death by signal instead of the job's status).
    ``min_ranks`` (with ``exclude_failed_hosts``): elastic shrink and grow (``hpcnet.launch.elastic``), the
    excluded hosts probed with ``probe_template`` (or the launcher's own probe) every ``probe_every_s``.
    ``launcher``: its kind, 'mpirun' or 'srun', for a wrapper that takes their options (``--launcher-kind``; '':
    by its name).
    """
    environ = dict(os.environ if environ is None else environ)
    job = prepare(command, environ, launcher)
    if isinstance(job, int):
        return job
    job.launcher_grace_s, job.start_timeout_s = launcher_grace_s, start_timeout_s
    job.max_restarts, job.backoff_base_s, job.backoff_cap_s = max_restarts, backoff_base_s, backoff_cap_s
    job.exclude_failed_hosts = exclude_failed_hosts
    hosts = job.hosts
    hosts.probe_template, hosts.probe_every_s, hosts.probe_timeout_s = probe_template, probe_every_s, probe_timeout_s
    hosts.probe_env = launcher_env(environ, job.openmpi)
    if exclude_failed_hosts and (error := hosts.configure(min_ranks)) is not None:
        say(f"error: {error}")
        return ExitCode.USAGE_ERROR
    if (status := _set_standby(job, standby)) is not None:
        return status
    forwarder = Forwarder(mpirun=job.openmpi).install()
    outcome = _Outcome()
    try:
        _attempts(job, forwarder, environ, outcome)
        return outcome.status
    finally:
        hosts.stop_watch()
        if job.standbys is not None:  # not needed: its processes end with us
            job.standbys.close()
        if not keep_signal_handlers:
            forwarder.restore()
        if outcome.message:
            say(outcome.message)
        job.write_launch_json(outcome.status, outcome.message)


def _set_standby(job: Job, standby: str) -> int | None:
    """Turn standbys on where ``--standby`` (auto, on, off) and the command allow; a status when 'on' cannot be."""
    possible = job.launcher in LAUNCHER_KINDS and job.train_start is not None and job.max_restarts > 0
    if standby == "on" and not possible:
        say("error: --standby on needs an mpirun or srun command that runs hpcnet.train, and --max-restarts > 0")
        return ExitCode.USAGE_ERROR
    if standby != "off" and possible:
        job.standbys = Standbys(job.launch_dir, job.config_file, launcher=job.launcher, openmpi=job.openmpi)
    return None


def _attempts(job: Job, forwarder: Forwarder, environ: dict[str, str], outcome: _Outcome) -> None:
    """Run attempts until one succeeds, fails for good, uses up the restarts or a stop signal comes; ``outcome``
    holds the status and what to say last."""
    budget = RestartBudget(job.max_restarts)
    while True:
        record = _run_next(job, budget, forwarder, environ)
        if record is None:
            name = signal.Signals(forwarder.received).name
            outcome.status = stop_status(forwarder.received)
            outcome.message = (f"stopped by {name} before restarting" if job.attempts
                               else f"stopped by {name} before the first attempt: nothing was started")
            return
        outcome.status = record.status
        if record.grow and record.status == ExitCode.PREEMPTED and not forwarder.received and not record.survivors:
            say(f"attempt {record.attempt} saved and stopped for {', '.join(record.grow)}: restarting with it")
            if (final := job.hosts.grow(len(job.attempts) + 1)) is not None:
                outcome.message = final
                return
            job.hosts.watch_excluded()
            continue  # no failure: no restart used, no backoff
        final = _why_final(record, forwarder.received)
        if final is None:
            final = _restart(job, record, budget, forwarder)
        if final is not None:
            outcome.message = final
            return


def _restart(job: Job, record: Attempt, budget: RestartBudget, forwarder: Forwarder) -> str | None:
    """Take a restart after ``record``'s restartable failure: leave its failed hosts out, wait the backoff.  Returns
    why none follows (the budget is used up, no host is left), else None."""
    if record.new_checkpoints and budget.progress():
        say(f"attempt {record.attempt} committed {record.new_checkpoints[-1]}: progress, so the restart "
            f"budget starts again ({job.max_restarts} restart(s))")
    restart = budget.take()
    if restart is None:
        return (f"giving up after {len(job.attempts)} attempts ({job.max_restarts} restarts"
                f"{' without a new checkpoint' if job.checkpoint_dir else ''}): last status {record.status}, "
                f"{describe_status(record.status)}{record.in_brackets()}")
    if job.exclude_failed_hosts and (final := _leave_out_failed_hosts(job, record)) is not None:
        return final
    delay = backoff_s(restart, job.backoff_base_s, job.backoff_cap_s)
    since = " since the last new checkpoint" if job.checkpoint_dir else ""
    say(f"restarting {restart_from(job.resume, own=job.own)} in {delay:.1f} s (restart {restart} of "
        f"{job.max_restarts}{since})")
    forwarder.wake.wait(delay)  # a stop signal ends it: the next _run_next starts nothing
    return None


def _leave_out_failed_hosts(job: Job, record: Attempt) -> str | None:
    """Let the hosts that answered again back in and leave out those ``record``'s failure lost; why no attempt may
    follow, else None."""
    hosts = job.hosts
    final = hosts.grow(len(job.attempts) + 1) if hosts.answered() else None
    final = final or hosts.exclude_failed(record, job.attempts)
    if final is None:
        hosts.watch_excluded()
    return final


def _why_final(record: Attempt, received: int) -> str | None:
    """Why no attempt may follow ``record`` ('' when it succeeded); None when a restart may."""
    if record.survivors:
        return (f"processes {record.survivors[:10]} of attempt {record.attempt} are still alive after SIGKILL "
                "(an uninterruptible wait?): not starting another attempt beside them")
    if record.status == 0:
        return ""
    if received:
        return f"stopped by {signal.Signals(received).name}: not restarting"
    if not record.restartable:
        return f"status {record.status} is not restartable: {describe_status(record.status)}{record.in_brackets()}"
    return None


def _run_next(job: Job, budget: RestartBudget, forwarder: Forwarder, environ: dict[str, str]) -> Attempt | None:
    """Run the next attempt of ``job`` (through its standby when one is ready) and record it in launch.json; None
    when a stop signal came first (before it, or while its standby's ranks were parking): none is started."""
    attempt = len(job.attempts) + 1
    cmd, env, run_dir = attempt_setup(job, attempt, environ)
    record = Attempt(attempt=attempt, command=cmd, run_dir=run_dir, start_unix=time.time(),
                     excluded_hosts=list(job.hosts.excluded))
    with contextlib.suppress(CommandError):
        record.ranks = ranks_of(cmd, job.launcher)
    standby = None
    if job.standbys is not None and not forwarder.stopping():
        standby = job.standbys.take(attempt, cmd, env, record, forwarder.stopping)
    if forwarder.stopping():
        if standby is not None:
            standby.discard()
        return None
    job.attempts.append(record)
    if not _open_fence(job, record, standby):
        return record
    say(f"attempt {attempt}/{budget.last_attempt(attempt)}{' (warm standby)' if standby else ''}: {shlex.join(cmd)}")
    before = committed_checkpoints(job.checkpoint_dir)
    all_started = _run(job, record, env, forwarder, environ, standby)
    _close_fence(job, attempt, f"its launcher ended with status {record.status}")
    record.new_checkpoints = new_checkpoints(before, committed_checkpoints(job.checkpoint_dir))
    job.own = job.own or bool(record.new_checkpoints)
    record.signal_received = forwarder.received
    settle(record, ready_dir(job.launch_dir, attempt) if run_dir else None, all_started=all_started,
           start_timeout_s=job.start_timeout_s, launcher_grace_s=job.launcher_grace_s)
    say(f"attempt {attempt} ended with status {record.status}: {describe_status(record.status)}"
        f"{record.in_brackets()} after {record.duration_s:.1f} s")
    job.write_launch_json(None, "")
    return record


def _open_fence(job: Job, record: Attempt, standby: Standby | None) -> bool:
    """Fence the checkpoint directory for ``record``'s attempt before any of its processes runs (a standby's ranks
    are parked before MPI starts); False, with ``record`` saying why, when the fence cannot be written."""
    if not record.run_dir or job.checkpoint_dir is None:
        return True
    try:
        write_fence(job.checkpoint_dir, Fence(job.launch_id, record.attempt), launch_dir=str(job.launch_dir))
        return True
    except OSError as exc:
        if standby is not None:
            standby.discard()
        record.status, record.end_unix = ExitCode.USAGE_ERROR, time.time()
        record.cause = (f"cannot write {job.checkpoint_dir / FENCE_NAME} (checkpoint.dir): {exc.strerror or exc}; "
                        "not starting an attempt that the ones before it could still commit over")
        say(f"error: {record.cause}")
        job.write_launch_json(None, "")
        return False


def _run(job: Job, record: Attempt, env: dict[str, str], forwarder: Forwarder, environ: dict[str, str],
         standby: Standby | None) -> bool:
    """Run ``record``'s attempt to its end (released from ``standby`` when there is one), starting the standby for
    the next one once its start-up is over; whether all its ranks had started."""
    reports = ready_dir(job.launch_dir, record.attempt) if record.run_dir else None
    started_up, ended = threading.Event(), threading.Event()
    ready = None
    if reports is not None:
        if standby is None:
            clear_reports(reports, f"{READY}.*")  # those of a discarded standby's ranks, which are gone
        ready = functools.partial(ranks_ready, reports, started_up)
    watcher = None
    if job.standbys is not None:
        watcher = job.standbys.start_when_up(record.attempt, functools.partial(attempt_setup, job, environ=environ),
                                             started_up, ended, forwarder.stopping)

    def on_line(line: str) -> None:
        if TRIGGER.match(line):
            started_up.set()

    if standby is not None:
        standby.release()
    try:
        run_attempt(record.command, env, forwarder, record, started=standby.process if standby else None,
                    on_line=on_line, ready=ready, launcher_grace_s=job.launcher_grace_s,
                    on_declared=lambda: _close_fence(job, record.attempt, "it declared its failure"),
                    poll=_growth_poll(job, record, ready, watcher, forwarder, environ),
                    start_timeout_s=job.start_timeout_s,
                    started_ranks=functools.partial(ranks_started, reports, started_up) if reports else None)
        return started_up.is_set() or (ready is not None and ready())
    finally:
        ended.set()
        started_up.set()
        if watcher is not None:
            watcher.join()


def _growth_poll(job: Job, record: Attempt, ready: Callable[[], bool] | None, watcher: threading.Thread | None,
                 forwarder: Forwarder, environ: dict[str, str]) -> Callable[[subprocess.Popen], None]:
    """The running attempt's ``poll``: once an excluded host answers again, ``ExcludedHosts.grow_step``, while the
    attempt runs on (its ranks ready, no failure declared, no stop signal, no standby starting) and was not yet
    asked to stop."""
    since: list[float] = []

    def poll(proc: subprocess.Popen) -> None:
        if (not job.hosts.answered() or record.grow or forwarder.received or record.declared_unix is not None
                or (ready is not None and not ready()) or (watcher is not None and watcher.is_alive())):
            return
        job.hosts.grow_step(record, proc, job.standbys, functools.partial(attempt_setup, job, environ=environ), since)

    return poll


def _close_fence(job: Job, attempt: int, why: str) -> None:
    """Hand the checkpoint directory's fence on from ``attempt`` (``hpcnet.ckpt.fence``) once it declared its failure
    or its launcher ended: a rank of it that is still running (cut off) commits nothing from then on, whether or not
    another attempt follows.  A fence that cannot be written is only reported here: the next attempt's start writes
    it again and does not start without it."""
    if job.train_start is None or job.checkpoint_dir is None:
        return
    try:
        write_fence(job.checkpoint_dir, Fence(job.launch_id, attempt + 1), launch_dir=str(job.launch_dir),
                    closed=attempt, why=f"attempt {attempt}: {why}")
    except OSError as exc:
        say(f"cannot write {job.checkpoint_dir / FENCE_NAME}: {exc.strerror or exc}")
