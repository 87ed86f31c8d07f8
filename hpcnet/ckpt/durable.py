"""Small files replaced atomically and durably (stdlib only: the torch- and h5py-free supervisor writes them too).

A file is written under a fresh name, created exclusively and never through a link (the directory may be writable
by others), fsync'd, renamed over its target, and the directory fsync'd: a reader sees the old content or the new,
and a crash after the return keeps the new.
"""

import os
import secrets
from pathlib import Path

from hpcnet.paths import TMP_SUFFIX


def fsync_path(path: Path) -> None:
    """Fsync a file or a directory (a rename is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, text: str) -> None:
    """Make ``text`` the content of ``path``, atomically and durably."""
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(8)}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with open(fd, "w", closefd=False) as handle:
            handle.write(text)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_path(path.parent)
