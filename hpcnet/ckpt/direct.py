"""Data of contiguous HDF5 datasets moved with pwrite/pread at their file offsets, hashed in threads.

HDF5 decides the layout (every dataset of a checkpoint is contiguous,
unfiltered and, with ``ALIGN_BYTES``, aligned); the bytes themselves need no
HDF5: each rank writes (reads) its rows at ``offset + row * row_bytes`` with
``os.pwrite`` (``os.preadv``), in chunks of whole hash blocks that a small
thread pool moves and hashes at once.  Both ``os.pwrite``/``os.preadv`` and
the checksums (on large slices) release the GIL, so the chunks overlap with each
other and with the disk.  On a save, writeback of each chunk starts as soon as
it is in the page cache (``sync_file_range``), so the final fsync waits only
for the tail; on a load, several reads are in flight at once.  The file stays a
plain HDF5 file: HDF5 and h5py read it as if h5py had written the data.
"""

import ctypes
import ctypes.util
import errno
import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from hpcnet.ckpt.schema import hash_view

IO_THREADS = 4
"""Most threads of one rank that move and hash chunks (``CheckpointManager`` gives each rank its share of
the node's cores, up to this).  More threads than cores only fight over them: with one core a rank, one
thread each writes and hashes faster than two or four."""
CHUNK_BYTES = 8 << 20
"""Bytes one thread moves and hashes in one task (rounded to whole hash blocks)."""
HASH_AFTER_BYTES = 1 << 20
"""On a read, bytes hashed straight after they arrive, while still in the CPU's cache (whole hash blocks, at
least one): 256 MB read and hashed from the page cache took 0.053-0.060 s a rank in 1 MiB steps, 0.057-0.169 s
in 8 MiB ones (2 ranks at once, benchmarks/2026-12-06-checkpoint-load.md)."""
ALIGN_BYTES = 1 << 20
"""Datasets of at least this many bytes start at a multiple of it in the file (page- and stripe-aligned)."""

_SYNC_FILE_RANGE_WRITE = 2


def _libc(name: str, argtypes: list[object]) -> object | None:
    """The C library's function ``name`` (Linux), returning an int, or None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


_START_WRITEBACK = _libc("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing these dirty pages now (no wait; nothing where unsupported)."""
    if _START_WRITEBACK is not None:
        _START_WRITEBACK(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # a hint: an error shows at the fsync


_FALLOCATE = _libc("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])


def allocate(fd: int, offset: int, nbytes: int) -> bool:
    """Allocate the blocks of ``[offset, offset + nbytes)`` of ``fd`` now, so that no later write there can
    run out of space: True once done, False where the file system cannot (nothing is written to emulate it,
    unlike ``posix_fallocate``).  Raises OSError (ENOSPC, EDQUOT) when there is no room."""
    if _FALLOCATE is None:
        return False
    if nbytes <= 0:
        return True
    while _FALLOCATE(fd, 0, offset, nbytes) != 0:
        code = ctypes.get_errno()
        if code in (errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        if code != errno.EINTR:
            raise OSError(code, os.strerror(code))
    return True


def chunk_bounds(nbytes: int, block_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """Byte ranges ``[lo, hi)`` covering ``nbytes``, each whole blocks of ``block_bytes`` (the last may be short)."""
    if nbytes <= 0:
        return []
    step = max(1, chunk_bytes // block_bytes) * block_bytes
    return [(lo, min(lo + step, nbytes)) for lo in range(0, nbytes, step)]


def _as_bytes(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` of ``fd`` (``os.pwrite`` may write less than asked)."""
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _write_chunk(fd: int, view: memoryview, offset: int, block_bytes: int, hash_name: str | None) -> bytes:
    pwrite_all(fd, view, offset)
    start_writeback(fd, offset, len(view))
    return b"" if hash_name is None else hash_view(view, block_bytes, hash_name)


def _read_chunk(fd: int, view: memoryview, offset: int, block_bytes: int, hash_name: str) -> bytes:
    # No POSIX_FADV_WILLNEED for the next chunk: the kernel's own readahead of a
    # sequential reader (``open_for_reading``) already runs ahead, and asking on top
    # of it slows the reads down.  Each stretch of about HASH_AFTER_BYTES is hashed
    # as soon as it is read, while it is still in the CPU's cache.
    step = max(1, HASH_AFTER_BYTES // block_bytes) * block_bytes
    hashes = []
    done = 0
    while done < len(view):
        end = min(done + step, len(view))
        start = done
        while done < end:
            got = os.preadv(fd, [view[done:end]], offset + done)
            if got == 0:
                raise ValueError(f"file ends at byte {offset + done}, inside a dataset (truncated?)")
            done += got
        hashes.append(hash_view(view[start:end], block_bytes, hash_name))
    return b"".join(hashes)


def _submit(pool: ThreadPoolExecutor, fn: object, fd: int, data: np.ndarray, offset: int,
            block_bytes: int, hash_name: str | None) -> list[Future]:
    view = _as_bytes(data)
    return [pool.submit(fn, fd, view[lo:hi], offset + lo, block_bytes, hash_name)  # type: ignore[arg-type]
            for lo, hi in chunk_bounds(len(view), block_bytes)]


def submit_write(pool: ThreadPoolExecutor, fd: int, data: np.ndarray, offset: int, block_bytes: int,
                 hashed: bool = True) -> list[Future]:
    """Queue ``data`` to be written at ``offset`` of ``fd`` and, when ``hashed``, hashed (``format.HASH_NAME``);
    ``collect`` the futures (no hashes when not ``hashed``)."""
    return _submit(pool, _write_chunk, fd, data, offset, block_bytes, "" if hashed else None)


def submit_read(pool: ThreadPoolExecutor, fd: int, target: np.ndarray, offset: int, block_bytes: int,
                hash_name: str = "") -> list[Future]:
    """Queue reading ``target``'s bytes (C-contiguous, writable) from ``offset`` of ``fd`` and hashing them
    with the file's checksum ``hash_name`` (default ``format.HASH_NAME``)."""
    if not target.flags.c_contiguous or not target.flags.writeable:
        raise ValueError("target must be C-contiguous and writable")
    return _submit(pool, _read_chunk, fd, target, offset, block_bytes, hash_name)


def submit_hash(pool: ThreadPoolExecutor, data: np.ndarray, block_bytes: int, hash_name: str = "") -> list[Future]:
    """Queue hashing ``data``'s blocks alone (nothing moved)."""
    view = _as_bytes(data)
    return [pool.submit(hash_view, view[lo:hi], block_bytes, hash_name)
            for lo, hi in chunk_bounds(len(view), block_bytes)]


def collect(futures: list[Future]) -> np.ndarray:
    """The block hashes (uint64) of the chunks of one ``submit_*``, in order; re-raises a chunk's error."""
    return np.frombuffer(b"".join(f.result() for f in futures), dtype="<u8").copy()


def open_for_reading(path: object) -> int:
    """A descriptor of ``path`` for reading ranges front to back (the kernel reads ahead more)."""
    fd = os.open(path, os.O_RDONLY)  # type: ignore[arg-type]
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return fd


def pool(threads: int = 0) -> ThreadPoolExecutor:
    """The threads that move and hash chunks: ``threads``, or ``IO_THREADS`` when 0."""
    return ThreadPoolExecutor(threads or IO_THREADS, thread_name_prefix="hpcnet-checkpoint-io")
