"""Bucketed gradient all-reduce, overlapped with the backward pass.

Parameters are packed, in reverse registration order (the last layers'
gradients are ready first), into flat buckets: a bucket is closed as soon as
it holds at least ``bucket_bytes`` (a smaller first bucket starts
communication early), so a large tensor goes out with the tensors before it
and never waits for the next layer's, as in DDP.

Gradients are handed over, not accumulated: ``zero_grad`` sets every
``.grad`` to None, autograd then gives each parameter the tensor it computed
(no zeroing pass, no read-modify-write), and the post-accumulate-grad hook
writes it, times 1/world size, into the parameter's place in its bucket in
one pass (a bucket of one whole parameter on the CPU takes autograd's tensor
itself as its buffer, scaled in place: no copy at all) (DDP divides before the sum as well; for a world size that is a
power of two the result is the same bits as dividing after) and sets
``.grad`` to None again; the bucket view becomes the parameter's ``.grad``
when the sum is in (``finish``).  When a bucket is complete it is handed to
an asynchronous transport (a worker thread, NCCL, gloo) at once, in bucket
order on every rank, while autograd goes on with earlier layers.

A parameter's gradient can arrive more than once in one backward: reentrant
activation checkpointing (``checkpoint(..., use_reentrant=True)``) runs a
backward per segment, so a layer shared by several segments (ALBERT) gets
its hook once per segment. (Uses within one graph, weight tying or a layer
applied twice, and non-reentrant checkpointing arrive once: autograd adds
them up before the hook.)  As ``.grad`` is None after each fold, a later
arrival is a fresh tensor, and is added, times 1/world size, into the
bucket view: with scaling exact (a power-of-two world size) that is the
bits of folding autograd's own sum once.  A parameter is complete after as
many arrivals as it had in earlier backwards (learned, the most seen), and
its bucket goes out only then.  An arrival after its bucket went out (the
first backward that shows it) cannot be added to a sum in flight: it is
dropped, the count learned, and ``finish`` raises ``LateGradient`` on every
rank; ``DataParallel`` redoes the step, which then waits for it.

With a synchronous transport (inline MPI, shm: the collective runs in the
caller) the buckets are summed in ``finish``, one after the other.

``finish()`` (before the optimizer step) agrees over the MPI control plane
that every rank completed the same buckets, waits for them (or runs them),
and agrees on the outcome: a failure on any rank raises ``CommFailure`` on
every rank, so the trainer can switch transport and redo the step.
"""

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from hpcnet.agree import mark_agreed
from hpcnet.comm.buckets import Bucket, bucket_layout
from hpcnet.comm.sharding.placement import Placement, ReplicatedGradients
from hpcnet.comm.transport import CommFailure, FaultyTransport, Transport, succeeded, wait_all
from hpcnet.fault.flightrec import NULL_RECORDER

log = logging.getLogger(__name__)


class LateGradient(RuntimeError):
    """A parameter's gradient arrived again after its bucket had been sent (agreed: raised on every rank).

    The step's gradients are wrong; the reducer has learned the count and waits for it from the next backward
    on, so a redone step is right (``DataParallel.step`` redoes it)."""


@dataclass
class ReducerStats:
    """Counters shown in the run summary."""

    steps: int = 0
    bytes_reduced: int = 0
    fallbacks: list[dict[str, Any]] = field(default_factory=list)
    comm_s: list[float] = field(default_factory=list)
    """Each step's all-reduce, from its first bucket sent to every sum in (``finish``), seconds; the last
    ``SPANS_KEPT`` steps."""


SPANS_KEPT = 1000


class Reducer:
    """Average gradients across ranks, bucket by bucket, during backward.

    Args:
        named_params: the model's ``named_parameters()``.
        transport: how a bucket is summed across ranks.
        control: the MPI communicator of the same ranks (control plane).
        bucket_bytes: bucket size cap.
        first_bucket_bytes: cap of the first (last-layer) bucket; 0 = same as the others.
        compression: None, torch.float16 or torch.bfloat16 for the wire format.
        find_unused: treat parameters that get no gradient in a step as zero
            gradients instead of raising.
        timeout_s: how long ``finish`` waits for the collectives.
        recorder: the flight recorder (``hpcnet.fault.flightrec``) the collectives are logged to.
        placement: where a bucket's sums go, the one thing that differs between the ``dist.zero`` stages
            (``hpcnet.comm.sharding.placement``): ``ReplicatedGradients`` (the default, stages 0 and 1) or
            ``ShardedGradients`` (stages 2 and 3: each rank keeps only the sums of the units it owns; a cut
            parameter's rows go to their owners apart, and the gradient of its rows lands on the unit's tensor,
            never on the parameter).
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], transport: Transport, control: Any, *,
                 bucket_bytes: int = 25 * 2**20, first_bucket_bytes: int = 2**20,
                 compression: torch.dtype | None = None, find_unused: bool = False, timeout_s: float = 600.0,
                 recorder: Any = NULL_RECORDER, placement: Placement | None = None):
        self.recorder = recorder
        self.control = control
        self.world_size = control.Get_size()
        self.compression = compression
        self.find_unused = find_unused
        self.timeout_s = timeout_s
        self.stats = ReducerStats()
        from mpi4py import MPI

        self._max_op, self._in_place = MPI.MAX, MPI.IN_PLACE  # looked up once: finish runs every step
        # finish's one control exchange, reused: [failed, lacked a gradient, a late arrival, a repeated arrival]
        self._outcome = np.zeros(4, dtype=np.int8)
        self._sync = True
        self._next_launch = 0
        self._paced = False  # ``pace``
        self._hooks: list[Any] = []
        self._uses: dict[nn.Parameter, int] = {}  # arrivals that complete a parameter, where more than one
        self._late: list[str] = []  # parameters whose gradient arrived after their bucket went out, this backward
        self._repeated = False  # a parameter's gradient arrived more than once here this backward
        self._repeats = False  # ... on some rank in some step (agreed): such a model may vary the count
        self._completed = False  # a step has completed
        named = [(n, p) for n, p in named_params if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        self.rank = control.Get_rank()
        self.placement: Placement = placement if placement is not None else ReplicatedGradients()
        self._set_transport(transport)
        self._named = named
        self._bucket_bytes_cap, self._first_bucket_bytes = bucket_bytes, first_bucket_bytes
        self._build_buckets()
        for _, p in named:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._scale = 1.0 / self.world_size
        self._bucket_bytes = sum(b.nbytes for b in self.buckets)
        self.zero_grad()
        self._reset()

    def _build_buckets(self) -> None:
        """Lay the trainable parameters out in buckets, as the placement orders their entries."""
        named = self._named
        # One dtype/device per bucket: a layout per (device, dtype) group.
        groups: dict[tuple[Any, Any], list[int]] = {}
        for i, (_, p) in enumerate(named):
            groups.setdefault((p.device, p.dtype), []).append(i)
        self.buckets: list[Bucket] = []
        for members in groups.values():
            sizes = [named[i][1].numel() * named[i][1].element_size() for i in members]
            for indices in bucket_layout(sizes, self._bucket_bytes_cap, self._first_bucket_bytes):
                params = [named[members[j]][1] for j in indices]
                names = [named[members[j]][0] for j in indices]
                entries = [(j, *entry) for j, m in enumerate(indices)
                           for entry in self.placement.entries(members[m], named[members[m]][1])]
                entries = self.placement.order(entries)
                offsets = np.cumsum([0] + [entry[2].numel() for entry in entries]).tolist()
                # Buckets that are dropped are made by the first fold of each backward.
                buffer = (params[0].new_empty(0) if self.placement.drops_buckets
                          else self._new_buffer(offsets[-1], params[0]))
                bucket = Bucket(len(self.buckets), params, names, buffer, offsets)
                bucket.expected = [self._uses.get(p, 1) for p in params]
                bucket.entry_param = [entry[0] for entry in entries]
                bucket.entry_unit = [entry[1] for entry in entries]
                bucket.entry_tensor = [entry[2] for entry in entries]
                bucket.entry_rows = [entry[3] for entry in entries]
                bucket.single = (len(entries) == 1 and entries[0][3] is None and params[0].device.type == "cpu"
                                 and params[0].is_contiguous())
                bucket.empty = params[0].new_empty(0)
                bucket.of_param = [[] for _ in params]
                for e, j in enumerate(bucket.entry_param):
                    bucket.of_param[j].append(e)
                self.placement.attach(bucket)
                self.buckets.append(bucket)
                bucket.make_views()
        self._bucket_of: dict[nn.Parameter, tuple[Bucket, int]] = {
            p: (bucket, j) for bucket in self.buckets for j, p in enumerate(bucket.params)}

    def reassign(self, owners: list[int]) -> None:
        """dist.zero=2: new owners, between steps; every gradient is dropped.

        Buckets in the transport's memory (shm's window) keep dist.zero=0's layout, so only the owned sums are
        made again; plain buckets are laid out again (owner by owner where the transport reduce-scatters).
        """
        self.placement.set_owners(owners)
        self.zero_grad()
        if not self.transport.keeps_buckets:
            self._build_buckets()
        else:
            for bucket in self.buckets:
                self.placement.assign(bucket)
        self._reset()

    def set_share(self, share: float) -> None:
        """The weight of this rank's gradients in the sum: its fraction of the global batch (1/world size unless
        ``data.balance`` gives the ranks slices of unequal size), so the sum is the mean over the global batch."""
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self._scale = share

    def _set_transport(self, transport: Transport) -> None:
        self.transport = transport
        # Fixed for a transport's life; read a few times a step, and a property chain costs microseconds here.
        self._synchronous = transport.synchronous
        self.placement.set_transport(transport)
        # A placement that drops buckets (dist.zero=2): each goes out as soon as it is complete, even on a
        # synchronous transport, and is dropped once its sum is in, so the whole gradient is never alive at
        # once (the stage's memory saving); see ``_launch_ready``.
        self._release_early = self.placement.releases_early
        # Whether the hooks send buckets before backward ends (else finish sends them all).
        self._early = not self._synchronous or self.world_size == 1 or self._release_early
        # dist.zero=3 where starting a bucket waits for the peers: it goes out where every rank meets (``pace``).
        self.pacing = self._paced and transport.blocking_start and self._early and self.world_size > 1
        # A transport that compresses between nodes only (hierarchical, gloo there) gets full-precision buckets.
        self._wire = None if transport.compresses else self.compression

    @property
    def may_redo(self) -> bool:
        """Whether the next step may end in ``LateGradient`` (the same on every rank): the hooks send buckets before
        backward ends, and no step has completed yet or some parameter has been seen to get its gradient more
        than once in one backward (such a model may vary the count)."""
        return self._early and (not self._completed or self._repeats)

    def _new_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A zeroed bucket: in the transport's memory when it keeps buckets (shm's shared window), else plain."""
        if self.transport.keeps_buckets and like.device.type == "cpu":
            return self.transport.allocate(numel, like.dtype)
        return torch.zeros(numel, dtype=like.dtype, device=like.device)

    def _rehome(self) -> None:
        """Move the buckets (and the gradients viewing them) out of the transport's memory, before it is freed."""
        if not self.transport.keeps_buckets:
            return
        for bucket in self.buckets:
            old = bucket.buffer
            start, end = old.data_ptr(), old.data_ptr() + old.numel() * old.element_size()
            bucket.buffer = old.clone()
            bucket.make_views()
            for e, t in enumerate(bucket.entry_tensor):
                if t.grad is not None and start <= t.grad.data_ptr() < end:
                    t.grad = bucket.views[e]

    # -- folding gradients into buckets ----------------------------------------
    def _fold(self, bucket: Bucket, j: int) -> None:
        """Write parameter j's gradient, times 1/world size, into its bucket view (one pass) and drop ``.grad``
        (the view becomes it when the sum is in, ``_release``; a later arrival in this backward is then a tensor
        of its own, ``_fold_more``).  No gradient: zeros (an unused parameter).  A cut parameter's rows go to
        their entries (its units' tensors get their sums)."""
        p, entries = bucket.params[j], bucket.of_param[j]
        if self._adoptable(bucket, p):
            self._adopt(bucket, p)
            return
        if not bucket.views and bucket.offsets[-1]:  # let go between steps (_let_go; dist.zero=2 drops them all)
            bucket.buffer = torch.empty(bucket.offsets[-1], dtype=p.dtype, device=p.device)
            bucket.make_views()  # every element is written by the folds
        if bucket.entry_rows[entries[0]] is not None:
            self._fold_rows(bucket, p, entries)
            return
        view = bucket.views[entries[0]]
        grad = p.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == view.data_ptr():  # gradients accumulated into the last step's (no zero_grad)
            if self._scale != 1.0:
                view.mul_(self._scale)
        elif self._scale != 1.0:
            torch.mul(grad, self._scale, out=view)
        else:
            view.copy_(grad)
        p.grad = None

    def _adoptable(self, bucket: Bucket, p: nn.Parameter) -> bool:
        """Whether the bucket can be parameter ``p``'s gradient itself instead of a copy of it: the bucket holds
        ``p`` whole and alone, the placement lets the reducer choose the buffer (not shm's window), and autograd
        handed over a dense CPU tensor of ``p``'s layout that nothing differentiates through."""
        grad = p.grad
        return (bucket.single and self.placement.adopts and grad is not None and not grad.requires_grad
                and grad.is_contiguous() and grad.dtype == p.dtype and grad.shape == p.shape
                and grad.device.type == "cpu")

    def _adopt(self, bucket: Bucket, p: nn.Parameter) -> None:
        """The bucket becomes ``p``'s gradient, scaled in place: no copy (a bucket of one large parameter,
        summed in place as a hand-written ``Allreduce`` of ``.grad`` would be).  Autograd handed the tensor over
        (``AccumulateGrad`` keeps a gradient no other tensor refers to, else a copy), so scaling it in place
        changes nothing else; the last step's buffer is let go.  CPU only: on a GPU the copy costs little, and
        a tensor allocated on the backward's stream would need its uses on the collective's stream recorded."""
        grad = p.grad
        if self._scale != 1.0:
            grad.mul_(self._scale)  # the same bits as torch.mul(grad, scale, out=view)
        bucket.buffer = grad.view(-1)
        bucket.views = [grad]
        p.grad = None

    def _let_go(self, bucket: Bucket) -> None:
        """``zero_grad`` of a bucket that may adopt: its buffer (the last gradient) is freed before the backward
        allocates the next, so the allocator hands that memory out again instead of new pages to fault in."""
        if bucket.single and self.placement.adopts and bucket.views:
            bucket.buffer = bucket.empty  # made once: this runs every step
            bucket.views = []

    def _fold_more(self, bucket: Bucket, j: int) -> None:
        """A later arrival of parameter j's gradient in this backward (reentrant checkpointing: one backward per
        segment): added, times 1/world size, to what its bucket view holds.  Scaling by a power of two is exact,
        so the view then holds the bits of autograd's own sum of the arrivals, folded once."""
        p = bucket.params[j]
        grad = p.grad
        for e in bucket.of_param[j]:
            rows = bucket.entry_rows[e]
            part = grad if rows is None else grad[rows[0]:rows[1]]
            if self._scale != 1.0:
                bucket.views[e].add_(part, alpha=self._scale)
            else:
                bucket.views[e].add_(part)
        p.grad = None

    def _fold_rows(self, bucket: Bucket, p: nn.Parameter, entries: list[int]) -> None:
        grad = p.grad
        for e in entries:
            lo, hi = bucket.entry_rows[e]  # type: ignore[misc]
            view = bucket.views[e]
            if grad is None:
                view.zero_()
            elif self._scale != 1.0:
                torch.mul(grad[lo:hi], self._scale, out=view)
            else:
                view.copy_(grad[lo:hi])
        p.grad = None

    def zero_grad(self) -> None:
        """Drop every gradient (``.grad = None``): the next backward hands its gradients over to the hooks, which
        fold them into the buckets (use instead of optimizer.zero_grad).  dist.zero=2: the owned sums too."""
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None
            for t in bucket.entry_tensor:
                t.grad = None
            self._let_go(bucket)
            self.placement.zero_grad(bucket)

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.arrived = [0] * len(bucket.params)
            bucket.launched = False
            bucket.handle = None
            self.recorder.end(bucket.token)  # no-op unless an error left it open
        self._next_launch = self._next_release = 0  # buckets before _next_release are released (in order)
        self._first_launch: float | None = None
        self._late.clear()
        self._repeated = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches); the step after the block communicates."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True
            self._reset()

    # -- launching -----------------------------------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._sync:
            return  # micro-batches: autograd accumulates in .grad; the last one folds the sum
        bucket, j = self._bucket_of[p]
        n = bucket.arrived[j] = bucket.arrived[j] + 1
        if n > 1:
            self._again(bucket, j, n)
            return
        self._fold(bucket, j)
        if bucket.expected[j] == 1:
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch_ready()

    def _again(self, bucket: Bucket, j: int, n: int) -> None:
        """Arrival ``n`` > 1 of parameter j's gradient in this backward (see the module's doc): added into its
        bucket unless the bucket went out already; the most arrivals seen is what completes it from now on."""
        self._repeated = True
        completes = n == bucket.expected[j]  # an arrival past the count learned: complete since that one
        if n > bucket.expected[j]:
            bucket.expected[j] = self._uses[bucket.params[j]] = n
        if bucket.launched:  # its sum is in flight or done: this step is redone (finish raises LateGradient)
            bucket.params[j].grad = None
            if bucket.names[j] not in self._late:
                self._late.append(bucket.names[j])
            return
        self._fold_more(bucket, j)
        if completes:
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Launch the complete buckets, strictly in bucket order, so every rank issues the same collectives in
        the same sequence; a synchronous transport's only from ``finish`` (``force``, see there), except where
        the placement releases early (``Placement.releases_early``, dist.zero=2).

        Releasing early: the hooks launch complete buckets on every transport and drop those whose sums are in
        (``_release_finished``), so a rank holds the buckets being filled and those in flight, not the whole
        gradient. A synchronous collective in a hook blocks until every rank has completed that bucket; a rank
        that lacks a gradient in it completes it in ``finish``, where its backward ends without a collective,
        so the others wait for it but never for each other in another order (the same argument as ``finish``'s).
        """
        if not force and (not self._early or self.pacing):
            return
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        if self._release_early and not force:
            self._release_finished()

    def pace(self) -> None:
        """Launch early buckets on a transport whose ``start`` waits for the peers (``blocking_start``: inline MPI,
        shm, a hierarchical transport's intra-node phases) only through ``launch_agreed``, never from the hooks.

        At ``dist.zero=3`` the ranks' backwards may take different paths (``hpcnet.comm.sharding.rounds``): a rank
        blocked in a bucket's collective inside a hook would wait for a rank that waits in a gather round for it.
        The rounds instead carry each rank's ``ready`` count, and every rank launches the buckets all ranks have
        complete (``launch_agreed``) at the same round, so the early release still bounds the gradient memory.
        """
        self._paced = True
        self._set_transport(self.transport)

    def ready(self) -> int:
        """The buckets, from the first, that are complete here (launched or not)."""
        n = self._next_launch
        while n < len(self.buckets) and self.buckets[n].pending == 0:
            n += 1
        return n

    def launch_agreed(self, upto: int) -> None:
        """Launch the buckets before ``upto``, which every rank has complete (collective: every rank calls it at the
        same round with the same ``upto``, ``pace``)."""
        while self._next_launch < upto:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        if self._release_early:
            self._release_finished()

    def _release_finished(self) -> None:
        """Release, in bucket order, the launched buckets whose collectives are known to have succeeded here
        (never waits; a failure is left to ``finish``, which agrees on it first)."""
        while self._next_release < self._next_launch and succeeded(self.buckets[self._next_release].handle):
            self._release(self.buckets[self._next_release])
            self._next_release += 1

    def _launch(self, bucket: Bucket) -> None:
        if self._first_launch is None:
            self._first_launch = time.perf_counter()
        bucket.launched = True
        bucket.token = self.recorder.start("allreduce.bucket", bucket.index,
                                           bucket.buffer.numel() * bucket.buffer.element_size())
        wire = None
        if self._wire is not None:
            # Divided already (in full precision, by _fold), so the half-precision sum cannot overflow.
            wire = bucket.wire = bucket.buffer.to(self._wire)
        bucket.handle = self.placement.start(bucket, wire)
        if self._synchronous:
            self.recorder.end(bucket.token)  # it ran in start: the flight recorder shows its real duration

    # -- finishing -------------------------------------------------------------
    def _wait(self, buckets: list[Bucket]) -> BaseException | None:
        # A synchronous transport's buckets were ended in the recorder as they ran (_launch).
        on_done = None if self._synchronous else (lambda i: self.recorder.end(buckets[i].token))
        return wait_all([b.handle for b in buckets], self.timeout_s, on_done=on_done)

    def finish(self) -> None:
        """Complete the reduction of this step (collective over the control plane).

        A parameter without a gradient here (unused in this step's graph, or
        only in earlier micro-batches) is folded in now (zeros, or what the
        micro-batches accumulated), one with fewer arrivals than learned is
        complete with those, and every bucket not yet launched goes out
        in bucket order: every rank issues the same collectives in the same
        order whatever it lacked, so none waits for a bucket another never
        sends.  A synchronous transport (inline MPI, shm) runs them all here:
        from the hooks, a rank whose bucket is complete would block in its sum
        while a rank still computing others' gradients had not started it;
        here the order is the same on every rank.  Then one small exchange,
        ``reducer.outcome``, agrees on whether a collective failed anywhere,
        whether any rank lacked a gradient, and whether any rank had a
        gradient arrive after its bucket went out.

        Raises:
            CommFailure: on every rank, when the transport failed on any rank.
            LateGradient: on every rank, when a gradient arrived after its
                bucket went out on any rank (see the module's doc).
            RuntimeError: on every rank, when parameters got no gradient and
                ``find_unused`` is off.
        """
        lacking = []
        for bucket in self.buckets:
            if bucket.pending > 0:
                for j, n in enumerate(bucket.arrived):
                    if n == 0:
                        self._fold(bucket, j)  # a gradient from earlier micro-batches, or zeros
                        lacking.append(bucket.index)
                bucket.pending = 0
        self._launch_ready(force=True)
        error = self._wait(self.buckets)
        if self._first_launch is not None and self.world_size > 1:
            spans = self.stats.comm_s
            spans.append(time.perf_counter() - self._first_launch)
            if len(spans) > SPANS_KEPT:
                del spans[0]
        outcome = self._outcome
        outcome[0], outcome[1], outcome[2], outcome[3] = error is not None, bool(lacking), bool(self._late), \
            self._repeated
        with self.recorder.op("reducer.outcome"):
            self.control.Allreduce(self._in_place, outcome, op=self._max_op)
        self.stats.steps += 1
        self._repeats = self._repeats or bool(outcome[3])
        if outcome[0]:
            self._reset()
            raise mark_agreed(CommFailure(f"{self.transport.name} all-reduce failed"
                                     + (f" here: {error}" if error else " on another rank")))
        if outcome[2]:
            self._raise_late()
        if outcome[1] and not self.find_unused:
            self._raise_unused(sorted(set(lacking)))
        for bucket in self.buckets[self._next_release:]:
            self._release(bucket)
        self.stats.bytes_reduced += self._bucket_bytes
        self._completed = True
        self._reset()

    def _release(self, bucket: Bucket) -> None:
        """A bucket whose sum is complete here: a compressed wire copied back; the placement hands the sums over
        as gradients (``Placement.release``)."""
        if bucket.wire is not None:
            bucket.buffer.copy_(bucket.wire)
            bucket.wire = None
        self.placement.release(bucket)

    def _raise_unused(self, lacking: list[int]) -> None:
        """``lacking``: this rank's buckets that lacked a gradient (empty when only another rank's did)."""
        names = [name for i in lacking for name, n in zip(self.buckets[i].names, self.buckets[i].arrived) if n == 0]
        shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
        self._reset()
        raise mark_agreed(RuntimeError(
            f"parameters received no gradient this step ({shown or 'on another rank'}); make every parameter "
            "take part in the loss, or set dist.find_unused=true"))

    def _raise_late(self) -> None:
        """Agreed: some rank had a gradient arrive after its bucket went out; the counts are learned (``_again``)."""
        uses = {name: self._uses[p] for b in self.buckets for name, p in zip(b.names, b.params) if name in self._late}
        shown = ", ".join(f"{name} ({uses[name]} times)" for name in self._late[:5])
        shown += " ..." if len(self._late) > 5 else ""
        self._reset()
        raise mark_agreed(LateGradient(
            f"a parameter's gradient arrived again in one backward after its bucket had been sent "
            f"({shown or 'on another rank'}; reentrant activation checkpointing runs a backward per segment); "
            "this step's gradients are void, and from the next backward on the reducer waits for them all"))

    # -- switching transport ---------------------------------------------------
    def switch(self, transport: Transport, cause: str, step: int) -> None:
        """Continue on another transport after an agreed failure (collective)."""
        old = self.transport
        self._rehome()
        self._set_transport(transport)
        old.close()
        self.stats.fallbacks.append({"step": step, "from": old.name, "to": transport.name, "cause": cause})
        log.warning("step %d: %s failed (%s); continuing on %s", step, old.name, cause, transport.name)

    def arm_fault(self, armed: bool) -> None:
        """Fault injection: make the transport fail (on the chosen ranks) for this step."""
        if isinstance(self.transport, FaultyTransport):
            self.transport.armed = armed

    def close(self, collective: bool = True) -> None:
        """Remove the hooks and close the transport; ``collective=False`` (an error raised on this rank alone
        is propagating) leaves out what would wait for the other ranks (shm's window frees)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._rehome()  # the gradients stay readable after the shared window is freed
        if collective:
            self.transport.close()
        else:
            self.transport.abandon()
