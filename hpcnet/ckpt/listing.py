"""A checkpoint directory's contents: the committed files in commit order, ``latest``, ``aside-`` folders.

Listing opens each file only for its validated root attributes
(``hpcnet.ckpt.validate``); nothing here communicates: the manager calls it on
rank 0 and shares the result.  Torch-free (the tool and fault injection use it).
"""

import contextlib
import os
import time
from pathlib import Path

from hpcnet.ckpt.durable import fsync_path, replace_file
from hpcnet.ckpt.schema import CheckpointInfo
from hpcnet.ckpt.validate import open_read, read_attrs
from hpcnet.paths import ASIDE_PREFIX, CKPT_NAME_RE, CKPT_TMP_RE, LATEST_NAME


def write_latest(directory: Path, name: str) -> None:
    """Point ``latest`` at ``name`` atomically and durably (for people and scripts; loading scans the directory)."""
    replace_file(directory / LATEST_NAME, name + "\n")


def read_info(path: Path) -> CheckpointInfo:
    """The root attributes of one checkpoint file; ``kind='unreadable'`` with ``error`` if it fails."""
    match = CKPT_NAME_RE.match(path.name)
    step = int(match.group(1)) if match else -1
    try:
        with open_read(path) as f:
            a = read_attrs(f, path)
    except Exception as exc:  # noqa: BLE001 - an unreadable file is listed, not fatal
        return CheckpointInfo(step=step, path=str(path), kind="unreadable", error=f"{type(exc).__name__}: {exc}")
    return CheckpointInfo(step=a["step"], path=str(path), kind=a["kind"], base=a["base"] or None,
                          parent=a["parent"] or None, uid=a["uid"], parent_uid=a["parent_uid"],
                          base_uid=a["base_uid"], world_size=a["world_size"], seq=a["seq"],
                          created_unix=a["created_unix"])


def scan(directory: Path) -> tuple[list[CheckpointInfo], list[Path]]:
    """Committed checkpoints in ``directory`` in commit order (oldest first) and uncommitted ``.tmp`` files."""
    committed, stale = [], []
    try:
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return [], []
    for entry in entries:
        if CKPT_NAME_RE.match(entry):
            info = read_info(directory / entry)
            if info.kind == "unreadable" and not os.path.lexists(info.path):
                continue  # deleted since the listing: pruned by the run that saves here, not damaged
            committed.append(info)
        elif CKPT_TMP_RE.match(entry):
            stale.append(directory / entry)
    return sorted(committed, key=lambda i: i.commit_order), stale


def listing(directory: Path) -> list[tuple[str, int]]:
    """Names and sizes of the committed checkpoints in ``directory``, by name (cheap: no file is opened)."""
    try:
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        if CKPT_NAME_RE.match(entry):
            try:
                out.append((entry, os.stat(directory / entry).st_size))
            except FileNotFoundError:
                continue  # deleted while listing
    return out


def set_aside(directory: Path, infos: list[CheckpointInfo], why: str, latest: str | None) -> Path:
    """Move committed checkpoints into a new ``<directory>/aside-<UTC time>-<why>/`` (rank 0; nothing deleted).

    ``latest`` then names the newest checkpoint left (or is removed when none
    is).  Renames within one directory tree are atomic and copy nothing.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    folder = directory / f"{ASIDE_PREFIX}{stamp}-{why}"
    suffix = 1
    while folder.exists():
        suffix += 1
        folder = directory / f"{ASIDE_PREFIX}{stamp}-{why}-{suffix}"
    folder.mkdir()
    (folder / "README.txt").write_text(
        f"hpcnet moved these {len(infos)} checkpoint(s) out of {directory} at {stamp} UTC ({why}).\n"
        "They are complete; to continue from one, pass it to --resume (or move it back).\n")
    for info in infos:
        os.rename(info.path, folder / info.name)
    if latest is not None:
        write_latest(directory, latest)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.rename(directory / LATEST_NAME, folder / LATEST_NAME)
    fsync_path(folder)
    fsync_path(directory)
    return folder
