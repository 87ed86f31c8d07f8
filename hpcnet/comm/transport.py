"""Transports: how one flat gradient bucket is summed across ranks.

Each transport starts a sum-all-reduce of a 1-d tensor in place and returns a
handle whose ``wait`` finishes it.  Four kinds:

- ``TorchTransport``: ``torch.distributed.all_reduce(async_op=True)`` on a
  NCCL or gloo group; NCCL and gloo progress on their own threads.
- ``MpiTransport``: ``MPI_Allreduce`` on the tensor's memory (no copy), on a
  private communicator, progressed one of two ways (``dist.progress``):
  ``thread``: from one worker thread per transport, so it runs while autograd
  computes the next gradients (mpi4py releases the GIL in MPI calls; MPI is
  initialised with ``MPI_THREAD_MULTIPLE``; Open MPI progresses non-blocking
  collectives only inside MPI calls, which is why a thread and not
  ``Iallreduce``); ``inline``: in the caller (the reducer's ``finish``), for a rank
  with no core to spare for a worker: the hand-off to a thread and back, and
  a busy-polling thread on the core that computes, cost more than the overlap
  gains there (measured in the README, Communication).
- ``ShmTransport`` (``hpcnet.comm.shm``): buckets in a node-shared MPI
  window, each rank summing its slice of them; MPI across nodes.
- ``HierarchicalTransport``: reduce-scatter inside the node, all-reduce of
  each shard among the ranks with the same local rank on other nodes, then
  all-gather inside the node, so each byte crosses the inter-node network
  once per node rather than once per rank.
"""

import concurrent.futures
import datetime
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import torch

from hpcnet.comm.world import World


class CommFailure(RuntimeError):
    """A collective of the data plane failed or timed out on some rank."""


class Handle(Protocol):
    def wait(self, timeout_s: float) -> None:
        """Finish the operation; raise CommFailure after ``timeout_s`` seconds."""


class Transport(Protocol):
    name: str
    synchronous: bool
    """``start`` returns after the collective finished (its handle only reports the outcome)."""

    def start(self, flat: torch.Tensor) -> Handle: ...

    def close(self) -> None: ...


class Done:
    """The handle of an operation that already finished (one rank, or synchronous)."""

    def wait(self, timeout_s: float) -> None:
        return None


class _TorchHandle:
    """A torch.distributed work.

    ``stream_ordered`` (NCCL): ``wait`` makes the current CUDA stream wait
    for the work and returns at once, so what the caller enqueues next on
    that stream (dividing the bucket, copying it out) runs after the
    collective.  No CPU timeout: ``work.wait(timeout)`` on a NCCL work spins
    a CPU thread until the work is done; the timeout is the group's own
    (``dist.timeout_s``, given when the group is created), enforced by NCCL's
    watchdog, which aborts the communicator.
    """

    def __init__(self, work: Any, *, stream_ordered: bool = False, keep: tuple[Any, ...] = ()) -> None:
        self.work = work
        self.stream_ordered = stream_ordered
        self.keep = keep  # buffers the enqueued collectives still use

    def wait(self, timeout_s: float) -> None:
        if self.stream_ordered:
            try:
                self.work.wait()
            except RuntimeError as exc:  # the watchdog already saw it fail or time out
                raise CommFailure(f"all-reduce failed: {exc}") from exc
            return
        try:
            ok = self.work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # gloo/NCCL errors and timeouts
            raise CommFailure(f"all-reduce failed: {exc}") from exc
        if ok is False:
            raise CommFailure(f"all-reduce did not finish within {timeout_s:.0f} s")


def _as_comm_failure(exc: BaseException) -> CommFailure:
    """An error of a collective as the CommFailure the reducer agrees on (itself when it is one)."""
    if isinstance(exc, CommFailure):
        return exc
    return CommFailure(f"all-reduce failed: {type(exc).__name__}: {exc}")


class _FutureHandle:
    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future

    def wait(self, timeout_s: float) -> None:
        try:
            self.future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise CommFailure(f"all-reduce did not finish within {timeout_s:.0f} s") from None
        except Exception as exc:  # MPI errors raised in the worker
            raise _as_comm_failure(exc) from exc


class TorchTransport:
    """All-reduce over a torch.distributed process group (NCCL on GPU, gloo on CPU)."""

    def __init__(self, group: Any, backend: str, size: int) -> None:
        self.group = group
        self.name = backend
        self.size = size
        self.synchronous = size == 1

    def start(self, flat: torch.Tensor) -> Handle:
        import torch.distributed as dist

        if self.size == 1:
            return Done()
        return _TorchHandle(dist.all_reduce(flat, group=self.group, async_op=True),
                            stream_ordered=self.name == "nccl")

    def close(self) -> None:
        self.group = None


def _mpi_buffer(flat: torch.Tensor) -> Any:
    """The tensor's memory as an MPI buffer, without a copy.

    CPU tensors go through numpy; CUDA tensors (CUDA-aware MPI only) through
    ``__cuda_array_interface__``, which mpi4py reads directly.
    """
    return flat.numpy() if flat.device.type == "cpu" else flat


class Failed:
    """The handle of a synchronous operation that raised: ``wait`` raises it as a CommFailure."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def wait(self, timeout_s: float) -> None:
        raise _as_comm_failure(self.exc) from self.exc


class _DaemonWorker:
    """One daemon thread running submitted calls in order, each resolving a Future.

    Not a ThreadPoolExecutor: the interpreter joins those workers at exit, so a
    worker left in a collective that will never finish (its peers failed or
    gave up) would hang the process after training ended.  A daemon thread is
    abandoned at exit instead, and ``MPI_Finalize`` or ``MPI_Abort`` ends it.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, arg = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(arg))
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
                future.set_exception(exc)

    def submit(self, fn: Callable[[Any], Any], arg: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, arg))
        return future

    def close(self) -> None:
        """Stop after the call in progress; calls not yet started are cancelled."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        self._jobs.put(None)


class Progress:
    """Where a transport's MPI collectives run: a worker thread (``thread``) or the caller (``inline``)."""

    def __init__(self, mode: str, prefix: str) -> None:
        if mode not in ("thread", "inline"):
            raise ValueError(f"progress must be 'thread' or 'inline', not {mode!r}")
        self._worker = _DaemonWorker(prefix) if mode == "thread" else None

    @property
    def synchronous(self) -> bool:
        return self._worker is None

    def run(self, fn: Callable[[torch.Tensor], None], flat: torch.Tensor) -> Handle:
        if self._worker is not None:
            return _FutureHandle(self._worker.submit(fn, flat))
        try:
            fn(flat)
        except Exception as exc:  # noqa: BLE001 - reported at wait, after the ranks agree (see wait_all)
            return Failed(exc)
        return Done()

    def close(self) -> None:
        # A worker stuck in a collective that will never finish cannot be
        # joined; it is a daemon, left behind rather than hanging the caller.
        if self._worker is not None:
            self._worker.close()


class MpiTransport:
    """All-reduce with MPI, in submission order, from a worker thread or inline (``progress``)."""

    name = "mpi"

    def __init__(self, comm: Any, progress: str = "thread") -> None:
        self.comm = comm.Dup()  # its own message space: never matched against other traffic
        self.size = self.comm.Get_size()
        self._progress = Progress(progress, "hpcnet-mpi-allreduce")

    @property
    def synchronous(self) -> bool:
        """True when ``start`` returns after the collective finished (inline progress, or one rank)."""
        return self.size == 1 or self._progress.synchronous

    def _allreduce(self, flat: torch.Tensor) -> None:
        from mpi4py import MPI

        self.comm.Allreduce(MPI.IN_PLACE, _mpi_buffer(flat), op=MPI.SUM)

    def start(self, flat: torch.Tensor) -> Handle:
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

            self.comm.Reduce_scatter(_mpi_buffer(buffer), _mpi_buffer(out), recvcounts=counts, op=MPI.SUM)

        return self._progress.run(reduce_scatter, flat)

    def close(self) -> None:
        self._progress.close()


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
        self._progress = Progress(progress if kind == "mpi" else "thread", "hpcnet-hier-allreduce")
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

            self.local.Reduce_scatter_block(_mpi_buffer(work), _mpi_buffer(out), op=MPI.SUM)
            if self.cross.Get_size() > 1:
                self.cross.Allreduce(MPI.IN_PLACE, _mpi_buffer(out), op=MPI.SUM)
            self.local.Allgather(_mpi_buffer(out), _mpi_buffer(work))
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
            return _PaddedHandle(_TorchHandle(last, stream_ordered=True, keep=(work, out)), flat, work)
        # gloo runs each group's operations on its own threads, so the phases
        # are sequenced by one worker thread (MPI: that thread, or inline).
        return self._progress.run(self._run, flat)

    def close(self) -> None:
        self._progress.close()
        for comm in (self.local, self.cross):
            comm.Free()


def build_transport(kind: str, hierarchical: bool, comm: Any, world: World, *,
                    timeout_s: float | None = None, progress: str = "thread") -> Transport:
    """Create a transport over the ranks of ``comm`` (collective).

    ``timeout_s`` (``dist.timeout_s``; None: torch's default) is given to
    every torch.distributed group created here: NCCL enforces it in its own
    watchdog, so nothing waits on a NCCL work with a CPU timeout (see
    the ``_TorchHandle`` docstring).  ``progress`` ('thread' or 'inline',
    ``hpcnet.comm.plan.mpi_progress``) says where MPI collectives run.
    """
    if kind == "shm":
        from hpcnet.comm.shm import ShmTransport

        return ShmTransport(comm, world)  # hierarchical by construction: shared memory in a node, MPI across
    if hierarchical and world.size > 1:
        return HierarchicalTransport(comm, node_index=world.node_index, local_rank=world.local_rank, kind=kind,
                                     timeout_s=timeout_s, progress=progress)
    if kind == "mpi":
        return MpiTransport(comm, progress)
    import torch.distributed as dist

    if world.size == 1:
        return TorchTransport(None, kind, 1)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    group = dist.group.WORLD if dist.get_backend() == kind else dist.new_group(backend=kind, timeout=timeout)
    return TorchTransport(group, kind, world.size)


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
            last.wait()  # a stream wait, not a CPU wait (no timeout: see _TorchHandle)
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


class FaultyTransport:
    """Fault injection: the wrapped transport's result fails on chosen ranks at one step.

    The collective itself still runs (so no rank is left inside it); the
    chosen ranks then report an error, as a NCCL error seen by one rank would.
    """

    def __init__(self, inner: Transport, *, fail: bool) -> None:
        self.inner = inner
        self.name = inner.name
        self.synchronous = inner.synchronous
        self.allocate = getattr(inner, "allocate", None)  # buckets in the inner transport's memory (shm)
        self.fail = fail
        self.armed = False
        if getattr(inner, "start_reduce_scatter", None) is not None:
            self.start_reduce_scatter = self._start_reduce_scatter

    def start(self, flat: torch.Tensor) -> Handle:
        return self._maybe_failing(self.inner.start(flat))

    def _start_reduce_scatter(self, flat: torch.Tensor, counts: list[int], out: torch.Tensor) -> Handle:
        return self._maybe_failing(self.inner.start_reduce_scatter(flat, counts, out))

    def _maybe_failing(self, handle: Handle) -> Handle:
        if self.armed and self.fail:
            return _FailingHandle(handle)
        return handle

    def close(self) -> None:
        self.inner.close()

    def abandon(self) -> None:
        abandon(self.inner)


def abandon(transport: Any) -> None:
    """Let go of ``transport`` without waiting for the other ranks: its ``abandon`` (shm: windows are freed
    collectively) or, where closing is local, its ``close``."""
    getattr(transport, "abandon", transport.close)()


class _FailingHandle:
    def __init__(self, inner: Handle) -> None:
        self.inner = inner

    def wait(self, timeout_s: float) -> None:
        self.inner.wait(timeout_s)
        raise CommFailure("injected communication failure (dist.fail_at_step)")


def succeeded(handle: Handle | None) -> bool:
    """True when ``handle``'s operation is known to have finished without an error here (never waits): a
    synchronous one that did not raise, or a worker thread's that returned. Others (torch works, failed or
    injected ones) answer False and are left to ``wait``."""
    if isinstance(handle, Done):
        return True
    if isinstance(handle, _FutureHandle):
        future = handle.future
        return future.done() and not future.cancelled() and future.exception() is None
    return False


def wait_all(handles: list[Handle], timeout_s: float,
             on_done: Callable[[int], None] | None = None) -> BaseException | None:
    """Wait for every handle (``timeout_s`` in all); return the first error instead of raising.

    The caller shares the outcome with the other ranks before raising, so a
    failure seen by one rank becomes the same failure on every rank.
    ``on_done(i)`` is called when the wait for ``handles[i]`` returns.
    """
    deadline = time.monotonic() + timeout_s
    error: BaseException | None = None
    for i, handle in enumerate(handles):
        try:
            handle.wait(max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the caller
            error = error or exc
        if on_done is not None:
            on_done(i)
    return error
