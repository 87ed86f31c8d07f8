"""Automatic restart: run an hpcnet job and, when it fails restartably, run it again from its newest checkpoint.

    python -m hpcnet.launch [--max-restarts 3] [--backoff-s 1] [--exclude-failed-hosts] -- \\
        mpirun -np 64 python -m mpi4py -m hpcnet.train run.name=big checkpoint.every_s=600 ...

Why a supervisor process outside MPI, not recovery inside the job: Open MPI 4
has no ULFM (user-level failure mitigation), so when one rank dies the
communicator is unusable and mpirun tears the whole job down within about a
second; the surviving ranks cannot shrink the communicator and carry on.  A
hung rank is worse: MPI never notices it, so the heartbeat monitor ends the
job itself (status 75).  Either way the only recovery is a fresh job, and
something that outlives the job must start it: this small process, which
holds no MPI state, imports no torch, and sits in front of the launcher
(mpirun or srun, inside the batch job, so requeueing stays with the scheduler).

What it does, per attempt:

- runs the command with ``HPCNET_ATTEMPT=<k>`` (exported to every rank with
  ``-x`` for Open MPI's mpirun; srun exports the environment anyway), tees its
  output and records when the launcher reported a dead rank; Open MPI gets
  ``odls_base_sigkill_timeout=0``, so a failed job is gone in milliseconds,
  not 2 s (``launcher_env``);
- pins the run directory of each attempt (``<launch dir>/attempt-<k>``, the
  launch directory being what ``run.dir``/``run.name`` would have given the
  run) and ``checkpoint.dir`` (the same for every attempt), so it knows where
  to read the monitor's ``failure.json`` and every attempt resumes from the
  same checkpoints;
- runs each attempt in a session of its own and, when the launcher has
  ended, kills whatever is left of that session (``reap_session``): ranks
  orphaned by a killed mpirun must not overlap the next attempt or write into
  the checkpoint directory.  A session, not the process group, because Open
  MPI's mpirun gives every rank a process group of its own;
- on status 0 it stops; on a restartable failure (75, or a rank or the
  launcher killed by SIGKILL, SIGSEGV, SIGBUS or SIGABRT: ``is_restartable``)
  it waits ``backoff_s * 2**(k-1)`` seconds (capped) and runs the command
  again with ``--resume auto``, up to ``--max-restarts`` times in a row
  without progress: an attempt that committed a new checkpoint
  (``committed_checkpoints`` of the pinned checkpoint directory, before and
  after) resets the count.  Anything else (1 code error, 2 bad input, 76
  preempted, 130 interrupted) is final;
- with ``--exclude-failed-hosts``, a failure pinned to a host (failure.json,
  or the launcher's "rank N on node H exited on signal" line) leaves that
  host out of the next attempt: srun gets ``--exclude``, mpirun a filtered
  ``--host`` list or hostfile (from the command, or from the SLURM
  allocation).  The allocation must have room to spare: ``-np`` is kept;
- SIGTERM, SIGUSR2, SIGINT and SIGHUP are forwarded to the launcher and end
  the restarts: the job stops after saving (76) and the supervisor exits
  with the job's status.  SIGHUP (the terminal or ssh session went away) is
  sent on as SIGTERM: hpcnet.train saves on SIGTERM, a bare SIGHUP would
  kill the ranks.  Open MPI's mpirun answers SIGTERM/SIGINT by killing the
  ranks a second later, before they can save, but forwards SIGUSR2 to them;
  so for mpirun the first signal is sent on as SIGUSR2 (hpcnet treats both
  as preemption), a second one as SIGTERM;
- prints one summary line per attempt (status, cause, duration) and writes
  ``launch.json`` (every attempt, its command, times, status and cause) to
  the launch directory (the current directory for a command that does not
  run hpcnet.train: then nothing is pinned and no failure.json is read).

Its exit status is the last attempt's (128 + N when the launcher itself died
of signal N), so a job script reads it like hpcnet.train's (see the README).
"""

import argparse
import contextlib
import ctypes
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from hpcnet.errors import ExitCode

ATTEMPT_ENV = "HPCNET_ATTEMPT"  # read by hpcnet.faults (kept in step: that module imports torch)

RESTART_SIGNALS = (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT)
"""A rank (or the launcher) that died of one of these may have been killed by
the OOM killer or a failing node, or crashed in a driver: worth a restart.
SIGINT and SIGTERM are requests to stop; a deterministic crash just uses up
the restarts."""

MPIRUN_NAMES = ("mpirun", "mpiexec", "orterun", "prterun")
_MPIRUN_HOST_OPTS = ("--host", "-host", "-H", "--H")
_MPIRUN_HOSTFILE_OPTS = ("--hostfile", "-hostfile", "--machinefile", "-machinefile", "--default-hostfile")

# What the launcher prints when a rank dies: rank, host, signal.
_DEATH_LINES = (
    re.compile(r"mpirun noticed that process rank (?P<rank>\d+) with PID \d+ on node (?P<host>\S+) "
               r"exited on signal (?P<signal>\d+)"),
    re.compile(r"srun: error: (?P<host>[^:\s]+): tasks? (?P<rank>[\d,\-]+): (?P<what>.+)"),
)


# --- decisions (pure) ----------------------------------------------------------------

def normalise_status(returncode: int) -> int:
    """A Popen return code as a shell would report it: -N (killed by signal N) becomes 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def is_restartable(status: int) -> bool:
    """Whether running the job again may succeed (see ``RESTART_SIGNALS`` and ``ExitCode``)."""
    if status == ExitCode.RESTARTABLE:
        return True
    return status > 128 and status - 128 in {int(s) for s in RESTART_SIGNALS}


def describe_status(status: int) -> str:
    """A status in words."""
    names = {ExitCode.OK: "finished", ExitCode.CODE_ERROR: "error (a bug, or a launcher failure)",
             ExitCode.USAGE_ERROR: "bad input (option, data, path, full disk)",
             ExitCode.DIVERGED: "diverged (non-finite loss, gradients or state; nothing of it saved)",
             ExitCode.RESTARTABLE: "restartable failure (peer died or hung, communication failed)",
             ExitCode.PREEMPTED: "preempted after saving", ExitCode.INTERRUPTED: "interrupted"}
    if status in names:
        return names[status]
    if status > 128:
        try:
            return f"killed by signal {status - 128} ({signal.Signals(status - 128).name})"
        except ValueError:
            return f"killed by signal {status - 128}"
    return f"failed with status {status}"


def backoff_s(restart: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait before restart number ``restart`` (1, 2, ...): doubling from ``base_s``, at most ``cap_s``."""
    if restart < 1:
        raise ValueError("restart must be at least 1")
    return min(cap_s, base_s * 2 ** min(restart - 1, 62))


def launcher_kind(command: list[str]) -> str:
    """'mpirun', 'srun' or '' for another launcher (or none)."""
    name = Path(command[0]).name if command else ""
    if name in MPIRUN_NAMES:
        return "mpirun"
    return "srun" if name == "srun" else ""


def train_args_start(command: list[str]) -> int | None:
    """Index of the first argument of hpcnet.train in ``command``, or None if it does not run hpcnet.train."""
    for i, arg in enumerate(command):
        if arg == "hpcnet.train" and i > 0 and command[i - 1] == "-m":
            return i + 1
        if Path(arg).name == "hpcnet-train" or arg.endswith("hpcnet/train.py"):
            return i + 1
    return None


@dataclass(slots=True)
class TrainArgs:
    """The parts of hpcnet.train's command line the supervisor needs."""

    config: str | None
    resume: str | None
    overrides: list[str]
    informational: bool
    """--help or --print-config: runs once, nothing to supervise."""


def parse_train_args(args: list[str]) -> TrainArgs:
    """Read hpcnet.train's own options the way it does (``--config``, ``--resume``; the rest are overrides)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config")
    parser.add_argument("--resume")
    parser.add_argument("--print-config", action="store_true")
    parser.add_argument("-h", "--help", action="store_true")
    known, overrides = parser.parse_known_args(args)
    return TrainArgs(known.config, known.resume, overrides, known.help or known.print_config)


def resume_args(train_args: list[str]) -> list[str]:
    """What to append so the run resumes from the newest checkpoint ('' if it already does)."""
    parsed = parse_train_args(train_args)
    resume = parsed.resume
    for item in parsed.overrides:  # --resume wins over checkpoint.resume=..., as in hpcnet.train
        if resume is None and item.startswith("checkpoint.resume="):
            resume = item.split("=", 1)[1]
    return [] if resume == "auto" else ["--resume", "auto"]


def default_checkpoint_dir(run_dir: str, run_name: str, checkpoint_dir: str) -> Path:
    """``checkpoint.dir`` as hpcnet.trainstate.checkpoint_dir resolves it (that module imports torch)."""
    return Path(checkpoint_dir) if checkpoint_dir else Path(run_dir) / f"{run_name}.ckpt"


def committed_checkpoints(directory: Path | None) -> dict[str, tuple[int, int]]:
    """The committed checkpoint files in ``directory``: name -> (size, mtime in ns); {} when there is none.

    Only committed names (``ckpt-<step>.h5``; a save in flight is a ``.tmp``)
    count, read from the directory listing alone: the supervisor imports
    neither torch nor h5py.
    """
    from hpcnet.ckpt.format import CKPT_NAME_RE  # numpy only

    found: dict[str, tuple[int, int]] = {}
    if directory is None:
        return found
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return found
    for entry in entries:
        if CKPT_NAME_RE.match(entry.name):
            with contextlib.suppress(FileNotFoundError):  # removed by retention meanwhile
                info = entry.stat()
                found[entry.name] = (info.st_size, info.st_mtime_ns)
    return found


def new_checkpoints(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """Checkpoints committed between two listings (new names, or names written again), sorted."""
    return sorted(name for name, stat in after.items() if before.get(name) != stat)


def failure_from_line(line: str) -> dict[str, Any] | None:
    """A launcher's report of a dead rank (mpirun or srun) as {rank, host, signal/what}; None if not one."""
    for pattern in _DEATH_LINES:
        match = pattern.search(line)
        if match:
            found: dict[str, Any] = {"kind": "rank died", "source": "launcher", **match.groupdict()}
            if str(found.get("rank", "")).isdigit():
                found["rank"] = int(found["rank"])
            if found.get("signal"):
                found["signal"] = int(found["signal"])
            return found
    return None


def failed_where(failure: dict[str, Any] | None) -> tuple[list[int], list[str]]:
    """The failed ranks and their hosts named by a report: ``{rank, host}`` or ``{failed: [{rank, host}, ...]}``."""
    if not failure:
        return [], []
    entries = failure.get("failed")
    if not isinstance(entries, list):
        entries = [failure]
    ranks = [e["rank"] for e in entries if isinstance(e, dict) and isinstance(e.get("rank"), int)]
    hosts = [e["host"] for e in entries if isinstance(e, dict) and isinstance(e.get("host"), str) and e["host"]]
    return ranks, list(dict.fromkeys(hosts))


def describe_failure(failure: dict[str, Any] | None) -> str:
    """A failure report (the monitor's failure.json, or a launcher's line about a dead rank) in words."""
    if not failure:
        return ""
    ranks, hosts = failed_where(failure)
    who = " ".join(part for part in (
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else "",
        f"on {', '.join(hosts)}" if hosts else "") if part)
    if failure.get("source") == "launcher":
        sig = failure.get("signal")
        if sig:
            try:
                how = f"died of signal {sig} ({signal.Signals(sig).name})"
            except ValueError:
                how = f"died of signal {sig}"
        else:
            how = f"failed: {failure.get('what', '')}".rstrip(": ")
        return f"{who or 'a rank'} {how}"
    first = failure["failed"][0] if isinstance(failure.get("failed"), list) and failure["failed"] else {}
    step = failure.get("step", first.get("last_step") if isinstance(first, dict) else None)
    collective = failure.get("collective") or (first.get("collective") if isinstance(first, dict) else None)
    parts = [f"{failure.get('kind') or 'failure'}:", who or "rank unknown"]
    if step is not None:
        parts.append(f"at step {step}")
    if collective:
        parts.append(f"in {collective}")
    if failure.get("detail"):
        parts.append(f"({failure['detail']})")
    return " ".join(parts)


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list (``node[01-03,07],gpu5``) as host names, in order."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?([^,]*)", nodelist):
        prefix, ranges, suffix = match.groups()
        if not ranges:
            hosts.append(prefix + (suffix or ""))
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if hi:
                hosts.extend(f"{prefix}{n:0{len(lo)}d}{suffix}" for n in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{lo}{suffix}")
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE (``2(x3),1``) as one count per node."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"cannot read SLURM_TASKS_PER_NODE={text!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def slurm_allocation(environ: dict[str, str]) -> list[tuple[str, int]] | None:
    """(host, slots) of the SLURM allocation, or None outside one."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        return None
    hosts = expand_nodelist(nodelist)
    counts = expand_tasks_per_node(environ.get("SLURM_TASKS_PER_NODE", "1"))
    if len(counts) != len(hosts):
        counts = [counts[0]] * len(hosts)
    return list(zip(hosts, counts))


def _same_host(a: str, b: str) -> bool:
    return a == b or a.split(".")[0] == b.split(".")[0]


def _option_value(command: list[str], names: tuple[str, ...]) -> tuple[int, int, str] | None:
    """(index of the option, index of its value, value) of the first of ``names`` (``--opt v`` or ``--opt=v``)."""
    for i, arg in enumerate(command):
        for name in names:
            if arg == name and i + 1 < len(command):
                return i, i + 1, command[i + 1]
            if arg.startswith(name + "="):
                return i, i, arg.split("=", 1)[1]
    return None


def _set_value(command: list[str], where: tuple[int, int, str], value: str) -> list[str]:
    i, j, _ = where
    out = list(command)
    out[j] = value if i != j else f"{command[i].split('=', 1)[0]}={value}"
    return out


@dataclass(slots=True)
class Exclusion:
    """A command with failed hosts left out, and how."""

    command: list[str]
    hostfile: str | None = None
    """Contents of the filtered hostfile to write at ``hostfile_path``, if one is needed."""
    hostfile_path: str | None = None
    note: str = ""


def exclude_hosts(command: list[str], hosts: list[str], *, allocation: list[tuple[str, int]] | None = None,
                  read_file: Any = None, hostfile_path: str = "hostfile") -> Exclusion:
    """Leave ``hosts`` out of a launcher command (pure but for ``read_file``, which reads a hostfile).

    srun: ``--exclude`` (merged with one already there).  mpirun: filter its
    ``--host`` list or its hostfile; without either, list the ``allocation``
    minus the failed hosts with ``--host``.  Anything else: unchanged, with a
    note saying why.
    """
    hosts = sorted(set(hosts))
    kind = launcher_kind(command)
    if not hosts:
        return Exclusion(list(command), note="no host to exclude")
    if kind == "srun":
        found = _option_value(command, ("--exclude", "-x"))
        if found:
            merged = sorted(set(found[2].split(",")) | set(hosts))
            return Exclusion(_set_value(command, found, ",".join(merged)), note=f"srun --exclude={','.join(merged)}")
        return Exclusion([command[0], f"--exclude={','.join(hosts)}", *command[1:]],
                         note=f"srun --exclude={','.join(hosts)}")
    if kind != "mpirun":
        return Exclusion(list(command), note=f"cannot exclude {', '.join(hosts)}: {command[0]!r} is not mpirun or srun")
    found = _option_value(command, _MPIRUN_HOST_OPTS)
    if found:
        entries = [e for e in found[2].split(",") if e]
        kept = [e for e in entries if not any(_same_host(e.split(":")[0], h) for h in hosts)]
        if not kept:
            return Exclusion(list(command), note=f"not excluding {', '.join(hosts)}: no host would be left")
        return Exclusion(_set_value(command, found, ",".join(kept)), note=f"mpirun --host {','.join(kept)}")
    found = _option_value(command, _MPIRUN_HOSTFILE_OPTS)
    if found:
        if read_file is None:
            return Exclusion(list(command), note="cannot read the hostfile")
        lines = read_file(found[2]).splitlines()
        kept_lines = [ln for ln in lines
                      if not ln.split() or ln.lstrip().startswith("#")
                      or not any(_same_host(ln.split()[0], h) for h in hosts)]
        if not any(ln.split() and not ln.lstrip().startswith("#") for ln in kept_lines):
            return Exclusion(list(command), note=f"not excluding {', '.join(hosts)}: no host would be left")
        return Exclusion(_set_value(command, found, hostfile_path), hostfile="\n".join(kept_lines) + "\n",
                         hostfile_path=hostfile_path,
                         note=f"mpirun hostfile {hostfile_path} without {', '.join(hosts)}")
    if allocation:
        kept_slots = [(h, n) for h, n in allocation if not any(_same_host(h, x) for x in hosts)]
        if not kept_slots:
            return Exclusion(list(command), note=f"not excluding {', '.join(hosts)}: no host would be left")
        spec = ",".join(f"{h}:{n}" for h, n in kept_slots)
        return Exclusion([command[0], "--host", spec, *command[1:]], note=f"mpirun --host {spec}")
    return Exclusion(list(command), note=f"cannot exclude {', '.join(hosts)}: the mpirun command has no --host "
                                         "or --hostfile and there is no SLURM allocation to filter")


SIGKILL_TIMEOUT_ENV = "OMPI_MCA_odls_base_sigkill_timeout"


def launcher_env(environ: dict[str, str], openmpi: bool) -> dict[str, str]:
    """The launcher's environment: for Open MPI, no grace period when it ends a failed job.

    When a rank dies (or the monitor calls MPI_Abort), mpirun sends the other
    ranks SIGTERM and, ``odls_base_sigkill_timeout`` (1 s) later, SIGKILL.
    hpcnet's ranks cannot use that second: they are blocked in a collective
    with the dead rank, and a checkpoint in flight needs it too.  Measured
    here: kill -9 of one of 2 ranks -> mpirun exits after 2.0 s with the
    default, 0.03 s with 0.  A value the user set is kept.
    """
    env = dict(environ)
    if openmpi:
        env.setdefault(SIGKILL_TIMEOUT_ENV, "0")
    return env


def attempt_command(base: list[str], attempt: int, *, train_start: int | None, pinned: list[str],
                    openmpi: bool) -> list[str]:
    """The command of attempt ``attempt``: pinned run/checkpoint directories, --resume auto from attempt 2.

    Args:
        base: the user's command (with hosts already excluded).
        train_start: where hpcnet.train's arguments begin (None: not an hpcnet.train command).
        pinned: ``section.key=value`` overrides appended to hpcnet.train's arguments.
        openmpi: the launcher is Open MPI's mpirun, which exports a variable to
            remote ranks only when told (``-x``).
    """
    command = list(base)
    if train_start is not None:
        train_args = command[train_start:] + pinned
        if attempt > 1:
            train_args += resume_args(train_args)
        command = command[:train_start] + train_args
    if openmpi and launcher_kind(command) == "mpirun":
        command = [command[0], "-x", ATTEMPT_ENV, *command[1:]]
    return command


# --- running -----------------------------------------------------------------------

@dataclass(slots=True)
class Attempt:
    """One run of the job, as written to launch.json."""

    attempt: int
    command: list[str]
    run_dir: str | None
    start_unix: float
    end_unix: float = 0.0
    duration_s: float = 0.0
    status: int = -1
    cause: str = ""
    restartable: bool = False
    failure: dict[str, Any] | None = None
    """failure.json of the run (heartbeat monitor), else the launcher's report of a dead rank."""
    launcher_report_unix: float | None = None
    """When the launcher printed that a rank died (how fast the death was noticed)."""
    excluded_hosts: list[str] = field(default_factory=list)
    signal_received: int = 0
    new_checkpoints: list[str] = field(default_factory=list)
    """Checkpoints this attempt committed (progress: the restart budget starts again)."""
    reaped: list[int] = field(default_factory=list)
    """Processes of the attempt still running after the launcher ended, killed before going on."""
    survivors: list[int] = field(default_factory=list)
    """Processes that would not die (SIGKILL in an uninterruptible wait): nothing more is started."""


class _Forwarder:
    """Signal handlers that pass SIGTERM/SIGUSR2/SIGINT/SIGHUP on to the running launcher (and end the restarts)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)

    def __init__(self, mpirun: bool) -> None:
        self.mpirun = mpirun
        self.received = 0
        self.count = 0
        self.proc: subprocess.Popen | None = None
        self.wake = threading.Event()
        self._previous: dict[int, Any] = {}

    def install(self) -> "_Forwarder":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum
        self.count += 1
        self.wake.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            # A hang-up is a request to stop, as SIGTERM is (which the ranks save on).
            forward = signal.SIGTERM if signum == signal.SIGHUP else signum
            # mpirun kills the ranks ~1 s after SIGTERM/SIGINT (no time to save)
            # but forwards SIGUSR2; a second signal means "now".
            if self.mpirun:
                forward = signal.SIGUSR2 if self.count == 1 else signal.SIGTERM
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(proc.pid, forward)
            print(f"hpcnet.launch: got {signal.Signals(signum).name}, sent {signal.Signals(forward).name} to the "
                  "job; no restart after it", file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the supervisor dies (Linux), so a job never outlives its supervisor."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the process group still gets signals
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def session_members(sid: int, proc_dir: Path = Path("/proc")) -> list[int]:
    """Live processes (zombies left out) of session ``sid``, from /proc (Linux; elsewhere none are found)."""
    members = []
    try:
        entries = list(os.scandir(proc_dir))
    except FileNotFoundError:
        return members
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # After the command name in parentheses (which may hold spaces): state, ppid, pgrp, session.
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def reap_session(sid: int, timeout_s: float = 30.0) -> tuple[list[int], list[int]]:
    """SIGKILL every process left in session ``sid`` until none is; return (killed, still alive after timeout_s).

    The attempt is over (its launcher ended): what is left of it would only
    race the next attempt, so it gets no grace period.  A checkpoint it was
    writing is never committed halfway (commits are a rename).  The kernel
    does not hand out a session's id as a new pid while the session has
    members, so the scan cannot pick up an unrelated process.
    """
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        members = session_members(sid)
        if not members or time.monotonic() > deadline:
            return killed, members
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if pid not in killed:
                killed.append(pid)
        time.sleep(0.05)


def _tee(stream: Any, out: TextIO, on_line: Any) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        out.write(line)
        out.flush()
        on_line(line)
    stream.close()


def run_attempt(command: list[str], env: dict[str, str], forwarder: _Forwarder, record: Attempt) -> None:
    """Run one attempt to its end, teeing its output; fill in ``record``."""
    def on_line(line: str) -> None:
        if record.launcher_report_unix is None:
            found = failure_from_line(line)
            if found:
                record.launcher_report_unix = time.time()
                record.failure = record.failure or found

    record.start_unix = time.time()
    t0 = time.monotonic()
    try:
        # Its own session (and so process group): a Ctrl-C on the terminal reaches
        # the job once, through us, and every process the attempt starts is
        # found by its session afterwards (reap_session).
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=_die_with_parent)
    except OSError as exc:
        print(f"hpcnet.launch: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        record.status, record.end_unix = 127, time.time()
        record.cause = f"cannot run {command[0]!r}"
        return
    forwarder.proc = proc
    if forwarder.received:  # a signal came between attempts: pass it on at once
        forwarder.count -= 1
        forwarder._handle(forwarder.received, None)
    threads = [threading.Thread(target=_tee, args=(proc.stdout, sys.stdout, on_line), daemon=True),
               threading.Thread(target=_tee, args=(proc.stderr, sys.stderr, on_line), daemon=True)]
    for thread in threads:
        thread.start()
    returncode = proc.wait()
    record.end_unix = time.time()
    record.duration_s = time.monotonic() - t0
    forwarder.proc = None
    record.reaped, record.survivors = reap_session(proc.pid)  # before the tees: survivors hold the pipes
    if record.reaped:
        _say(f"killed {len(record.reaped)} process(es) the attempt left running: {record.reaped[:10]}")
    for thread in threads:
        thread.join(timeout=5)
    record.status = normalise_status(returncode)


def _read_failure(run_dir: str | None) -> dict[str, Any] | None:
    if not run_dir:
        return None
    path = Path(run_dir) / "failure.json"
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {"kind": "unreadable failure.json", "error": str(exc)}
    return found if isinstance(found, dict) else {"kind": "unreadable failure.json"}


def _is_openmpi(launcher: str) -> bool:
    try:
        out = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out.stdout + out.stderr or "OpenRTE" in out.stdout + out.stderr


def _launch_dir(run_dir: str, run_name: str, exact: bool) -> Path:
    """Where launch.json and the attempts' run directories go: what hpcnet.train would have made its run directory."""
    if exact:
        return Path(run_dir).absolute()
    path = Path(run_dir).absolute() / f"{run_name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    if path.exists():
        path = path.with_name(path.name + f"-{time.monotonic_ns() % 10**6:06d}")
    return path


def _say(message: str) -> None:
    print(f"hpcnet.launch: {message}", file=sys.stderr, flush=True)


def supervise(command: list[str], *, max_restarts: int = 3, backoff_base_s: float = 1.0,
              backoff_cap_s: float = 60.0, exclude_failed_hosts: bool = False,
              environ: dict[str, str] | None = None) -> int:
    """Run ``command`` until it succeeds, fails for good, or uses up ``max_restarts``; return its status."""
    environ = dict(os.environ if environ is None else environ)
    kind = launcher_kind(command)
    openmpi = kind == "mpirun" and _is_openmpi(command[0])
    start = train_args_start(command)
    pinned: list[str] = []
    launch_dir = checkpoint_dir = None
    if start is not None:
        parsed = parse_train_args(command[start:])
        if parsed.informational:
            start = None
        else:
            from hpcnet.config import load_config  # light: no torch
            from hpcnet.errors import ConfigError

            try:
                cfg = load_config(parsed.config, parsed.overrides)
            except ConfigError as exc:
                _say(f"error: {exc}")
                return ExitCode.USAGE_ERROR
            launch_dir = _launch_dir(cfg.run.dir, cfg.run.name, cfg.run.dir_exact)
            checkpoint_dir = default_checkpoint_dir(cfg.run.dir, cfg.run.name, cfg.checkpoint.dir).absolute()
    if launch_dir is None:
        launch_dir = Path.cwd()
        _say("the command does not run hpcnet.train: run directories are not pinned, failure.json is not read")
    else:
        try:
            launch_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            _say(f"error: run.dir: cannot create the launch directory {launch_dir}: {exc.strerror or exc}")
            return ExitCode.USAGE_ERROR
        _say(f"launch directory {launch_dir}; checkpoints in {checkpoint_dir}")
    allocation = slurm_allocation(environ)
    forwarder = _Forwarder(mpirun=openmpi).install()
    attempts: list[Attempt] = []
    base = list(command)
    excluded: list[str] = []
    status, message = ExitCode.CODE_ERROR, ""
    try:
        attempt = restarts = 0  # restarts in a row without progress
        while True:
            attempt += 1
            run_dir = str(launch_dir / f"attempt-{attempt}") if start is not None else None
            pinned = [f"run.dir={run_dir}", "run.dir_exact=true", f"checkpoint.dir={checkpoint_dir}"] if run_dir else []
            cmd = attempt_command(base, attempt, train_start=start, pinned=pinned, openmpi=openmpi)
            record = Attempt(attempt=attempt, command=cmd, run_dir=run_dir, start_unix=time.time(),
                             excluded_hosts=list(excluded))
            attempts.append(record)
            # k/n: n is the last attempt, unless an attempt makes progress.
            _say(f"attempt {attempt}/{attempt + max_restarts - restarts}: {shlex.join(cmd)}")
            before = committed_checkpoints(checkpoint_dir)
            run_attempt(cmd, {**launcher_env(environ, openmpi), ATTEMPT_ENV: str(attempt)}, forwarder, record)
            record.new_checkpoints = new_checkpoints(before, committed_checkpoints(checkpoint_dir))
            record.failure = _read_failure(run_dir) or record.failure
            record.signal_received = forwarder.received
            record.restartable = is_restartable(record.status)
            record.cause = describe_failure(record.failure) if record.status else ""
            cause = f" ({record.cause})" if record.cause else ""
            _say(f"attempt {attempt} ended with status {record.status}: {describe_status(record.status)}{cause} "
                 f"after {record.duration_s:.1f} s")
            _write_json(launch_dir, command, attempts, None, "")
            status = record.status
            if record.survivors:
                message = (f"processes {record.survivors[:10]} of attempt {attempt} are still alive after SIGKILL "
                           "(an uninterruptible wait?): not starting another attempt beside them")
                return status
            if status == 0:
                return status
            if forwarder.received:
                message = f"stopped by {signal.Signals(forwarder.received).name}: not restarting"
                return status
            if not record.restartable:
                message = f"status {status} is not restartable: {describe_status(status)}{cause}"
                return status
            if record.new_checkpoints and restarts:
                _say(f"attempt {attempt} committed {record.new_checkpoints[-1]}: progress, so the restart budget "
                     f"starts again ({max_restarts} restart(s))")
                restarts = 0
            if restarts >= max_restarts:
                break
            restarts += 1
            hosts = [h for h in failed_where(record.failure)[1] if h not in excluded]
            if exclude_failed_hosts and hosts:
                exclusion = exclude_hosts(base, [*excluded, *hosts], allocation=allocation,
                                          read_file=lambda p: Path(p).read_text(),
                                          hostfile_path=str(launch_dir / f"hostfile.attempt-{attempt + 1}"))
                if exclusion.command != base:
                    if exclusion.hostfile is not None:
                        Path(exclusion.hostfile_path).write_text(exclusion.hostfile)
                    base = exclusion.command
                    excluded.extend(hosts)
                _say(f"excluding {', '.join(hosts)}: {exclusion.note}")
            delay = backoff_s(restarts, backoff_base_s, backoff_cap_s)
            _say(f"restarting from the newest checkpoint in {delay:.1f} s (restart {restarts} of {max_restarts}"
                 f"{' since the last new checkpoint' if checkpoint_dir else ''})")
            if forwarder.wake.wait(delay) or forwarder.received:
                message = f"stopped by {signal.Signals(forwarder.received).name} before restarting"
                status = ExitCode.INTERRUPTED if forwarder.received == signal.SIGINT else ExitCode.PREEMPTED
                return status
        message = (f"giving up after {len(attempts)} attempts ({max_restarts} restarts"
                   f"{' without a new checkpoint' if checkpoint_dir else ''}): last status {status}, "
                   f"{describe_status(status)}{cause}")
        return status
    finally:
        forwarder.restore()
        if message:
            _say(message)
        _write_json(launch_dir, command, attempts, status, message)


def _write_json(launch_dir: Path, command: list[str], attempts: list[Attempt], final: int | None,
                message: str) -> None:
    record = {"command": command, "launch_dir": str(launch_dir), "attempts": [asdict(a) for a in attempts],
              "final_status": final, "message": message}
    tmp = launch_dir / "launch.json.tmp"
    try:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, launch_dir / "launch.json")
    except OSError as exc:
        _say(f"cannot write {launch_dir / 'launch.json'}: {exc.strerror or exc}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcnet.launch``."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m hpcnet.launch",
        description="Run an hpcnet job; on a restartable failure run it again with --resume auto.",
        epilog="example: python -m hpcnet.launch --max-restarts 3 -- mpirun -np 4 python -m mpi4py -m "
               "hpcnet.train run.name=x checkpoint.every_steps=100")
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts after the first attempt (default 3)")
    parser.add_argument("--backoff-s", type=float, default=1.0,
                        help="wait before the first restart, doubled for each further one (default 1)")
    parser.add_argument("--max-backoff-s", type=float, default=60.0, help="longest wait (default 60)")
    parser.add_argument("--exclude-failed-hosts", action="store_true",
                        help="leave a host that a failure is pinned to out of the next attempts (mpirun, srun)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launcher command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: python -m hpcnet.launch [options] -- mpirun ... python -m mpi4py -m hpcnet.train ...")
    if args.max_restarts < 0 or args.backoff_s < 0 or args.max_backoff_s < 0:
        parser.error("--max-restarts, --backoff-s and --max-backoff-s must be >= 0")
    return supervise(command, max_restarts=args.max_restarts, backoff_base_s=args.backoff_s,
                     backoff_cap_s=args.max_backoff_s, exclude_failed_hosts=args.exclude_failed_hosts)
