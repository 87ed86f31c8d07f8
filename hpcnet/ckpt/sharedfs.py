"""Collective checks that every rank sees the same checkpoint directory: one file system shared by every node.

A node-local directory (``/tmp``) exists on every node but holds other files on
each; these checks turn that into one clear ``UsageError`` on every rank.
"""

import uuid
from pathlib import Path
from typing import Any

from hpcnet.agree import agree_on_error, mark_agreed, shared_errors
from hpcnet.ckpt.listing import listing
from hpcnet.errors import UsageError


def check_shared_directory(comm: Any, directory: Path) -> None:
    """Collective: rank 0 creates ``directory``; every rank must see it, and the same one.

    Rank 0 leaves a file with a random name there: a directory that merely
    exists on every node (node-local /tmp) shows up as ranks that cannot see it.
    """
    error = None
    probe = directory / f".hpcnet-probe-{uuid.uuid4().hex}"
    if comm.Get_rank() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
        except OSError as exc:
            error = UsageError(f"checkpoint.dir: cannot write to checkpoint directory {str(directory)!r}: "
                               f"{exc.strerror or exc}")
    agree_on_error(comm, error)
    probe = Path(comm.bcast(str(probe), root=0))
    try:
        seen = comm.allgather(probe.exists())
    finally:
        if comm.Get_rank() == 0:
            probe.unlink(missing_ok=True)
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise mark_agreed(UsageError(f"checkpoint.dir: {str(directory)!r} on ranks {blind} is not the directory rank 0 "
                                "writes to; use a file system shared by every node"))


def check_same_listing(comm: Any, folder: str, expected: list[tuple[str, int]]) -> None:
    """Collective: every rank must see the committed checkpoints rank 0 listed (a shared directory)."""
    with shared_errors(comm):
        mine = listing(Path(folder))
        if mine != expected:
            import socket

            raise UsageError(
                f"checkpoint directory {folder!r}: rank {comm.Get_rank()} on {socket.gethostname()} sees "
                f"{len(mine)} committed checkpoint(s), rank 0 sees {len(expected)} (other names or sizes): "
                "checkpoint.dir must be one directory shared by every node, not a node-local one")
