"""Which checkpoint a load takes, and the load: newest committed first, past damaged ones, on every rank.

Rank 0 lists the directory and chooses the candidates (``Choice``); every
rank checks it sees the same committed files, then all read the first
candidate whose chain verifies (``hpcnet.ckpt.read``).  Damage is a reason to
try an older checkpoint, an I/O error is not (docs/checkpoints.md).
"""

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcnet.agree import mark_agreed, shared_errors
from hpcnet.ckpt.job import IoFault
from hpcnet.ckpt.listing import listing, read_info, scan
from hpcnet.ckpt.read import read_chain
from hpcnet.ckpt.schema import CheckpointInfo, resolve_chain
from hpcnet.ckpt.sharedfs import check_same_listing
from hpcnet.errors import CheckpointCorrupt, UsageError
from hpcnet.paths import ASIDE_PREFIX, CKPT_TMP_RE, TMP_SUFFIX

if TYPE_CHECKING:
    import torch

log = logging.getLogger("hpcnet.checkpoint")


@dataclass(slots=True)
class Loaded:
    """A loaded checkpoint: full logical tensors (CPU), the meta, and this rank's rank_state."""

    path: Path
    step: int
    tensors: dict[str, "torch.Tensor"]
    meta: dict[str, Any]
    rank_state: dict[str, Any] | None
    """This rank's saved state; None on ranks at or beyond the saved world size
    (resuming on more ranks): seed those afresh, e.g. from run.seed and rank."""
    saved_world_size: int
    info: CheckpointInfo
    skipped: list[str] = field(default_factory=list)
    """Why checkpoints committed after it were passed over ('auto' only)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds this rank spent reading and verifying, waiting for the others, exchanging."""


@dataclass(slots=True)
class Choice:
    """What rank 0 found to load (broadcast to every rank)."""

    candidates: list[tuple[CheckpointInfo, list[CheckpointInfo] | None, str]]
    """Newest first: (checkpoint, its chain or None, why it cannot be loaded or '')."""
    explicit: bool
    """One file was asked for: its failure is an error, not a reason to try an older one."""
    folder: str
    infos: list[CheckpointInfo]
    """The folder's committed checkpoints, in commit order."""
    listing: list[tuple[str, int]]
    """File names and sizes of ``infos``, for comparing with what the other ranks see."""
    stale: list[str]


def _choose(which: str, directory: Path | None) -> Choice:
    """Rank 0: the checkpoints to try for ``which`` ('auto', a directory or a file)."""
    if which == "auto":
        if directory is None:
            raise UsageError("load('auto') needs the checkpoint directory")
        folder, target = directory, None
    else:
        path = Path(which)
        if not which or not path.exists():
            if path.name.endswith(TMP_SUFFIX) or _uncommitted(path):
                raise UsageError(f"checkpoint {which!r} was never committed (a save that did not finish)")
            raise UsageError(f"checkpoint {which!r} does not exist")
        if path.name.endswith(TMP_SUFFIX):
            raise UsageError(f"checkpoint {which!r} is an uncommitted (half-written) file; it cannot be loaded")
        folder, target = (path, None) if path.is_dir() else (path.parent, path)
    infos, stale = scan(folder)
    if target is None:
        todo = infos[::-1]
    else:
        info = next((i for i in infos if Path(i.path) == target), None) or read_info(target)
        if info.kind == "unreadable":
            raise UsageError(f"checkpoint {str(target)!r} cannot be read: {info.error}")
        todo = [info]
        infos = [*[i for i in infos if i.path != info.path], info] if info not in infos else infos
    candidates = []
    for info in todo:
        if info.kind == "unreadable":
            candidates.append((info, None, str(info.error)))
            continue
        try:
            candidates.append((info, resolve_chain(infos, info), ""))
        except ValueError as exc:
            candidates.append((info, None, str(exc)))
    return Choice(candidates, target is not None, str(folder), infos, listing(folder), [str(p) for p in stale])


def _uncommitted(path: Path) -> bool:
    """Whether a save of checkpoint ``path`` began but did not commit (its temporary file is there)."""
    try:
        names = os.listdir(path.parent)
    except OSError:
        return False
    return any(match and match.group(1) == path.name for match in map(CKPT_TMP_RE.match, names))


def load_with_choice(comm: Any, which: str, directory: Path | None, fault: IoFault | None,
                     into: "dict[str, torch.Tensor] | None" = None, io_threads: int = 0,
                     wanted: Callable[[str], bool] | None = None,
                     wanted_from_meta: "Callable[[dict[str, Any]], Callable[[str], bool] | None] | None" = None
                     ) -> tuple[Loaded | None, Choice]:
    """Collective: ``load_checkpoint``, and what rank 0 chose from (the manager settles the directory by it)."""
    choice = None
    with shared_errors(comm):
        if comm.Get_rank() == 0:
            choice = _choose(which, directory)
    choice = comm.bcast(choice, root=0)
    check_same_listing(comm, choice.folder, choice.listing)
    for tmp in choice.stale:
        log.warning("ignoring uncommitted checkpoint %s (a save that did not finish)", tmp)
    rejected = []
    for info, chain, why in choice.candidates:
        if chain is not None:
            try:
                result = read_chain(comm, [Path(i.path) for i in chain], uids=[i.uid for i in chain], fault=fault,
                                    into=into, io_threads=io_threads, wanted=wanted,
                                    wanted_from_meta=wanted_from_meta)
            except CheckpointCorrupt as exc:  # damage only: an I/O error is not a reason to go back
                why = str(exc).removeprefix(f"{info.path}: ")
            else:
                return Loaded(Path(info.path), result.attrs["step"], result.tensors, result.meta,
                              result.rank_state, result.attrs["world_size"], info,
                              [f"{i.path}: {w}" for i, w in rejected], result.timings), choice
        if choice.explicit:
            raise mark_agreed(CheckpointCorrupt(f"checkpoint {info.path!r} cannot be loaded: {why}"))
        log.warning("skipping checkpoint %s: %s; trying the previous one", info.path, why)
        rejected.append((info, why))
    if rejected:
        lines = "".join(f"\n  {info.name} (step {info.step}): {why}" for info, why in rejected)
        raise mark_agreed(UsageError(
            f"none of the {len(rejected)} committed checkpoint(s) in {choice.folder!r} can be loaded:{lines}\n"
            "Repair or remove them, or start afresh with checkpoint.move_aside=true, which moves them into "
            f"{choice.folder}/{ASIDE_PREFIX}<time>-fresh-run/ (nothing is deleted)"))
    if which != "auto":
        raise mark_agreed(UsageError(f"no loadable checkpoint in {choice.folder!r}: it holds no committed checkpoint"))
    return None, choice


def load_checkpoint(comm: Any, which: str = "auto", directory: str | Path | None = None, *,
                    fault: IoFault | None = None, into: "dict[str, torch.Tensor] | None" = None,
                    io_threads: int = 0, wanted: Callable[[str], bool] | None = None) -> Loaded | None:
    """Collective: load a checkpoint, verified, on every rank of ``comm`` (any world size).

    Args:
        comm: the ranks that load; each gets the full tensors it wants.
        which: 'auto' (the last committed one in ``directory`` that verifies;
            damaged ones are skipped with a warning; None if the directory holds
            no checkpoint, UsageError listing each one if none loads), a
            directory (the same, but UsageError if it holds none), or a
            checkpoint file (CheckpointCorrupt if it fails verification,
            UsageError if it is missing or uncommitted).
        directory: the checkpoint directory, for 'auto'.
        fault: fault injection (``hpcnet.ckpt.write.IoFault``), or None.
        into: tensors to load into in place where they fit (``hpcnet.ckpt.read.read_chain``).
        io_threads: threads that read and hash (0: ``hpcnet.ckpt.direct.IO_THREADS``).
        wanted: this rank's choice of tensors by name (None: all of them); ``Loaded.tensors`` holds those only,
            and a tensor one rank alone wants reaches that rank only (``hpcnet.stateful.wanted_by``).

    I/O errors are not damage: they are raised (on every rank) as what they
    are, ``OSError`` with its errno.
    """
    return load_with_choice(comm, which, None if directory is None else Path(directory), fault, into,
                            io_threads, wanted)[0]
