"""Tensors from every rank to every rank as raw bytes (``exchange``): the optimizer state that moves when the owners
of ``dist.zero`` change (``ShardedOptimizer.reshard``).

What moves is described first, in one small pickled ``alltoall``: keys, names, dtypes and shapes, and the values
that are not tensors.  Then every tensor travels as its own bytes, ``Isend``/``Irecv`` straight from the sender's
tensor and into the receiver's (no pickling, no staging buffer of everything a rank sends), in messages of at most
``MAX_MESSAGE_BYTES``: an MPI count is a C ``int``, so one message of 2**31 elements or more is refused
(``MPI_ERR_ARG``), and a larger tensor goes in several.  The bytes arrive unchanged: a moved tensor equals the
sender's bit for bit.
"""

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

MAX_MESSAGE_BYTES = 2**30
"""The most bytes one message carries: below MPI's limit of 2**31 - 1 elements (bytes here) a message.  Tests lower
it to move small tensors in many pieces."""
_TAG = 27


@dataclass(frozen=True, slots=True)
class _Bytes:
    """Where a description has a tensor: its bytes follow as messages of their own."""

    dtype: str
    shape: tuple[int, ...]


def exchange(comm: Any, outgoing: list[dict[Hashable, dict[str, Any]]]) -> dict[Hashable, dict[str, Any]]:
    """Send ``outgoing[r]`` to rank ``r``, for every rank ``r``, and return what was sent here (collective).

    Args:
        comm: the ranks.
        outgoing: per destination rank, entries ``{key: {name: value}}``.  A tensor value (any device, dtype or
            layout) travels as bytes and arrives as a contiguous CPU tensor of its dtype and shape; any other value
            is pickled with the description, so keep those small.  This rank's own entry is returned as it is.

    Returns:
        the entries sent to this rank by every rank, by key (a key sent by two ranks keeps the higher rank's).
    """
    from mpi4py import MPI

    size, rank = comm.Get_size(), comm.Get_rank()
    if len(outgoing) != size:
        raise ValueError(f"outgoing has {len(outgoing)} entries for {size} ranks")
    descriptions: list[dict[Hashable, dict[str, Any]] | None] = []
    sends: list[tuple[int, torch.Tensor]] = []
    for dest, entries in enumerate(outgoing):
        if dest == rank:
            descriptions.append(None)
            continue
        described: dict[Hashable, dict[str, Any]] = {}
        for key, values in entries.items():
            described[key] = {}
            for name, value in values.items():
                if isinstance(value, torch.Tensor):
                    # A contiguous CPU tensor goes from its own memory; others are copied (to the host) first.
                    data = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
                    described[key][name] = _Bytes(str(data.dtype).removeprefix("torch."), tuple(data.shape))
                    sends.append((dest, data))
                else:
                    described[key][name] = value
        descriptions.append(described)
    received = comm.alltoall(descriptions)
    merged: dict[Hashable, dict[str, Any]] = {}
    requests: list[Any] = []
    link = comm.Dup()  # its own message space: no other message can match these
    try:
        for source, described in enumerate(received):
            if source == rank:
                merged.update(outgoing[rank])
                continue
            for key, values in described.items():
                arrived: dict[str, Any] = {}
                for name, value in values.items():
                    if isinstance(value, _Bytes):
                        arrived[name] = torch.empty(value.shape, dtype=getattr(torch, value.dtype))
                        requests += _post(link.Irecv, arrived[name], source)
                    else:
                        arrived[name] = value
                merged[key] = arrived
        # Both sides walk the same tensors in the same order, and MPI keeps the order of the messages between
        # two ranks on one tag: the n-th piece from a rank lands in the n-th piece posted for it.
        for dest, data in sends:
            requests += _post(link.Isend, data, dest)
        MPI.Request.Waitall(requests)
    finally:
        link.Free()
    return merged


def pieces(nbytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` byte ranges that cover ``nbytes`` bytes in order, none longer than ``MAX_MESSAGE_BYTES``."""
    step = MAX_MESSAGE_BYTES
    return [(lo, min(lo + step, nbytes)) for lo in range(0, nbytes, step)]


def _post(call: Any, tensor: torch.Tensor, peer: int) -> list[Any]:
    """``call`` (``Isend`` or ``Irecv``) on the bytes of contiguous ``tensor``, one message a piece."""
    from mpi4py import MPI

    flat = tensor.reshape(-1).view(torch.uint8).numpy()
    return [call([flat[lo:hi], MPI.BYTE], peer, _TAG) for lo, hi in pieces(flat.size)]
