"""Damage on purpose, for ``fault.corrupt_checkpoint`` (``hpcnet.fault.inject``): bytes flipped inside a tensor of
the newest committed checkpoint, below HDF5, as bit rot would.  The file still opens; only the block checksums
can tell, so ``--resume auto`` must pass it over and take the previous one.

Where a checkpoint's bytes lie is this package's knowledge (its listing, its datasets' offsets): the injector
decides when, and calls this through the hook it is handed.
"""

import os
from pathlib import Path
from typing import Any

from hpcnet.ckpt.listing import scan
from hpcnet.ckpt.validate import open_read

CORRUPT_BYTES = 64
"""Bytes flipped in the middle of a dataset: inside one checksum block, so the read fails there."""


def corrupt_newest(directory: Path) -> str:
    """Flip ``CORRUPT_BYTES`` bytes in the largest dataset of the last committed checkpoint.

    The bytes are overwritten in place below HDF5 (at the dataset's file
    offset), so the file still opens and only checksum verification can
    notice.  Returns what was corrupted, or '' when there is no checkpoint.
    """
    import h5py

    infos = [i for i in scan(directory)[0] if i.kind != "unreadable"]
    if not infos:
        return ""
    path = Path(infos[-1].path)  # the last committed
    found: list[tuple[int, str, int]] = []  # (bytes, name, file offset)

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset) and obj.id.get_offset() is not None and obj.id.get_storage_size():
            found.append((obj.id.get_storage_size(), name, obj.id.get_offset()))

    with open_read(path) as f:
        f.visititems(visit)
    tensors = [d for d in found if d[1].startswith("tensors/")]
    if not (tensors or found):
        raise RuntimeError(f"fault injection: {path} has no dataset with contiguous storage to corrupt")
    size, name, offset = max(tensors or found)
    count = min(CORRUPT_BYTES, size)
    where = offset + (size - count) // 2
    fd = os.open(path, os.O_RDWR)
    try:
        data = bytearray(os.pread(fd, count, where))
        os.pwrite(fd, bytes(b ^ 0xFF for b in data), where)
        os.fsync(fd)
    finally:
        os.close(fd)
    return f"{path} (dataset /{name}: {count} bytes flipped at file offset {where})"
