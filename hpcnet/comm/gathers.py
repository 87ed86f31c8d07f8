"""Stage 3's gathers as rounds, so that ranks may need parameters at different points (``hpcnet.comm.zero3``).

A gather is collective: each owner sends its units of a group to the ranks that want the group.  Ranks do not
always want the same group at the same point: one skips a block that another runs (data-dependent control flow,
``dist.find_unused``), runs a block twice, reads a parameter in its loss, or runs out of evaluation batches
first.  So every gather is a *round* of all ranks on the gathers' own communicator:

1. the ranks exchange what each wants (a group's index, or nothing): one ``MPI_Allgather`` of an integer;
2. each rank receives the units of the group it wants from their owners, and sends its own units of the group
   each other rank wants to that rank: one ``MPI_Ialltoallw`` over the units where they are (an ``hindexed``
   datatype a group, nothing staged); with ``torch.distributed`` (CUDA), a broadcast a unit when every rank wants
   the same group, else point-to-point sends and receives, in stream order.

A rank that has finished its forwards and backwards *settles*: it takes part in rounds, wanting nothing, until a
round in which no rank wants anything, so every rank leaves its part of the work together and none waits for a
gather that another rank would never start.  Rounds match by their order on each rank, whatever each wants.  The
cost is one small all-gather a gather and one a settle.
"""

from typing import Any

import numpy as np
import torch

from hpcnet.comm.exchange import pieces

NOTHING = -1
"""A round's want of a rank that needs no group."""


class Rounds:
    """The gathers' rounds over ``comm`` (duplicated: they have their own message space).

    Args:
        comm: the ranks.
        layout: the units of ownership and their tensors (``hpcnet.comm.zero.ShardLayout``).
        owner: each unit's owner (``set_owner`` changes it).
        groups: the groups (``hpcnet.comm.zero3.Group``): units, byte offsets, flat buffers.
        region: ``region(group, unit)``: the unit's place in the group's flat buffer, shaped as its tensor.
        collective: 'mpi' (CPU buffers) or 'torch' (``torch.distributed``).
    """

    def __init__(self, comm: Any, layout: Any, owner: list[int], groups: list[Any], region: Any, *,
                 collective: str) -> None:
        if collective not in ("mpi", "torch"):
            raise ValueError(f"collective {collective!r} is not 'mpi' or 'torch'")
        self.comm = comm.Dup()
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.layout, self.groups, self.region, self.collective = layout, groups, region, collective
        self.owner = list(owner)
        self._mine = np.zeros(2, dtype=np.int64)  # [the group wanted, the buckets ready]
        self._every = np.zeros((self.size, 2), dtype=np.int64)
        self.paced: Any = None
        """The reducer, whose synchronous buckets go out at the rounds (``Reducer.pace``): each round carries every
        rank's ``ready()`` count and launches what all have (``launch_agreed``)."""
        self._send: dict[int, tuple[Any, Any]] = {}  # group -> (addresses, datatype of this rank's units)
        self._recv: dict[int, tuple[Any, list[Any]]] = {}  # group -> (owners, datatype per sending rank)
        self.rounds = 0

    def set_owner(self, owner: list[int]) -> None:
        self.owner = list(owner)

    # -- one round -------------------------------------------------------------------------
    def start(self, g: Any) -> Any:
        """A round in which this rank wants group ``g`` (None: nothing); returns what ``wait`` completes (None:
        nothing to wait for).  ``g``'s flat buffer must have its memory."""
        if self.size == 1:
            if g is not None:
                self._copy_own(g)
            return None
        wants = self._exchange(NOTHING if g is None else g.index)
        if (wants == NOTHING).all():
            return None
        if g is not None:
            self._copy_own(g)
        if self.collective == "torch":
            return self._start_torch(g, wants)
        return self._start_mpi(g, wants)

    @staticmethod
    def wait(pending: Any) -> None:
        if pending is None:
            return
        if isinstance(pending, list):
            for work in pending:
                work.wait()
        else:
            pending.Wait()

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

    def _copy_own(self, g: Any) -> None:
        with torch.no_grad():
            for k in g.units:
                if self.owner[k] == self.rank:
                    self.region(g, k).copy_(self.layout.tensors[k])

    # -- MPI: one Ialltoallw a round ------------------------------------------------------------
    def _start_mpi(self, g: Any, wants: np.ndarray) -> Any:
        from mpi4py import MPI

        send = [self._send_type(self.groups[w]) if w != NOTHING and r != self.rank else None
                for r, w in enumerate(wants)]
        recv = self._recv_types(g) if g is not None else [None] * self.size
        base = MPI.buffer.fromaddress(g.flat.data_ptr(), g.nbytes) if g is not None and g.nbytes else MPI.BOTTOM
        # Not ``flat.numpy()``: a storage once seen by numpy can no longer be resized.
        return self.comm.Ialltoallw(
            [MPI.BOTTOM, [int(t is not None) for t in send], [0] * self.size, [t or MPI.BYTE for t in send]],
            [base, [int(t is not None) for t in recv], [0] * self.size, [t or MPI.BYTE for t in recv]])

    def _send_type(self, g: Any) -> Any:
        """This rank's units of ``g`` at their own addresses (None: it owns none); remade when a tensor moved (a
        resume writes into them in place, so they rarely do)."""
        from mpi4py import MPI

        mine = [self.layout.tensors[k] for k in g.units if self.owner[k] == self.rank]
        key = tuple((t.data_ptr(), t.numel() * t.element_size()) for t in mine)
        cached = self._send.get(g.index)
        if cached is not None and cached[0] == key:
            return cached[1]
        if cached is not None and cached[1] is not None:
            cached[1].Free()
        dtype = None
        if mine:
            blocks = [(addr + lo, hi - lo) for addr, n in key for lo, hi in pieces(n)]
            dtype = MPI.BYTE.Create_hindexed([n for _, n in blocks], [a for a, _ in blocks]).Commit()
        self._send[g.index] = (key, dtype)
        return dtype

    def _recv_types(self, g: Any) -> list[Any]:
        """Each rank's units of ``g`` at their places relative to the flat buffer (None: it owns none there, or
        it is this rank, whose own units are copied)."""
        from mpi4py import MPI

        owners = [self.owner[k] for k in g.units]
        cached = self._recv.get(g.index)
        if cached is not None and cached[0] == owners:
            return cached[1]
        if cached is not None:
            _free(cached[1])
        per_rank: list[list[tuple[int, int]]] = [[] for _ in range(self.size)]
        for k in g.units:
            if self.owner[k] == self.rank:
                continue
            u = self.layout.units[k]
            p = self.layout.params[u.param]
            row = p.numel() * p.element_size() // max(1, u.rows)
            start = g.offsets[u.param] + u.lo * row
            for lo, hi in pieces((u.hi - u.lo) * row):
                per_rank[self.owner[k]].append((start + lo, hi - lo))
        types = [MPI.BYTE.Create_hindexed([n for _, n in blocks], [a for a, _ in blocks]).Commit() if blocks
                 else None for blocks in per_rank]
        self._recv[g.index] = (owners, types)
        return types

    # -- torch.distributed: broadcasts, or sends and receives ------------------------------------
    def _start_torch(self, g: Any, wants: np.ndarray) -> list[Any]:
        import torch.distributed as dist

        if g is not None and (wants == g.index).all():  # the common round: one broadcast a unit, from its owner
            return [dist.broadcast(self.region(g, k), src=self.owner[k], async_op=True) for k in g.units]
        ops = []
        for r, w in enumerate(wants):
            if w == NOTHING or r == self.rank:
                continue
            ops += [dist.P2POp(dist.isend, self.layout.tensors[k].detach(), r) for k in self.groups[w].units
                    if self.owner[k] == self.rank]
        if g is not None:
            ops += [dist.P2POp(dist.irecv, self.region(g, k), self.owner[k]) for k in g.units
                    if self.owner[k] != self.rank]
        return dist.batch_isend_irecv(ops) if ops else []

    def close(self, collective: bool) -> None:
        """Free the datatypes; ``collective`` (every rank closes): the communicator too."""
        for _, dtype in self._send.values():
            _free([dtype])
        for _, types in self._recv.values():
            _free(types)
        self._send.clear()
        self._recv.clear()
        if collective and self.comm is not None:
            self.comm.Free()
            self.comm = None


def _free(types: list[Any]) -> None:
    for t in types:
        if t is not None:
            t.Free()
