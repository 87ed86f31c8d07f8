"""MPI on the tensors' own memory: the gradients' all-reduce and reduce-scatter, from a worker thread or inline
(``dist.progress``), and stage 3's gathers, one ``MPI_Ialltoallw`` a round."""

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from hpcnet.comm.exchange import pieces
from hpcnet.comm.transport.base import (
    WANTS_NOTHING,
    CollectiveExecutor,
    Done,
    GatherGroup,
    GroupGather,
    Handle,
    Transport,
    mpi_buffer,
)
from hpcnet.fault.survive import track


class MpiTransport(Transport):
    """All-reduce with MPI, in submission order, from a worker thread or inline (``progress``)."""

    name = "mpi"
    reduce_scatters = True

    def __init__(self, comm: Any, progress: str = "thread") -> None:
        self.comm = track(comm.Dup())  # its own message space: never matched against other traffic
        self.size = self.comm.Get_size()
        self._progress = CollectiveExecutor(progress, "hpcnet-mpi-allreduce")

    @property
    def synchronous(self) -> bool:
        """True when ``start`` returns after the collective finished (inline progress, or one rank)."""
        return self.size == 1 or self._progress.synchronous

    @property
    def blocking_start(self) -> bool:
        return self.size > 1 and self._progress.synchronous

    def _allreduce(self, flat: torch.Tensor) -> None:
        from mpi4py import MPI

        self.comm.Allreduce(MPI.IN_PLACE, mpi_buffer(flat), op=MPI.SUM)

    def start(self, flat: torch.Tensor, key: Any = None) -> Handle:
        if self.size == 1:
            return Done()
        if flat.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"the mpi transport sums float32/float64 buckets, not {flat.dtype}")
        return self._progress.run(self._allreduce, flat)

    def start_reduce_scatter(self, flat: torch.Tensor, counts: list[int], out: torch.Tensor) -> Handle:
        """``Transport.start_reduce_scatter`` with ``MPI_Reduce_scatter``."""
        if self.size == 1:
            out.copy_(flat[:counts[0]])
            return Done()
        if flat.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"the mpi transport sums float32/float64 buckets, not {flat.dtype}")

        def reduce_scatter(buffer: torch.Tensor) -> None:
            from mpi4py import MPI

            self.comm.Reduce_scatter(mpi_buffer(buffer), mpi_buffer(out), recvcounts=counts, op=MPI.SUM)

        return self._progress.run(reduce_scatter, flat)

    def close(self) -> None:
        self._progress.close()


class MpiGroupGather(GroupGather):
    """Gather rounds of CPU tensors: one ``MPI_Ialltoallw`` a round, over the units where they are (an ``hindexed``
    datatype a group and peer, from the units' own addresses and to their places relative to the group's buffer,
    which moves between gathers), so nothing is staged; the datatypes are kept from round to round."""

    name = "MPI_Ialltoallw"

    def __init__(self, comm: Any, groups: list[GatherGroup], tensors: list[torch.Tensor], owner: list[int]) -> None:
        super().__init__(comm, groups, tensors, owner)
        self.comm = track(comm.Dup())  # its own message space
        self._send: dict[int, tuple[Any, Any]] = {}  # group -> (addresses, datatype of this rank's units)
        self._recv: dict[int, tuple[Any, list[Any]]] = {}  # group -> (owners, datatype per sending rank)
        self._in_flight: set[_Request] = set()

    def send_and_receive(self, wants: Sequence[int]) -> "_Request":
        from mpi4py import MPI

        send = [self._send_type(self.groups[w]) if w != WANTS_NOTHING and r != self.rank else None
                for r, w in enumerate(wants)]
        want = wants[self.rank]
        g = self.groups[want] if want != WANTS_NOTHING else None
        recv = self._recv_types(g) if g is not None else [None] * self.size
        nbytes = g.buffer.numel() if g is not None else 0
        base = MPI.buffer.fromaddress(g.buffer.data_ptr(), nbytes) if nbytes else MPI.BOTTOM
        # Not ``buffer.numpy()``: a storage once seen by numpy can no longer be resized.
        return _Request(self.comm.Ialltoallw(
            [MPI.BOTTOM, [int(t is not None) for t in send], [0] * self.size, [t or MPI.BYTE for t in send]],
            [base, [int(t is not None) for t in recv], [0] * self.size, [t or MPI.BYTE for t in recv]]),
            self._in_flight)

    def _send_type(self, g: GatherGroup) -> Any:
        """This rank's units of ``g`` at their own addresses (None: it owns none); remade when a tensor moved (new
        owners, a resume that fills them anew: rarely)."""
        from mpi4py import MPI

        mine = [self.tensors[k] for k in g.units if self.owner[k] == self.rank]
        key = tuple((t.data_ptr(), t.numel() * t.element_size()) for t in mine)
        cached = self._send.get(g.index)
        if cached is not None and cached[0] == key:
            return cached[1]
        if cached is not None:
            _free([cached[1]])
        dtype = None
        if mine:
            blocks = [(addr + lo, hi - lo) for addr, n in key for lo, hi in pieces(n)]
            dtype = MPI.BYTE.Create_hindexed([n for _, n in blocks], [a for a, _ in blocks]).Commit()
        self._send[g.index] = (key, dtype)
        return dtype

    def _recv_types(self, g: GatherGroup) -> list[Any]:
        """Each rank's units of ``g`` at their places relative to the buffer (None: it owns none there, or it is
        this rank, whose own units are placed by copying)."""
        from mpi4py import MPI

        owners = [self.owner[k] for k in g.units]
        cached = self._recv.get(g.index)
        if cached is not None and cached[0] == owners:
            return cached[1]
        if cached is not None:
            _free(cached[1])
        per_rank: list[list[tuple[int, int]]] = [[] for _ in range(self.size)]
        for k, offset, place in zip(g.units, g.offsets, g.places):
            if self.owner[k] != self.rank:
                # A block length is a C int: a unit of 2 GiB or more is listed in pieces.
                for lo, hi in pieces(place.numel() * place.element_size()):
                    per_rank[self.owner[k]].append((offset + lo, hi - lo))
        types = [MPI.BYTE.Create_hindexed([n for _, n in blocks], [a for a, _ in blocks]).Commit() if blocks
                 else None for blocks in per_rank]
        self._recv[g.index] = (owners, types)
        return types

    def close(self, collective: bool) -> None:
        if not collective and self.comm is not None and self.comm.Is_revoked():
            # Peers were lost (hpcnet.fault.live): a round left in flight ends now, with the revoke's error; left
            # pending, MPI_Finalize would wait for it for good.
            for request in list(self._in_flight):
                request.abandon()
        for _, dtype in self._send.values():
            _free([dtype])
        for _, types in self._recv.values():
            _free(types)
        self._send.clear()
        self._recv.clear()
        if collective and self.comm is not None:
            self.comm.Free()
            self.comm = None


class _Request:
    """A round's ``MPI_Ialltoallw`` in flight."""

    def __init__(self, request: Any, in_flight: set["_Request"]) -> None:
        self.request, self.in_flight = request, in_flight
        in_flight.add(self)

    def wait(self) -> None:
        try:
            self.request.Wait()
        finally:
            self.in_flight.discard(self)

    def abandon(self) -> None:
        """Complete a round whose communicator is revoked (its error is the loss already being handled)."""
        from mpi4py import MPI

        with contextlib.suppress(MPI.Exception):
            self.wait()


def _free(types: list[Any]) -> None:
    for t in types:
        if t is not None:
            t.Free()
