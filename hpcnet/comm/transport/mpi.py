"""All-reduce with MPI on the tensor's own memory, from a worker thread or inline (``dist.progress``)."""

from typing import Any

import torch

from hpcnet.comm.transport.base import CollectiveExecutor, Done, Handle, mpi_buffer


class MpiTransport:
    """All-reduce with MPI, in submission order, from a worker thread or inline (``progress``)."""

    name = "mpi"

    def __init__(self, comm: Any, progress: str = "thread") -> None:
        self.comm = comm.Dup()  # its own message space: never matched against other traffic
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
        """Sum ``flat`` across ranks; rank r receives elements ``[sum(counts[:r]), +counts[r])`` of the sum in
        ``out`` (``MPI_Reduce_scatter``; ``dist.zero=2``). ``flat`` is left as scratch."""
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
