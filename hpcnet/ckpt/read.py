"""The verified read of a checkpoint chain, and the exchange that gives every rank the full tensors it wants.

Reading opens committed files with serial h5py (no MPI-IO, no collective, so
nothing can hang), each rank reads and verifies the blocks it owns under an
``Ownership`` for the *current* world size, and the ranks then exchange the
pieces (README: Checkpoints): a tensor every rank wants is all-gathered, one that a single rank wants (a
sharded optimizer's state, ``dist.zero``) is gathered to that rank only, so no rank ever holds the others'
shards.  Failures are classified (damage, I/O error,
memory) and agreed, so every rank raises alike.
"""

import errno
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from hpcnet.agree import agree_on_error, agreed, ranks_differing
from hpcnet.ckpt import direct
from hpcnet.ckpt.format import (Ownership, TensorSpec, block_hashes, dtype_name, from_storage, packed_rows,
                                plan_ownership, sha256_hex, to_storage)
from hpcnet.ckpt.validate import checked, open_read, read_header, read_json
from hpcnet.ckpt.write import IoFault
from hpcnet.errors import CheckpointCorrupt, RestartableError, errno_of, error_text, os_error

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class ReadResult:
    tensors: dict[str, "torch.Tensor"]
    meta: dict[str, Any]
    rank_state: dict[str, Any] | None
    attrs: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)


def _verify(got: np.ndarray, want: np.ndarray, spec: TensorSpec, blocks: np.ndarray) -> None:
    bad = np.flatnonzero(got != want)
    if len(bad):
        lo, hi = spec.block_range_rows(int(blocks[bad[0]]), int(blocks[bad[0]]) + 1)
        raise ValueError(f"checksum mismatch in {len(bad)} block(s), first at rows {lo}-{hi - 1}")


def _read_owned(f: Any, path: Path, attrs: dict[str, Any], index: list[dict[str, Any]], owned: list,
                out: dict[int, np.ndarray], file_hashes: np.ndarray, file_blocks: np.ndarray | None,
                io_threads: int = 0) -> None:
    """Read (and verify) this rank's pieces from one file of a chain into ``out``.

    A full file's pieces are read in chunks by several threads at once, each
    hashing what it read (``hpcnet.ckpt.direct``): reads of disjoint ranges in
    flight together, overlapped with the hashing.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        with direct.pool(io_threads) as pool:
            checks: list[tuple[str, TensorSpec, np.ndarray, np.ndarray, list]] = []
            try:
                _read_pieces(f, fd, attrs, index, owned, out, file_hashes, file_blocks, pool, checks)
            finally:
                for dataset, spec, blocks, want, futures in checks:
                    try:
                        _verify(direct.collect(futures), want, spec, blocks)
                    except ValueError as exc:
                        raise ValueError(f"dataset {dataset}: {exc}") from None
    finally:
        os.close(fd)


def _read_pieces(f: Any, fd: int, attrs: dict[str, Any], index: list[dict[str, Any]], owned: list,
                 out: dict[int, np.ndarray], file_hashes: np.ndarray, file_blocks: np.ndarray | None, pool: Any,
                 checks: list) -> None:
    import h5py

    for i, piece in owned:
        entry = index[i]
        spec: TensorSpec = entry["spec"]
        dataset = f"/tensors/{spec.name}"
        try:
            block_bytes = spec.block_rows * spec.row_bytes
            hashes = file_hashes[entry["hash_offset"]:entry["hash_offset"] + entry["n_hashes"]]
            target = out[i].reshape(spec.rows, *spec.row_shape)
            if attrs["kind"] == "full":
                d = checked(f, dataset, spec.shape, spec.storage)
                lo, hi = spec.block_range_rows(piece.block_lo, piece.block_hi)
                offset = d.id.get_offset() if d.id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS else None
                if offset is not None:  # checked: inside the file
                    futures = direct.submit_read(pool, fd, target[lo:hi], offset + lo * spec.row_bytes, block_bytes,
                                                 attrs["hash"])
                else:  # compact (hpcnet never writes it, HDF5 may): through h5py
                    if spec.shape:
                        d.read_direct(target, np.s_[lo:hi], np.s_[lo:hi])
                    else:
                        target[0] = d[()]
                    futures = direct.submit_hash(pool, target[lo:hi], block_bytes, attrs["hash"])
                blocks = np.arange(piece.block_lo, piece.block_hi)
                checks.append((dataset, spec, blocks, hashes[blocks], futures))
                continue
            if entry["n_hashes"] == 0:
                continue
            numbers = file_blocks[entry["hash_offset"]:entry["hash_offset"] + entry["n_hashes"]]
            if np.any(numbers < 0) or np.any(numbers >= spec.n_blocks) or np.any(np.diff(numbers) <= 0):
                raise ValueError("/blocks of this tensor are not increasing block numbers")
            a, b = np.searchsorted(numbers, [piece.block_lo, piece.block_hi])
            if a == b:
                continue
            d = checked(f, dataset, (packed_rows(spec, numbers), *spec.row_shape), spec.storage)
            mine = numbers[a:b]
            packed = d[a * spec.block_rows:a * spec.block_rows + packed_rows(spec, mine)]
            got = np.empty(len(mine), dtype="<u8")
            for k, block in enumerate(mine):
                lo, hi = spec.block_range_rows(int(block), int(block) + 1)
                rows = packed[k * spec.block_rows:k * spec.block_rows + hi - lo]
                got[k] = block_hashes(rows, block_bytes, attrs["hash"])[0]
                target[lo:hi] = rows
            _verify(got, hashes[a:b], spec, mine)
        except Exception as exc:  # noqa: BLE001 - reported with file and dataset by the caller
            raise ValueError(f"dataset {dataset}: {exc}") from None


def _allgatherv_inplace(comm: Any, buffer: np.ndarray, counts: list[int], displs: list[int],
                        root: int | None = None) -> None:
    """Allgatherv of byte ranges of ``buffer`` in place, in units large enough for MPI's int counts; with
    ``root``, a Gatherv to that rank only (the others' ``buffer`` keeps just their own range)."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    if comm.Get_size() == 1 or not any(counts):
        return
    # Plain bytes where the counts fit an int: Open MPI moves one huge derived
    # element at half the speed (measured here).
    unit = 1 if max(max(counts), max(displs)) < 2**31 else math.gcd(*counts, *displs)
    if max(max(counts), max(displs)) // unit >= 2**31:
        raise ValueError("piece too large for one MPI call")
    datatype = MPI.BYTE if unit == 1 else MPI.BYTE.Create_contiguous(unit).Commit()
    whole = [buffer.reshape(-1).view(np.uint8), [c // unit for c in counts], [d // unit for d in displs], datatype]
    try:
        if root is None:
            comm.Allgatherv(MPI.IN_PLACE, whole)
        elif rank == root:
            comm.Gatherv(MPI.IN_PLACE, whole, root=root)
        else:
            mine = buffer.reshape(-1).view(np.uint8)[displs[rank]:displs[rank] + counts[rank]]
            comm.Gatherv([mine, counts[rank] // unit, datatype], None, root=root)
    finally:
        if unit != 1:
            datatype.Free()


def _read_failure(path: Path, exc: BaseException) -> BaseException:
    """What a failed read of ``path`` was: damage to the file, an I/O error, or not enough memory.

    Only damage (a checksum, a structure that HDF5 or the checks reject) is
    ``CheckpointCorrupt``, which a resume may skip for an older checkpoint; an
    I/O error keeps its errno (EIO restarts, ENOENT and EACCES are for the
    user to fix) and anything else is raised as what it is.
    """
    if isinstance(exc, (MemoryError, RestartableError, CheckpointCorrupt)):
        return exc
    code = errno_of(exc)
    if isinstance(exc, OSError) and code:
        gone = " (it was listed a moment ago: is another job changing the directory?)" \
            if code == errno.ENOENT else ""
        return os_error(code, f"reading checkpoint {str(path)!r} failed: {error_text(exc)}{gone}")
    if isinstance(exc, (ValueError, KeyError, OSError)) or type(exc) is RuntimeError:
        return CheckpointCorrupt(f"{path}: {exc}")  # our checks, or HDF5 rejecting the structure
    return exc


def _raise_read_failure(path: Path, exc: Exception) -> None:
    failure = _read_failure(path, exc)
    if failure is exc:
        raise exc
    raise failure from exc


def _read_headers(chain: list[Path], uids: list[str] | None, fault: IoFault | None
                  ) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Every file's validated header; the chain must hold one set of tensors and, if given, these uids."""
    headers = []
    for path in chain:
        try:
            if fault is not None:
                fault("read", -1)
            with open_read(path) as f:
                headers.append(read_header(f, path))
        except Exception as exc:  # noqa: BLE001 - classified
            _raise_read_failure(path, exc)
    specs = [e["spec"] for e in headers[-1][1]]
    for path, (attrs, index) in zip(chain, headers):
        if [e["spec"] for e in index] != specs:
            raise CheckpointCorrupt(f"{path}: holds other tensors than {chain[-1].name} (a broken chain)")
    read = [attrs["uid"] for attrs, _ in headers]
    if uids is not None and read != uids:
        changed = [p.name for p, a, b in zip(chain, uids, read) if a != b]
        raise RestartableError(f"checkpoint {', '.join(changed)} was replaced after it was listed "
                               "(is another job writing to the checkpoint directory?)")
    return headers


def _read_rank_state(f: Any, attrs: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """This rank's saved RNG/loader state, None beyond the saved world size."""
    if rank >= attrs["world_size"]:
        return None
    table = f.get("rank_state")
    width = table.shape[1] if table is not None and table.ndim == 2 else -1
    try:
        row = checked(f, "rank_state", (attrs["world_size"], width), np.dtype(np.uint8))[rank]
        want = checked(f, "rank_state_hashes", (attrs["world_size"],), np.dtype("<u8"))[rank]
        if block_hashes(row, width, attrs["hash"])[0] != want:
            raise ValueError(f"checksum mismatch in row {rank}")
        state = json.loads(row.tobytes().decode("utf-8"))
        if not isinstance(state, dict):
            raise ValueError(f"row {rank} is not a JSON object")
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"dataset /rank_state: {exc}") from None
    return state


def _buffer(spec: TensorSpec, into: "dict[str, torch.Tensor] | None") -> np.ndarray:
    """Where tensor ``spec`` is read to: the storage of ``into[spec.name]`` if it fits (CPU, contiguous, the
    same shape and dtype), else a new tensor's.

    New memory comes from torch, not numpy: numpy asks for transparent huge
    pages, and where the kernel compacts memory to find them (THP defrag
    ``madvise``) a first touch of a fresh 256 MB array took seconds here
    instead of 0.1-0.2 s with small pages.
    """
    import torch

    tensor = into.get(spec.name) if into else None
    if not (tensor is not None and tensor.device.type == "cpu" and tensor.is_contiguous()
            and tuple(tensor.shape) == spec.shape and dtype_name(tensor) == spec.dtype):
        tensor = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
    return to_storage(tensor.detach()).reshape(spec.shape)


def _read_local(chain: list[Path], headers: list, ownership: Ownership, rank: int,
                into: "dict[str, torch.Tensor] | None" = None, io_threads: int = 0
                ) -> tuple[dict[int, np.ndarray], ReadResult]:
    """This rank's verified pieces of every tensor (in full-size buffers), the meta and its rank state."""
    specs = [e["spec"] for e in headers[-1][1]]
    owned = ownership.owned(rank)
    # Every size was checked against the base file's own size by read_header, so
    # a crafted /index cannot make this allocate what the file does not hold.
    out = {i: _buffer(spec, into) for i, spec in enumerate(specs)}
    for path, (attrs, index) in zip(chain, headers):
        try:
            with open_read(path) as f:
                file_hashes = checked(f, "hashes", (sum(e["n_hashes"] for e in index),), np.dtype("<u8"))[()]
                file_blocks = None
                if attrs["kind"] == "incremental":
                    file_blocks = checked(f, "blocks", file_hashes.shape, np.dtype("<i8"))[()]
                _read_owned(f, path, attrs, index, owned, out, file_hashes, file_blocks, io_threads)
                if path != chain[-1]:
                    continue
                try:
                    meta = read_json(f, "meta", attrs["meta_sha256"])
                except ValueError as exc:
                    raise ValueError(f"dataset /meta: {exc}") from None
                if not isinstance(meta, dict):
                    raise ValueError("dataset /meta: not a JSON object")
                result = ReadResult({}, meta, _read_rank_state(f, attrs, rank), attrs)
        except Exception as exc:  # noqa: BLE001 - classified
            _raise_read_failure(path, exc)
    return out, result


def read_chain(comm: Any, chain: list[Path], *, uids: list[str] | None = None,
               wanted: Callable[[str], bool] | None = None,
               fault: IoFault | None = None, into: "dict[str, torch.Tensor] | None" = None,
               io_threads: int = 0) -> ReadResult:
    """Collective: read the chain (full base first, increments after), verify it, return full tensors.

    Args:
        comm: the ranks that read; each verifies its share and all exchange.
        chain: the files, base first.
        uids: the uids the listing gave these files; a file replaced since is an error.
        fault: fault injection (``IoFault``), or None.
        into: tensors to read into in place where one of the name fits (CPU, contiguous, the saved
            shape and dtype), as torch.distributed.checkpoint loads: no new memory to allocate and
            fault in.  The returned tensors then share their memory.  A failed load may have
            overwritten some of them.
        io_threads: threads that read and hash (0: ``hpcnet.ckpt.direct.IO_THREADS``).

    Raises, on every rank alike: ``CheckpointCorrupt`` (a checksum or the
    structure; the message names file and dataset), an ``OSError`` with its
    errno for an I/O error, ``RestartableError`` when a file was replaced after
    it was listed or ranks read different files, or what else went wrong.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    t_start = time.perf_counter()
    error = None
    try:
        headers = _read_headers(chain, uids, fault)
        ownership = plan_ownership([e["spec"] for e in headers[-1][1]], size)
        out, result = _read_local(chain, headers, ownership, rank, into, io_threads)
    except BaseException as exc:  # noqa: BLE001 - shared below, so every rank raises alike
        error = exc
    t_read = time.perf_counter()
    agree_on_error(comm, error)
    # Every rank opened the files itself: they must have read the same ones.
    seen = [(p.name, a["uid"], a["index_sha256"], a["meta_sha256"]) for p, (a, _) in zip(chain, headers)]
    odd = ranks_differing(comm, sha256_hex(repr(seen).encode()))
    if odd:
        raise agreed(RestartableError(f"ranks {odd} read other files than rank 0 for {chain[-1]} (was a file "
                                      "replaced while loading, or is the directory not shared?)"))
    specs = [e["spec"] for e in headers[-1][1]]
    t_agreed = time.perf_counter()
    wanting = _wanting(comm, specs, wanted)
    t_split = _exchange(comm, ownership, specs, out, wanting)
    result.tensors = {spec.name: from_storage(out[i], spec.dtype).reshape(spec.shape) for i, spec in enumerate(specs)
                      if rank in wanting[i]}
    result.timings = {"read_verify_s": t_read - t_start, "wait_s": t_agreed - t_read,
                      "exchange_s": time.perf_counter() - t_agreed, "exchange_split_s": t_split}
    return result


def _wanting(comm: Any, specs: list[TensorSpec], wanted: Callable[[str], bool] | None) -> list[set[int]]:
    """Collective: for each tensor, the ranks whose ``wanted`` takes it (every rank where ``wanted`` is None);
    a ``wanted`` that fails on some rank is raised on every rank."""
    error = None
    flags = [True] * len(specs)
    try:
        if wanted is not None:
            flags = [bool(wanted(spec.name)) for spec in specs]
    except Exception as exc:  # noqa: BLE001 - shared below, so no rank is left in the allgather
        error = exc
    agree_on_error(comm, error)
    mine = np.packbits(flags)
    every = [np.unpackbits(bits, count=len(specs)).astype(bool) for bits in comm.allgather(mine)]
    return [{r for r, flags in enumerate(every) if flags[i]} for i in range(len(specs))]


def _exchange(comm: Any, ownership: Ownership, specs: list[TensorSpec], out: dict[int, np.ndarray],
              wanting: list[set[int]]) -> float:
    """Collective: give each rank the pieces the others read of the tensors it wants (``wanting``); return the
    seconds spent on split tensors.

    Each split tensor is exchanged in place: all-gathered, or gathered to the one rank that wants it (the
    others touch only their own piece of its buffer), or left alone when no rank wants it.  Whole small
    tensors are packed into one buffer that every rank gets.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    small = [i for i in range(len(specs)) if not ownership.split[i] and ownership.pieces[i]]
    t_split = time.perf_counter()
    for i, spec in enumerate(specs):
        if ownership.split[i] and wanting[i]:
            ranges = [spec.block_range_rows(p.block_lo, p.block_hi) for p in ownership.pieces[i]]
            root = next(iter(wanting[i])) if len(wanting[i]) == 1 else None
            _allgatherv_inplace(comm, out[i], [(hi - lo) * spec.row_bytes for lo, hi in ranges],
                                [lo * spec.row_bytes for lo, _ in ranges], root)
    t_split = time.perf_counter() - t_split
    if size > 1 and small:
        by_rank: list[list[int]] = [[] for _ in range(size)]
        for i in small:
            by_rank[ownership.pieces[i][0].rank].append(i)
        counts = [sum(specs[i].nbytes for i in ids) for ids in by_rank]
        displs = [sum(counts[:r]) for r in range(size)]
        packed = np.empty(sum(counts), dtype=np.uint8)
        pos = displs[rank]
        for i in by_rank[rank]:
            packed[pos:pos + specs[i].nbytes] = out[i].reshape(-1).view(np.uint8)
            pos += specs[i].nbytes
        _allgatherv_inplace(comm, packed, counts, displs)
        for r, ids in enumerate(by_rank):
            pos = displs[r]
            for i in ids:
                out[i].reshape(-1).view(np.uint8)[:] = packed[pos:pos + specs[i].nbytes]
                pos += specs[i].nbytes
    return t_split
