"""The records of one save that the writer, the collective steps and the manager share: ``SaveJob`` (one rank's
part of a save, snapshotted to host memory) and ``SaveResult``, and the fault-injection hook of a save's I/O."""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpcnet.ckpt.fence import Fence
from hpcnet.ckpt.schema import CheckpointInfo, PieceAssignment, TensorSpec
from hpcnet.paths import checkpoint_name, checkpoint_tmp_name

IoFault = Callable[[str, int], None]
"""Fault injection (``hpcnet.fault.inject``): ``fault(phase, step)`` is called where an I/O error can strike
(``"precheck"`` on rank 0 before a save's free-space check, ``"write"`` on every rank while it writes
its data, ``"read"`` on every rank before it opens each file of a load); an OSError it raises fails
the operation as the file system would.  Every rank's writer also calls it at the collective file
create, with ``"arrive"`` before the ranks meet there, and ``"structure"`` once the file exists and its
quiet structure calls are announced, just before the first: where a slow or stuck save is injected; and
rank 0 calls it with ``"reserve"`` once the file's structure exists, just before it allocates the file's space."""


@dataclass(slots=True)
class SaveJob:
    """One rank's part of one save, snapshotted to host memory: all the background writer needs."""

    directory: Path
    step: int
    kind: str
    uid: str
    created_unix: float
    specs: list[TensorSpec]
    assignment: PieceAssignment
    arrays: dict[int, np.ndarray]
    """Tensor index -> this rank's rows of it (storage dtype), for every piece this rank writes."""
    meta_bytes: bytes
    rank_state_bytes: bytes
    keep: int
    seq: int = 0
    """Its place in the directory's commit order."""
    fault: IoFault | None = None
    collective_writes: bool = True
    """Write tensors split across ranks with collective MPI-IO (else independently, each rank its rows);
    only where ``direct_writes`` does not apply."""
    direct_writes: bool = True
    """A full checkpoint's tensor data: pwrite at the datasets' offsets, hashed in threads (``hpcnet.ckpt.direct``),
    instead of h5py writes."""
    io_threads: int = 0
    """Threads that write and hash (0: ``hpcnet.ckpt.direct.IO_THREADS``)."""
    parent: CheckpointInfo | None = None
    base: CheckpointInfo | None = None
    prev_hashes: dict[int, np.ndarray] | None = None
    fence: Fence | None = None
    """The attempt of ``hpcnet.launch`` this save belongs to (``hpcnet.ckpt.fence``): rank 0 commits only while it
    holds the directory's fence; None (no supervisor): unfenced."""

    @property
    def path(self) -> Path:
        return self.directory / checkpoint_name(self.step)

    @property
    def tmp(self) -> Path:
        """Where it is written until its commit: its own name (its uid's, the same on every rank)."""
        return self.directory / checkpoint_tmp_name(self.step, self.uid[:16])


@dataclass(slots=True)
class SaveResult:
    """What a finished save reports: the checkpoint's info, this rank's block hashes, timings and bytes written."""

    info: CheckpointInfo
    hashes: dict[int, np.ndarray]
    timings: dict[str, float] = field(default_factory=dict)
    bytes_written: int = 0
