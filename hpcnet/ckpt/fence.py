"""Commit fencing by attempt: only the attempt that ``hpcnet.launch`` started last may commit in a checkpoint directory.

A rank cut off by a network partition can outlive its attempt: the others gave
up, the supervisor started a new attempt, and the cut-off rank, on shared
storage it can still write, finishes a save.  Were it to rename its file or
move ``latest``, it would put a checkpoint of a dead timeline in front of the
new attempt.  So the supervisor writes the attempt it is about to start, and a
token of its own run, into ``<checkpoint dir>/fence`` (``FENCE_NAME``) before
it starts any of that attempt's processes; every rank knows its attempt and
token from its environment (``ATTEMPT_ENV``, ``LAUNCH_ID_ENV``); rank 0 reads
the fence right before its commit's rename and refuses the commit when another
attempt holds it (``refusal``).  A job without the supervisor has no token and
checks nothing.  Torch-free and h5py-free: the supervisor imports it.
"""

import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcnet.ckpt.durable import replace_file
from hpcnet.paths import ATTEMPT_ENV, FENCE_NAME, LAUNCH_ID_ENV


@dataclass(frozen=True, slots=True)
class Fence:
    """Who may commit: attempt ``attempt`` of the supervisor's run ``launch``."""

    launch: str
    attempt: int

    def words(self) -> str:
        return f"attempt {self.attempt} of launch {self.launch}"


def own_fence(environ: Mapping[str, str] | None = None) -> Fence | None:
    """This process's attempt under ``hpcnet.launch`` (from ``LAUNCH_ID_ENV`` and ``ATTEMPT_ENV``); None without a
    supervisor (or with an attempt number that is not one): its commits are not fenced."""
    environ = os.environ if environ is None else environ
    launch, attempt = environ.get(LAUNCH_ID_ENV, ""), environ.get(ATTEMPT_ENV, "")
    if not launch or not attempt.isdigit() or int(attempt) < 1:
        return None
    return Fence(launch, int(attempt))


def write_fence(directory: Path, fence: Fence, **info: Any) -> Path:
    """Make ``fence`` the holder of ``directory`` (created if missing): atomically (a fresh name, then a rename) and
    durably (the file and the directory fsync'd), before the attempt starts. ``info`` (JSON-able) is recorded beside
    it for people."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / FENCE_NAME
    record = {"launch": fence.launch, "attempt": fence.attempt, "host": socket.gethostname(), "pid": os.getpid(),
              "written_unix": time.time(), **info}
    replace_file(path, json.dumps(record) + "\n")
    return path


def read_fence(directory: Path) -> Fence | None:
    """The holder of ``directory``'s fence; None when there is no fence file. Raises OSError when it cannot be read
    and ValueError when it is not a fence."""
    try:
        text = (directory / FENCE_NAME).read_text()
    except FileNotFoundError:
        return None
    record = json.loads(text)
    if not (isinstance(record, dict) and isinstance(record.get("launch"), str)
            and isinstance(record.get("attempt"), int)):
        raise ValueError(f"{directory / FENCE_NAME} is not a fence: {text[:200]!r}")
    return Fence(record["launch"], record["attempt"])


def refusal(directory: Path, mine: Fence | None) -> str | None:
    """Why the commit of a checkpoint by ``mine`` in ``directory`` must not go ahead; None when it may.

    It may when ``mine`` is None (no supervisor), when there is no fence (nobody claimed the directory), or when
    the fence names ``mine`` or an earlier attempt of the same launch (the supervisor writes the fence before the
    attempt starts, so an earlier one there means the write is not visible yet, never that a newer attempt runs).
    It must not when a later attempt of the same launch, or another launch, holds the fence, or when the fence
    cannot be read (nothing proves this attempt is still the current one).
    """
    if mine is None:
        return None
    try:
        holder = read_fence(directory)
    except (OSError, ValueError) as exc:
        return f"the fence {str(directory / FENCE_NAME)!r} cannot be read ({exc}): this rank is {mine.words()}"
    if holder is None or (holder.launch == mine.launch and holder.attempt <= mine.attempt):
        return None
    return (f"{holder.words()} holds the checkpoint directory's fence ({FENCE_NAME}); this rank is {mine.words()}, "
            "which the supervisor has given up on: its commit would put a stale checkpoint in front of the newer "
            "attempt")
