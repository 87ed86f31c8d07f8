"""The verified read of a checkpoint chain, and the exchange that gives every rank the full tensors it wants.

Reading opens committed files with serial h5py (no MPI-IO, no collective, so
nothing can hang).  The ranks first agree which of them want each tensor; a
tensor one rank wants (a sharded optimizer's state, ``dist.zero``) is read by
that rank alone, so no rank ever holds the others' shards, and the rest are
cut into one contiguous stretch of the file per rank (``assign_readers``).  Each
rank reads and verifies its stretch, and the ranks then exchange the pieces
(docs/checkpoints.md).  Where every rank runs on one node and the file fits in
its memory, there is no exchange: each rank reads the others' stretches too,
while they read them, from the node's page cache (``shared_reads``).  Failures
are classified (damage, I/O error, memory) and agreed, so every rank raises
alike.
"""

import errno
import json
import math
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcnet.agree import agree_on_error, mark_agreed, ranks_differing, shared_errors
from hpcnet.ckpt import direct
from hpcnet.ckpt.job import IoFault
from hpcnet.ckpt.schema import (
    SPLIT_MIN_BYTES,
    Piece,
    PieceAssignment,
    TensorSpec,
    assign_readers,
    block_hashes,
    dtype_name,
    from_storage,
    packed_rows,
    sha256_hex,
    to_storage,
)
from hpcnet.ckpt.validate import checked, open_read, read_header, read_json
from hpcnet.errors import CheckpointCorrupt, RestartableError, errno_of, error_text, os_error

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class ReadResult:
    """What a checkpoint read returns: the tensors, the metadata, this rank's state, the file attributes and timings."""

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
                io_threads: int = 0, others: list | None = None) -> None:
    """Read (and verify) this rank's pieces from one file of a chain into ``out``.

    A full file's pieces are read in chunks by several threads at once, each
    hashing what it read (``hpcnet.ckpt.direct``): reads of disjoint ranges in
    flight together, overlapped with the hashing.  ``others`` (the stretches
    other ranks read, ``shared_reads``) go to threads of their own, so that
    this rank follows the others through the file while it reads its own
    stretch, and copies their pages from the page cache as they arrive.
    """
    fds = [direct.open_for_reading(path)]
    try:
        if others:  # a descriptor of its own: the kernel keeps one readahead state per open file
            fds.append(direct.open_for_reading(path))
        with direct.pool(io_threads) as pool, direct.pool(io_threads if others else 1) as second:
            checks: list[tuple[str, TensorSpec, np.ndarray, np.ndarray, list]] = []
            try:
                _read_pieces(f, fds[0], attrs, index, owned, out, file_hashes, file_blocks, pool, checks)
                if others:
                    _read_pieces(f, fds[1], attrs, index, others, out, file_hashes, file_blocks, second, checks)
            finally:
                for dataset, spec, blocks, want, futures in checks:
                    try:
                        _verify(direct.collect(futures), want, spec, blocks)
                    except ValueError as exc:
                        raise ValueError(f"dataset {dataset}: {exc}") from None
    finally:
        for fd in fds:
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


EXCHANGES_IN_FLIGHT = 8
"""Tensors exchanged at once on a load.  Broadcasts from different ranks in flight together move data both
ways at once, so the exchange ends sooner than one tensor at a time."""


def _start_allgatherv(comm: Any, buffer: np.ndarray, counts: list[int], displs: list[int]) -> tuple[Any, Any]:
    """Start an Allgatherv of byte ranges of ``buffer`` in place (a broadcast where one rank holds all of it), in
    units large enough for MPI's int counts; returns the request and a datatype to free after it (or None)."""
    from mpi4py import MPI

    # Plain bytes where the counts fit an int: Open MPI moves one huge derived
    # element more slowly.
    unit = 1 if max(max(counts), max(displs)) < 2**31 else math.gcd(*counts, *displs)
    if max(max(counts), max(displs)) // unit >= 2**31:
        raise ValueError("piece too large for one MPI call")
    datatype = MPI.BYTE if unit == 1 else MPI.BYTE.Create_contiguous(unit).Commit()
    data = buffer.reshape(-1).view(np.uint8)
    holders = [r for r, c in enumerate(counts) if c]
    if len(holders) == 1:
        (root,) = holders
        request = comm.Ibcast([data[displs[root]:displs[root] + counts[root]], counts[root] // unit, datatype],
                              root=root)
    else:
        request = comm.Iallgatherv(MPI.IN_PLACE, [data, [c // unit for c in counts], [d // unit for d in displs],
                                                  datatype])
    return request, (None if unit == 1 else datatype)


def _allgatherv_inplace(comm: Any, exchanges: list[tuple[np.ndarray, list[int], list[int]]]) -> None:
    """Collective: every ``(buffer, counts, displs)`` all-gathered in place, ``EXCHANGES_IN_FLIGHT`` at once."""
    in_flight: list[tuple[Any, Any]] = []

    def finish_one() -> None:
        request, datatype = in_flight.pop(0)
        request.Wait()
        if datatype is not None:
            datatype.Free()

    try:
        for buffer, counts, displs in exchanges:
            if comm.Get_size() == 1 or not any(counts):
                continue
            in_flight.append(_start_allgatherv(comm, buffer, counts, displs))
            if len(in_flight) >= EXCHANGES_IN_FLIGHT:
                finish_one()
    finally:
        while in_flight:
            finish_one()


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


def _read_meta(f: Any, attrs: dict[str, Any]) -> dict[str, Any]:
    try:
        meta = read_json(f, "meta", attrs["meta_sha256"])
    except ValueError as exc:
        raise ValueError(f"dataset /meta: {exc}") from None
    if not isinstance(meta, dict):
        raise ValueError("dataset /meta: not a JSON object")
    return meta


def _read_headers(chain: list[Path], uids: list[str] | None, fault: IoFault | None
                  ) -> tuple[list[tuple[dict[str, Any], list[dict[str, Any]]]], dict[str, Any]]:
    """Every file's validated header, and the meta of the last; the chain must hold one set of tensors and, if
    given, these uids."""
    headers = []
    meta: dict[str, Any] = {}
    for path in chain:
        try:
            if fault is not None:
                fault("read", -1)
            with open_read(path) as f:
                headers.append(read_header(f, path))
                if path == chain[-1]:
                    meta = _read_meta(f, headers[-1][0])
        except Exception as exc:  # noqa: BLE001 - classified
            _raise_read_failure(path, exc)
    specs = [e["spec"] for e in headers[-1][1]]
    for path, (_attrs, index) in zip(chain, headers):
        if [e["spec"] for e in index] != specs:
            raise CheckpointCorrupt(f"{path}: holds other tensors than {chain[-1].name} (a broken chain)")
    read = [attrs["uid"] for attrs, _ in headers]
    if uids is not None and read != uids:
        changed = [p.name for p, a, b in zip(chain, uids, read) if a != b]
        raise RestartableError(f"checkpoint {', '.join(changed)} was replaced after it was listed "
                               "(is another job writing to the checkpoint directory?)")
    return headers, meta


def _read_rank_state(f: Any, attrs: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """This rank's saved RNG/loader state, None beyond the saved world size."""
    import h5py

    if rank >= attrs["world_size"]:
        return None
    table = f.get("rank_state")
    width = table.shape[1] if isinstance(table, h5py.Dataset) and table.ndim == 2 else -1
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


def _buffer(spec: TensorSpec, into: "dict[str, torch.Tensor] | None") -> tuple[np.ndarray, bool]:
    """Where tensor ``spec`` is read to, and whether it is new memory: the storage of ``into[spec.name]`` if it
    fits (CPU, contiguous, the same shape and dtype), else a new tensor's.

    New memory comes from torch, not numpy: numpy asks for transparent huge
    pages, and where the kernel compacts memory to find them (THP defrag
    ``madvise``) a first touch of a fresh large array takes many times
    longer than with small pages.
    """
    import torch

    tensor = into.get(spec.name) if into else None
    if not (tensor is not None and tensor.device.type == "cpu" and tensor.is_contiguous()
            and tuple(tensor.shape) == spec.shape and dtype_name(tensor) == spec.dtype):
        return to_storage(torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))).reshape(spec.shape), True
    return to_storage(tensor.detach()).reshape(spec.shape), False


def _to_receive(assignment: PieceAssignment, specs: list[TensorSpec], wanting: list[set[int]], rank: int
                ) -> list[tuple[int, int, int]]:
    """``(tensor, first byte, end byte)`` of what this rank will receive from others in ``_exchange``."""
    ranges = []
    for i, spec in enumerate(specs):
        if rank in wanting[i] and len(wanting[i]) > 1 and spec.nbytes >= SPLIT_MIN_BYTES:
            for p in assignment.pieces[i]:
                if p.rank != rank:
                    lo, hi = spec.block_range_rows(p.block_lo, p.block_hi)
                    ranges.append((i, lo * spec.row_bytes, hi * spec.row_bytes))
    return ranges


def _prefault(views: list[np.ndarray]) -> None:
    """Write a byte of every page of these views of new memory, so that the exchange copies into mapped pages.

    Run in a thread while this rank's own reads wait for the disk: an exchange
    that faults in the pages it receives is several times slower than one into
    mapped memory.  numpy fills a strided view
    without the GIL.  The bytes written lie in ranges this rank does not read.
    """
    for view in views:
        view[::mmap.PAGESIZE] = 0


def _read_local(chain: list[Path], headers: list, assignment: PieceAssignment, wanting: list[set[int]], rank: int,
                into: "dict[str, torch.Tensor] | None" = None, io_threads: int = 0, page_cache: bool = False
                ) -> tuple[dict[int, np.ndarray], ReadResult]:
    """This rank's verified pieces of every tensor (in full-size buffers), the meta and its rank state; with
    ``page_cache``, every piece of every tensor it wants (``shared_reads``), nothing to receive."""
    specs = [e["spec"] for e in headers[-1][1]]
    if page_cache:
        owned, others = shared_reads(assignment, wanting, rank)
    else:
        owned, others = assignment.of_rank(rank), []
    # Every size was checked against the base file's own size by read_header, so
    # a crafted /index cannot make this allocate what the file does not hold.
    out, new = {}, set()
    for i, spec in enumerate(specs):
        if page_cache and rank not in wanting[i]:
            continue  # read by the ranks that want it, each for itself
        out[i], fresh = _buffer(spec, into)
        if fresh:
            new.add(i)
    receive = [] if page_cache else [
        out[i].reshape(-1).view(np.uint8)[lo:hi] for i, lo, hi in _to_receive(assignment, specs, wanting, rank)
        if i in new]
    if not receive:
        return out, _read_files(chain, headers, owned, out, rank, io_threads, others)
    with ThreadPoolExecutor(1, thread_name_prefix="hpcnet-checkpoint-prefault") as toucher:
        touched = toucher.submit(_prefault, receive)
        result = _read_files(chain, headers, owned, out, rank, io_threads)
        touched.result()
    return out, result


def _read_files(chain: list[Path], headers: list, owned: list, out: dict[int, np.ndarray], rank: int,
                io_threads: int, others: list | None = None) -> ReadResult:
    for path, (attrs, index) in zip(chain, headers):
        try:
            with open_read(path) as f:
                file_hashes = checked(f, "hashes", (sum(e["n_hashes"] for e in index),), np.dtype("<u8"))[()]
                file_blocks = None
                if attrs["kind"] == "incremental":
                    file_blocks = checked(f, "blocks", file_hashes.shape, np.dtype("<i8"))[()]
                _read_owned(f, path, attrs, index, owned, out, file_hashes, file_blocks, io_threads, others)
                if path == chain[-1]:
                    result = ReadResult({}, {}, _read_rank_state(f, attrs, rank), attrs)
        except Exception as exc:  # noqa: BLE001 - classified
            _raise_read_failure(path, exc)
    return result


def read_chain(comm: Any, chain: list[Path], *, uids: list[str] | None = None,
               wanted: Callable[[str], bool] | None = None,
               fault: IoFault | None = None, into: "dict[str, torch.Tensor] | None" = None,
               io_threads: int = 0,
               wanted_from_meta: "Callable[[dict[str, Any]], Callable[[str], bool] | None] | None" = None,
               page_cache: bool | None = None) -> ReadResult:
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
        wanted_from_meta: called on every rank with the checkpoint's meta once every rank has checked it read
            the same files, before any tensor is read; returns ``wanted`` (which it replaces).  It may be
            collective: a sharded optimizer takes the owners the checkpoint was saved under there, so that
            each rank then reads the state of the parameters it will own.
        page_cache: whether each rank reads every tensor it wants itself, the others' stretches from the
            node's page cache, instead of receiving them (``shared_reads``); None decides
            (``_reads_through_page_cache``).  The same on every rank.

    Raises, on every rank alike: ``CheckpointCorrupt`` (a checksum or the
    structure; the message names file and dataset), an ``OSError`` with its
    errno for an I/O error, ``RestartableError`` when a file was replaced after
    it was listed or ranks read different files, or what else went wrong.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    t_start = time.perf_counter()
    error = headers = None
    meta: dict[str, Any] = {}
    try:
        headers, meta = _read_headers(chain, uids, fault)
    except BaseException as exc:  # noqa: BLE001 - shared below, so every rank raises alike
        error = exc
    agree_on_error(comm, error)
    # Every rank opened the files itself: they must have read the same ones.
    seen = [(p.name, a["uid"], a["index_sha256"], a["meta_sha256"]) for p, (a, _) in zip(chain, headers)]
    odd = ranks_differing(comm, sha256_hex(repr(seen).encode()))
    if odd:
        raise mark_agreed(RestartableError(f"ranks {odd} read other files than rank 0 for {chain[-1]} (was a file "
                                      "replaced while loading, or is the directory not shared?)"))
    specs = [e["spec"] for e in headers[-1][1]]
    if wanted_from_meta is not None:
        with shared_errors(comm):
            wanted = wanted_from_meta(meta)
    wanting = _wanting(comm, specs, wanted)
    assignment = assign_readers(specs, wanting, size)
    if page_cache is None:
        page_cache = _reads_through_page_cache(comm, _exchanged_bytes(specs, wanting))
    t_assigned = time.perf_counter()
    try:
        out, result = _read_local(chain, headers, assignment, wanting, rank, into, io_threads, page_cache)
    except BaseException as exc:  # noqa: BLE001 - shared below, so every rank raises alike
        error = exc
    t_read = time.perf_counter()
    agree_on_error(comm, error)
    t_agreed = time.perf_counter()
    t_split = 0.0 if page_cache else _exchange(comm, assignment, specs, out, wanting)
    result.meta = meta
    result.tensors = {spec.name: from_storage(out[i], spec.dtype).reshape(spec.shape) for i, spec in enumerate(specs)
                      if rank in wanting[i]}
    result.timings = {"open_assign_s": t_assigned - t_start, "read_verify_s": t_read - t_assigned,
                      "wait_s": t_agreed - t_read, "exchange_s": time.perf_counter() - t_agreed,
                      "exchange_large_s": t_split}
    return result


PAGE_CACHE_MEMORY_FRACTION = 0.5
"""Largest share of the node's available memory (``MemAvailable``) the pages of the tensors several ranks want
may take for a load to read them through the page cache (``shared_reads``): each rank reads the others'
stretches after them, so those pages must stay cached until the last rank has copied them."""


def shared_reads(assignment: PieceAssignment, wanting: list[set[int]], rank: int
                 ) -> tuple[list[tuple[int, Piece]], list[tuple[int, Piece]]]:
    """The pieces ``rank`` reads where every rank reads all it wants itself (pure): ``(own, others)``.

    ``own`` is its stretch of the reads (``assign_readers``) of the tensors it wants;
    ``others`` the other ranks' pieces of those tensors, in file order starting
    where its own stretch ends (the next rank's), so that it reads them just
    behind (or beside) the rank that reads them from the disk, as the pages
    arrive in the page cache.  The disk then delivers every byte once, and
    there is nothing to exchange; each rank copies and verifies what it holds.
    """
    size = assignment.world_size
    own = [(i, p) for i, p in assignment.of_rank(rank) if rank in wanting[i]]
    others = [(i, p) for i, pieces in enumerate(assignment.pieces) if rank in wanting[i] for p in pieces
              if p.rank != rank]
    others.sort(key=lambda ip: ((ip[1].rank - rank) % size, ip[0]))
    return own, others


def _exchanged_bytes(specs: list[TensorSpec], wanting: list[set[int]]) -> int:
    """Bytes of the tensors that several ranks want: what an exchange would move."""
    return sum(spec.nbytes for spec, ranks in zip(specs, wanting) if len(ranks) > 1)


def _available_memory_bytes() -> int:
    """``MemAvailable`` of /proc/meminfo (Linux), 0 where unknown."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _reads_through_page_cache(comm: Any, exchanged_bytes: int) -> bool:
    """Collective: whether this load reads through the page cache (``shared_reads``) instead of exchanging.

    Only where every rank runs on one node (one kernel, one page cache; across
    nodes each rank would fetch the whole file over the network) and the
    pages fit comfortably in every rank's view of the available memory.
    """
    from mpi4py import MPI

    if comm.Get_size() == 1 or exchanged_bytes == 0:
        return False
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = node.Get_size() == comm.Get_size()
    node.Free()
    fits = exchanged_bytes <= PAGE_CACHE_MEMORY_FRACTION * _available_memory_bytes()
    return bool(comm.allreduce(int(one_node and fits), op=MPI.MIN))


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


def _exchange(comm: Any, assignment: PieceAssignment, specs: list[TensorSpec], out: dict[int, np.ndarray],
              wanting: list[set[int]]) -> float:
    """Collective: give each rank the pieces the others read of the tensors it wants (``wanting``); return the
    seconds spent on large tensors.

    A tensor one rank wants was read by that rank alone (``assign_readers``): nothing
    to do.  Each large tensor that several want is exchanged in place: broadcast
    from the one rank that read it, or all-gathered from the several whose
    ranges it straddles.  Small whole tensors are packed into one buffer that
    every rank gets.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return 0.0
    shared = [i for i in range(len(specs)) if len(wanting[i]) > 1 and assignment.pieces[i]]
    small = [i for i in shared if len(assignment.pieces[i]) == 1 and specs[i].nbytes < SPLIT_MIN_BYTES]
    t_large = time.perf_counter()
    exchanges = []
    for i in shared:
        if i in small:
            continue
        spec = specs[i]
        counts, displs = [0] * size, [0] * size
        for p in assignment.pieces[i]:
            lo, hi = spec.block_range_rows(p.block_lo, p.block_hi)
            counts[p.rank], displs[p.rank] = (hi - lo) * spec.row_bytes, lo * spec.row_bytes
        exchanges.append((out[i], counts, displs))
    _allgatherv_inplace(comm, exchanges)
    t_large = time.perf_counter() - t_large
    if small:
        by_rank: list[list[int]] = [[] for _ in range(size)]
        for i in small:
            by_rank[assignment.pieces[i][0].rank].append(i)
        counts = [sum(specs[i].nbytes for i in ids) for ids in by_rank]
        displs = [sum(counts[:r]) for r in range(size)]
        packed = np.empty(sum(counts), dtype=np.uint8)
        pos = displs[rank]
        for i in by_rank[rank]:
            packed[pos:pos + specs[i].nbytes] = out[i].reshape(-1).view(np.uint8)
            pos += specs[i].nbytes
        _allgatherv_inplace(comm, [(packed, counts, displs)])
        for r, ids in enumerate(by_rank):
            pos = displs[r]
            for i in ids:
                out[i].reshape(-1).view(np.uint8)[:] = packed[pos:pos + specs[i].nbytes]
                pos += specs[i].nbytes
    return t_large
