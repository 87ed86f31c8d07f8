"""Two-level all-reduce: reduce-scatter in the node, all-reduce across nodes, all-gather in the node."""

import datetime
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from hpcnet.comm.transport.base import CollectiveExecutor, Done, Handle, mpi_buffer
from hpcnet.comm.transport.torchdist import TorchHandle


class HierarchicalTransport:
    """Reduce-scatter in the node, all-reduce across nodes, all-gather in the node.

    Args:
        comm: the job's communicator.
        node_index, local_rank: this rank's place (``World``, virtual nodes allowed).
        kind: 'mpi' (MPI collectives from a worker thread) or a torch backend
            ('gloo', 'nccl') for which subgroups are created (collective over
            every rank of the default group).
        timeout_s: the subgroups' timeout (NCCL enforces it in its watchdog); None: torch's default.
    """

    def __init__(self, comm: Any, *, node_index: int, local_rank: int, kind: str,
                 timeout_s: float | None = None, progress: str = "thread") -> None:
        self.kind = kind
        self.name = f"hierarchical-{kind}"
        self.size = comm.Get_size()
        self.local = comm.Split(color=node_index, key=local_rank)
        self.cross = comm.Split(color=local_rank, key=node_index)
        self.local_size = self.local.Get_size()
        nodes = comm.allgather((node_index, local_rank))  # the same answer on every rank: the same error or none
        sizes = list(Counter(node for node, _ in nodes).values())
        if min(sizes) != max(sizes):
            self.local.Free()
            self.cross.Free()
            raise ValueError(f"hierarchical all-reduce needs as many ranks on every node; these nodes have "
                             f"{min(sizes)} to {max(sizes)} (each node cuts a bucket into one shard a rank, and "
                             "the shards are summed across nodes)")
        # gloo's phases are sequenced by a worker thread too (see start); NCCL's are enqueued in order.
        self._progress = CollectiveExecutor(progress if kind == "mpi" else "thread", "hpcnet-hier-allreduce")
        self.synchronous = self.size == 1 or (kind == "mpi" and self._progress.synchronous)
        self._local_group = self._cross_group = None
        if kind != "mpi":
            import torch.distributed as dist

            # new_group is collective over the default group: every rank
            # creates every subgroup, in the same order.
            by_node: dict[int, list[int]] = {}
            by_local: dict[int, list[int]] = {}
            for rank, (node, local) in enumerate(nodes):
                by_node.setdefault(node, []).append(rank)
                by_local.setdefault(local, []).append(rank)
                # Given, or new_group takes torch's default (10 min for NCCL), not dist.timeout_s.
            timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
            self._local_group, _ = dist.new_subgroups_by_enumeration(list(by_node.values()), timeout=timeout,
                                                                     backend=kind)
            self._cross_group, _ = dist.new_subgroups_by_enumeration(list(by_local.values()), timeout=timeout,
                                                                     backend=kind)

    def _phases(self, flat: torch.Tensor, *, enqueue: bool) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Run (or, for NCCL, enqueue in order) the three phases.

        Returns the padded work buffer, this rank's shard and the last work
        (None when the phases already ran).
        """
        n = flat.numel()
        pad = (-n) % self.local_size
        # Reduce-scatter needs equal shards; a padded copy only when needed.
        work = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
        shard = work.numel() // self.local_size
        out = torch.empty(shard, dtype=work.dtype, device=work.device)  # this rank's reduced shard
        if self.kind == "mpi":
            from mpi4py import MPI

            self.local.Reduce_scatter_block(mpi_buffer(work), mpi_buffer(out), op=MPI.SUM)
            if self.cross.Get_size() > 1:
                self.cross.Allreduce(MPI.IN_PLACE, mpi_buffer(out), op=MPI.SUM)
            self.local.Allgather(mpi_buffer(out), mpi_buffer(work))
            return work, out, None
        import torch.distributed as dist

        # torch >= 2.13 renamed these (the old names warn); clusters may run older torch.
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        phases = [lambda: reduce_scatter(out, work, group=self._local_group, async_op=enqueue)]
        if self.cross.Get_size() > 1:
            phases.append(lambda: dist.all_reduce(out, group=self._cross_group, async_op=enqueue))
        phases.append(lambda: all_gather(work, out, group=self._local_group, async_op=enqueue))
        if not enqueue:
            for phase in phases:
                phase()  # gloo: returns when done
            return work, out, None
        return work, out, enqueue_in_order(phases)

    def _run(self, flat: torch.Tensor) -> None:
        work, _, _ = self._phases(flat, enqueue=False)
        if work is not flat:
            flat.copy_(work[:flat.numel()])

    def start(self, flat: torch.Tensor) -> Handle:
        if self.size == 1:
            return Done()
        if self.kind == "nccl":
            # Enqueued from this thread, where the bucket's device and stream
            # are current; ordered on the device by enqueue_in_order.
            work, out, last = self._phases(flat, enqueue=True)
            return _PaddedHandle(TorchHandle(last, stream_ordered=True, keep=(work, out)), flat, work)
        # gloo runs each group's operations on its own threads, so the phases
        # are sequenced by one worker thread (MPI: that thread, or inline).
        return self._progress.run(self._run, flat)

    def close(self) -> None:
        self._progress.close()
        for comm in (self.local, self.cross):
            comm.Free()


def enqueue_in_order(phases: list[Callable[[], Any]]) -> Any:
    """Enqueue NCCL collectives on different process groups so that each runs after the previous one.

    Every process group has its own CUDA stream.  When a collective is
    enqueued, its stream waits for the current stream, and only for it: two
    collectives on two groups, enqueued back to back, may run at the same
    time on the device, the second reading a buffer the first is still
    writing.  ``work.wait()`` without a timeout on a NCCL work is a stream
    wait: the current stream waits for the work's completion event and the
    CPU returns at once.  So after it, the next collective (whose stream
    waits for the current stream) starts only when the previous one has
    finished: reduce-scatter -> all-reduce -> all-gather, in device order,
    without blocking the CPU.  Returns the last phase's work.
    """
    last = None
    for phase in phases:
        if last is not None:
            last.wait()  # a stream wait, not a CPU wait (no timeout: see TorchHandle)
        last = phase()
    return last


class _PaddedHandle:
    """Wait for the last phase, then copy the result out of a padded work buffer.

    For NCCL the wait is a stream wait, so the copy (on the current stream)
    is ordered after the all-gather without a CPU synchronisation.
    """

    def __init__(self, inner: Handle, flat: torch.Tensor, work: torch.Tensor) -> None:
        self.inner, self.flat, self.work = inner, flat, work

    def wait(self, timeout_s: float) -> None:
        self.inner.wait(timeout_s)
        if self.work is not self.flat:
            self.flat.copy_(self.work[:self.flat.numel()])
