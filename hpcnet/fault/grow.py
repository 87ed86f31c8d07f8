"""Growing back after a shrink (``fault.grow=spawn``): replacements for the lost ranks join the running job at a
step boundary and take their state from the ranks, never from disk.

At the first step boundary after a shrink the survivors start the replacements (``MPI_Comm_spawn``, collective
over them, from the training thread): Open MPI's launcher places them on free slots of the job's allocation (the
lost host's slots where its daemon still runs).  A replacement (``python -m hpcnet.fault.replacement``) starts MPI
first, so the spawn returns once a Python process has started; then it imports torch and the trainer, tells the
survivors' rank 0 that it is ready and waits for their word, while the survivors go on training.  Rank 0 sees the
word at a later boundary and says so in the boundary's all-reduce (``hpcnet.ckpt.schedule.SavePolicy.agree``);
every survivor stops there (``Growing``), they merge with the replacements (``MPI_Intercomm_merge``: the
survivors first, in their order) and rebuild the trainer at the larger size, the state going from its holders to
every rank that reads it (``hand_over``).  So the survivors pause twice: for a process start (the spawn) and for
the merge, the hand-over and the rebuild; never for an import of torch.

The spawn runs in the training thread, not beside it: a spawn in a thread of its own, concurrent with the
trainer's communicator creation and teardown, was seen never to complete under Open MPI 5.0.

A replacement that is no longer wanted (the run ended, or more ranks were lost first) is told to leave by the
survivors' rank 0, once its first message has arrived (``Replacements.dismiss`` says why), or by the next survivor
where rank 0 was lost.
"""

import logging
import math
import os
import sys
import time
from typing import Any

import torch

from hpcnet.agree import mark_agreed
from hpcnet.fault.replacement import HELLO_TAG, READY_TAG, WORD_TAG
from hpcnet.fault.survive import is_process_failure
from hpcnet.stateful import Entries, Saved

log = logging.getLogger(__name__)

POLL_S = 0.02
HELLO_WAIT_S, LOST_WAIT_S = 30.0, 3.0
"""How long the survivors' rank 0 waits for replacements it started to reach it before it lets them go: at the end
of a run, and where more ranks were lost."""


class Growing(Exception):
    """Raised by every survivor at the same step boundary (agreed): the replacements are ready to join."""

    def __init__(self, step: int) -> None:
        super().__init__(f"replacements join after step {step}")
        self.step = step
        mark_agreed(self)


class Replacements:
    """The survivors' side: ``count`` replacements for lost ranks, from the shrink after ``from_step`` until they
    join (``merge``) or are let go (``dismiss``).

    ``due`` (rank 0) says when to start them, ``start`` (collective over the survivors, at a boundary they agreed
    on) starts them, ``ready`` (rank 0) says when every one waits to join, ``merge`` (collective, at a boundary
    they agreed on) is the communicator of survivors and replacements.
    """

    def __init__(self, count: int, *, from_step: int, retry_s: float) -> None:
        self.count, self.from_step, self.retry_s = count, from_step, retry_s
        self.inter: Any = None
        self.started_at_step = -1
        self.spawn_s = self.ready_s = 0.0
        self._started = 0.0
        self._tried = -math.inf
        self._waiting: dict[int, set[int]] = {}
        """Per tag, the replacements rank 0 has not heard from yet."""

    def due(self) -> bool:
        """Rank 0: whether to start the replacements at this boundary (not started yet; a failed try is retried
        after ``retry_s``)."""
        return self.inter is None and time.monotonic() - self._tried >= self.retry_s

    def start(self, comm: Any, step: int) -> None:
        """Collective over the survivors: start the replacements (the training thread pauses for a process start;
        where none can be started, a warning and another try later)."""
        from mpi4py import MPI

        self._tried = time.monotonic()
        t0 = time.perf_counter()
        info = MPI.Info.Create()
        info.Set("wdir", os.getcwd())
        try:
            inter = comm.Spawn(sys.executable, args=["-m", "hpcnet.fault.replacement"], maxprocs=self.count,
                               info=info, root=0)
        except MPI.Exception as exc:
            if is_process_failure(exc):
                raise  # another loss: the job shrinks again
            if comm.Get_rank() == 0:
                log.warning("no replacement could be started (%s): trying again in %.0f s (fault.grow_retry_s)",
                            exc, self.retry_s)
            return
        finally:
            info.Free()
        self.inter, self.started_at_step = inter, step  # never revoked (``dismiss``): not tracked
        self.spawn_s, self._started = time.perf_counter() - t0, time.perf_counter()
        self._waiting = {tag: set(range(inter.Get_remote_size())) for tag in (HELLO_TAG, READY_TAG)}
        if comm.Get_rank() == 0:
            log.info("%d replacement(s) started after step %d: the survivors paused %.3f s for it; they join once "
                     "they are ready", self.count, step, self.spawn_s)

    def ready(self, wait_s: float = 0.0) -> bool:
        """Rank 0: whether every replacement has said it waits to join (waiting up to ``wait_s`` for them)."""
        if self.inter is None:
            return False
        if self._heard(READY_TAG, wait_s):
            self.ready_s = self.ready_s or time.perf_counter() - self._started
            return True
        return False

    def _heard(self, tag: int, wait_s: float) -> bool:
        """Rank 0: whether every replacement sent ``tag`` (waiting up to ``wait_s``)."""
        waiting = self._waiting[tag]
        deadline = time.monotonic() + wait_s
        while True:
            for child in sorted(waiting):
                if self.inter.iprobe(source=child, tag=tag):
                    self.inter.recv(source=child, tag=tag)
                    waiting.discard(child)
            if not waiting:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)

    def merge(self, rank: int) -> Any:
        """Collective over the survivors, at a boundary after which rank 0 was ``ready``: the merged communicator,
        the survivors first in their order, then the replacements."""
        if rank == 0:
            self._word(range(self.inter.Get_remote_size()), "join")
        merged = self.inter.Merge(high=False)
        self.inter.Free()
        self.inter = None
        return merged

    def _word(self, children: Any, word: str) -> None:
        """Rank 0: ``word`` ('join' or 'leave') to each of ``children``."""
        for child in children:
            self.inter.send(word, dest=child, tag=WORD_TAG)

    def dismiss(self, rank: int, *, lost: bool, gone: tuple[int, ...] = ()) -> None:
        """Let the replacements go: the lowest rank of the survivors that started them (``rank``: this one's number
        among those; ``gone``: the ones lost since) tells each to leave, the others nothing.  Rank 0 first waits
        for every replacement's first message (up to ``HELLO_WAIT_S``; a few seconds where ranks were just
        ``lost``): one that first reaches out after rank 0 is gone would wait in Open MPI's runtime for good, and
        mpirun with it (``hpcnet.fault.replacement``).  Where rank 0 itself is gone, the next survivor tells every
        replacement: they take the word from any survivor, and a failure in the survivors' job is not seen in
        theirs, so nobody else would.  No revoke: a replacement passes a revoke on to every survivor, and reaching
        one that has left waits for good in the same way."""
        if self.inter is None:
            return
        teller = next((r for r in range(self.inter.Get_size()) if r not in gone), None)
        if rank != teller:
            return
        children = set(range(self.inter.Get_remote_size()))
        if teller == 0:
            if not self._heard(HELLO_TAG, LOST_WAIT_S if lost else HELLO_WAIT_S):
                log.warning("a replacement did not reach rank 0 in time: mpirun may wait for it")
            children -= self._waiting[HELLO_TAG]
        self._word(children, "leave")


def join_if_spawned() -> Any:
    """A replacement's start (the entry point, before anything collective): None where this process was not
    started by survivors; else, once the survivors call it in, the merged communicator. A replacement that is let
    go (or whose survivors are gone) leaves here, with status 0. A replacement that joined ends with MPI_Finalize
    (where the survivors leave without: ``hpcnet.fault.survive.survived_a_loss``) unless it sees a loss itself:
    Open MPI's launcher takes a spawned process that leaves without it for a failed one.

    Its messages to rank 0 are not waited for: rank 0 may have ended before they could leave (a send that sets up
    a connection to an ended process waits for good), and then the word comes from the next survivor
    (``Replacements.dismiss``); the replacement leaves at once, without MPI_Finalize, which would wait for them."""
    from mpi4py import MPI

    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return None
    status = MPI.Status()
    try:
        ready = parent.isend(None, dest=0, tag=READY_TAG)
        while not parent.iprobe(source=MPI.ANY_SOURCE, tag=WORD_TAG):  # rank 0's, or the next survivor's
            time.sleep(POLL_S)
        word = parent.recv(source=MPI.ANY_SOURCE, tag=WORD_TAG, status=status)
    except MPI.Exception:  # the survivors' rank 0 is gone: nothing of the run is here to lose
        MPI.Finalize()  # leaving without it, mpirun would take this process for a failed one and end with 1
        sys.exit(0)
    if status.Get_source() != 0:  # rank 0 is gone, its messages maybe with it: nothing of the run is here to lose
        log.info("the survivors' rank 0 is gone: this replacement leaves, as the next survivor says")
        os._exit(0)
    ready.wait()
    if word != "join":  # let go: the run ended, or more ranks were lost
        MPI.Finalize()
        sys.exit(0)
    return parent.Merge(high=True)


def hand_over(comm: Any, entries: Entries | None, step: int, last_saved_step: int, from_size: int,
              before_read: Any) -> tuple[Saved, int]:
    """Collective over the grown job: every part's entries from the survivors that hold them to every rank that
    reads them, as a resume reads a checkpoint written at ``from_size`` ranks (the survivors are ranks 0 to
    ``from_size - 1`` in their old order, so a holder keeps its number).  ``entries``: a survivor's (None on a
    replacement); ``before_read(meta)``: the parts' readiness (``TrainState.before_read``), what this rank reads.
    Returns what the parts take back and the step of the last committed checkpoint."""
    header = None
    if comm.Get_rank() == 0:
        assert entries is not None
        header = ([(name, tuple(t.shape), t.dtype) for name, t in entries.tensors.items()], entries.holders,
                  entries.meta, step, last_saved_step)
    names, holders, meta, step, last_saved_step = comm.bcast(header, root=0)
    wanted = before_read(meta)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, dtype in names:
        root = holders.get(name, 0)
        if comm.Get_rank() == root:
            assert entries is not None
            value = entries.tensors[name].detach().to("cpu").contiguous()
        else:
            value = torch.empty(shape, dtype=dtype)
        if value.numel():
            comm.Bcast(value.reshape(-1).view(torch.uint8).numpy(), root=root)
        if wanted is None or wanted(name):
            tensors[name] = value
    saved = Saved(tensors, meta, entries.rank_state if entries is not None else None, saved_world_size=from_size,
                  step=step, source="the survivors' memory")
    return saved, last_saved_step
