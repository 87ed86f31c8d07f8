"""Two-level all-reduce: reduce-scatter in the node, all-reduce across nodes, all-gather in the node."""

import collections
import datetime
import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from hpcnet.comm.quantize import (
    BLOCK,
    ErrorFeedback,
    add_dequantized,
    compress_with_feedback,
    dequantize,
    pack,
    packed_bytes,
    padded_length,
    unpack,
)
from hpcnet.comm.transport.base import (
    CollectiveExecutor,
    Done,
    Failed,
    Handle,
    Transport,
    as_comm_failure,
    mpi_buffer,
)
from hpcnet.comm.transport.torchdist import TorchHandle
from hpcnet.fault.survive import track

PIPELINE_CHUNK_BYTES = 4 << 20
"""A bucket is summed in chunks of this size (``HierarchicalTransport._run``; NCCL pipelines by itself)."""
PIPELINE_DEPTH = 2
"""Chunks whose inter-node sums may be in flight at once."""


def chunk_bounds(numel: int, chunk: int, multiple: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges that cover ``numel`` elements in order, each ``chunk`` elements rounded down to a
    multiple of ``multiple`` (at least ``multiple``), the last one what is left (pure)."""
    step = max(multiple, chunk - chunk % multiple)
    return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)]


class HierarchicalTransport(Transport):
    """Reduce-scatter in the node, all-reduce across nodes, all-gather in the node.

    Args:
        comm: the job's communicator.
        node_index, local_rank: this rank's place (``World``, virtual nodes allowed).
        kind: 'mpi' (MPI collectives from a worker thread or inline) or a torch backend
            ('gloo', 'nccl') for which subgroups are created (collective over
            every rank of the default group).
        timeout_s: the subgroups' timeout (NCCL enforces it in its watchdog); None: torch's default.
        progress: where MPI collectives run ('thread' or 'inline', ``hpcnet.comm.route.mpi_progress``).
        cross_kind: between the nodes: ``kind`` (None), or 'gloo' under 'mpi' (a gloo subgroup of the
            ranks with the same local rank; its sockets block while they wait, where MPI polls a core).
        chunk_bytes: the pipelined chunks of a bucket (``_run``; not NCCL's).
        wire: ``dist.compression`` between the nodes only (gloo there), while the sums inside a node stay exact;
            the reducer then leaves its buckets in full precision (``compresses``).  torch.bfloat16 or
            torch.float16: each shard crosses in half precision and comes back into the full-precision bucket.
            torch.int8: blockwise int8 with error feedback (``hpcnet.comm.quantize``; ``_start_int8``).
        feedback: the residuals of int8 (kept by the caller across transports and checkpoints); None: a new store.
    """

    def __init__(self, comm: Any, *, node_index: int, local_rank: int, kind: str,
                 timeout_s: float | None = None, progress: str = "thread", cross_kind: str | None = None,
                 chunk_bytes: int = PIPELINE_CHUNK_BYTES, wire: torch.dtype | None = None,
                 feedback: ErrorFeedback | None = None) -> None:
        self.kind = kind
        self.wire = wire
        self.feedback = feedback if feedback is not None else ErrorFeedback()
        if wire is not None and (cross_kind or kind) != "gloo":
            raise ValueError("a hierarchical transport compresses only what gloo carries between the nodes")
        self.cross_kind = cross_kind or kind
        if self.cross_kind != kind and (kind, self.cross_kind) != ("mpi", "gloo"):
            raise ValueError(f"between nodes a hierarchical {kind} transport uses {kind}, or gloo under mpi; "
                             f"not {self.cross_kind}")
        self.name = f"hierarchical-{kind}" + (f"+{self.cross_kind}" if self.cross_kind != kind else "")
        self.chunk_bytes = chunk_bytes
        self.size = comm.Get_size()
        self.local = track(comm.Split(color=node_index, key=local_rank))
        self.cross = track(comm.Split(color=local_rank, key=node_index))
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
        # Inline MPI with gloo between the nodes: ``start`` (a backward hook) runs the intra-node reduce-scatters
        # and starts the sums across the nodes, which gloo's threads carry while backward goes on; the handle's
        # wait (the reducer's finish) gathers (``_SplitHandle``).
        self.split = kind == "mpi" and self.cross_kind == "gloo" and self._progress.synchronous
        self.synchronous = self.size == 1 or (kind == "mpi" and self._progress.synchronous and not self.split)
        self.blocking_start = self.size > 1 and kind == "mpi" and self._progress.synchronous
        self._local_group = self._cross_group = None
        if kind != "mpi" or self.cross_kind != "mpi":
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
            if kind != "mpi":
                self._local_group, _ = dist.new_subgroups_by_enumeration(list(by_node.values()), timeout=timeout,
                                                                         backend=kind)
                # torch >= 2.13 renamed these (the old names warn); clusters may run older torch.
                self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            self._cross_group, _ = dist.new_subgroups_by_enumeration(list(by_local.values()), timeout=timeout,
                                                                     backend=self.cross_kind)

    def _enqueue_phases(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """NCCL: enqueue the three phases of the whole bucket, in order (``enqueue_in_order``).

        Returns the padded work buffer, this rank's shard and the last work.
        """
        import torch.distributed as dist

        work, out = self._padded(flat)
        phases = [lambda: self._reduce_scatter(out, work, group=self._local_group, async_op=True)]
        if self.cross.Get_size() > 1:
            phases.append(lambda: dist.all_reduce(out, group=self._cross_group, async_op=True))
        phases.append(lambda: self._all_gather(work, out, group=self._local_group, async_op=True))
        return work, out, enqueue_in_order(phases)

    def _padded(self, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The work buffer (``part``, or a copy padded to a multiple of the node's ranks: reduce-scatter needs
        equal shards) and an empty shard for this rank's sum."""
        pad = (-part.numel()) % self.local_size
        work = torch.cat([part, part.new_zeros(pad)]) if pad else part
        return work, torch.empty(work.numel() // self.local_size, dtype=work.dtype, device=work.device)

    def _run(self, flat: torch.Tensor, key: Any = None) -> None:
        """The bucket in chunks (``chunk_bounds``), pipelined: while chunk k's shard is summed across the nodes,
        chunk k+1 is reduce-scattered in the node, and chunk k is gathered back only when ``PIPELINE_DEPTH``
        later chunks are on their way or none is left, so the intra-node phases and the inter-node link
        work at the same time.  Inside a node every element is summed in the same order as in one piece; between
        3 or more nodes gloo and MPI choose their order by the message's size (docs/communication.md).

        A failure between the nodes is raised after every chunk's intra-node phases ran: the other ranks of the
        node wait for them in MPI or gloo, and would wait forever for a rank that stopped half-way."""
        pending: collections.deque = collections.deque()
        errors: list[BaseException] = []
        for entry in self._chunks(flat, key, errors):
            pending.append(entry)
            if len(pending) > 1:
                self._advance(pending[-2], errors)  # int8: its second exchange, while this chunk's first goes
            if len(pending) > PIPELINE_DEPTH:
                self._gather(*pending.popleft(), errors=errors)
        self._drain(list(pending), errors)
        if errors:
            raise errors[0]

    def _drain(self, entries: list[tuple], errors: list[BaseException]) -> None:
        """Gather ``entries`` (``_chunks``'s) in order, advancing int8's second exchange one chunk ahead."""
        for i, entry in enumerate(entries):
            if i + 1 < len(entries):
                self._advance(entries[i + 1], errors)
            self._gather(*entry, errors=errors)

    def _chunks(self, flat: torch.Tensor, key: Any, errors: list[BaseException]) -> Any:
        """Per chunk: its intra-node reduce-scatter, then its sum across the nodes started; yields
        ``(part, work, shard, cross)`` (cross None where starting it failed: in ``errors``)."""
        for index, (lo, hi) in enumerate(chunk_bounds(flat.numel(), self.chunk_elements(flat), self.local_size)):
            part = flat[lo:hi]
            work, shard = self._padded(part)
            self._scatter(work, shard)
            cross = None
            if not errors:  # after a failure between the nodes, only the node's own phases go on
                try:
                    cross = self._start_cross(shard, f"{key}/{index}")
                except Exception as exc:  # noqa: BLE001 - raised once the node's phases are done
                    errors.append(exc)
            yield part, work, shard, cross

    @staticmethod
    def _advance(entry: tuple, errors: list[BaseException]) -> None:
        if isinstance(entry[3], _Int8) and not errors:
            try:
                entry[3].advance()
            except Exception as exc:  # noqa: BLE001 - see _run
                errors.append(exc)

    def chunk_elements(self, flat: torch.Tensor) -> int:
        """Elements per pipelined chunk: ``chunk_bytes`` of ``flat``'s dtype."""
        return max(1, self.chunk_bytes // flat.element_size())

    def _scatter(self, work: torch.Tensor, shard: torch.Tensor) -> None:
        if self.kind == "mpi":
            from mpi4py import MPI

            self.local.Reduce_scatter_block(mpi_buffer(work), mpi_buffer(shard), op=MPI.SUM)
        else:
            self._reduce_scatter(shard, work, group=self._local_group)  # gloo: returns when done

    @property
    def compresses(self) -> bool:
        """Whether this transport applies ``dist.compression`` itself (between the nodes; the reducer does not)."""
        return self.wire is not None

    def _start_cross(self, shard: torch.Tensor, name: str) -> Any:
        """Start the sum of this rank's shard across the nodes; what ``_gather`` waits for (None: one node).
        ``name``: the bucket's key and the chunk's index (int8's residuals)."""
        if self.cross.Get_size() == 1:
            return None
        if self.wire == torch.int8:
            return self._start_int8(shard, name)
        if self.wire is not None:
            import torch.distributed as dist

            wire = shard.to(self.wire)  # the bucket was divided already, so the half-precision sum cannot overflow
            return _Wire(dist.all_reduce(wire, group=self._cross_group, async_op=True), wire, shard)
        if self.cross_kind == "mpi":
            from mpi4py import MPI

            # Progressed by the MPI calls of the next chunks' intra-node phases, then waited for.
            return self.cross.Iallreduce(MPI.IN_PLACE, mpi_buffer(shard), op=MPI.SUM)
        import torch.distributed as dist

        return dist.all_reduce(shard, group=self._cross_group, async_op=True)  # gloo's own threads

    def _start_int8(self, shard: torch.Tensor, name: str) -> "_Int8":
        """int8 between the nodes, in two exchanges (a reduce-scatter and an all-gather, as a ring all-reduce
        moves its data): this rank's shard, plus its residual, is quantized (``compress_with_feedback``) and cut
        into one part per node; an all-to-all gives node j every node's part j, which it dequantizes and sums in
        node order, quantizes again (with a residual of its own) and all-gathers; everyone dequantizes the same
        bytes, so every replica gets the same bits.  Each byte crosses once, as 1.016 bytes an element instead
        of 4 (``_Int8.wait`` does the second half)."""
        import torch.distributed as dist

        nodes = self.cross.Get_size()
        padded = padded_length(shard.numel(), nodes)
        x = shard if padded == shard.numel() else torch.cat([shard, shard.new_zeros(padded - shard.numel())])
        q, scales = compress_with_feedback(x, self.feedback.get(f"{name}/worker", padded, x))
        part = padded // nodes
        nbytes = packed_bytes(part)
        blocks = part // BLOCK
        send = torch.empty(nodes * nbytes, dtype=torch.uint8, device=shard.device)
        for j in range(nodes):
            pack(q[j * part:(j + 1) * part], scales[j * blocks:(j + 1) * blocks], send[j * nbytes:(j + 1) * nbytes])
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self._cross_group, async_op=True)
        return _Int8(self, work, send, recv, shard, name, part)

    def _gather(self, part: torch.Tensor, work: torch.Tensor, shard: torch.Tensor, cross: Any, *,
                errors: list[BaseException]) -> None:
        """Wait for the chunk's sum across the nodes (a failure goes to ``errors``) and all-gather it in the node,
        whatever happened between the nodes (see ``_run``)."""
        try:
            if self.cross_kind == "mpi" and cross is not None:
                cross.Wait()  # an MPI request
            elif cross is not None and not errors:
                cross.wait()  # a gloo work, or _Wire, or _Int8
        except Exception as exc:  # noqa: BLE001 - see _run
            errors.append(exc)
        if self.kind == "mpi":
            self.local.Allgather(mpi_buffer(shard), mpi_buffer(work))
        else:
            self._all_gather(work, shard, group=self._local_group)
        if work is not part:
            part.copy_(work[:part.numel()])

    def start(self, flat: torch.Tensor, key: Any = None) -> Handle:
        """``key``: which bucket (the same every step), naming int8's residuals."""
        if self.size == 1:
            return Done()
        if self.kind == "nccl":
            # Enqueued from this thread, where the bucket's device and stream
            # are current; ordered on the device by enqueue_in_order.
            work, out, last = self._enqueue_phases(flat)
            return _PaddedHandle(TorchHandle(last, stream_ordered=True, keep=(work, out)), flat, work)
        if self.split:
            errors: list[BaseException] = []
            try:
                entries = list(self._chunks(flat, key, errors))
            except Exception as exc:  # noqa: BLE001 - an intra-node phase: reported at wait, agreed in finish
                return Failed(exc)
            return _SplitHandle(self, entries, errors)
        # gloo runs each group's operations on its own threads, so the phases
        # are sequenced by one worker thread (MPI: that thread, or inline).
        return self._progress.run(functools.partial(self._run, key=key), flat)

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


class _Wire:
    """A half-precision sum between the nodes in flight: waiting copies it back into the full-precision shard."""

    def __init__(self, work: Any, wire: torch.Tensor, shard: torch.Tensor) -> None:
        self.work, self.wire, self.shard = work, wire, shard

    def wait(self) -> None:
        self.work.wait()
        self.shard.copy_(self.wire)


class _Int8:
    """int8's exchange between the nodes in flight (``HierarchicalTransport._start_int8``), in two halves:
    ``advance`` sums this node's part once the all-to-all is in, quantizes it again and starts the all-gather;
    ``wait`` writes the gathered parts into the shard.  ``_run`` advances a chunk as soon as the next one's
    all-to-all is on its way, so both exchanges of different chunks share the link."""

    def __init__(self, transport: HierarchicalTransport, work: Any, send: torch.Tensor, recv: torch.Tensor,
                 shard: torch.Tensor, name: str, part: int) -> None:
        self.transport, self.work, self.send, self.recv = transport, work, send, recv
        self.shard, self.name, self.part = shard, name, part
        self.gather: Any = None

    def advance(self) -> None:
        if self.gather is not None:
            return
        transport, part = self.transport, self.part
        self.work.wait()
        nbytes = packed_bytes(part)
        nodes = self.recv.numel() // nbytes
        total = torch.zeros(part, dtype=torch.float32, device=self.shard.device)
        for i in range(nodes):  # in node order: every node sums its part the same way
            add_dequantized(total, *unpack(self.recv[i * nbytes:(i + 1) * nbytes], part))
        q, scales = compress_with_feedback(total, transport.feedback.get(f"{self.name}/server", part, total))
        mine = self.send[:nbytes]  # sent already: reused
        pack(q, scales, mine)
        self.gather = transport._all_gather(self.recv, mine, group=transport._cross_group, async_op=True)

    def wait(self) -> None:
        self.advance()
        self.gather.wait()
        part, nbytes, numel = self.part, packed_bytes(self.part), self.shard.numel()
        for i in range(self.recv.numel() // nbytes):
            lo, hi = i * part, min((i + 1) * part, numel)
            if lo < hi:
                values = dequantize(*unpack(self.recv[i * nbytes:(i + 1) * nbytes], part))
                self.shard[lo:hi].copy_(values[:hi - lo])


class _SplitHandle:
    """A bucket whose intra-node reduce-scatters ran and whose sums across the nodes are on their way
    (``HierarchicalTransport.split``); waiting gathers its chunks in order (and advances int8's second exchange
    one chunk ahead), then raises the first failure, if any, once every intra-node phase ran."""

    def __init__(self, transport: HierarchicalTransport, entries: list[tuple], errors: list[BaseException]) -> None:
        self.transport, self.entries, self.errors = transport, entries, errors

    def wait(self, timeout_s: float) -> None:
        entries, errors = self.entries, self.errors
        self.entries = []
        self.transport._drain(entries, errors)
        if errors:
            raise as_comm_failure(errors[0]) from errors[0]


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
