"""Checks of untrusted checkpoint files, before anything is read or allocated from them.

Every file a listing, a load or the tool opens may be damaged or crafted: the
root attributes, the links, each dataset's layout and size, and the JSON
tables are validated here, in one place, so each reader trusts only what
passed (docs/checkpoints.md).  Torch-free.
"""

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from hpcnet.ckpt.schema import FORMAT, FORMAT_VERSION, HASHES, MAX_JSON_BYTES, UID_RE, parse_index, sha256_hex
from hpcnet.paths import CKPT_NAME_RE, file_kind

_ATTR_TYPES: dict[str, type] = {
    "format": str, "format_version": int, "kind": str, "step": int, "uid": str, "parent": str,
    "parent_uid": str, "base": str, "base_uid": str, "world_size": int, "hash": str,
    "created_unix": float, "index_sha256": str, "meta_sha256": str,
}


_OPTIONAL_ATTRS: dict[str, tuple[type, Any]] = {"seq": (int, 0)}
"""Attributes that files of older hpcnet versions lack, with the value that stands in for them."""


def _attr(f: Any, key: str, kind: type) -> Any:
    if f.attrs.get_id(key).get_storage_size() > 1024:  # before reading it: a crafted file may hold gigabytes
        raise ValueError(f"attribute {key!r} is too large")
    value = f.attrs[key]
    if kind is str:
        if not isinstance(value, str) or len(value) > 256:
            raise ValueError(f"attribute {key!r} is not a short string")
    elif kind is int:
        if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
            raise ValueError(f"attribute {key!r} is not an integer")
        value = int(value)
    elif not isinstance(value, (float, np.floating)):
        raise ValueError(f"attribute {key!r} is not a number")
    return kind(value)


def read_attrs(f: Any, path: Path) -> dict[str, Any]:
    """The validated root attributes of an open checkpoint; ValueError names what is wrong."""
    out: dict[str, Any] = {}
    for key, kind in _ATTR_TYPES.items():
        if key not in f.attrs:
            raise ValueError(f"attribute {key!r} is missing (not an hpcnet checkpoint?)")
        out[key] = _attr(f, key, kind)
    for key, (kind, default) in _OPTIONAL_ATTRS.items():
        out[key] = _attr(f, key, kind) if key in f.attrs else default
    if out["format"] != FORMAT or out["format_version"] != FORMAT_VERSION:
        raise ValueError(f"format {out['format']!r} version {out['format_version']} is not "
                         f"{FORMAT!r} version {FORMAT_VERSION}")
    if out["kind"] not in ("full", "incremental") or out["hash"] not in HASHES:
        raise ValueError(f"unknown kind {out['kind']!r} or hash {out['hash']!r}")
    if (not 0 <= out["step"] < 10**19 or not 1 <= out["world_size"] <= 1 << 24 or not UID_RE.match(out["uid"])
            or not 0 <= out["seq"] < 2**62 or not math.isfinite(out["created_unix"])):
        raise ValueError("step, world_size, uid, seq or created_unix out of range")
    for key in ("parent", "base"):
        if out["kind"] == "incremental" and not (CKPT_NAME_RE.match(out[key]) and UID_RE.match(out[key + "_uid"])):
            raise ValueError(f"attribute {key!r} is not a checkpoint name")
    if not all(len(out[k]) == 64 and all(c in "0123456789abcdef" for c in out[k])
               for k in ("index_sha256", "meta_sha256")):
        raise ValueError("index or meta checksum attribute malformed")
    return out


def open_read(path: Path) -> Any:
    """Open a checkpoint with serial h5py, read-only, no file locks (committed files never change).

    Raises:
        ValueError: ``path`` is a FIFO or a device (opening it could wait forever), before it is opened.
    """
    import h5py

    kind = file_kind(path)
    if kind not in ("file", "missing", "directory"):  # the last two: h5py's own OSError, with its errno
        raise ValueError(f"{str(path)!r} is a {kind}, not a checkpoint file")
    return h5py.File(path, "r", locking=False)


def _check_links(f: Any) -> None:
    """Raise ValueError at the first soft or external link: a checkpoint is one file of hard links.

    An external link would make a read open another file, a soft link read
    another object than the one named.
    """
    import h5py

    found: list[str] = []

    def visit(name: str, link: Any) -> bool | None:
        if not isinstance(link, h5py.HardLink):
            found.append(f"/{name} is {'an external' if isinstance(link, h5py.ExternalLink) else 'a soft'} link")
            return True  # stop the walk
        return None

    f.visititems_links(visit)
    if found:
        raise ValueError(f"{found[0]}, which hpcnet checkpoints never hold")


def checked(f: Any, name: str, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """The dataset ``name``, if it is a plain one of this shape and dtype, all of it stored in this file.

    Checked before anything is read or allocated, so a crafted file cannot make
    a reader allocate what the file does not hold: no filters (they would load
    plugins), no external or virtual storage (other files), no chunks, and the
    stored bytes are exactly what the shape declares and lie inside the file.
    """
    import h5py

    d = f.get(name)
    if not isinstance(d, h5py.Dataset):
        raise ValueError("missing or not a dataset")
    if d.shape != shape or d.dtype != dtype:
        raise ValueError(f"has shape {d.shape} and dtype {d.dtype}, expected {shape} and {dtype}")
    plist = d.id.get_create_plist()
    if d.is_virtual or plist.get_nfilters() or plist.get_external_count():
        raise ValueError("uses filters, external or virtual storage, which hpcnet checkpoints never do")
    if plist.get_layout() not in (h5py.h5d.CONTIGUOUS, h5py.h5d.COMPACT):
        raise ValueError("is chunked, which hpcnet checkpoints never are")
    declared = math.prod(shape) * dtype.itemsize
    stored = d.id.get_storage_size()
    if stored != declared:
        raise ValueError(f"declares {declared} bytes but the file stores {stored}")
    offset = d.id.get_offset() if declared and plist.get_layout() == h5py.h5d.CONTIGUOUS else None
    if offset is not None and offset + declared > f.id.get_filesize():
        raise ValueError(f"declares {declared} bytes at offset {offset}, beyond the end of the file")
    return d


def read_json(f: Any, name: str, digest: str, limit: int = MAX_JSON_BYTES) -> Any:
    """Read a uint8 JSON dataset, check its sha256 against ``digest``, parse it with json.loads only."""
    import h5py

    d = f.get(name)
    if not isinstance(d, h5py.Dataset) or d.ndim != 1 or d.dtype != np.uint8 or d.shape[0] > limit:
        raise ValueError("missing, of the wrong type, or too large")
    raw = checked(f, name, d.shape, np.dtype(np.uint8))[()].tobytes()
    if sha256_hex(raw) != digest:
        raise ValueError("checksum mismatch")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"is not valid JSON ({type(exc).__name__})") from None


def read_header(f: Any, path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Validated root attributes, links and index of an open checkpoint."""
    attrs = read_attrs(f, path)
    _check_links(f)
    try:
        index = parse_index(read_json(f, "index", attrs["index_sha256"]), attrs["kind"])
    except ValueError as exc:
        raise ValueError(f"dataset /index: {exc}") from None
    if attrs["kind"] == "full":
        declared = sum(e["spec"].nbytes for e in index)
        if declared > f.id.get_filesize():
            raise ValueError(f"/index declares {declared} bytes of tensors, but the file has only "
                             f"{f.id.get_filesize()} bytes")
    _check_tables(f, attrs, sum(e["n_hashes"] for e in index))
    return attrs, index


def _check_tables(f: Any, attrs: dict[str, Any], n_hashes: int) -> None:
    """Raise ValueError unless /hashes, /blocks (increments), /rank_state and /rank_state_hashes are plain
    datasets of the shapes the attributes and the index give (``checked``): a reader may trust their type."""
    import h5py

    size = attrs["world_size"]
    tables = {"hashes": ((n_hashes,), "<u8"), "rank_state_hashes": ((size,), "<u8")}
    if attrs["kind"] == "incremental":
        tables["blocks"] = ((n_hashes,), "<i8")
    table = f.get("rank_state")
    width = table.shape[1] if isinstance(table, h5py.Dataset) and table.ndim == 2 else -1
    tables["rank_state"] = ((size, width), "u1")
    for name, (shape, dtype) in tables.items():
        try:
            if name == "rank_state" and width < 0:
                raise ValueError("missing, not a dataset, or not a table of rows")
            checked(f, name, shape, np.dtype(dtype))
        except ValueError as exc:
            raise ValueError(f"dataset /{name}: {exc}") from None
