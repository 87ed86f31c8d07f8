"""The user's arrays for ``hpcnet.data.convert``: ``.npy`` files and ``.npz`` members, checked against the archive.

An ``.npz`` archive records each member's size and CRC-32; numpy's ``np.load`` refuses a member that
does not match them. The converter reads members its own way, so it checks the same things itself:

- before anything is read, the member's stored size must be what its ``.npy`` header implies (header
  bytes plus rows x row bytes), so a header that claims more or wider rows never reads into the next
  member or past the end of the file;
- a stored member (``np.savez``) in C order is memory-mapped, and its CRC-32 is computed from the very
  bytes the conversion reads, block by block, with no second read (``MemberCheck``); the conversion
  verifies it before its output is committed;
- any other member (``np.savez_compressed``, Fortran order, empty) is read whole through ``zipfile``,
  which checks the CRC-32 when it reaches the member's recorded size and never inflates past it, and
  only when that size is at most ``whole_member_limit_bytes()``.

Every failure is a ``DatasetError`` that names the file and the member.
"""

import io
import math
import os
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcnet.errors import DatasetError

WHOLE_MEMBER_SHARE = 4
"""A member read whole (compressed, Fortran order) may inflate to at most 1/this of the machine's memory:
inputs and targets then take at most half of it, whatever the archive claims."""
_READ_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class Arrays:
    """An (inputs, targets) pair to convert and the names that locate each in error messages."""

    inputs: np.ndarray
    """As stored in the user's file (``channels_last`` says how the conversion lays its rows out)."""
    targets: np.ndarray
    inputs_name: str
    """E.g. ``"data.npz: array 'x'"`` or ``"X.npy"``."""
    targets_name: str
    checks: "tuple[MemberCheck | None, MemberCheck | None]" = (None, None)
    """The CRC-32 checks of memory-mapped ``.npz`` members (inputs, targets); None where nothing is pending."""
    channels_last: bool = False
    """Image inputs are [N, H, W, C]: the conversion stores each block as [N, C, H, W]."""

    def __len__(self) -> int:
        return len(self.inputs)


# ---------------------------------------------------------------------------
# CRC-32 of rows read in any order (zlib's crc32_combine, vectorised over rows)

_POLY = 0xEDB88320
"""The CRC-32 polynomial in zlib's reflected bit order."""


def _multmodp(a: int, b: int) -> int:
    """``a(x) * b(x)`` modulo the polynomial (zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
        m >>= 1
    return p


def _x8nmodp(n: int) -> int:
    """``x^(8n)`` modulo the polynomial: what a CRC is multiplied by when ``n`` bytes follow it."""
    p, power = 1 << 31, 1 << 30  # x^0, x^1
    for _ in range(3):
        power = _multmodp(power, power)  # x^8
    while n:
        if n & 1:
            p = _multmodp(power, p)
        n >>= 1
        power = _multmodp(power, power)
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)`` (zlib's ``crc32_combine``)."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


def _shift_tables(nbytes: int) -> np.ndarray:
    """Four byte-indexed tables that multiply CRCs by ``x^(8 nbytes)`` (the map is linear over GF(2))."""
    a = _x8nmodp(nbytes)
    basis = [_multmodp(a, 1 << bit) for bit in range(32)]
    byte = np.arange(256)
    tables = np.zeros((4, 256), np.uint32)
    for k in range(4):
        for bit in range(8):
            tables[k] ^= np.where((byte >> bit) & 1, basis[8 * k + bit], 0).astype(np.uint32)
    return tables


def _shift(crcs: np.ndarray, tables: np.ndarray) -> np.ndarray:
    return (tables[0][crcs & 0xFF] ^ tables[1][(crcs >> 8) & 0xFF] ^ tables[2][(crcs >> 16) & 0xFF]
            ^ tables[3][crcs >> 24])


def _byte_table() -> np.ndarray:
    """zlib's table: the CRC of each byte value."""
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(_POLY), table >> 1).astype(np.uint32)
    return table


_TABLE = _byte_table()


def row_crcs(block: np.ndarray) -> np.ndarray:
    """The CRC-32 of each row of a C-contiguous block (uint32, one per row)."""
    rows = np.ascontiguousarray(block).reshape(len(block), -1).view(np.uint8)
    if rows.shape[1] > 16:  # zlib, a call per row (a byte column at a time costs more from about 16 bytes)
        return np.fromiter((zlib.crc32(row) for row in rows), np.uint32, len(rows))
    crc = np.full(len(rows), 0xFFFFFFFF, np.uint32)  # short rows (labels): a byte column at a time
    for column in rows.T:
        crc = _TABLE[(crc ^ column) & 0xFF] ^ (crc >> 8)
    return crc ^ np.uint32(0xFFFFFFFF)


def fold_rows(crcs: np.ndarray, row_bytes: int) -> int:
    """The CRC-32 of rows laid end to end, from each row's CRC-32 (every row ``row_bytes`` long).

    Pairs are combined level by level, every pair of a level with the same shift, so the work is a few
    numpy passes however many rows there are.
    """
    crcs = np.asarray(crcs, np.uint32)
    tail: list[tuple[int, int]] = []  # pieces set aside at the end, right to left: (crc, length)
    length = row_bytes
    while len(crcs) > 1:
        if len(crcs) % 2:
            tail.append((int(crcs[-1]), length))
            crcs = crcs[:-1]
        crcs = _shift(crcs[0::2], _shift_tables(length)) ^ crcs[1::2]
        length *= 2
    crc = int(crcs[0]) if len(crcs) else 0
    for piece, piece_bytes in reversed(tail):
        crc = crc32_combine(crc, piece, piece_bytes)
    return crc


class MemberCheck:
    """The CRC-32 of one memory-mapped ``.npz`` member, from the rows the conversion reads.

    Rows read in order (slices, one after the other) extend a running CRC; rows read in any other order
    (``--shuffle``) each get their own, folded together at the end. Either way each row's bytes are the
    ones the conversion converts, read once.
    """

    def __init__(self, where: str, array: np.ndarray, header: bytes, expected_crc: int) -> None:
        self.where = where
        """E.g. ``"data.npz: member 'x.npy' (array 'x')"``."""
        self.array = array
        self._header_crc = zlib.crc32(header)
        self._expected = expected_crc
        self._crc = self._header_crc
        self._next = 0  # rows read in order so far
        self._row_crcs: np.ndarray | None = None  # rows read out of order: each row's CRC
        self._seen: np.ndarray | None = None

    def see(self, block: np.ndarray, rows: np.ndarray | slice) -> None:
        """Take in ``block``, the member's rows ``rows`` as read for conversion (C-contiguous)."""
        if isinstance(rows, slice) and self._row_crcs is None and rows.start == self._next:
            self._crc = zlib.crc32(np.ascontiguousarray(block).view(np.uint8).reshape(-1), self._crc)
            self._next = rows.stop
            return
        if self._row_crcs is None:
            if self._next:  # a conversion reads a member either in order or shuffled, never both
                raise AssertionError(f"{self.where}: rows read in order, then out of order")
            self._row_crcs = np.zeros(len(self.array), np.uint32)
            self._seen = np.zeros(len(self.array), bool)
        index = np.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows
        self._row_crcs[index] = row_crcs(block)
        self._seen[index] = True

    def verify(self, *, complete: bool = False) -> None:
        """Raise ``DatasetError`` unless the member's bytes have the CRC-32 the archive records.

        Args:
            complete: read the rows the conversion did not get to first (after a conversion stopped
                early, so damage is named as damage rather than as the bad value it made).
        """
        n = len(self.array)
        if complete:
            step = max(1, _READ_BYTES // max(1, self.array[0].nbytes))
            if self._row_crcs is None:
                for lo in range(self._next, n, step):
                    self.see(np.array(self.array[lo:min(n, lo + step)]), slice(lo, min(n, lo + step)))
            else:
                missing = np.flatnonzero(~self._seen)
                for lo in range(0, len(missing), step):
                    rows = missing[lo:lo + step]
                    self.see(np.array(self.array[rows]), rows)
        if self._row_crcs is None:
            if self._next != n:
                raise AssertionError(f"{self.where}: rows {self._next}..{n} were never read")
            crc = self._crc
        else:
            if not self._seen.all():
                raise AssertionError(f"{self.where}: {int((~self._seen).sum())} rows were never read")
            row_bytes = self.array[0].nbytes
            crc = crc32_combine(self._header_crc, fold_rows(self._row_crcs, row_bytes), n * row_bytes)
        if crc != self._expected:
            raise DatasetError(f"{self.where} is damaged: CRC-32 {crc:08x} of its bytes, but the archive records "
                               f"{self._expected:08x} (np.load refuses it too); make the archive again")


# ---------------------------------------------------------------------------
# reading members


def whole_member_limit_bytes() -> int:
    """The most a member read whole may inflate to: ``1/WHOLE_MEMBER_SHARE`` of this machine's memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // WHOLE_MEMBER_SHARE


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _npy_header(fh: io.IOBase, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Shape, Fortran order and dtype from the ``.npy`` header at ``fh``'s position."""
    try:
        version = np.lib.format.read_magic(fh)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"format version {version[0]}.{version[1]}; numpy writes numbers as 1.0 or 2.0")
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        return read(fh)
    except (ValueError, EOFError) as exc:
        raise DatasetError(f"{where} is not a .npy array ({exc})") from exc


def _data_start(fh: io.BufferedReader, info: zipfile.ZipInfo, where: str) -> int:
    """Where a member's bytes begin in the archive: after its local header, name and extra field."""
    fh.seek(info.header_offset)
    local = fh.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise DatasetError(f"{where} is damaged: no local header where the archive's directory puts it")
    return info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")


def _read_member(path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo, name: str
                 ) -> tuple[np.ndarray, MemberCheck | None]:
    """One member: memory-mapped with a pending ``MemberCheck`` where it is stored in C order, else read whole."""
    where = f"{path}: member {info.filename!r} (array {name!r})"
    try:
        if info.compress_type == zipfile.ZIP_STORED:
            with open(path, "rb") as fh:  # not through zipfile: it would check the CRC of a small member early
                start = _data_start(fh, info, where)
                fh.seek(start)
                shape, fortran_order, dtype = _npy_header(fh, where)
                header_bytes = fh.tell() - start
                fh.seek(start)
                header = fh.read(header_bytes)
                end = fh.seek(0, io.SEEK_END)
            nbytes = _check_size(info, where, shape, dtype, header_bytes)
            if start + info.file_size > end:
                raise DatasetError(f"{where} is cut short: the file ends {start + info.file_size - end:,} bytes "
                                   "before the member does")
            if not fortran_order and nbytes:
                array = np.memmap(path, dtype=dtype, mode="r", offset=start + header_bytes, shape=shape)
                return array, MemberCheck(where, array, header, info.CRC)
        with archive.open(info) as stream:
            shape, fortran_order, dtype = _npy_header(stream, where)
            nbytes = _check_size(info, where, shape, dtype, stream.tell())
            limit = whole_member_limit_bytes()
            if nbytes > limit:
                how = "compressed" if info.compress_type != zipfile.ZIP_STORED else "in Fortran order"
                raise DatasetError(f"{where} is {how} and inflates to {_size(nbytes)}, more than the {_size(limit)} "
                                   f"a {how} member may take (1/{WHOLE_MEMBER_SHARE} of this machine's memory: it "
                                   "is read whole); save it with np.savez, in C order, or as .npy files, which "
                                   "are converted from the file a block at a time")
            array = np.empty(shape, dtype, order="F" if fortran_order else "C")
            # zipfile stops at the recorded size and checks the CRC-32 when it gets there.
            view = memoryview(array.T if fortran_order else array).cast("B") if nbytes else memoryview(b"")
            done = 0
            while done < nbytes:
                got = stream.readinto(view[done:done + _READ_BYTES])
                if not got:
                    raise EOFError(f"the member ends after {done:,} of {nbytes:,} bytes")
                done += got
            stream.read(1)  # an empty member's CRC is checked here
            return array, None
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise DatasetError(f"{where} is damaged ({exc}); make the archive again") from exc


def _check_size(info: zipfile.ZipInfo, where: str, shape: tuple[int, ...], dtype: np.dtype, header_bytes: int
                ) -> int:
    """The bytes of a member's array, after checking its header against the sizes the archive records."""
    if dtype.hasobject:
        raise DatasetError(f"{where} cannot be read without pickle (dtype object: Python objects, which are not "
                           "safe to load); store numbers, not Python objects")
    nbytes = math.prod(shape) * dtype.itemsize
    if header_bytes + nbytes != info.file_size or (
            info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size):
        raise DatasetError(f"{where} is damaged: its .npy header says {list(shape)} {dtype} "
                           f"({header_bytes + nbytes:,} bytes with the header), but the archive holds "
                           f"{info.file_size:,} bytes for it")
    return nbytes


def load_npz(path: str | Path, inputs: str, targets: str) -> Arrays:
    """The arrays named ``inputs`` and ``targets`` of an ``.npz`` archive.

    Members written by ``np.savez`` are memory-mapped, with their CRC-32 check pending until the
    conversion has read them (``Arrays.checks``); those of ``np.savez_compressed`` are read whole and
    checked, up to ``whole_member_limit_bytes()``.

    Args:
        path: the archive.
        inputs: the name of the inputs array (``--inputs``).
        targets: the name of the targets array (``--targets``).

    Raises:
        DatasetError: the file is missing or not an .npz, an array is missing (the names present are
            listed), or a member is damaged, holds Python objects or is too large to read whole.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file" if not path.exists() else f"{path}: not a regular file")
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise DatasetError(f"{path}: not an .npz archive ({exc})") from exc
    with archive:
        members = {info.filename.removesuffix(".npy"): info for info in archive.infolist()
                   if info.filename.endswith(".npy")}
        found = []
        for option, name in (("--inputs", inputs), ("--targets", targets)):
            if name not in members:
                present = ", ".join(repr(n) for n in sorted(members)) or "no arrays"
                raise DatasetError(f"{path}: no array named {name!r} ({option}); the file holds {present}")
            found.append(_read_member(path, archive, members[name], name))
    (x, x_check), (y, y_check) = found
    return Arrays(x, y, f"{path}: array {inputs!r}", f"{path}: array {targets!r}", checks=(x_check, y_check))


def _load_npy(path: Path, option: str) -> np.ndarray:
    if not path.is_file():
        raise DatasetError(f"{path} ({option}): no such file" if not path.exists()
                           else f"{path} ({option}): not a regular file")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:
        # Object arrays, and any file that is not .npy (np.load then takes it for a pickle).
        raise DatasetError(f"{path} ({option}): not a .npy file of numbers ({exc})") from exc
    except OSError as exc:
        raise DatasetError(f"{path} ({option}): cannot read it ({exc})") from exc
    if isinstance(array, np.lib.npyio.NpzFile):
        array.close()
        raise DatasetError(f"{path} ({option}) is an .npz archive; pass it as --npz with --inputs and --targets")
    return array


def load_npy_pair(inputs: str | Path, targets: str | Path, *, options: tuple[str, str] = (
        "--inputs-npy", "--targets-npy")) -> Arrays:
    """Two ``.npy`` files, memory-mapped (a ``.npy`` file records no checksum to verify).

    Args:
        inputs: the inputs file.
        targets: the targets file.
        options: the command-line options that named them, for messages.

    Raises:
        DatasetError: a file is missing or not a .npy file of numbers.
    """
    inputs, targets = Path(inputs), Path(targets)
    return Arrays(_load_npy(inputs, options[0]), _load_npy(targets, options[1]), str(inputs), str(targets))
