"""What every transport shares: the base classes, their handles, where MPI collectives run, and waiting for them.

A transport (``Transport``) starts a sum-all-reduce of a 1-d tensor in place and returns a handle whose ``wait``
finishes it; ``wait_all`` waits for a step's handles and returns the first error instead of raising, so the
caller can agree on it with the other ranks first.  What only some transports offer (buckets in their own
memory, a reduce-scatter, compression of their own) is declared on the base class, off by default, so a caller
asks a flag and never probes for a method.

A group gather (``GroupGather``) moves stage 3's parameters: in one round each rank receives the units of the
group it wants from their owners and sends its own units of the group each other rank wants
(``hpcnet.comm.sharding.rounds`` decides, round by round, who wants what).
"""

import abc
import atexit
import concurrent.futures
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class CommFailure(RuntimeError):
    """A collective of the data plane failed or timed out on some rank."""


class Handle(Protocol):
    """An all-reduce in flight, as a transport's ``start`` returns it."""

    def wait(self, timeout_s: float) -> None:
        """Finish the operation; raise CommFailure after ``timeout_s`` seconds."""


class Transport(abc.ABC):
    """How one bucket is summed across ranks.  Every transport starts an in-place sum-all-reduce of a flat tensor
    (``start``) and closes; what only some offer is declared below, off unless a subclass turns it on and
    implements what goes with it."""

    name: str
    synchronous: bool = False
    """``start`` returns after the collective finished (its handle only reports the outcome)."""
    blocking_start: bool = False
    """``start`` runs a collective in the caller that returns only once every peer has reached it (a synchronous
    transport, or the intra-node phases of a hierarchical one): a caller must not start it where a peer may be
    waiting for this rank in another collective (``Reducer.pace``)."""
    compresses: bool = False
    """The transport applies ``dist.compression`` itself (a hierarchical transport with gloo between the nodes,
    there only): the reducer hands it full-precision buckets."""
    chunk_bytes: int | None = None
    """The chunks a bucket is pipelined in (a hierarchical transport); None: each bucket goes whole."""
    keeps_buckets: bool = False
    """The buckets live in the transport's memory (shm's node-shared window): the reducer makes them with
    ``allocate`` and keeps them from step to step, and ``start`` refuses a tensor of other memory."""
    reduce_scatters: bool = False
    """``start_reduce_scatter`` is offered: ``dist.zero=2`` then receives each rank's own sums only."""

    @abc.abstractmethod
    def start(self, flat: torch.Tensor, key: Any = None) -> Handle:
        """Start the sum of ``flat``; ``key`` names the bucket (the same every step) for a transport that keeps
        state per bucket (int8's residuals, ``HierarchicalTransport``); the others ignore it."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free what the transport holds (collective where that is: shm's windows)."""

    def abandon(self) -> None:
        """Let go without waiting for the other ranks (an error raised on this rank alone is propagating): a
        transport whose close is local closes; one whose close is collective (shm) overrides this."""
        self.close()

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed bucket of ``numel`` elements in the transport's memory; offered only where ``keeps_buckets``."""
        raise NotImplementedError(f"the {self.name} transport keeps no buckets of its own (keeps_buckets is False)")

    def start_reduce_scatter(self, flat: torch.Tensor, counts: list[int], out: torch.Tensor) -> Handle:
        """Sum ``flat`` across ranks; rank r receives elements ``[sum(counts[:r]), +counts[r])`` of the sum in
        ``out``; ``flat`` is left as scratch.  Offered only where ``reduce_scatters``."""
        raise NotImplementedError(f"the {self.name} transport offers no reduce-scatter (reduce_scatters is False)")


class Done:
    """The handle of an operation that already finished (one rank, or synchronous)."""

    def wait(self, timeout_s: float) -> None:
        return None


class Failed:
    """The handle of a synchronous operation that raised: ``wait`` raises it as a CommFailure."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def wait(self, timeout_s: float) -> None:
        raise as_comm_failure(self.exc) from self.exc


def as_comm_failure(exc: BaseException) -> CommFailure:
    """An error of a collective as the CommFailure the reducer agrees on (itself when it is one)."""
    if isinstance(exc, CommFailure):
        return exc
    return CommFailure(f"all-reduce failed: {type(exc).__name__}: {exc}")


class FutureHandle:
    """A handle over a ``concurrent.futures.Future`` (an all-reduce run on a worker thread)."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future

    def wait(self, timeout_s: float) -> None:
        try:
            self.future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise CommFailure(f"all-reduce did not finish within {timeout_s:.0f} s") from None
        except Exception as exc:  # MPI errors raised in the worker
            raise as_comm_failure(exc) from exc


class _DaemonWorker:
    """One daemon thread running submitted calls in order, each resolving a Future.

    Not a ThreadPoolExecutor: the interpreter joins those workers at exit, so a
    worker left in a collective that will never finish (its peers failed or
    gave up) would hang the process after training ended.  A daemon thread is
    abandoned at exit instead; ``release_workers`` then keeps ``MPI_Finalize``
    from running while it is still inside MPI.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.in_call = False
        """A submitted call is running (for a worker that cannot be joined: inside a collective)."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        _WORKERS.add(self)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, arg = job
            if not future.set_running_or_notify_cancel():
                continue
            self.in_call = True
            try:
                future.set_result(fn(arg))
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
                future.set_exception(exc)
            finally:
                self.in_call = False

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

    def stuck(self, timeout_s: float) -> bool:
        """Close, and wait up to ``timeout_s`` for the thread to end; True when it is still inside a call."""
        self.close()
        self._thread.join(timeout_s)
        return self._thread.is_alive() and self.in_call


_WORKERS: "weakref.WeakSet[_DaemonWorker]" = weakref.WeakSet()

RELEASE_WAIT_S = 2.0
"""How long ``release_workers`` lets a worker finish the call in progress (at exit nothing healthy is in flight)."""


def release_workers(timeout_s: float = RELEASE_WAIT_S) -> bool:
    """Stop every worker thread before ``MPI_Finalize``; True when one stays inside a collective that will never
    finish (its peers failed or gave up on it).

    ``MPI_Finalize`` while another thread waits in a collective crashes Open MPI 4.1 (it frees what that thread is
    polling), and MPI offers no way to take a thread out of a blocking collective (docs/communication.md, "Where
    MPI collectives run"). So a process with such a worker must end without ``MPI_Finalize``: ``hpcnet.train``
    then ends with ``os._exit`` and its status, any other program at exit with ``STUCK_EXIT``.
    """
    return any([worker.stuck(timeout_s) for worker in list(_WORKERS)])  # a list: every worker is closed


STUCK_EXIT = 1
"""The status of a program whose worker thread is stuck in a collective at exit (``_exit_if_stuck``)."""


def _exit_if_stuck() -> None:
    """At exit (Python's exit handlers run before mpi4py's ``MPI_Finalize``): end the process without finalizing
    MPI when a worker thread is stuck inside a collective (``release_workers``)."""
    if not _WORKERS or not release_workers():
        return
    print("hpcnet: a worker thread is still inside an MPI collective that its peers abandoned; ending without "
          f"MPI_Finalize (which would crash), status {STUCK_EXIT}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(STUCK_EXIT)


atexit.register(_exit_if_stuck)


class CollectiveExecutor:
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
            return FutureHandle(self._worker.submit(fn, flat))
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


def mpi_buffer(flat: torch.Tensor) -> Any:
    """The tensor's memory as an MPI buffer, without a copy.

    CPU tensors go through numpy; CUDA tensors (CUDA-aware MPI only) through
    ``__cuda_array_interface__``, which mpi4py reads directly.
    """
    return flat.numpy() if flat.device.type == "cpu" else flat


def succeeded(handle: Handle | None) -> bool:
    """True when ``handle``'s operation is known to have finished without an error here (never waits): a
    synchronous one that did not raise, or a worker thread's that returned. Others (torch works, failed or
    injected ones) answer False and are left to ``wait``."""
    if isinstance(handle, Done):
        return True
    if isinstance(handle, FutureHandle):
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


WANTS_NOTHING = -1
"""The want of a rank that needs no group in a gather round."""


@dataclass(eq=False)
class GatherGroup:
    """A group of units that gather rounds move together (stage 3: one block's parameters, or the root's)."""

    index: int
    buffer: torch.Tensor
    """uint8, the group's memory: it exists while the group is gathered, and may move between two gathers."""
    units: list[int]
    """The units, as indices into the gather's ``tensors`` and ``owner``."""
    offsets: list[int]
    """Each unit's byte offset in ``buffer``."""
    places: list[torch.Tensor]
    """Each unit's place in ``buffer``, shaped as its tensor (views of the buffer's storage: valid while it moves)."""


class GroupGather(abc.ABC):
    """Moves units between ranks in rounds: in each, every rank receives the units of the group it wants from their
    owners and sends its own units of the group each other rank wants (one implementation a backend).

    Args:
        comm: the ranks.
        groups: the groups, by index.
        tensors: each unit's values (memory on its owner only); the same tensor objects for the gather's life.
        owner: each unit's owner rank (``set_owner`` changes it).
    """

    name: str

    def __init__(self, comm: Any, groups: list[GatherGroup], tensors: list[torch.Tensor], owner: list[int]) -> None:
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.groups, self.tensors, self.owner = groups, tensors, list(owner)

    def set_owner(self, owner: list[int]) -> None:
        self.owner = list(owner)

    def start(self, wants: Sequence[int]) -> "GatherHandle | None":
        """Start a round's traffic (collective: every rank, once any rank wants a group; or one rank alone):
        ``wants[r]`` is the group rank r wants, or ``WANTS_NOTHING``.  This rank's own units of the group it wants
        are copied into their places first; the rest moves between the ranks (``send_and_receive``); None where
        nothing else moves (one rank)."""
        want = wants[self.rank]
        if want != WANTS_NOTHING:
            g = self.groups[want]
            with torch.no_grad():
                for k, place in zip(g.units, g.places):
                    if self.owner[k] == self.rank:
                        place.copy_(self.tensors[k])
        return self.send_and_receive(wants) if self.size > 1 else None

    @abc.abstractmethod
    def send_and_receive(self, wants: Sequence[int]) -> "GatherHandle":
        """Start moving each rank's units of the group each other rank wants to that rank (the group wanted here
        must have its memory)."""

    @abc.abstractmethod
    def close(self, collective: bool) -> None:
        """Free what the gather holds; ``collective`` (every rank closes): what freeing waits for the others for too."""


class GatherHandle(Protocol):
    """A round's traffic in flight, as ``GroupGather.start`` returns it."""

    def wait(self) -> None:
        """Finish it (no timeout: a round that never ends is a stall the monitor reports)."""
