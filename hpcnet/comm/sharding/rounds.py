"""Stage 3's gathers as rounds, so that ranks may need parameters at different points
(``hpcnet.comm.sharding.params``).

A gather is collective: each owner sends its units of a group to the ranks that want the group.  Ranks do not
always want the same group at the same point: one skips a block that another runs (data-dependent control flow,
``dist.find_unused``), runs a block twice, reads a parameter in its loss, or runs out of evaluation batches
first.  So every gather is a *round* of all ranks:

1. the ranks exchange what each wants (a group's index, or nothing): one ``MPI_Allgather`` of an integer, on the
   rounds' own communicator;
2. each rank receives the units of the group it wants from their owners, and sends its own units of the group
   each other rank wants to that rank: the transport layer moves them (``hpcnet.comm.transport.GroupGather``:
   one ``MPI_Ialltoallw`` over the units where they are, or with ``torch.distributed`` (CUDA) a broadcast a unit
   when every rank wants the same group, else point-to-point sends and receives, in stream order).

A rank that has finished its forwards and backwards *settles*: it takes part in rounds, wanting nothing, until a
round in which no rank wants anything, so every rank leaves its part of the work together and none waits for a
gather that another rank would never start.  Rounds match by their order on each rank, whatever each wants.  The
cost is one small all-gather a gather and one a settle.  Each round is in the flight recorder (``gather.round``,
from the exchange of wants to the end of its traffic), so a stall in one is reported where it is.
"""

from typing import Any

import numpy as np

from hpcnet.comm.transport import WANTS_NOTHING, GatherHandle, GroupGather
from hpcnet.fault.flightrec import NULL_RECORDER
from hpcnet.fault.survive import track


class Round:
    """A round whose traffic is in flight (``Rounds.start``)."""

    __slots__ = ("handle", "token")

    def __init__(self, handle: GatherHandle, token: int) -> None:
        self.handle, self.token = handle, token


class Rounds:
    """The gathers' rounds over ``comm`` (duplicated: the exchanges of wants have their own message space).

    Args:
        comm: the ranks.
        gather: what moves the units (``hpcnet.comm.transport.build_group_gather``), its groups by index.
        recorder: the flight recorder (``hpcnet.fault.flightrec``) each round is logged to.
    """

    def __init__(self, comm: Any, gather: GroupGather, *, recorder: Any = NULL_RECORDER) -> None:
        self.comm = track(comm.Dup())
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.gather, self.recorder = gather, recorder
        self._mine = np.zeros(2, dtype=np.int64)  # [the group wanted, the buckets ready]
        self._every = np.zeros((self.size, 2), dtype=np.int64)
        self.paced: Any = None
        """The reducer, whose early buckets go out at the rounds (``pace``)."""
        self.rounds = 0

    def pace(self, reducer: Any) -> None:
        """Launch ``reducer``'s early buckets at the rounds (``Reducer.pace``): each round carries every rank's
        ``ready()`` count and launches what all have (``launch_agreed``)."""
        reducer.pace()
        self.paced = reducer

    def set_owner(self, owner: list[int]) -> None:
        self.gather.set_owner(owner)

    # -- one round -------------------------------------------------------------------------
    def start(self, g: Any) -> Round | None:
        """A round in which this rank wants group ``g`` (None: nothing); returns what ``wait`` completes (None:
        nothing to wait for).  ``g``'s buffer must have its memory."""
        if self.size == 1:
            if g is not None:
                self.gather.start([g.index])  # its own units, copied
            return None
        token = self.recorder.start("gather.round", -1, 0 if g is None else g.nbytes)
        wants = self._exchange(WANTS_NOTHING if g is None else g.index)
        if (wants == WANTS_NOTHING).all():
            self.recorder.end(token)
            return None
        return Round(self.gather.start(wants), token)

    def wait(self, pending: Round | None) -> None:
        if pending is None:
            return
        pending.handle.wait()
        self.recorder.end(pending.token)

    def settle(self) -> None:
        """Take part in rounds, wanting nothing, until a round in which no rank wants anything (collective)."""
        if self.size == 1:
            return
        while (pending := self.start(None)) is not None:
            self.wait(pending)

    def _exchange(self, want: int) -> np.ndarray:
        """Every rank's want (collective); the buckets every rank has ready launched."""
        from mpi4py import MPI

        paced = self.paced is not None and self.paced.pacing
        self._mine[0], self._mine[1] = want, self.paced.ready() if paced else 0
        self.comm.Allgather([self._mine, MPI.INT64_T], [self._every, MPI.INT64_T])
        self.rounds += 1
        if paced:
            self.paced.launch_agreed(int(self._every[:, 1].min()))
        return self._every[:, 0]

    def close(self, collective: bool) -> None:
        """Free the gather's resources; ``collective`` (every rank closes): the communicators too."""
        self.gather.close(collective)
        if collective and self.comm is not None:
            self.comm.Free()
            self.comm = None
