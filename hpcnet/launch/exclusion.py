"""The hosts the supervisor's next attempts run on (``--exclude-failed-hosts``, ``--min-ranks``;
docs/fault-tolerance.md): which ones a failure leaves out, and which come back once they answer again.

``ExcludedHosts`` holds that state: the user's command with the excluded hosts left out (and, elastic, its rank
count fitted to the hosts left), and the ``HostWatch`` that asks whether an excluded host answers again; when one
does, it asks the running attempt to save and stop so that the next one runs with the host (``grow_step``).  The
decisions it takes are pure and live beside the host lists: which entries of the launcher's list a failure lost
(``hpcnet.launch.elastic.lost_entries``), the command without them (``hpcnet.launch.elastic.place``).
"""

import contextlib
import functools
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcnet.launch.attempt import Attempt
from hpcnet.launch.command import ranks_of
from hpcnet.launch.elastic import (
    PROBE_EVERY_S,
    PROBE_TIMEOUT_S,
    ElasticError,
    HostWatch,
    elastic_ranks,
    host_names,
    known_kind,
    lost_entries,
    place,
    probe_command,
    probe_hosts,
)
from hpcnet.launch.hosts import RESOLVE_TIMEOUT_S, resolve_all
from hpcnet.launch.processes import reap_session, say
from hpcnet.launch.restarts import failed_where, read_rank_places
from hpcnet.launch.standby import PARK_WAIT_S, Standbys
from hpcnet.launch.stop import READY
from hpcnet.paths import ready_dir


def _read_file(path: str) -> str:
    return Path(path).read_text()


def _reap_probe(sid: int) -> None:
    reap_session(sid, timeout_s=5.0)


class ExcludedHosts:
    """The hosts left out of the next attempts, and the command that leaves them out.

    Args:
        command: the user's launcher command.
        launcher: the launcher's kind as declared (``hpcnet.launch.command.launcher_kind``).
        allocation: the SLURM allocation's (host, slots), or None outside one.
        launch_dir: where filtered hostfiles are written and the attempts' ranks report where they run.
    """

    def __init__(self, command: list[str], *, launcher: str, allocation: list[tuple[str, int]] | None,
                 launch_dir: Path) -> None:
        self.user_command, self.launcher, self.allocation, self.launch_dir = command, launcher, allocation, launch_dir
        self.command = list(command)
        """The user's command with the excluded hosts left out: what the next attempt runs."""
        self.excluded: list[str] = []
        self.min_ranks: int | None = None
        """``--min-ranks``: run on fewer ranks when hosts are lost (elastic), never fewer than this; None: keep
        ``-np``."""
        self.ranks = 0
        """The ranks the user's command runs (elastic only): what a grow goes back to."""
        self.probe_template: str | None = None
        self.probe_every_s = PROBE_EVERY_S
        self.probe_timeout_s = PROBE_TIMEOUT_S
        self.probe_env: dict[str, str] | None = None
        self.watch: HostWatch | None = None
        """Asks whether an excluded host answers again (elastic only, while hosts are excluded)."""

    def configure(self, min_ranks: int | None) -> str | None:
        """Check ``--exclude-failed-hosts`` and ``--min-ranks`` (None: not given) against the command (a launcher
        whose options the supervisor can rewrite, ``hpcnet.launch.elastic.elastic_ranks``); why it cannot run so,
        else None."""
        try:
            known_kind(self.user_command, self.launcher, "--exclude-failed-hosts",
                       "it rewrites the host list or --exclude")
            if min_ranks is not None:
                self.ranks = elastic_ranks(self.user_command, min_ranks, allocation=self.allocation,
                                           read_file=_read_file, kind=self.launcher)
        except ElasticError as exc:
            return str(exc)
        self.min_ranks = min_ranks
        return None

    def answered(self) -> bool:
        """Whether an excluded host answered again (elastic)."""
        return self.watch is not None and self.watch.answered.is_set()

    def back(self) -> list[str]:
        """The excluded hosts that answered again."""
        return list(self.watch.back) if self.watch is not None else []

    def exclude_failed(self, record: Attempt, attempts: list[Attempt]) -> str | None:
        """Leave the hosts that ``record``'s failure names out of the next attempts: the entries of the launcher's
        host list that are them (by what their ranks reported, in every attempt's ready reports) and do not answer
        the launcher's probe (``hpcnet.launch.elastic.lost_entries``).  Returns why no attempt may follow (a host
        that does not answer and that the command cannot leave out; elastic: the hosts left hold fewer than
        ``--min-ranks``), else None."""
        lost = [record.lost_host["host"]] if record.lost_host and record.lost_host.get("host") else []
        named = list(dict.fromkeys([*lost, *failed_where(record.failure)[1]]))
        if not named:
            return None
        places = [place for a in attempts if a.run_dir
                  for place in read_rank_places(ready_dir(self.launch_dir, a.attempt), READY).values()]
        entries = host_names(self.user_command, allocation=self.allocation, read_file=_read_file, kind=self.launcher)
        probe = functools.partial(probe_hosts, make=self.probe_for, timeout_s=self.probe_timeout_s,
                                  env=self.probe_env, reap=_reap_probe)
        hosts, said, final = lost_entries(named, entries, places, excluded=self.excluded, probe=probe,
                                          resolve=functools.partial(resolve_all, timeout_s=RESOLVE_TIMEOUT_S))
        if said:
            say(said)
        if final is not None or not hosts:
            return final
        return self.place([*self.excluded, *hosts], len(attempts) + 1)

    def probe_for(self, host: str) -> list[str] | None:
        """The command that asks whether ``host`` answers (``hpcnet.launch.elastic.probe_command``)."""
        return probe_command(self.user_command, host, self.probe_template, self.launcher)

    def place(self, excluded: list[str], attempt: int) -> str | None:
        """Set the command of attempt ``attempt`` and those after it to the user's without ``excluded``
        (``hpcnet.launch.elastic.place``) and say so.  Returns why no attempt may follow (the command cannot leave
        them out; elastic: too few slots left), else None: an exclusion is said only once the next attempts'
        command carries it."""
        placed = place(self.user_command, excluded, allocation=self.allocation, min_ranks=self.min_ranks,
                       ranks=self.ranks,
                       ranks_now=ranks_of(self.command, self.launcher) if self.min_ranks is not None else None,
                       read_file=_read_file, hostfile_path=str(self.launch_dir / f"hostfile.attempt-{attempt}"),
                       kind=self.launcher)
        if placed.error:
            return placed.error
        if placed.hostfile is not None and placed.hostfile_path is not None:
            Path(placed.hostfile_path).write_text(placed.hostfile)
        self.command, self.excluded = placed.command, placed.excluded
        say(placed.note)
        return None

    def grow(self, attempt: int) -> str | None:
        """Let the hosts that answered again back in from attempt ``attempt`` on (nothing when they are in
        already); why no attempt may follow, else None."""
        back = self.back()
        remaining = [h for h in self.excluded if h not in back]
        if remaining == self.excluded:
            return None
        return self.place(remaining, attempt)

    def grow_step(self, record: Attempt, proc: subprocess.Popen, standbys: Standbys | None,
                  setup: Callable[[int], tuple[list[str], dict[str, str], Any]], since: list[float]) -> None:
        """An excluded host answers again while ``record``'s attempt runs (its launcher: ``proc``): ask it to save
        and stop (SIGUSR2, which the launcher passes on to the ranks) so that the next attempt runs with the host.
        With ``standbys``, first start one for that next attempt (its command and environment: ``setup``, with the
        host back) and wait, up to ``PARK_WAIT_S``, for its ranks to park, so that the attempt after the stop is
        warm; ``since`` holds when that standby was started."""
        attempt = record.attempt
        if standbys is not None and not since:
            since.append(time.time())
            self.grow(attempt + 1)  # the next attempt's command, with the host back
            cmd, env, _ = setup(attempt + 1)
            try:
                standbys.start(attempt + 1, cmd, env)
                say(f"excluded host {', '.join(self.back())} answers again: starting a standby for attempt "
                    f"{attempt + 1} with it; attempt {attempt} saves and stops once the standby's ranks have parked")
                return
            except OSError as exc:
                say(f"cannot start a standby for attempt {attempt + 1}: {exc.strerror or exc}")
        standby = standbys.current if standbys is not None else None
        if since and standby is not None and standby.alive() and not standby.wait_parked(0.0) \
                and time.time() - since[0] < PARK_WAIT_S:
            return
        record.grow, record.grow_unix = self.back(), time.time()
        say(f"excluded host {', '.join(record.grow)} answers again: asking attempt {attempt} to save and stop "
            "(SIGUSR2) so that the next one runs with it")
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGUSR2)

    def watch_excluded(self) -> None:
        """Elastic: (re)start asking whether the excluded hosts answer again; stop when none is excluded."""
        if self.watch is not None and (not self.excluded or sorted(self.watch.hosts) != sorted(self.excluded)):
            self.stop_watch()
        if self.min_ranks is None or not self.excluded or self.watch is not None:
            return
        if self.probe_for(self.excluded[0]) is None:
            say("no probe for this launcher (--probe-command): the excluded hosts stay out")
            return
        self.watch = HostWatch(list(self.excluded), self.probe_for, every_s=self.probe_every_s,
                               timeout_s=self.probe_timeout_s, env=self.probe_env, reap=_reap_probe).start()
        say(f"asking every {self.probe_every_s:g} s whether {', '.join(self.excluded)} answer(s) again")

    def stop_watch(self) -> None:
        """Stop asking (after the probe in flight)."""
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
