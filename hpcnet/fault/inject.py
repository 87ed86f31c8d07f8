"""Fault injection: kill, hang or slow a rank, corrupt a checkpoint, fill the disk.

Everything is off by default and configured by the ``[fault]`` options
(``hpcnet.config.FaultConfig``), so a fault travels with the command line
and works under any launcher::

    python -m hpcnet.launch -- mpirun -np 4 python -m mpi4py -m hpcnet.train \\
        fault.kill_at_step=30 fault.only_attempt=1 checkpoint.every_steps=10

The training loop calls three hooks, each one line:

- ``at_step(step)`` after every optimizer step, on every rank; only the
  chosen rank (``fault.rank``, -1 = the last) acts: SIGKILL itself
  (``kill_at_step``: a dead peer, what MPI notices), SIGSTOP itself
  (``hang_at_step``: a hung peer, what only heartbeats notice), sleep once
  (``sleep_at_step`` + ``sleep_s``: a hang that ends) or in every step
  (``slow_s``: a straggler, which is not a failure; ``slow_per_sample_s``,
  through ``slow_compute`` in every forward: a slower device, whose time grows
  with its share of the batch).  The step is the one
  just completed, before its checkpoint: a rank killed at step K loses the
  steps since the last checkpoint, which the next attempt recomputes.
- ``before_resume(corrupt, comm)`` when resuming: rank 0 flips bytes
  inside a tensor dataset of the newest committed checkpoint
  (``corrupt_checkpoint``), as bit rot would, below HDF5 (the file still
  opens; only the block checksums can tell), so ``--resume auto`` must skip
  it and take the previous one.  How to damage a checkpoint is the
  checkpoints' own knowledge (``hpcnet.ckpt.damage``), handed in as
  ``corrupt``: this package imports no checkpoint module, as the
  checkpoints use its deadlines (``hpcnet.fault.watchdog``).
- ``io_fault(phase, step)``, handed to the checkpoint manager
  (``hpcnet.ckpt.job.IoFault``): with ``fill_disk_at_step`` every save of that
  step or later fails with ``OSError(ENOSPC)`` where hpcnet checks the free
  space before writing (the file system is shared, so this hits every rank
  alike and ``fault.rank`` does not apply); with ``write_error`` the chosen
  rank's write of every save from ``write_error_at_step`` on fails inside the
  collective write with that errno, as a quota (EDQUOT), a disk filling up
  meanwhile (ENOSPC) or a storage fault (EIO) would; ``write_error='fill'``
  fills the checkpoint directory's file system for real instead (a file
  ``fill-disk.fault`` there, left for the user to delete: use it on a small
  scratch file system) once the file's structure exists and before its
  space is allocated, so that not even HDF5's close of the file can write
  (``fault.rank`` does not apply).  A full disk or quota is
  not worth restarting (status 2): the next attempt would fail at its first
  save, after recomputing everything since the last checkpoint; EIO is (75).
  With ``slow_save_s`` (every save) or ``stuck_save_at_step`` the chosen
  rank's save sleeps, or blocks for good with the GIL released (as a write
  or fsync to a stuck file system does: every monitor still runs and reports
  the checkpoint deadline), where the ranks meet before the collective
  file create (phase ``arrive``): a slow peer, which must not be a failure,
  or a stuck one.  With ``stuck_fs_at_step`` every rank's save blocks for
  good once the file exists, in its structure calls (``structure``), holding
  the GIL in a C call as h5py does on a stuck file system: no Python runs anywhere, and only the native
  watchdog (``hpcnet.fault.native``) can end the job.

``fault.only_attempt = k`` injects only in attempt k of ``hpcnet.launch``
(which sets ``HPCNET_ATTEMPT``; a run without it is attempt 1), so a
restarted run gets past the fault; 0 injects in every attempt.
"""

import contextlib
import ctypes
import errno
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpcnet.agree import mark_agreed, shared_errors
from hpcnet.config import MAX_DURATION_S, FaultConfig
from hpcnet.errors import ConfigError
from hpcnet.paths import ATTEMPT_ENV
from hpcnet.world import World

log = logging.getLogger(__name__)


def current_attempt(environ: Mapping[str, str] | None = None) -> int:
    """This run's attempt number under ``hpcnet.launch`` (1 when not supervised)."""
    environ = os.environ if environ is None else environ
    text = environ.get(ATTEMPT_ENV, "") or "1"
    try:
        attempt = int(text)
    except ValueError:
        raise ConfigError(f"{ATTEMPT_ENV}={text!r} is not an integer") from None
    if attempt < 1:
        raise ConfigError(f"{ATTEMPT_ENV}={text!r} must be at least 1")
    return attempt


class FaultInjector:
    """The faults of one run on this rank; every hook is a no-op unless a fault is configured.

    Args:
        cfg: the ``[fault]`` section.
        world: this job's world (which rank is the chosen one).
        attempt: the attempt number; None reads ``HPCNET_ATTEMPT``.
        checkpoint_dir: where ``write_error='fill'`` fills the file system.
        generation: how many times the job has shrunk (``hpcnet.fault.live``); with ``fault.only_attempt`` the faults
            hit the attempt's first world only, as they would hit its first process.
        killed: the steps whose kill has happened in this job (kept across its worlds by ``hpcnet.fault.live``).
    """

    def __init__(self, cfg: FaultConfig, world: World, attempt: int | None = None,
                 checkpoint_dir: str | Path | None = None, generation: int = 0,
                 killed: set[int] | None = None) -> None:
        self.cfg = cfg
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        try:
            self.attempt = current_attempt() if attempt is None else attempt
        except ConfigError as exc:
            raise mark_agreed(exc) from None  # the same environment, so the same verdict, on every rank
        self.active = cfg.only_attempt == 0 or (cfg.only_attempt == self.attempt and generation == 0)
        target = cfg.rank if cfg.rank >= 0 else world.size + cfg.rank
        if not 0 <= target < world.size:
            # Every rank computes the same verdict from the same config.
            raise mark_agreed(ConfigError(f"fault.rank: {cfg.rank} is not a rank of this {world.size}-rank job"))
        self.target = target
        self.rank = world.rank
        self.mine = self.active and world.rank == target
        self.killed = set() if killed is None else killed
        armed = self.describe()
        if armed and world.rank == 0:
            log.warning("fault injection armed (attempt %d): %s", self.attempt, armed)

    def describe(self) -> str:
        """The faults armed in this attempt, in words ('' when none)."""
        if not self.active:
            return ""
        c, who = self.cfg, f"rank {self.target}"
        parts = []
        if c.kill_at_step:
            parts.append(f"{who} SIGKILLs itself at step {c.kill_at_step}" +
                         (f" and every {c.kill_every_steps} steps after (the last rank of the job as it is then)"
                          if c.kill_every_steps and c.rank < 0 else
                          f" and every {c.kill_every_steps} steps after" if c.kill_every_steps else ""))
        if c.hang_at_step:
            parts.append(f"{who} SIGSTOPs itself at step {c.hang_at_step}")
        if c.hang_at_startup:
            parts.append(f"{who} blocks for good before the start-up phase {c.hang_at_startup!r}")
        if c.sleep_at_step and c.sleep_s:
            parts.append(f"{who} sleeps {c.sleep_s:g} s at step {c.sleep_at_step}")
        if c.slow_s:
            parts.append(f"{who} sleeps {c.slow_s:g} s every step")
        if c.slow_per_sample_s:
            parts.append(f"{who}'s forward sleeps {c.slow_per_sample_s:g} s per sample")
        if c.corrupt_checkpoint:
            parts.append("the newest checkpoint is corrupted before resuming")
        if c.fill_disk_at_step:
            parts.append(f"checkpoint saves from step {c.fill_disk_at_step} on fail with ENOSPC")
        if c.write_error == "fill":
            parts.append(f"the checkpoint file system is filled for real in the saves from step "
                         f"{c.write_error_at_step} on")
        elif c.write_error:
            parts.append(f"{who}'s checkpoint writes from step {c.write_error_at_step} on fail with {c.write_error}")
        if c.slow_save_s:
            parts.append(f"{who}'s checkpoint save sleeps {c.slow_save_s:g} s before every collective create")
        if c.stuck_save_at_step:
            parts.append(f"{who}'s checkpoint save blocks for good in the save of step {c.stuck_save_at_step}")
        if c.stuck_fs_at_step:
            parts.append(f"every rank's checkpoint save blocks for good, holding the GIL, in the checkpoint "
                         f"file's structure calls of step {c.stuck_fs_at_step} (a stuck file system)")
        return "; ".join(parts)

    def slow_compute(self, samples: int) -> None:
        """Called in every forward with its micro-batch's sample count: ``fault.slow_per_sample_s`` on the chosen
        rank (a slower device, whose time grows with its share of the batch)."""
        if self.mine and self.cfg.slow_per_sample_s:
            # The product is not an option, so it is bounded here: longer than MAX_DURATION_S is a hang anyway,
            # and time.sleep overflows past about 9.2e9 s.
            time.sleep(min(self.cfg.slow_per_sample_s * samples, MAX_DURATION_S))

    def before_phase(self, phase: str) -> None:
        """Called by every rank before start-up phase ``phase`` ('probe', 'rendezvous', 'groups'): with
        ``fault.hang_at_startup`` equal to it, the chosen rank blocks here for good (GIL released, its monitor
        thread still beats and answers), so the others wait for it in the phase."""
        if self.mine and self.cfg.hang_at_startup == phase:
            log.error("fault injection: rank %d blocks for good before the start-up phase %r", self.rank, phase)
            threading.Event().wait()

    def _kill_step(self, step: int) -> bool:
        """Whether the chosen rank is killed after ``step`` (``kill_at_step``, then every ``kill_every_steps``),
        once in a job: every rank notes it."""
        c = self.cfg
        due = step == c.kill_at_step or (c.kill_at_step > 0 and c.kill_every_steps > 0 and step > c.kill_at_step
                                         and (step - c.kill_at_step) % c.kill_every_steps == 0)
        if not self.active or not due or step in self.killed:
            return False
        self.killed.add(step)
        return True

    def at_step(self, step: int) -> None:
        """Called by every rank after optimizer step ``step``; acts on the chosen rank only."""
        kill = self._kill_step(step)
        if not self.mine:
            return
        c = self.cfg
        if c.slow_s:
            time.sleep(c.slow_s)
        if step == c.sleep_at_step and c.sleep_s:
            log.warning("fault injection: rank %d sleeps %g s at step %d", self.rank, c.sleep_s, step)
            time.sleep(c.sleep_s)
        if step == c.hang_at_step:
            # Logged at ERROR so it reaches the console from any rank; the
            # record is flushed before the process stops.
            log.error("fault injection: rank %d stops itself (SIGSTOP) at step %d", self.rank, step)
            os.kill(os.getpid(), signal.SIGSTOP)
        if kill:
            log.error("fault injection: rank %d kills itself (SIGKILL) at step %d", self.rank, step)
            os.kill(os.getpid(), signal.SIGKILL)

    def before_resume(self, corrupt: Callable[[], str], comm: Any) -> None:
        """Collective: with ``fault.corrupt_checkpoint``, rank 0 corrupts the newest committed checkpoint by
        ``corrupt`` (the checkpoints' hook, ``hpcnet.ckpt.damage.corrupt_newest`` of their directory), which says
        what it corrupted ('' when there is nothing to corrupt)."""
        if not (self.active and self.cfg.corrupt_checkpoint):
            return
        with shared_errors(comm):
            if comm.Get_rank() == 0:
                what = corrupt()
                if what:
                    log.warning("fault injection: corrupted %s", what)
                else:
                    log.warning("fault injection: no committed checkpoint to corrupt")

    @property
    def io_fault(self) -> Callable[[str, int], None] | None:
        """The checkpoint manager's I/O hook (``hpcnet.ckpt.job.IoFault``), or None when no I/O fault is armed."""
        c = self.cfg
        armed = (c.fill_disk_at_step or c.write_error or c.slow_save_s or c.stuck_save_at_step or c.stuck_fs_at_step)
        return self._io_fault if self.active and armed else None

    def _io_fault(self, phase: str, step: int) -> None:
        c = self.cfg
        if phase == "precheck" and c.fill_disk_at_step and step >= c.fill_disk_at_step:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} "
                                        f"(injected: fault.fill_disk_at_step={c.fill_disk_at_step})")
        if phase == "reserve" and c.write_error == "fill" and step >= c.write_error_at_step:
            what = fill_disk(self.checkpoint_dir or Path("."))
            log.warning("fault injection: filled the checkpoint file system (%s) in the save of step %d", what, step)
        elif phase == "write" and self.mine and c.write_error and step >= c.write_error_at_step:
            code = getattr(errno, c.write_error)
            raise OSError(code, f"{os.strerror(code)} (injected: fault.write_error={c.write_error})")
        if phase == "arrive" and self.mine and c.slow_save_s:
            log.warning("fault injection: rank %d's checkpoint save sleeps %g s (step %d)", self.rank,
                        c.slow_save_s, step)
            time.sleep(c.slow_save_s)
        if phase == "arrive" and self.mine and step == c.stuck_save_at_step:
            log.error("fault injection: rank %d's checkpoint save blocks for good (step %d)", self.rank, step)
            threading.Event().wait()
        if phase == "structure" and step == c.stuck_fs_at_step:
            log.error("fault injection: rank %d's checkpoint save blocks for good in the file's structure calls, "
                      "holding the GIL (step %d)", self.rank, step)
            block_holding_the_gil()


FILL_NAME = "fill-disk.fault"
"""The file with which ``write_error='fill'`` fills the checkpoint directory's file system (left for the user)."""


def fill_disk(directory: Path, leave_bytes: int = 0) -> str:
    """Fill the file system of ``directory`` for real, but for ``leave_bytes``: append to ``FILL_NAME`` there.

    Space is taken at once where the file system allocates (``posix_fallocate``);
    to fill it completely, the file is then written until the write fails with
    ENOSPC (or EDQUOT).  Returns the file and its size, in words.
    """
    path = directory / FILL_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    try:
        stat = os.statvfs(directory)
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, os.fstat(fd).st_size, max(1, stat.f_bavail * stat.f_frsize - leave_bytes))
        chunk = bytes(1 << 16)
        try:
            while not leave_bytes:
                os.write(fd, chunk)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    return f"{path}: {size / 2**20:.1f} MiB"


def block_holding_the_gil() -> None:
    """Never return, inside a C call that keeps the GIL: what h5py does in a create on a stuck file system.

    A read from a pipe that nobody writes to, called through ``ctypes.PyDLL``
    (which does not release the GIL); faulthandler's signal handlers restart
    it (SA_RESTART), so the stacks signal does not end it either.
    """
    libc = ctypes.PyDLL(None, use_errno=True)
    read_end, write_end = os.pipe()  # write_end stays open: the read never sees end-of-file
    buffer = ctypes.create_string_buffer(1)
    while write_end >= 0:
        libc.read(read_end, buffer, 1)
