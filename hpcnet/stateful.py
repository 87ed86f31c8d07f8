"""The state protocol between the trainer's parts and the checkpoints, as torchtitan's checkpointer collects
``Stateful`` objects.

A *part* is anything of a run whose state a resume needs: the model's parameters and buffers, the optimizer
(sharded or not), int8's error-feedback residuals, the owners in force, the data position, the balance shares, the
RNG.  Each offers its entries and takes them back through ``Stateful``; ``hpcnet.ckpt.state.TrainState`` holds the
trainer's parts and knows nothing else of them.

- ``state_entries()`` (collective): the part's named tensors, who holds each one that one rank alone holds (a
  sharded part's entries are spread over the ranks; the others pass a ``meta``-device tensor of its shape), the
  meta (JSON-able, the same on every rank) and this rank's own JSON state.  The tensors are the part's own, not
  copies, so a resume also reads into them where they fit, as torch.distributed.checkpoint loads into the state
  dict's tensors.
- ``before_read(meta)`` (collective, on a resume, before any tensor is read): a part that decides who holds what
  takes the checkpoint's decision first (the owners in force), so each rank then reads only what it will hold.
- ``wants(name)``: whether this rank reads a checkpoint tensor; a part answers for its own names only (None
  otherwise), and a name no part claims is read by every rank.
- ``load_entries(saved)``: take the entries back; a checkpoint that does not fit the part is a ``UsageError``
  naming ``saved.source`` and what differs.

The names ``state_entries``/``load_entries`` are not torch's ``state_dict``/``load_state_dict``: a part's entries
are checkpoint names with holders, and the model, the optimizers and the sampler keep their torch-style state dicts
beside them.  Import-light (no torch, no MPI): every package whose objects hold state imports it.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class Entries:
    """What a part offers a checkpoint."""

    tensors: dict[str, "torch.Tensor"] = field(default_factory=dict)
    """Checkpoint name -> tensor, the same names in the same order on every rank (the order is the file's)."""
    holders: dict[str, int] = field(default_factory=dict)
    """Of ``tensors``, those one rank alone holds -> that rank (elsewhere a ``meta``-device tensor)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Top-level keys of the checkpoint's meta -> JSON-able values, equal on every rank."""
    rank_state: dict[str, Any] = field(default_factory=dict)
    """Top-level keys of this rank's own JSON state (``/rank_state``)."""
    synced: set[str] = field(default_factory=set)
    """Of ``tensors``, those that differ between ranks at a step's end and that the next step makes equal, from rank
    0's (a model's buffers, which data parallelism broadcasts at every step's start as DDP does): ranks that compare
    their states in memory (``hpcnet.fault.live``) leave them out."""

    def add(self, other: "Entries") -> None:
        """Take ``other``'s entries after these; ValueError when a name or key is offered twice."""
        for mine, theirs in ((self.tensors, other.tensors), (self.meta, other.meta),
                             (self.rank_state, other.rank_state)):
            twice = sorted(set(mine) & set(theirs))
            if twice:
                raise ValueError(f"two parts offer {twice[:3]}")
            mine.update(theirs)
        self.holders.update(other.holders)
        self.synced |= other.synced


@dataclass(slots=True)
class Saved:
    """What a part takes back from a checkpoint."""

    tensors: dict[str, "torch.Tensor"]
    """The checkpoint's tensors this rank read (those ``wants`` chose), by name."""
    meta: dict[str, Any]
    rank_state: dict[str, Any] | None = None
    """This rank's saved state; None on a rank the saving run did not have (a resume on more ranks)."""
    saved_world_size: int = 1
    step: int = 0
    source: str = "checkpoint"
    """The checkpoint, in words, for error messages (``checkpoint '<path>'``)."""


class Stateful(Protocol):
    """A part of a run that has state (see the module's doc).  ``state_entries`` and ``load_entries`` are what
    every part implements; a part that subclasses this class keeps the defaults of the other two."""

    def state_entries(self) -> Entries:
        """Collective: this part's entries (see ``Entries``)."""
        ...

    def before_read(self, meta: dict[str, Any]) -> None:
        """Collective, on a resume, once the checkpoint's meta is known and before any tensor is read: take what
        decides who holds what (nothing by default)."""

    def wants(self, name: str) -> bool | None:
        """Whether this rank reads checkpoint tensor ``name``; None: not this part's to say (the default)."""
        return None

    def load_entries(self, saved: Saved) -> None:
        """Take the entries back from ``saved``; UsageError naming ``saved.source`` where they do not fit."""
        ...


def wanted_by(parts: list[Stateful]) -> Callable[[str], bool] | None:
    """This rank's choice of a checkpoint's tensors by name (``hpcnet.ckpt.read.read_chain``'s ``wanted``): the
    answer of the part whose name it is, else True; None (every rank reads all) where no part chooses."""
    choosing = [part for part in parts if type(part).wants is not Stateful.wants]
    if not choosing:
        return None

    def wants(name: str) -> bool:
        for part in choosing:
            answer = part.wants(name)
            if answer is not None:
                return answer
        return True
    return wants
