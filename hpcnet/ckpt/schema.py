"""The checkpoint file format as pure logic: names, dtypes, blocks, who writes and reads which, chains.

Nothing here communicates or touches HDF5; ``write``, ``read`` and ``listing`` do.  The
layout of one checkpoint file (``ckpt-<step>.h5``)::

    /                      attrs: format, format_version, kind ('full' | 'incremental'),
                           step, uid, parent, parent_uid, base, base_uid, world_size,
                           hash, created_unix, index_sha256, meta_sha256, and seq (the
                           save's place in its directory's commit order; absent in files
                           of hpcnet before 0.2, which are ordered by created_unix)
    /index                 uint8: JSON list of tensors (name, dtype, shape, block_rows,
                           hash_offset, n_hashes): the source of truth for the datasets
    /meta                  uint8: JSON of the caller's meta plus meta["checkpoint"]
    /hashes                uint64: the attribute ``hash``'s checksum of every block, tensor
                           after tensor (incremental: of the changed blocks only); see HASHES
    /blocks                int64, incremental only: the changed block numbers, aligned with /hashes
    /rank_state            uint8 (world_size, width): rank r's JSON in row r, padded with spaces
    /rank_state_hashes     uint64 (world_size,): hash of each row
    /tensors/<name>        full: the logical shape; incremental: the changed rows, packed
                           (block after block); absent when nothing changed

A *block* is ``block_rows`` consecutive rows (first-dimension slices) of a
tensor, at least ``BLOCK_BYTES``: the unit of hashing, of change detection and
of the pieces each rank writes or reads.
"""

import hashlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

if TYPE_CHECKING:
    import torch

FORMAT = "hpcnet.checkpoint"
FORMAT_VERSION = 1
HASHES: dict[str, Callable[[Any], int]] = {
    "xxh3-64": xxhash.xxh3_64_intdigest,
    "sha256-64": lambda data: int.from_bytes(hashlib.sha256(data).digest()[:8], "little"),
}
"""Block checksums by the name a file's ``hash`` attribute gives, each a function of a buffer to its uint64.
``xxh3-64`` (XXH3, 64 bits) is what hpcnet writes: several times faster than sha256 even with the CPU's SHA
extensions, so that hashing adds next to nothing to a save's or a load's time beside the disk (see
benchmarks/README.md).  The checksums guard against damage (a torn or flipped block) and find
the blocks an increment changed; neither needs a cryptographic hash: a file's writer can rewrite its
checksums too, whatever they are.  ``sha256-64`` (the first 8 bytes of sha256, little-endian) is what
hpcnet wrote before; such files still read and verify."""
HASH_NAME = "xxh3-64"
"""The checksum new files are written with."""
BLOCK_BYTES = 1024
"""Smallest block.  Sparse updates touch whole rows at random (an embedding
lookup), so a block of one row is what makes an increment small; rows shorter
than this are grouped, because below this size the per-block cost (a hash
call, 16 bytes of hash and index) stops being small against the data."""
LARGE_BLOCK_BYTES = 1 << 20
"""Smallest block where no increment will ever compare blocks (``CheckpointManager(full_every=1)``):
fewer, larger hash calls (each has a fixed cost besides its bytes) and a smaller /hashes table.  Readers take each
tensor's ``block_rows`` from /index, so files with either block size read alike."""
SPLIT_MIN_BYTES = 256 << 10
"""Tensors this large are split by blocks across all ranks and written
collectively; smaller ones are written whole by one rank each, independently,
so a model of many small tensors makes no flood of tiny collective writes.
Whole tensors can unbalance the ranks by at most the largest of them, so the
cut is low enough to keep that a few percent of a typical model."""
WRITE_PIECE_BYTES = 64 << 20
"""Largest piece one rank passes to one h5py write call: h5py holds its global
lock for a whole call, and other threads (the data loader) must get a turn."""
MAX_NAME_CHARS = 1024
MAX_JSON_BYTES = 256 << 20

_COMPONENT_RE = re.compile(r"^[A-Za-z0-9_.:+\-]+$")
ROW_PIECE = re.compile(r"^(?P<key>.+):(?P<lo>[0-9]+)-(?P<hi>[0-9]+)$")
"""The name of rows lo to hi of a tensor stored in row pieces: ``optim/<index>/<key>:<lo>-<hi>`` holds those rows
of the optimizer state ``optim/<index>/<key>`` of a parameter cut into row ranges (``dist.zero``), and
``model/<key>:<lo>-<hi>`` those of the parameter itself (``dist.zero=3``)."""
FEEDBACK_PREFIX = "feedback/"
"""The names of int8's error-feedback residuals (``dist.compression=int8``):
``feedback/<rank>/<bucket>/<chunk>/<worker|server>``, each held by its rank."""
UID_RE = re.compile(r"^[0-9a-f]{32}$")

# torch dtype name -> (numpy storage dtype, raw).  ``raw`` dtypes have no HDF5
# equivalent: the dataset holds their bits and an attribute ``dtype`` says what they are.
DTYPES: dict[str, tuple[str, bool]] = {
    "float64": ("<f8", False), "float32": ("<f4", False), "float16": ("<f2", False),
    "bfloat16": ("<u2", True),
    "int64": ("<i8", False), "int32": ("<i4", False), "int16": ("<i2", False), "int8": ("|i1", False),
    "uint64": ("<u8", False), "uint32": ("<u4", False), "uint16": ("<u2", False), "uint8": ("|u1", False),
    "bool": ("|u1", True),
    "float8_e4m3fn": ("|u1", True), "float8_e5m2": ("|u1", True),
}

_RAW_AS_INT = {"<u2": "int16", "|u1": "uint8"}
"""A raw dtype's storage -> the torch integer dtype of that width, through which its bits reach numpy.

The views between tensors and storage arrays live next to ``DTYPES`` because they are its other half:
what the table says is stored, they produce and read back (torch is imported where used: listing and
inspecting checkpoints need no torch)."""


def dtype_name(tensor: "torch.Tensor") -> str:
    return str(tensor.dtype).removeprefix("torch.")


def to_storage(host: "torch.Tensor") -> np.ndarray:
    """A numpy view, in the storage dtype, of a contiguous CPU tensor."""
    import torch

    storage, raw = DTYPES[dtype_name(host)]
    if raw:
        return host.view(getattr(torch, _RAW_AS_INT[storage])).numpy().view(storage)
    return host.numpy().view(storage)


def from_storage(array: np.ndarray, dtype: str) -> "torch.Tensor":
    """The torch tensor (sharing memory) that ``array`` stores for ``dtype``."""
    import torch

    storage, raw = DTYPES[dtype]
    if raw:
        return torch.from_numpy(array.view(np.dtype(_RAW_AS_INT[storage]))).view(getattr(torch, dtype))
    return torch.from_numpy(array.view(array.dtype.newbyteorder("=")))


def check_tensor_name(name: str) -> None:
    """Raise ValueError unless ``name`` can be an HDF5 path below /tensors."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise ValueError(f"tensor name {name!r} must be a string of 1 to {MAX_NAME_CHARS} characters")
    for part in name.split("/"):
        if part in (".", "..") or not _COMPONENT_RE.match(part):
            raise ValueError(f"tensor name {name!r}: each '/'-separated part must match [A-Za-z0-9_.:+-]+ "
                             "and not be '.' or '..'")


def check_names_nest(names: list[str]) -> None:
    """Raise ValueError if a name is also a group of another (``a/b`` and ``a/b/c``) or repeats."""
    seen = set(names)
    if len(seen) != len(names):
        raise ValueError("tensor names repeat")
    for name in names:
        parts = name.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in seen:
                raise ValueError(f"tensor name {'/'.join(parts[:i])!r} is also a group in {name!r}")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What is known of one tensor before its data: name, dtype, logical shape, blocks."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    block_rows: int

    @property
    def storage(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype][0])

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * self.storage.itemsize

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def n_blocks(self) -> int:
        return -(-self.rows // self.block_rows) if self.nbytes else 0

    def block_range_rows(self, block_lo: int, block_hi: int) -> tuple[int, int]:
        """Rows ``[lo, hi)`` covered by blocks ``[block_lo, block_hi)``."""
        return block_lo * self.block_rows, min(block_hi * self.block_rows, self.rows)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "block_rows": self.block_rows}


def make_spec(name: str, dtype: str, shape: tuple[int, ...], block_bytes: int = BLOCK_BYTES) -> TensorSpec:
    """The spec of a tensor about to be saved; blocks of at least ``block_bytes`` (whole rows)."""
    check_tensor_name(name)
    if dtype not in DTYPES:
        raise ValueError(f"tensor {name!r}: dtype {dtype} is not supported in checkpoints "
                         f"(supported: {', '.join(DTYPES)})")
    row_bytes = math.prod(shape[1:]) * np.dtype(DTYPES[dtype][0]).itemsize
    block_rows = max(1, -(-block_bytes // row_bytes)) if row_bytes else 1
    return TensorSpec(name, dtype, tuple(int(s) for s in shape), block_rows)


@dataclass(frozen=True, slots=True)
class Piece:
    """Blocks ``[block_lo, block_hi)`` of one tensor, written (or read) by ``rank``."""

    rank: int
    block_lo: int
    block_hi: int


@dataclass(frozen=True, slots=True)
class PieceAssignment:
    """Who writes (and reads) which blocks of which tensor: per tensor, its pieces in rank order."""

    world_size: int
    pieces: tuple[tuple[Piece, ...], ...]
    split: tuple[bool, ...]
    """Per tensor: split across every rank (each has at least one block) and written collectively."""
    rank_bytes: tuple[int, ...]

    def of_rank(self, rank: int) -> list[tuple[int, Piece]]:
        """``(tensor index, piece)`` of every piece given to ``rank``, in tensor order."""
        return [(i, p) for i, pieces in enumerate(self.pieces) for p in pieces if p.rank == rank]


def assign_writers(specs: list[TensorSpec], world_size: int, *, split_min_bytes: int = SPLIT_MIN_BYTES,
                   fixed: dict[int, int] | None = None) -> PieceAssignment:
    """Assign every block of every tensor to exactly one rank, about 1/N of the bytes each (pure).

    ``fixed`` (tensor index -> rank) tensors go whole to that rank: the only
    rank that holds them (``dist.zero``'s sharded optimizer state).  Of the
    others, tensors of at least ``split_min_bytes`` with at least
    ``world_size`` blocks are cut into ``world_size`` contiguous block ranges,
    one per rank in rank order, and the rest go whole to the least-loaded
    rank, largest first.  Deterministic: equal inputs give equal assignments on
    every rank.
    """
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    fixed = fixed or {}
    for i, rank in fixed.items():
        if not 0 <= rank < world_size:
            raise ValueError(f"tensor {specs[i].name!r} is held by rank {rank}, not one of {world_size}")
    loads = [0] * world_size
    pieces: list[tuple[Piece, ...]] = [()] * len(specs)
    split = [False] * len(specs)
    whole = []
    for i, spec in enumerate(specs):
        n = spec.n_blocks
        if n == 0:
            continue
        if i in fixed:
            pieces[i] = (Piece(fixed[i], 0, n),)
            loads[fixed[i]] += spec.nbytes
        elif spec.nbytes >= split_min_bytes and n >= world_size:
            cuts = [r * n // world_size for r in range(world_size + 1)]
            pieces[i] = tuple(Piece(r, cuts[r], cuts[r + 1]) for r in range(world_size))
            split[i] = True
            for r in range(world_size):
                lo, hi = spec.block_range_rows(cuts[r], cuts[r + 1])
                loads[r] += (hi - lo) * spec.row_bytes
        else:
            whole.append(i)
    for i in sorted(whole, key=lambda i: (-specs[i].nbytes, specs[i].name)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        pieces[i] = (Piece(rank, 0, specs[i].n_blocks),)
        loads[rank] += specs[i].nbytes
    return PieceAssignment(world_size, tuple(pieces), tuple(split), tuple(loads))


def assign_readers(specs: list[TensorSpec], wanting: list[set[int]] | list[frozenset[int]], world_size: int
                   ) -> PieceAssignment:
    """Who reads which blocks of a checkpoint on a load (pure): each rank one contiguous run of the file.

    A tensor no rank wants is not read; one that a single rank wants is read
    whole by that rank (nothing to exchange: ``dist.zero``'s own optimizer
    state).  The others, taken in index order - the order the writer created
    them, which HDF5 allocated in increasing offsets for every dataset large
    enough to matter (``direct.ALIGN_BYTES``) - form one stream of bytes cut
    into ``world_size`` consecutive ranges, so that each rank reads one
    stretch of the file: a tensor is split only where a cut falls inside it.
    Each rank's range is sized to even out the bytes it reads, counting the
    tensors only it wants.  Cutting every tensor across every rank (as a save
    does, ``assign_writers``) makes each rank's reads strided, which reads
    markedly slower than one run each (see benchmarks/README.md).
    """
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    loads = [0] * world_size
    pieces: list[tuple[Piece, ...]] = [()] * len(specs)
    shared = []
    for i, (spec, ranks) in enumerate(zip(specs, wanting)):
        if spec.n_blocks == 0 or not ranks:
            continue
        if len(ranks) == 1:
            (rank,) = ranks
            if not 0 <= rank < world_size:
                raise ValueError(f"tensor {spec.name!r} is wanted by rank {rank}, not one of {world_size}")
            pieces[i] = (Piece(rank, 0, spec.n_blocks),)
            loads[rank] += spec.nbytes
        else:
            shared.append(i)
    stream = sum(specs[i].nbytes for i in shared)
    share = [max(0, (stream + sum(loads)) / world_size - load) for load in loads]
    scale = stream / sum(share) if sum(share) else 0.0
    cuts = [0.0]
    for s in share:
        cuts.append(cuts[-1] + s * scale)
    position = 0
    for i in shared:
        spec = specs[i]
        block_bytes = spec.block_rows * spec.row_bytes
        # Block numbers where each rank's range starts, rounded to the nearest block boundary.
        starts = [min(spec.n_blocks, max(0, round((cut - position) / block_bytes))) for cut in cuts[1:-1]]
        bounds = [0, *starts, spec.n_blocks]
        pieces[i] = tuple(Piece(r, bounds[r], bounds[r + 1]) for r in range(world_size) if bounds[r + 1] > bounds[r])
        for p in pieces[i]:
            lo, hi = spec.block_range_rows(p.block_lo, p.block_hi)
            loads[p.rank] += (hi - lo) * spec.row_bytes
        position += spec.nbytes
    return PieceAssignment(world_size, tuple(pieces), tuple(len(p) > 1 for p in pieces), tuple(loads))


def write_pieces(rows_per_rank: list[int], piece_rows_max: int) -> int:
    """How many collective calls split a tensor whose ranks own ``rows_per_rank`` rows (pure).

    Every rank must pass a non-empty selection to every call, so never more
    calls than the smallest share has rows.
    """
    wanted = max(1, -(-max(rows_per_rank) // max(1, piece_rows_max)))
    return max(1, min(wanted, min(rows_per_rank)))


def block_hashes(data: np.ndarray, block_bytes: int, hash_name: str = "") -> np.ndarray:
    """The checksum ``hash_name`` (default ``HASH_NAME``) of each ``block_bytes`` slice of ``data``'s bytes
    (the last may be short), as uint64."""
    view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    return np.frombuffer(hash_view(view, block_bytes, hash_name), dtype="<u8").copy()


def hash_view(view: memoryview, block_bytes: int, hash_name: str = "") -> bytes:
    """``block_hashes`` of a byte view, as the little-endian bytes of the uint64s.

    Both checksums release the GIL on large slices, so other threads run meanwhile."""
    digest = HASHES[hash_name or HASH_NAME]
    n = -(-len(view) // block_bytes)
    return b"".join(digest(view[i * block_bytes:(i + 1) * block_bytes]).to_bytes(8, "little") for i in range(n))


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- the index ----------------------------------------------------------------

def parse_index(text: Any, kind: str) -> list[dict[str, Any]]:
    """Validate the decoded /index JSON of a ``kind`` checkpoint; raise ValueError naming the fault."""
    if not isinstance(text, list):
        raise ValueError("/index is not a list")
    entries = []
    names = []
    expect_offset = 0
    for n, entry in enumerate(text):
        if not isinstance(entry, dict) or set(entry) != {"name", "dtype", "shape", "block_rows", "hash_offset",
                                                          "n_hashes"}:
            raise ValueError(f"/index entry {n} has unexpected keys")
        name, dtype, shape = entry["name"], entry["dtype"], entry["shape"]
        check_tensor_name(name)
        if dtype not in DTYPES:
            raise ValueError(f"/index entry {name!r}: unknown dtype {dtype!r}")
        if (not isinstance(shape, list) or len(shape) > 32
                or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**48 for s in shape)):
            raise ValueError(f"/index entry {name!r}: bad shape {shape!r}")
        for key in ("block_rows", "hash_offset", "n_hashes"):
            value = entry[key]
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**48:
                raise ValueError(f"/index entry {name!r}: bad {key} {value!r}")
        spec = TensorSpec(name, dtype, tuple(shape), entry["block_rows"])
        if spec.block_rows < 1 or spec.nbytes >= 2**50:
            raise ValueError(f"/index entry {name!r}: bad block_rows or size")
        if entry["hash_offset"] != expect_offset or entry["n_hashes"] > spec.n_blocks or (
                kind == "full" and entry["n_hashes"] != spec.n_blocks):
            raise ValueError(f"/index entry {name!r}: hash_offset/n_hashes do not fit the blocks")
        expect_offset += entry["n_hashes"]
        names.append(name)
        entries.append({"spec": spec, "hash_offset": entry["hash_offset"], "n_hashes": entry["n_hashes"]})
    check_names_nest(names)
    check_row_pieces([e["spec"] for e in entries])
    return entries


def check_row_pieces(specs: list[TensorSpec]) -> None:
    """Raise ValueError unless each row piece of optimizer state or of a parameter (``ROW_PIECE``) holds the rows
    its name says, and the pieces of each state, in one dtype and row shape, cover its rows from 0 once each,
    with no whole tensor of that name beside them: a reader joins them by their names."""
    names = {spec.name for spec in specs}
    pieces: dict[str, list[tuple[int, int, TensorSpec]]] = {}
    for spec in specs:
        piece = ROW_PIECE.match(spec.name) if spec.name.startswith(("optim/", "model/")) else None
        if piece is None:
            continue
        lo, hi = int(piece["lo"]), int(piece["hi"])
        if not spec.shape or lo >= hi or spec.shape[0] != hi - lo:
            raise ValueError(f"/index entry {spec.name!r}: shape {list(spec.shape)} does not hold the rows {lo} to "
                             f"{hi} its name says")
        pieces.setdefault(piece["key"], []).append((lo, hi, spec))
    for key, parts in pieces.items():
        if key in names:
            raise ValueError(f"/index: {key!r} is stored both whole and in row pieces")
        parts.sort(key=lambda part: part[0])
        at, first = 0, parts[0][2]
        for lo, hi, spec in parts:
            if lo != at:
                raise ValueError(f"/index entry {spec.name!r}: the row pieces of {key!r} "
                                 f"{'leave out' if lo > at else 'repeat'} rows at {min(lo, at)} to {max(lo, at)}")
            if (spec.dtype, spec.row_shape) != (first.dtype, first.row_shape):
                raise ValueError(f"/index entry {spec.name!r}: dtype {spec.dtype} and rows of {list(spec.row_shape)}, "
                                 f"other pieces of {key!r} {first.dtype} and {list(first.row_shape)}")
            at = hi


def piece_name(name: str, lo: int, hi: int) -> str:
    """The name of rows ``lo`` to ``hi`` of tensor ``name`` stored in row pieces (``ROW_PIECE``)."""
    return f"{name}:{lo}-{hi}"


def split_pieces(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[tuple[int, int, Any]]]]:
    """``values`` by name (or state key) into those that are not row pieces, and the pieces of each base name:
    ``"<name>:<lo>-<hi>"`` -> ``{"<name>": [(lo, hi, value), ...]}``."""
    plain: dict[str, Any] = {}
    pieces: dict[str, list[tuple[int, int, Any]]] = {}
    for key, value in values.items():
        piece = ROW_PIECE.match(key)
        if piece is None:
            plain[key] = value
        else:
            pieces.setdefault(piece["key"], []).append((int(piece["lo"]), int(piece["hi"]), value))
    return plain, pieces


def rows_of(parts: list[tuple[int, int, "torch.Tensor"]], lo: int, hi: int, what: str) -> "torch.Tensor":
    """Rows ``lo`` to ``hi`` made of row pieces ``(lo, hi, tensor)``; ValueError naming ``what`` when they do not
    cover them."""
    import torch

    chunks, at = [], lo
    for p_lo, p_hi, tensor in sorted(parts, key=lambda part: part[0]):
        if p_hi <= at or p_lo >= hi:
            continue
        if p_lo > at:
            break
        chunks.append(tensor[at - p_lo:min(hi, p_hi) - p_lo])
        at = min(hi, p_hi)
        if at == hi:
            break
    if at != hi:
        raise ValueError(f"{what}: rows {at} to {hi} are in none of the checkpoint's pieces")
    return chunks[0].clone() if len(chunks) == 1 else torch.cat(chunks)


def join_pieces(tensors: dict[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """``tensors`` (a loaded checkpoint's) with the row pieces of each cut tensor (``ROW_PIECE``) joined into one
    tensor under the unsharded name: the names and values an unsharded run saves, each joined tensor where its
    first piece was (a state dict keeps its order).  ValueError when a tensor's pieces leave rows out."""
    _, pieces = split_pieces(tensors)
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        piece = ROW_PIECE.match(name)
        if piece is None:
            out[name] = value
        elif piece["key"] not in out:
            parts = pieces[piece["key"]]
            out[piece["key"]] = rows_of(parts, 0, max(hi for _, hi, _ in parts), piece["key"])
    return out


def packed_rows(spec: TensorSpec, blocks: np.ndarray) -> int:
    """Rows of the packed dataset holding ``blocks`` (sorted) of ``spec`` in an increment."""
    if len(blocks) == 0:
        return 0
    last = int(blocks[-1])
    lo, hi = spec.block_range_rows(last, last + 1)
    return (len(blocks) - 1) * spec.block_rows + (hi - lo)


# --- checkpoints on disk: chains and retention -------------------------------

@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One committed checkpoint file, as listed from its root attributes."""

    step: int
    path: str
    kind: str
    """'full', 'incremental', or 'unreadable' (then ``error`` says why)."""
    base: str | None = None
    """File name of the full checkpoint an incremental builds on (None for a full one)."""
    parent: str | None = None
    """File name of the checkpoint an incremental is a difference to."""
    uid: str = ""
    parent_uid: str = ""
    base_uid: str = ""
    world_size: int = 0
    error: str | None = None
    seq: int = 0
    """Place in the directory's commit order (0 in files written before hpcnet recorded it)."""
    created_unix: float = 0.0

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def commit_order(self) -> tuple[float, float, int, str]:
        """Sort key of the order in which checkpoints were committed (not their step).

        A fresh run that reused a directory, or a rollback, makes steps go back
        while commits go on.  An unreadable file's order is unknown: it sorts
        last, so a resume tries it first and sets it aside with the rest.
        """
        if self.kind == "unreadable":
            return (math.inf, math.inf, self.step, self.name)
        return (self.seq, self.created_unix, self.step, self.name)


def resolve_chain(infos: list[CheckpointInfo], target: CheckpointInfo) -> list[CheckpointInfo]:
    """The files to read for ``target``: its full base first, then each increment (pure).

    Raises ValueError naming the missing or replaced link.
    """
    by_name = {info.name: info for info in infos}
    chain = [target]
    seen = {target.name}
    while chain[-1].kind == "incremental":
        child = chain[-1]
        parent = by_name.get(child.parent or "")
        if parent is None or parent.kind == "unreadable":
            why = "is missing" if parent is None else f"is unreadable ({parent.error})"
            raise ValueError(f"{child.name} builds on {child.parent}, which {why}")
        if parent.uid != child.parent_uid:
            raise ValueError(f"{child.name} builds on {child.parent}, but that file was replaced by another save")
        if parent.name in seen or len(chain) > 100_000:
            raise ValueError(f"{child.name}: the chain of increments loops")
        seen.add(parent.name)
        chain.append(parent)
    if target.kind == "incremental" and (chain[-1].name != target.base or chain[-1].uid != target.base_uid):
        raise ValueError(f"{target.name}: its chain ends at {chain[-1].name}, not at its base {target.base}")
    if chain[-1].kind != "full":
        raise ValueError(f"{target.name}: cannot be read ({chain[-1].error})")
    return chain[::-1]


def checkpoints_to_prune(infos: list[CheckpointInfo], keep: int) -> list[CheckpointInfo]:
    """The checkpoints to delete so that the newest ``keep`` full ones and their increments stay (pure).

    Newest means last committed (``CheckpointInfo.commit_order``), not
    highest step.  Only readable checkpoints committed before the oldest kept
    full one are candidates, and none that a kept increment builds on
    (through any number of links) is deleted, even after a rollback mixed chains.
    """
    if keep < 1:
        raise ValueError("keep must be at least 1")
    ordered = sorted(infos, key=lambda i: i.commit_order)
    fulls = [i for i in ordered if i.kind == "full"]
    if len(fulls) <= keep:
        return []
    cut = ordered.index(fulls[-keep])
    doomed = {i.name for i in ordered[:cut] if i.kind != "unreadable"}
    by_name = {i.name: i for i in ordered}
    for info in ordered[cut:]:
        link = info
        while link.kind == "incremental" and link.parent in by_name:
            link = by_name[link.parent]
            doomed.discard(link.name)
    return [i for i in ordered if i.name in doomed]


def committed_after(infos: list[CheckpointInfo], target: CheckpointInfo) -> list[CheckpointInfo]:
    """The checkpoints committed after ``target`` (pure): what a run that continues from it abandons."""
    return [i for i in infos if i.name != target.name and i.commit_order > target.commit_order]
