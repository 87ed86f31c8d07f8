"""Mirrors of each rank's sharded state in another rank's memory (``fault.replicas=1``), so that live recovery at
``dist.zero`` 1 to 3 takes nothing from disk.

At every step's end (after the update and the step's own collectives, before the next step) each rank copies its
parts' entries to host memory, its *snapshot* (``S``: the tensors it holds and those every rank holds), and sends the
tensors it alone holds to its *keeper*, which keeps them as its *ward's* mirror (``M``). The keepers form a ring over
the ranks ordered by (local index, host): the hosts interleaved, so a rank's keeper is on another host wherever there
is one (``keepers``).  The exchange is one blocking ``Sendrecv`` of a flat byte buffer a rank, its layout derived on
both sides from the entries' names, shapes, dtypes and holders, which every rank knows of every tensor.

When ranks are lost, the survivors restore the state at the snapshot's step ``m`` where every survivor's snapshot is
at ``m`` with the same tensors that no single rank holds, and every lost rank's keeper survived with its mirror at
``m`` (``mirrored_step``); each survivor then offers its snapshot and its lost ward's tensors, held by the survivors'
new ranks (``Mirror.restored``), and the rebuilt trainer takes them as a grow does (``hpcnet.fault.grow.hand_over``).
Anything else (a rank lost with its keeper, a loss inside the exchange) goes to the newest checkpoint.
"""

import copy
import logging
import statistics
import time
import zlib
from typing import Any

import torch

from hpcnet.agree import shared_errors
from hpcnet.stateful import Entries
from hpcnet.world import World, node_layout

log = logging.getLogger(__name__)

ALIGN = 16
"""Byte alignment of each tensor in a mirror's buffer: a view of it as any dtype needs its offset aligned."""
HEADER = ALIGN
"""A buffer's first bytes: a checksum of its layout (``layout_digest``), which the receiver checks against its
own view of the sender's tensors (equal sizes may still differ in shapes)."""
Layout = list[tuple[str, int, tuple[int, ...], torch.dtype]]
"""A buffer's tensors in order: (name, byte offset, shape, dtype)."""
MIRROR_TAG = 4646
"""The exchange's message tag on the job's communicator."""
Offer = tuple[int, int, int, int]
"""A survivor's word in the recovery's agreement: (S's step, M's step, its ward, a digest of S's unheld tensors)."""


def keepers(hostnames: tuple[str, ...] | list[str]) -> list[int]:
    """Each rank's keeper (pure): the ranks ordered by (local index on their host, host order), a ring in that order.
    2 hosts x 2 ranks: 0 -> 2 -> 1 -> 3 -> 0; one host: r -> r + 1."""
    layout = node_layout(list(hostnames))
    order = sorted(range(len(hostnames)), key=lambda rank: (layout[rank][1], layout[rank][0]))
    keeper = [0] * len(order)
    for position, rank in enumerate(order):
        keeper[rank] = order[(position + 1) % len(order)]
    return keeper


def snapshot(entries: Entries, reuse: dict[str, torch.Tensor] | None = None) -> Entries:
    """A copy of ``entries`` in host memory: each tensor copied to the CPU (into ``reuse[name]`` where its shape and
    dtype fit), a ``meta`` tensor kept as it is (another rank holds it), the meta and the rank's state deep-copied
    (parts may hand out their live values)."""
    reuse = reuse or {}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in entries.tensors.items():
        if tensor.is_meta:
            tensors[name] = tensor
            continue
        into = reuse.get(name)
        if into is None or into.shape != tensor.shape or into.dtype != tensor.dtype:
            into = torch.empty(tensor.shape, dtype=tensor.dtype)
        tensors[name] = into.copy_(tensor.detach())
    return Entries(tensors, dict(entries.holders), copy.deepcopy(entries.meta), copy.deepcopy(entries.rank_state),
                   set(entries.synced))


def layouts(entries: Entries) -> dict[int, Layout]:
    """Each holder's buffer: the tensors it alone holds, in the entries' order, at aligned offsets (pure: the same on
    every rank, a ``meta`` tensor having its holder's shape and dtype). One pass over the entries for every rank."""
    out: dict[int, Layout] = {}
    ends: dict[int, int] = {}
    for name, tensor in entries.tensors.items():
        holder = entries.holders.get(name)
        if holder is None:
            continue
        offset = -(-ends.get(holder, HEADER) // ALIGN) * ALIGN
        out.setdefault(holder, []).append((name, offset, tuple(tensor.shape), tensor.dtype))
        ends[holder] = offset + tensor.numel() * tensor.element_size()
    return out


def layout(entries: Entries, rank: int) -> Layout:
    """``rank``'s buffer (``layouts``)."""
    return layouts(entries).get(rank, [])


def nbytes(tensors: Layout) -> int:
    """The size of a buffer of ``tensors`` (``layout``)."""
    if not tensors:
        return HEADER
    _, offset, shape, dtype = tensors[-1]
    return offset + torch.Size(shape).numel() * dtype.itemsize


def buffer_sizes(entries: Entries, size: int, every: dict[int, Layout] | None = None) -> list[int]:
    """Every rank's buffer bytes, ``nbytes(layout(entries, rank))`` for each of ``size`` ranks (``every``: the
    entries' ``layouts``, where known)."""
    every = layouts(entries) if every is None else every
    return [nbytes(every.get(rank, [])) for rank in range(size)]


def layout_digest(tensors: Layout) -> int:
    """A checksum of a layout (CRC-32 of its names, offsets, shapes and dtypes)."""
    return zlib.crc32(repr(tensors).encode())


def views(buffer: torch.Tensor, tensors: Layout) -> dict[str, torch.Tensor]:
    """The tensors of ``buffer`` (uint8) as ``tensors`` lays them out, sharing its memory."""
    return {name: buffer[offset:offset + torch.Size(shape).numel() * dtype.itemsize].view(dtype).reshape(shape)
            for name, offset, shape, dtype in tensors}


def mirrored_step(offers: list[Offer | None], lost: tuple[int, ...] | list[int]) -> int | None:
    """The step the survivors restore from the mirrors, or None (pure).  ``offers``: each survivor's, in its new
    rank's order (None: it keeps no mirror); ``lost``: the lost ranks, numbered as before the loss.  A step ``m``
    where every snapshot is at ``m`` with the same unheld tensors and every lost rank's keeper holds its mirror
    at ``m``; None otherwise (a keeper lost too, a loss inside the exchange, snapshots of different steps)."""
    mirrors = [offer for offer in offers if offer is not None]
    if not mirrors or len(mirrors) < len(offers):
        return None
    step, _, _, digest = mirrors[0]
    if step < 0 or any(o[0] != step or o[3] != digest for o in mirrors):
        return None
    kept = {ward for _, ward_step, ward, _ in mirrors if ward_step == step}
    return step if all(rank in kept for rank in lost) else None


def new_holders(holders: dict[str, int], offers: list[Offer], lost: tuple[int, ...] | list[int],
                old_size: int) -> dict[str, int]:
    """``holders`` (old ranks) as the survivors' new ranks (pure): a survivor's own by its place among the survivors
    (the shrink keeps their order), a lost rank's by its keeper's."""
    survivors = [rank for rank in range(old_size) if rank not in lost]
    new = {old: rank for rank, old in enumerate(survivors)}
    new.update({ward: rank for rank, (_, _, ward, _) in enumerate(offers) if ward in lost})
    return {name: new[holder] for name, holder in holders.items()}


class Mirror:
    """This rank's snapshot and its ward's mirror, from one capture to the next (``hpcnet.fault.live.Live`` holds
    one for the job; ``attach`` sets it up for each world)."""

    def __init__(self) -> None:
        self.keeper: list[int] = []
        self.rank = 0
        self.own: Entries | None = None
        """S: this rank's snapshot (None before the first capture of a world)."""
        self.own_step = -1
        self.last_saved_step = -1
        self.ward = -1
        self.ward_step = -1
        """M's step: -1 while it is being received."""
        self._send: torch.Tensor | None = None
        self._send_layout: Layout = []
        self._ward_buffer: torch.Tensor | None = None
        self._ward_layout: Layout = []
        self.wards: list[int] = []
        self.capture_s: list[float] = []
        self.worlds: list[dict[str, Any]] = []
        """Each world's keepers and every rank's largest S and M bytes (summary.json)."""
        self._captures = 0
        """Of this world."""

    def attach(self, world: World) -> None:
        """A new world (the job's first, or one rebuilt): its keeper ring; nothing kept until the next capture."""
        self.keeper, self.rank = keepers(world.hostnames), world.rank
        self.wards = [self.keeper.index(rank) for rank in range(len(self.keeper))]
        self.ward, self._captures = self.wards[world.rank], 0
        if len(self.keeper) > 1:
            self.worlds.append({"keepers": self.keeper, "snapshot_bytes": [0] * len(self.keeper),
                                "ward_bytes": [0] * len(self.keeper)})
        self.reset()

    def reset(self) -> None:
        """Forget S and M (restored, or of a world gone): the next capture makes new buffers."""
        self.own, self.own_step, self.ward_step = None, -1, -1
        self._send = self._ward_buffer = None
        self._send_layout, self._ward_layout = [], []

    def offer(self, digest: int) -> Offer:
        """This survivor's part of the recovery's agreement (``digest``: S's unheld tensors')."""
        return self.own_step, self.ward_step, self.ward, digest

    def capture(self, state: Any, step: int, comm: Any, monitor: Any) -> None:
        """Collective, after ``step``: S from ``state``'s entries, then the tensors this rank holds to its keeper and
        its ward's into M (``monitor.collective('mirror')``).  A buffer laid out otherwise than the entries say is
        the same error on every rank."""
        if len(self.keeper) < 2:
            return
        t0 = time.perf_counter()
        entries = state.entries()
        every = layouts(entries)
        mine = every.get(self.rank, [])
        if self._send is None or mine != self._send_layout:
            self._send, self._send_layout = torch.empty(nbytes(mine), dtype=torch.uint8), mine
            self._send[:8].view(torch.int64)[0] = layout_digest(mine)
        reuse = dict(self.own.tensors) if self.own is not None else {}
        reuse.update(views(self._send, mine))
        self.own_step = -1
        self.own = snapshot(entries, reuse)
        self.own_step, self.last_saved_step = step, state.last_saved_step
        theirs = every.get(self.ward, [])
        if self._ward_buffer is None or theirs != self._ward_layout:
            self._ward_buffer, self._ward_layout = torch.empty(nbytes(theirs), dtype=torch.uint8), theirs
        self.ward_step = -1
        with shared_errors(comm):
            with monitor.collective("mirror", nbytes=self._send.numel()):
                received = _sendrecv(comm, self._send, self.keeper[self.rank], self._ward_buffer, self.ward)
            _check(received, self._ward_buffer, theirs, self.ward, self.rank)
        self.ward_step = step
        self.capture_s.append(time.perf_counter() - t0)
        self._account(entries, every)

    def restored(self, offers: list[Offer], lost: tuple[int, ...] | list[int], old_size: int) -> Entries:
        """After ``mirrored_step`` agreed: S with the lost ward's tensors from M, held by the survivors' new ranks."""
        assert self.own is not None and self._ward_buffer is not None
        tensors = dict(self.own.tensors)
        if self.ward in lost:
            tensors.update(views(self._ward_buffer, self._ward_layout))
        return Entries(tensors, new_holders(self.own.holders, offers, lost, old_size), self.own.meta,
                       self.own.rank_state, self.own.synced)

    def _account(self, entries: Entries, every: dict[int, Layout]) -> None:
        """Every rank's S and M bytes, from the entries (no communication), the largest of the world kept; after
        the world's first step (an optimizer makes its state there), rank 0 says who keeps whose state and the
        memory it takes."""
        sizes = buffer_sizes(entries, len(self.keeper), every)
        unheld = sum(t.numel() * t.element_size() for name, t in entries.tensors.items() if name not in entries.holders)
        world = self.worlds[-1]
        for key, now in (("snapshot_bytes", [unheld + size for size in sizes]),
                         ("ward_bytes", [sizes[ward] for ward in self.wards])):
            world[key] = [max(peak, value) for peak, value in zip(world[key], now)]
        self._captures += 1
        if self._captures == 2 and self.rank == 0:
            log.info("fault.replicas=1: each rank's state is mirrored on its keeper (%s); host memory a rank: "
                     "snapshot %.3g MiB, ward's mirror %.3g MiB at most", ", ".join(
                         f"{rank}->{keeper}" for rank, keeper in enumerate(self.keeper)),
                     max(world["snapshot_bytes"]) / 2**20, max(world["ward_bytes"]) / 2**20)

    def summary(self) -> dict[str, Any]:
        """summary.json's ``recovery.mirror``: each world's keepers (rank r's at index r) and bytes a rank (S, M), and
        this rank's median capture seconds."""
        return {"worlds": self.worlds,
                "capture_s_median": round(statistics.median(self.capture_s), 6) if self.capture_s else None}


def _check(received: int, buffer: torch.Tensor, expected: Layout, ward: int, rank: int) -> None:
    """RuntimeError where ``ward``'s buffer (``received`` bytes of it, -1: more than fit) is not laid out as
    ``rank``'s entries say it is."""
    if received == buffer.numel() and int(buffer[:8].view(torch.int64)[0]) == layout_digest(expected):
        return
    got = f"{received} bytes" if received >= 0 else "more bytes"
    raise RuntimeError(f"fault.replicas: rank {ward} sent rank {rank} its state in {got} laid out otherwise than "
                       f"rank {rank}'s entries say ({buffer.numel()} bytes, {len(expected)} tensors): the ranks' "
                       "state entries differ")


def _sendrecv(comm: Any, send: torch.Tensor, keeper: int, receive: torch.Tensor, ward: int) -> int:
    """``send`` to ``keeper`` while ``ward``'s buffer arrives in ``receive``: the bytes received, -1 where more came
    than fit."""
    from mpi4py import MPI

    status = MPI.Status()
    try:
        comm.Sendrecv([send.numpy(), MPI.BYTE], dest=keeper, sendtag=MIRROR_TAG,
                      recvbuf=[receive.numpy(), MPI.BYTE], source=ward, recvtag=MIRROR_TAG, status=status)
    except MPI.Exception as exc:
        if exc.Get_error_class() != MPI.ERR_TRUNCATE:
            raise
        return -1
    return status.Get_count(MPI.BYTE)
