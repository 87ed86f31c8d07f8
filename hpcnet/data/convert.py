"""Convert the user's arrays, or text files, into an hpcnet HDF5 dataset file.

    python -m hpcnet.data convert --npz data.npz --inputs x --targets y --out data.h5
    python -m hpcnet.data convert --inputs-npy X.npy --targets-npy Y.npy --out data.h5 --eval-fraction 0.2
    python -m hpcnet.data convert --text a.txt b.txt --tokenizer tokenizer.json --seq-len 512 --out data.h5

The arrays are checked before they are trusted (numeric dtypes, matching row counts, the shapes of
the kind, whole non-negative labels below ``num_classes``, finite image inputs), converted a block of
rows at a time from memory-mapped ``.npy`` files (and the stored members of an ``.npz``, whose sizes
and CRC-32 are checked against the archive: ``hpcnet.data.arrays``), so memory stays bounded, and
written through ``hpcnet.data.h5`` (the format's one home) to a temporary name that is renamed into
place only when everything succeeded. Every bad input raises ``DatasetError`` naming the file, the
member, the array or the option; the command line prints it on one line and exits with status 2.
Text files become a token stream (``hpcnet.data.text``) cut into rows of next-token prediction
(``convert_text``), written the same way. docs/data.md."""

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcnet.data.arrays import Arrays, MemberCheck, load_npy_pair, load_npz
from hpcnet.data.cli import run_commands
from hpcnet.data.h5 import atomic_h5, create_split, set_root_attributes
from hpcnet.data.info import DATASET_KINDS
from hpcnet.data.text import BYTES, check_text_files, load_tokenizer, token_rows, token_stream
from hpcnet.errors import DatasetError

CHUNK_BYTES = 16 << 10
"""Target size of one HDF5 chunk of a converted file. The trainer reads a batch as random single rows,
so every row read touches one chunk, and HDF5 reads a whole chunk that fits its 1 MiB chunk cache: small
chunks make a batch of random rows read several times faster than chunks of a whole cache's size."""
BLOCK_BYTES = 32 << 20
"""About how many bytes of input rows are converted at a time: bounds the memory a conversion uses."""
PROGRESS_INTERVAL_S = 5.0
"""How often a long conversion says how far it is, on stderr."""
MAX_INFERRED_CLASSES = 1_000_000
"""The most classes (vocabulary) inferred from the largest label without ``--num-classes``: above every
tokenizer's vocabulary (under 300,000) and every class count of public classification sets (ImageNet-21k:
about 22,000), so a larger label is far more likely a stray value (an id, a timestamp) than a class,
and it would make the model's output layer that wide. ``--num-classes`` says it is meant."""

__all__ = ["Arrays", "Converted", "convert", "convert_text", "load_npy_pair", "load_npz", "main"]


# ---------------------------------------------------------------------------
# checking shapes and dtypes (before anything is written)


def infer_kind(arrays: Arrays) -> str:
    """``"tokens"`` for integer [N, T] inputs with targets of the same shape, else ``"image"``."""
    x, y = arrays.inputs, arrays.targets
    if x.dtype.kind in "iu" and x.ndim == 2 and y.shape == x.shape:
        return "tokens"
    return "image"


def _check_arrays(arrays: Arrays, kind: str) -> None:
    x, y = arrays.inputs, arrays.targets
    for name, a in ((arrays.inputs_name, x), (arrays.targets_name, y)):
        if a.ndim == 0:
            raise DatasetError(f"{name} is a scalar; expected one row per sample")
        if a.size == 0:
            raise DatasetError(f"{name} is empty (shape {list(a.shape)})")
        if a.dtype.kind not in "fiu":
            raise DatasetError(f"{name} has dtype {a.dtype}; expected numbers (floating point or integer)")
    if len(x) != len(y):
        raise DatasetError(f"{arrays.inputs_name} has {len(x)} rows but {arrays.targets_name} has {len(y)}")
    if kind == "image":
        if x.ndim < 2:
            raise DatasetError(f"{arrays.inputs_name} has shape {list(x.shape)}; image inputs must be [N, ...] "
                               "with at least one value per row, e.g. [N, C, H, W]")
        if y.ndim != 1:
            raise DatasetError(f"{arrays.targets_name} has shape {list(y.shape)}; image targets must be one "
                               "class per row, [N] (y.reshape(-1) if it is [N, 1])")
    else:
        if x.dtype.kind not in "iu":
            raise DatasetError(f"{arrays.inputs_name} has dtype {x.dtype}; token inputs must be integers")
        if x.ndim != 2:
            raise DatasetError(f"{arrays.inputs_name} has shape {list(x.shape)}; token inputs must be [N, T]")
        if y.shape != x.shape:
            raise DatasetError(f"{arrays.targets_name} has shape {list(y.shape)}; token targets must have the "
                               f"shape of the inputs, {list(x.shape)}")


def _check_eval_matches(train: Arrays, eval_: Arrays, kind: str) -> None:
    for attr in ("inputs", "targets"):
        a, b = getattr(train, attr), getattr(eval_, attr)
        if a.shape[1:] != b.shape[1:]:
            raise DatasetError(f"{getattr(eval_, attr + '_name')} has rows of shape {list(b.shape[1:])} but "
                               f"{getattr(train, attr + '_name')} has {list(a.shape[1:])}")
    if kind == "tokens" and eval_.inputs.dtype.kind not in "iu":
        raise DatasetError(f"{eval_.inputs_name} has dtype {eval_.inputs.dtype}; token inputs must be integers")


def _stored_dtypes(arrays: Arrays, kind: str) -> tuple[np.dtype, np.dtype]:
    """The file's dtypes: float32 image inputs (what the trainer computes in); integers keep their own
    width, in native byte order; whole-number float labels become int64."""
    def integer(dtype: np.dtype) -> np.dtype:
        return dtype.newbyteorder("=") if dtype.kind in "iu" else np.dtype(np.int64)

    inputs = np.dtype(np.float32) if kind == "image" else integer(arrays.inputs.dtype)
    return inputs, integer(arrays.targets.dtype)


# ---------------------------------------------------------------------------
# converting a block of rows at a time


def _first_bad(mask: np.ndarray) -> int:
    """The first row of a block with a True anywhere in it."""
    return int(np.flatnonzero(mask.reshape(len(mask), -1).any(axis=1))[0])


class _Labels:
    """Checks label (and token) values block by block and keeps the largest seen."""

    def __init__(self, num_classes: int | None) -> None:
        self.num_classes = num_classes
        self.max_seen = -1

    def check(self, values: np.ndarray, name: str, source_rows: np.ndarray) -> np.ndarray:
        """``values`` as integers, after checking they are whole, >= 0 and < num_classes.

        Float labels are checked as floats, before the cast, so a value beyond the integers (1e20) is
        named as it is written.

        Args:
            values: a block of rows.
            name: the array, for messages.
            source_rows: each row's number in the user's array, for messages.
        """
        if values.dtype.kind == "f":
            whole = np.isfinite(values) & (values == np.floor(values))
            if not whole.all():
                i = _first_bad(~whole)
                bad = values[i][~whole[i]] if values.ndim > 1 else values[i]
                raise DatasetError(f"{name} holds {np.ravel(bad)[0]} at row {source_rows[i]}; labels must be "
                                   "whole numbers")
        low, high = values.min(), values.max()
        if low < 0:
            raise DatasetError(f"{name} holds {low} (row {source_rows[_first_bad(values < 0)]}); labels must "
                               "be >= 0")
        if self.num_classes is not None and high >= self.num_classes:
            raise DatasetError(f"{name} holds {high} (row {source_rows[_first_bad(values >= self.num_classes)]}), "
                               f"outside [0, {self.num_classes}) given by --num-classes")
        if self.num_classes is None and high >= MAX_INFERRED_CLASSES:
            row = source_rows[_first_bad(values >= MAX_INFERRED_CLASSES)]
            if high >= 2**63 - 1:  # no --num-classes could hold it
                raise DatasetError(f"{name} holds {high} (row {row}); labels must be below 2**63 - 1 "
                                   "(num_classes is stored as an int64)")
            raise DatasetError(f"{name} holds {high} (row {row}); num_classes would be {int(high) + 1}: give "
                               f"--num-classes {int(high) + 1} if that is meant (without it labels must be below "
                               f"{MAX_INFERRED_CLASSES:,})")
        self.max_seen = max(self.max_seen, int(high))
        return values.astype(np.int64) if values.dtype.kind == "f" else values


def _rows(array: np.ndarray, rows: np.ndarray | slice, check: MemberCheck | None) -> np.ndarray:
    """The rows of a block; those of an ``.npz`` member are copied once into memory and that copy is
    what its CRC-32 check sees and the conversion converts."""
    if isinstance(rows, slice):
        return np.asarray(array[rows]) if check is None else np.array(array[rows])
    # A memory map reads fastest front to back: gather in sorted order, then put the rows back in order.
    order = np.argsort(rows, kind="stable")
    out = np.empty((len(rows), *array.shape[1:]), dtype=array.dtype)
    out[order] = array[rows[order]]
    return out


def _channels_first_shape(arrays: Arrays) -> tuple[int, ...]:
    shape = arrays.inputs.shape[1:]
    return (shape[2], shape[0], shape[1]) if arrays.channels_last else shape


def _write_split(f: h5py.File, split: str, arrays: Arrays, rows: np.ndarray | slice, count: int, kind: str,
                 labels: _Labels, progress: "_Progress") -> None:
    x_dtype, y_dtype = _stored_dtypes(arrays, kind)
    x_src, y_src = arrays.inputs, arrays.targets
    inputs, targets = create_split(f, split, ((count, *_channels_first_shape(arrays)), x_dtype),
                                   ((count, *y_src.shape[1:]), y_dtype), chunk_bytes=CHUNK_BYTES)
    row_bytes = x_src[0].nbytes + y_src[0].nbytes
    chunk_rows = inputs.chunks[0]
    # Whole chunks of inputs per block, so no input chunk is written twice.
    block = max(chunk_rows, BLOCK_BYTES // max(1, row_bytes) // chunk_rows * chunk_rows)
    for lo in range(0, count, block):
        hi = min(count, lo + block)
        source = slice(rows.start + lo, rows.start + hi) if isinstance(rows, slice) else rows[lo:hi]
        # Messages name a row by its number in the user's array, shuffled or not.
        source_rows = np.arange(source.start, source.stop) if isinstance(source, slice) else source
        x, y = _rows(x_src, source, arrays.checks[0]), _rows(y_src, source, arrays.checks[1])
        for check, read in zip(arrays.checks, (x, y)):
            if check is not None:
                check.see(read, source)
        if arrays.channels_last:
            x = x.transpose(0, 3, 1, 2)  # [N, H, W, C] -> [N, C, H, W], as it is copied below
        if kind == "image":
            x = np.ascontiguousarray(x, dtype=x_dtype)
            finite = np.isfinite(x)
            if not finite.all():  # after the cast: a float64 beyond float32's range is inf here
                raise DatasetError(f"{arrays.inputs_name} holds a non-finite value (nan or inf, or too large "
                                   f"for float32) at row {source_rows[_first_bad(~finite)]}")
        else:
            x = labels.check(x, arrays.inputs_name, source_rows)
        y = labels.check(y, arrays.targets_name, source_rows)
        inputs[lo:hi] = np.ascontiguousarray(x, dtype=x_dtype)
        targets[lo:hi] = np.ascontiguousarray(y, dtype=y_dtype)
        progress.advance(hi - lo)


class _Progress:
    """A line on stderr every ``PROGRESS_INTERVAL_S`` while a long conversion runs; silent for short ones."""

    def __init__(self, total_rows: int, quiet: bool) -> None:
        self.total, self.done, self.quiet = total_rows, 0, quiet
        self.start = self.last = time.monotonic()

    def advance(self, rows: int) -> None:
        self.done += rows
        now = time.monotonic()
        if not self.quiet and now - self.last >= PROGRESS_INTERVAL_S:
            self.last = now
            rate = self.done / (now - self.start)
            print(f"converting: {self.done}/{self.total} rows ({100 * self.done / self.total:.0f}%), "
                  f"{(self.total - self.done) / rate:.0f} s left", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Converted:
    """What ``convert`` wrote."""

    path: Path
    kind: str
    num_classes: int
    train_rows: int
    eval_rows: int


def convert(out: str | Path, train: Arrays, eval_arrays: Arrays | None = None, *, eval_fraction: float = 0.1,
            kind: str | None = None, num_classes: int | None = None, shuffle: bool = False, seed: int = 0,
            overwrite: bool = False, quiet: bool = True, provenance: dict[str, Any] | None = None) -> Converted:
    """Write ``train`` (and ``eval_arrays``, or a fraction of ``train``) as an hpcnet dataset file.

    Args:
        out: the ``.h5`` file to write, atomically.
        train: the training rows, or all rows when ``eval_arrays`` is None.
        eval_arrays: the evaluation rows; None takes the last ``eval_fraction`` of ``train``'s rows.
        eval_fraction: the share of ``train``'s rows held out, in (0, 1); only without ``eval_arrays``.
        kind: ``"image"`` or ``"tokens"``; None infers it (``infer_kind``).
        num_classes: classes (vocabulary size for tokens); None takes the largest label + 1, which must
            then be at most ``MAX_INFERRED_CLASSES``.
        shuffle: shuffle the rows before the eval rows are taken, so the held-out rows are a random
            sample (the trainer shuffles the training rows itself); only without ``eval_arrays``.
        seed: the shuffle's seed.
        overwrite: replace ``out`` if it exists.
        quiet: False prints progress lines to stderr during long conversions.
        provenance: more root attributes (they replace the default ``source``).

    Raises:
        DatasetError: naming the file, array or option that is wrong; ``out`` is then left as it was.
    """
    out = Path(out)
    _check_out(out, overwrite)
    if kind is not None and kind not in DATASET_KINDS:
        raise DatasetError(f"--kind must be one of {', '.join(DATASET_KINDS)}, got {kind!r}")
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int)
                                    or not 1 <= num_classes < 2**63):  # stored as an int64 attribute
        raise DatasetError(f"--num-classes must be a positive integer below 2**63, got {num_classes!r}")
    kind = kind or infer_kind(train)
    _check_arrays(train, kind)
    total = len(train)
    if eval_arrays is None:
        _check_eval_fraction(eval_fraction)
        num_eval = round(total * eval_fraction)
        if not 0 < num_eval < total:
            raise DatasetError(f"--eval-fraction {eval_fraction} of {total} rows leaves "
                               f"{'no eval rows' if num_eval == 0 else 'no training rows'}; "
                               "both splits need at least one")
        order = np.random.default_rng(seed).permutation(total) if shuffle else None
        num_train = total - num_eval
        splits = [("train", train, slice(0, num_train) if order is None else order[:num_train], num_train),
                  ("eval", train, slice(num_train, total) if order is None else order[num_train:], num_eval)]
    else:
        if shuffle:
            raise DatasetError("--shuffle only decides which rows --eval-fraction holds out; with separate "
                               "eval arrays there is nothing to shuffle (the trainer shuffles training rows)")
        _check_arrays(eval_arrays, kind)
        _check_eval_matches(train, eval_arrays, kind)
        splits = [("train", train, slice(0, total), total),
                  ("eval", eval_arrays, slice(0, len(eval_arrays)), len(eval_arrays))]
    labels = _Labels(num_classes)
    progress = _Progress(sum(count for *_, count in splits), quiet)
    sources = sorted({f"{a.inputs_name}, {a.targets_name}" for _, a, _, _ in splits})
    checks = [check for arrays in {id(a): a for _, a, _, _ in splits}.values() for check in arrays.checks if check]
    with atomic_h5(out) as f:
        try:
            for split, arrays, rows, count in splits:
                _write_split(f, split, arrays, rows, count, kind, labels, progress)
        except DatasetError:
            for check in checks:  # a value made by damage is named as the damage: finish reading, then verify
                check.verify(complete=True)
            raise
        for check in checks:  # before anything is committed
            check.verify()
        found = num_classes if num_classes is not None else labels.max_seen + 1
        set_root_attributes(f, kind, found, generator="hpcnet.data.convert",
                            **{"source": "; ".join(sources), "shuffled": bool(shuffle), "seed": seed,
                               **(provenance or {})})
        if not overwrite and out.exists():  # appeared while converting: do not clobber someone's file
            raise DatasetError(f"--out {out} was created by someone else during the conversion; not replaced")
    return Converted(out, kind, found, splits[0][3], splits[1][3])


def _check_out(out: Path, overwrite: bool) -> None:
    if out.is_dir():
        raise DatasetError(f"--out {out} is a directory; give the .h5 file to write")
    if out.exists() and not overwrite:
        raise DatasetError(f"--out {out} exists; pass --force to replace it")


def _check_eval_fraction(eval_fraction: float) -> None:
    if not 0 < eval_fraction < 1:
        raise DatasetError(f"--eval-fraction must be between 0 and 1 (exclusive), got {eval_fraction!r}")


def _file_list(paths: Sequence[Path], max_chars: int = 4096) -> str:
    """The files, ``"a.txt; b.txt"``, cut short with how many more: an HDF5 attribute holds at most 64 KiB."""
    listed: list[str] = []
    for name in map(str, paths):
        if sum(map(len, listed)) + 2 * len(listed) + len(name) + 40 > max_chars:  # 40: room for "; and N more"
            return "; ".join([*listed, f"and {len(paths) - len(listed)} more"])
        listed.append(name)
    return "; ".join(listed)


def convert_text(out: str | Path, files: Sequence[str | Path], *, seq_len: int, tokenizer: str | Path = BYTES,
                 eval_fraction: float = 0.1, shuffle: bool = False, seed: int = 0, overwrite: bool = False,
                 quiet: bool = True, piece_bytes: int | None = None) -> Converted:
    """Write text files as an hpcnet tokens dataset file of next-token rows (``hpcnet.data.text``).

    The files' tokens, joined into one stream (the tokenizer's end-of-text token between two files), are cut
    into consecutive windows of ``seq_len + 1``: inputs the first ``seq_len`` tokens of each, targets the last
    ``seq_len``; the tail shorter than a window is left out. ``num_classes`` is the vocabulary size and the
    tokens are stored in the smallest unsigned integer type that holds it.

    Args:
        out: the ``.h5`` file to write, atomically.
        files: the UTF-8 text files (any bytes with ``"bytes"``), in order.
        seq_len: tokens per row, at least 1.
        tokenizer: ``"bytes"`` (every byte a token, vocabulary 256) or the path of a Hugging Face
            ``tokenizer.json``.
        eval_fraction: the share of the rows held out, in (0, 1): the last ones (the end of the stream), or a
            random sample with ``shuffle``.
        shuffle: shuffle the rows before the eval rows are taken.
        seed: the shuffle's seed.
        overwrite: replace ``out`` if it exists.
        quiet: False says on stderr how many tokens there are and how many are left out, and how far a long
            conversion is.
        piece_bytes: the size of the pieces the files are read in; None is ``hpcnet.data.text.PIECE_BYTES``.

    Raises:
        DatasetError: naming the file or option that is wrong; ``out`` is then left as it was.
    """
    out = Path(out)
    _check_out(out, overwrite)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise DatasetError(f"--seq-len must be a positive integer, got {seq_len!r}")
    _check_eval_fraction(eval_fraction)
    paths = check_text_files(files)
    text_tokenizer = load_tokenizer(tokenizer)
    source = f"--text {paths[0]}" + (f" and {len(paths) - 1} more" if len(paths) > 1 else "")
    with token_stream(paths, text_tokenizer, out, quiet=quiet, piece_bytes=piece_bytes) as tokens:
        num_tokens = len(tokens)
        rows, left_out = divmod(num_tokens, seq_len + 1)
        if rows == 0:
            raise DatasetError(f"{source} gives {num_tokens} tokens (--tokenizer {text_tokenizer.name}), fewer than "
                               f"one row of --seq-len {seq_len} takes: {seq_len + 1}, the inputs and one more target")
        done = convert(out, token_rows(tokens, seq_len, source), eval_fraction=eval_fraction, kind="tokens",
                       num_classes=text_tokenizer.vocab_size, shuffle=shuffle, seed=seed, overwrite=overwrite,
                       quiet=quiet, provenance={"source": _file_list(paths), "tokenizer": text_tokenizer.name,
                                                "seq_len": seq_len, "end_of_text": text_tokenizer.end_of_text or ""})
    if not quiet:
        between = ("nothing" if text_tokenizer.end_of_text is None else text_tokenizer.end_of_text) + " between files"
        print(f"{num_tokens:,} tokens from {len(paths)} file(s) (--tokenizer {text_tokenizer.name}, "
              f"vocabulary {text_tokenizer.vocab_size:,}, {between}): {rows:,} rows of {seq_len} + 1; the "
              f"last {left_out:,} tokens, less than a row, are left out", file=sys.stderr, flush=True)
    return done


# ---------------------------------------------------------------------------
# command line


def add_convert_command(commands: Any) -> None:
    """Add ``convert`` to the subcommands of a ``python -m hpcnet.data`` parser.

    Args:
        commands: what ``ArgumentParser.add_subparsers`` returned.
    """
    cmd = commands.add_parser(
        "convert", help="convert .npz/.npy arrays or text files into an hpcnet dataset file",
        description="Convert your arrays or text files into an hpcnet HDF5 dataset file (docs/data.md). Give "
                    "--npz with --inputs and --targets, or --inputs-npy and --targets-npy, or --text with "
                    "--seq-len.")
    src = cmd.add_argument_group("the data")
    src.add_argument("--npz", type=Path, help="an .npz archive (np.savez) holding the arrays")
    src.add_argument("--inputs", metavar="NAME", help="with --npz: the name of the inputs array")
    src.add_argument("--targets", metavar="NAME", help="with --npz: the name of the targets array")
    src.add_argument("--inputs-npy", type=Path, metavar="FILE", help="a .npy file of inputs")
    src.add_argument("--targets-npy", type=Path, metavar="FILE", help="a .npy file of targets")
    text = cmd.add_argument_group("text (rows of next-token prediction, kind tokens)")
    text.add_argument("--text", type=Path, nargs="+", metavar="FILE",
                      help="text files, joined in this order into one stream of tokens")
    text.add_argument("--tokenizer", metavar="bytes|FILE",
                      help="bytes (default): every byte is a token, vocabulary 256; or a Hugging Face "
                           "tokenizer.json (needs pip install 'hpcnet[hf]')")
    text.add_argument("--seq-len", type=int, metavar="T",
                      help="tokens per row: the stream is cut into windows of T + 1, inputs the first T, "
                           "targets the last T")
    split = cmd.add_argument_group("the eval split (default: --eval-fraction 0.1)")
    split.add_argument("--eval-fraction", type=float, metavar="F",
                       help="hold out this share of the rows, the last ones unless --shuffle")
    split.add_argument("--shuffle", action="store_true", help="shuffle the rows before the eval rows are taken")
    split.add_argument("--seed", type=int, help="the seed of --shuffle (default 0)")
    split.add_argument("--eval-npz", type=Path, metavar="FILE",
                       help="eval arrays in another .npz, under the names of --inputs and --targets")
    split.add_argument("--eval-inputs-npy", type=Path, metavar="FILE", help="eval inputs, a .npy file")
    split.add_argument("--eval-targets-npy", type=Path, metavar="FILE", help="eval targets, a .npy file")
    what = cmd.add_argument_group("the output")
    what.add_argument("--out", type=Path, required=True, help="the .h5 file to write")
    what.add_argument("--force", action="store_true", help="replace --out if it exists")
    what.add_argument("--kind", choices=DATASET_KINDS,
                      help="image: float inputs [N, ...] (stored as float32), targets [N]; tokens: integer "
                           "inputs [N, T], targets [N, T]. Default: tokens for integer [N, T] inputs with "
                           "targets of the same shape, else image")
    what.add_argument("--num-classes", type=int, metavar="N",
                      help="classes (vocabulary size for tokens); default: the largest label + 1, "
                           f"up to {MAX_INFERRED_CLASSES:,} (a larger label needs --num-classes)")
    what.add_argument("--channels-last", action="store_true",
                      help="image inputs are [N, H, W, C]: store them as [N, C, H, W]")
    cmd.set_defaults(handler=_run)


def _sources(args: argparse.Namespace) -> tuple[Arrays, Arrays | None]:
    npy = args.inputs_npy is not None or args.targets_npy is not None
    if args.npz is not None and npy:
        raise DatasetError("give --npz or --inputs-npy/--targets-npy, not both")
    if args.npz is not None:
        missing = [o for o, v in (("--inputs", args.inputs), ("--targets", args.targets)) if v is None]
        if missing:
            raise DatasetError(f"--npz needs {' and '.join(missing)}: the names of the arrays in {args.npz}")
        train = load_npz(args.npz, args.inputs, args.targets)
    elif npy:
        if args.inputs_npy is None or args.targets_npy is None:
            raise DatasetError("--inputs-npy and --targets-npy go together")
        if args.inputs is not None or args.targets is not None:
            raise DatasetError("--inputs/--targets name arrays of --npz; with .npy files give only the files")
        train = load_npy_pair(args.inputs_npy, args.targets_npy)
    else:
        raise DatasetError("no data: give --npz FILE --inputs NAME --targets NAME, "
                           "or --inputs-npy FILE --targets-npy FILE, or --text FILE... --seq-len T")
    eval_npy = args.eval_inputs_npy is not None or args.eval_targets_npy is not None
    given = [o for o, v in (("--eval-fraction", args.eval_fraction is not None),
                            ("--eval-npz", args.eval_npz is not None),
                            ("--eval-inputs-npy/--eval-targets-npy", eval_npy)) if v]
    if len(given) > 1:
        raise DatasetError(f"give one of {' or '.join(given)}, not both")
    if args.eval_npz is not None:
        if args.npz is None:
            raise DatasetError("--eval-npz takes the array names of --npz; with .npy files use "
                               "--eval-inputs-npy and --eval-targets-npy")
        return train, load_npz(args.eval_npz, args.inputs, args.targets)
    if eval_npy:
        if args.eval_inputs_npy is None or args.eval_targets_npy is None:
            raise DatasetError("--eval-inputs-npy and --eval-targets-npy go together")
        return train, load_npy_pair(args.eval_inputs_npy, args.eval_targets_npy,
                                    options=("--eval-inputs-npy", "--eval-targets-npy"))
    return train, None


def _channels_first(arrays: Arrays) -> Arrays:
    x = arrays.inputs
    if x.ndim != 4:
        raise DatasetError(f"{arrays.inputs_name} has shape {list(x.shape)}; --channels-last needs [N, H, W, C]")
    # The blocks are transposed as they are copied, so memory stays bounded.
    return dataclasses.replace(arrays, channels_last=True)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    prog = f"{parser.prog} convert"
    try:
        if args.seed is not None and not args.shuffle:
            raise DatasetError("--seed is the seed of --shuffle; give --shuffle too")
        if args.text is not None:
            done = _run_text(args)
        else:
            done = _run_arrays(args)
    except DatasetError as exc:
        parser.exit(2, f"{prog}: error: {exc}\n")
    except OSError as exc:
        parser.exit(1, f"{prog}: error: cannot write {args.out}: {exc}\n")
    with h5py.File(done.path, "r") as f:
        x = f["train/inputs"]
        print(f"wrote {done.path}: {done.kind}, num_classes {done.num_classes}, {done.train_rows} train / "
              f"{done.eval_rows} eval rows, inputs {x.dtype}{list(x.shape[1:])}, targets "
              f"{f['train/targets'].dtype}, {x.chunks[0]} rows a chunk")
    return 0


def _run_text(args: argparse.Namespace) -> Converted:
    arrays = [option for option, value in (
        ("--npz", args.npz), ("--inputs", args.inputs), ("--targets", args.targets),
        ("--inputs-npy", args.inputs_npy), ("--targets-npy", args.targets_npy), ("--eval-npz", args.eval_npz),
        ("--eval-inputs-npy", args.eval_inputs_npy), ("--eval-targets-npy", args.eval_targets_npy),
        ("--channels-last", args.channels_last or None)) if value is not None]
    if arrays:
        raise DatasetError(f"give --text or {arrays[0]}, not both: --text makes the rows from text files")
    if args.kind == "image":
        raise DatasetError("--text makes rows of tokens; --kind image does not apply")
    if args.num_classes is not None:
        raise DatasetError("--num-classes comes from --tokenizer with --text (its vocabulary size)")
    if args.seq_len is None:
        raise DatasetError("--text needs --seq-len T, the tokens of one row")
    return convert_text(args.out, args.text, seq_len=args.seq_len, tokenizer=args.tokenizer or BYTES,
                        eval_fraction=0.1 if args.eval_fraction is None else args.eval_fraction,
                        shuffle=args.shuffle, seed=args.seed or 0, overwrite=args.force, quiet=False)


def _run_arrays(args: argparse.Namespace) -> Converted:
    given = [option for option, value in (("--tokenizer", args.tokenizer), ("--seq-len", args.seq_len))
             if value is not None]
    if given:
        raise DatasetError(f"{given[0]} goes with --text FILE...; arrays give their rows as they are")
    train, eval_arrays = _sources(args)
    if args.channels_last:
        if args.kind == "tokens":
            raise DatasetError("--channels-last applies to image inputs, not --kind tokens")
        train = _channels_first(train)
        if eval_arrays is not None:
            eval_arrays = _channels_first(eval_arrays)
    return convert(args.out, train, eval_arrays,
                   eval_fraction=0.1 if args.eval_fraction is None else args.eval_fraction,
                   kind=args.kind, num_classes=args.num_classes, shuffle=args.shuffle,
                   seed=args.seed or 0, overwrite=args.force, quiet=False)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hpcnet.data convert [options]``; ``python -m hpcnet.data`` has ``generate`` as well.

    Args:
        argv: the arguments after the program name; None reads ``sys.argv``.
    """
    return run_commands(argv, add_convert_command)
