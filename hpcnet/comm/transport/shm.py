"""The shared-memory transport (``dist.backend = "shm"``): gradient buckets live in a node-shared MPI window.

Each bucket is allocated by the transport (``allocate``) in an
``MPI.Win.Allocate_shared`` window over the ranks of one node, one segment
per rank, so the reducer's fold (``Reducer._fold``) writes every gradient
straight into memory that the node's other ranks can read.  Summing a bucket
(``start``) is then:

1. a barrier on the node: every rank's bucket is complete;
2. local rank k sums slice k of the bucket over the node's segments, in rank
   order (segment 0 + segment 1 + ...), with torch ops, into segment 0's slice k;
   on several nodes it then all-reduces that slice with MPI among the ranks
   with the same local rank on the other nodes;
3. it copies the sum into slice k of every other segment; a barrier: every
   rank's bucket now holds the whole sum.

Every element is summed once on its node, by one rank, in a fixed order, so
every rank gets the same bits.  No message is sent inside a node: each byte
is read once and written once per rank, about half the memory traffic of
Open MPI's shared-memory all-reduce, which copies through its own buffers.
What limits it is the memory bandwidth, shared by the node's ranks.

The collective runs in the caller (the reducer's ``finish``), like inline
MPI: ``synchronous`` is True.  Tensors not allocated here (a compression wire,
a foreign tensor) are refused: ``hpcnet.comm.route`` rejects compression
with this backend.
"""

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from hpcnet.comm.transport.base import CollectiveExecutor, Transport
from hpcnet.comm.transport.mpi import MpiTransport
from hpcnet.fault.survive import track
from hpcnet.world import World

ALIGN_ELEMENTS = 16
"""Slice boundaries are multiples of this many elements (64 bytes of float32: one cache line)."""


def slice_bounds(numel: int, parts: int, index: int, align: int = ALIGN_ELEMENTS) -> tuple[int, int]:
    """The slice ``[lo, hi)`` of ``numel`` elements that part ``index`` of ``parts`` sums (pure).

    Slices are contiguous, start at multiples of ``align`` elements (or at
    ``numel``, empty), cover every element once, and differ in size by less
    than ``2 * align`` elements (whole blocks of ``align``, the last one partial).
    """
    blocks = -(-numel // align)
    per, extra = divmod(blocks, parts)
    lo = (index * per + min(index, extra)) * align
    hi = lo + (per + (index < extra)) * align
    return min(lo, numel), min(hi, numel)


@dataclass
class _Region:
    window: Any
    segments: list[torch.Tensor]
    """The bucket as each local rank holds it (index = local rank), all in the shared window."""


class ShmTransport(Transport):
    """Sum buckets across ranks through node-shared memory; across nodes, MPI on each rank's slice.

    Args:
        comm: the job's communicator.
        world: its layout; ``node_index`` and ``local_rank`` group the ranks
            (virtual nodes from ``HPCNET_RANKS_PER_NODE`` are allowed: their
            ranks are on one machine).
    """

    name = "shm"
    synchronous = True
    blocking_start = True
    keeps_buckets = True

    def __init__(self, comm: Any, world: World) -> None:
        from hpcnet.agree import mark_agreed
        from hpcnet.errors import UsageError

        self.size = comm.Get_size()
        self.node = track(comm.Split(color=world.node_index, key=world.local_rank))
        self.local_rank, self.local_size = self.node.Get_rank(), self.node.Get_size()
        self.cross = track(comm.Split(color=self.local_rank, key=world.node_index))
        self._regions: dict[int, _Region] = {}
        # Errors become a handle that raises at wait, as inline MPI's do.
        self._inline = CollectiveExecutor("inline", "")
        sizes = comm.allgather(self.local_size)
        if len(set(sizes)) > 1:
            self.close()
            raise mark_agreed(UsageError(f"dist.backend: 'shm' needs the same number of ranks on every node, not "
                                    f"{min(sizes)} to {max(sizes)}; use 'mpi'"))

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed bucket of ``numel`` elements in a new shared window (collective over the node).

        Every rank of the node must allocate the same buckets in the same order.
        """
        from mpi4py import MPI

        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"the shm transport sums float32/float64 buckets, not {dtype}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        window = MPI.Win.Allocate_shared(numel * itemsize, itemsize, comm=self.node)
        window.Lock_all(MPI.MODE_NOCHECK)  # one passive epoch for the window's life; Sync orders the stores
        segments = []
        for r in range(self.local_size):
            memory, _ = window.Shared_query(r)
            segments.append(torch.frombuffer(memory, dtype=dtype, count=numel) if numel else
                            torch.empty(0, dtype=dtype))
        mine = segments[self.local_rank]
        mine.zero_()
        self._regions[mine.data_ptr()] = _Region(window, segments)
        self.node.Barrier()  # every segment zeroed before anyone reads it
        return mine

    def release(self, flat: torch.Tensor) -> None:
        """Free the window of a bucket from ``allocate`` (collective over the node; ``flat`` is unusable after)."""
        region = self._regions.pop(flat.data_ptr())
        region.window.Unlock_all()
        region.window.Free()

    def start(self, flat: torch.Tensor, key: Any = None) -> Any:
        region = self._regions.get(flat.data_ptr())
        if region is None or region.segments[self.local_rank].numel() != flat.numel():
            raise ValueError("the shm transport sums only buckets it allocated (ShmTransport.allocate)")
        return self._inline.run(lambda _: self._sum(region, flat.numel()), flat)

    def _sum(self, region: _Region, numel: int) -> None:
        from mpi4py import MPI

        window, segments = region.window, region.segments
        lo, hi = slice_bounds(numel, self.local_size, self.local_rank)
        window.Sync()
        self.node.Barrier()  # every rank's bucket is complete
        window.Sync()
        total = segments[0][lo:hi]
        for segment in segments[1:]:
            total.add_(segment[lo:hi])  # in rank order: the same bits on every rank
        if self.cross.Get_size() > 1 and hi > lo:
            self.cross.Allreduce(MPI.IN_PLACE, total.numpy(), op=MPI.SUM)
        for segment in segments[1:]:
            segment[lo:hi].copy_(total)
        window.Sync()
        self.node.Barrier()  # every slice summed: each rank's bucket holds the whole sum
        window.Sync()

    def abandon(self) -> None:
        """Forget the windows and communicators without freeing them (local): while an error raised on this rank
        alone propagates, its peers may be inside a collective, and freeing a window is one (the job is
        aborted next, which frees everything)."""
        self._regions.clear()

    def close(self) -> None:
        for region in self._regions.values():
            region.window.Unlock_all()
            region.window.Free()
        self._regions.clear()
        for comm in (self.node, self.cross):
            comm.Free()


RACE_BYTES = 4 << 20
"""The bucket size ``dist.backend=auto`` times both ways on CPU (``race_shm_against_mpi``)."""
RACE_ITERS = 3


def race_shm_against_mpi(comm: Any, world: World, nbytes: int, iters: int = RACE_ITERS) -> tuple[float, float]:
    """Collective: seconds per all-reduce of ``nbytes`` of float32 with MPI (inline) and with shm, alternating,
    one warm-up each; the slowest rank's median of ``iters``.  (MPI's, shm's) on every rank, so every rank
    decides alike.  Every node must have the same number of ranks (``ShmTransport``)."""
    from mpi4py import MPI

    numel = max(1, nbytes // 4)
    contenders = [MpiTransport(comm, progress="inline"), ShmTransport(comm, world)]
    try:
        buffers = [torch.ones(numel), contenders[1].allocate(numel, torch.float32)]
        buffers[1].fill_(1.0)
        seconds: list[list[float]] = [[], []]
        for i in range(iters + 1):
            for k, (transport, flat) in enumerate(zip(contenders, buffers)):
                comm.Barrier()
                t0 = time.perf_counter()
                transport.start(flat).wait(600.0)
                if i:
                    seconds[k].append(time.perf_counter() - t0)
                flat.fill_(1.0)  # no growth to inf at any size
        return tuple(comm.allreduce(statistics.median(s), op=MPI.MAX) for s in seconds)  # type: ignore[return-value]
    finally:
        for transport in contenders:
            transport.close()
