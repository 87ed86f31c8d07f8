"""The collective file create of a checkpoint with the GIL released.

h5py calls ``H5Fcreate`` holding the GIL, and ``H5Pset_fapl_mpio`` (which
duplicates the communicator).  Over MPI-IO both calls are collective: they
wait inside ``MPI_Comm_dup`` and ``MPI_File_open`` for every rank, so while one
rank is late, or cut off by the network, no other Python thread of the
waiting ranks runs, their heartbeat monitors included.  A rank that left the
ranks' meeting before the create just as its host was cut off then sits in
``MPI_File_open`` without a monitor until the checkpoint deadline.

``create_file`` makes the same calls through ``ctypes``, which releases the
GIL for the duration of a foreign call, into the HDF5 library that h5py
itself is linked against (found through h5py's ``h5f`` extension module, so
the two share one library and its state), holding h5py's own lock (``phil``)
as h5py would, so that no other thread enters HDF5 meanwhile.  The file
access list is h5py's (``h5py.h5p``), the result an ordinary ``h5py.File``.
Where the library cannot be reached so (an HDF5 without the symbol),
``available()`` is False and the caller uses h5py's own create.

A failed create raises OSError with HDF5's error stack as its text (read
through ``H5Ewalk2``, its innermost message as h5py quotes it), where ``hpcnet.errors.errno_of`` finds an errno that
the stack names, as in h5py's own messages.
"""

import ctypes
import functools
import os
from pathlib import Path
from typing import Any

_HID = ctypes.c_int64
_H5P_DEFAULT = 0
_H5E_DEFAULT = 0
_H5E_WALK_DOWNWARD = 1


class _ErrorRecord(ctypes.Structure):
    """HDF5's ``H5E_error2_t``."""

    _fields_ = [("cls_id", _HID), ("maj_num", _HID), ("min_num", _HID), ("line", ctypes.c_uint),
                ("func_name", ctypes.c_char_p), ("file_name", ctypes.c_char_p), ("desc", ctypes.c_char_p)]


_WALK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ErrorRecord), ctypes.c_void_p)


def _mpi_handle(kind: str) -> Any:
    """The C type of an MPI handle (a pointer in Open MPI, an int in MPICH)."""
    from mpi4py import MPI

    size = MPI._sizeof(getattr(MPI, kind))
    return ctypes.c_void_p if size == ctypes.sizeof(ctypes.c_void_p) else ctypes.c_int


@functools.cache
def _library() -> Any:
    """HDF5's functions, as h5py's ``h5f`` module resolves them (None if not found)."""
    import h5py.h5f

    try:
        lib = ctypes.CDLL(h5py.h5f.__file__)  # dlsym searches the module's dependencies: h5py's libhdf5
        create, walk, mpio = lib.H5Fcreate, lib.H5Ewalk2, lib.H5Pset_fapl_mpio
    except (OSError, AttributeError):
        return None
    create.restype, create.argtypes = _HID, [ctypes.c_char_p, ctypes.c_uint, _HID, _HID]
    mpio.restype, mpio.argtypes = ctypes.c_int, [_HID, _mpi_handle("Comm"), _mpi_handle("Info")]
    walk.restype, walk.argtypes = ctypes.c_int, [_HID, ctypes.c_int, _WALK, ctypes.c_void_p]
    return lib


def available() -> bool:
    """Whether ``create_file`` can call HDF5 with the GIL released here."""
    return _library() is not None


def _error_stack(lib: Any) -> str:
    """The innermost message of HDF5's current error stack (what h5py's messages quote)."""
    texts: list[str] = []

    def visit(_n: int, record: Any, _data: Any) -> int:
        desc = record.contents.desc
        if desc:
            texts.append(" ".join(desc.decode(errors="replace").split()))
        return 0

    lib.H5Ewalk2(_H5E_DEFAULT, _H5E_WALK_DOWNWARD, _WALK(visit), None)
    return texts[-1] if texts else "no HDF5 error recorded"


def create_file(path: Path, comm: Any, *, alignment_threshold: int, alignment_interval: int) -> Any:
    """Collective: ``h5py.File(path, "w", driver="mpio", comm=comm, alignment_...)``, its ``H5Fcreate`` made
    with the GIL released.  Raises OSError if the create fails."""
    import h5py
    from h5py import h5f, h5p
    from h5py._objects import phil
    from mpi4py import MPI

    lib = _library()
    if lib is None:
        raise RuntimeError("HDF5's H5Fcreate is not reachable through ctypes here (check available() first)")
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5f.LIBVER_EARLIEST, h5f.LIBVER_LATEST)  # h5py's default
    fapl.set_alignment(alignment_threshold, alignment_interval)
    with phil:
        # H5Pset_fapl_mpio duplicates the communicator: collective too, and h5py would hold the GIL in it
        if lib.H5Pset_fapl_mpio(fapl.id, MPI._handleof(comm), MPI._handleof(MPI.INFO_NULL)) < 0:
            raise OSError(f"unable to set up MPI-IO for {path} ({_error_stack(lib)})")
        hid = lib.H5Fcreate(os.fsencode(path), h5f.ACC_TRUNC, _H5P_DEFAULT, fapl.id)
        if hid < 0:
            raise OSError(f"unable to create {path} over MPI-IO ({_error_stack(lib)})")
        created = h5f.FileID(hid)
        try:
            return h5py.File(created)  # takes a reference of its own
        finally:
            del created  # ... so that the file's only reference is the File's
