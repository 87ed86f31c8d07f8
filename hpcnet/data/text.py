"""Text files as one stream of tokens, for ``python -m hpcnet.data convert --text``.

    python -m hpcnet.data convert --text book1.txt book2.txt --seq-len 256 --out data/books.h5
    python -m hpcnet.data convert --text corpus/*.txt --tokenizer tokenizer.json --seq-len 1024 --out data/corpus.h5

``--tokenizer bytes`` makes every byte a token (vocabulary 256); ``--tokenizer FILE`` loads a Hugging Face
``tokenizer.json`` with the ``tokenizers`` library (``load_tokenizer``). A file is read in pieces of about
``PIECE_BYTES``, never whole; for a tokenizer a piece ends where the tokenizer itself splits the text, between
two lines where it can (``_cut``), and is tokenized after the end of the piece before it, whose tokens are then
dropped (``TextTokenizer.encode``), so the stream is the whole file's tokenization wherever the tokenizer's
decisions reach less than ``CONTEXT_CHARS`` characters. The files are joined in the order given, with
the tokenizer's end-of-text token between two files (``END_OF_TEXT``). ``token_stream`` writes the tokens to
a temporary file next to the output and maps it; ``token_rows`` cuts it into rows of next-token prediction,
which ``hpcnet.data.convert.convert_text`` writes. Every bad input raises ``DatasetError`` naming the file or
the option. docs/data.md.
"""

import contextlib
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from hpcnet.data.arrays import Arrays
from hpcnet.errors import DatasetError
from hpcnet.paths import file_kind

BYTES = "bytes"
"""``--tokenizer bytes``: every byte is a token."""
PIECE_BYTES = 256 << 10
"""About how many bytes of a text file are read and tokenized as one piece."""
PIECES_PER_BATCH = 16
"""Pieces a tokenizer gets at once (it spreads a batch over the cores): 4 MiB of text, about a million tokens
in flight."""
CONTEXT_CHARS = 256
"""At most this many characters of the end of a piece are tokenized again in front of the next piece (and as
many on either side of a cut are tokenized to try it)."""
_CONTEXT_BYTES = 4 * CONTEXT_CHARS + 4
"""Enough bytes for ``CONTEXT_CHARS`` characters of UTF-8, one of them maybe cut."""
CUT_TRIES = 64
"""At most this many places are tried for the end of a piece (``_cut``)."""
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
"""The names of the end-of-text token, in the order they are looked for in a tokenizer's vocabulary: GPT-2 and
Qwen, Llama 3, Llama 2, Mistral and T5, Gemma, BERT."""
PROGRESS_INTERVAL_S = 5.0
"""How often a long tokenization says how far it is, on stderr."""
_SPACE = b" \t\n\r\f\v"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds the ids ``0 .. vocab_size - 1``."""
    return next(np.dtype(t) for t in (np.uint8, np.uint16, np.uint32, np.uint64) if vocab_size - 1 <= np.iinfo(t).max)


# ---------------------------------------------------------------------------
# the tokenizer


@dataclass(frozen=True, slots=True)
class TextTokenizer:
    """What ``--tokenizer`` names: bytes, or a Hugging Face tokenizer."""

    name: str
    """``"bytes"``, or the path of the ``tokenizer.json``."""
    vocab_size: int
    """Token ids are in ``[0, vocab_size)``: 256 for bytes; a tokenizer's largest id + 1 (added tokens too)."""
    end_of_text: str | None = None
    """The token put between two files; None puts nothing."""
    end_of_text_id: int | None = None
    hf: Any = None
    """The ``tokenizers.Tokenizer``; None for bytes."""

    def encode(self, pieces: Sequence[tuple[str, str]]) -> list[np.ndarray]:
        """The token ids of consecutive pieces of a file, each given as ``(context, text)``.

        ``context`` is the end of the piece before (empty for a file's first piece). ``context + text`` is
        tokenized and the context's own tokens are dropped from its front, so the text is tokenized as it is
        in the middle of the file (a SentencePiece-style tokenizer, for one, marks the start of its input). Where
        those tokens are not a prefix (a token runs on from the context into the text), the text is tokenized
        alone.

        Args:
            pieces: the pieces, in the order of the file.
        """
        # encode_batch_fast (tokenizers >= 0.20) skips the offsets, which are not needed here.
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        joined = encode([context + text for context, text in pieces], add_special_tokens=False)
        with_context = [i for i, (context, _) in enumerate(pieces) if context]
        contexts = dict(zip(with_context, encode([pieces[i][0] for i in with_context], add_special_tokens=False)))
        out = []
        for i, ((_, text), encoding) in enumerate(zip(pieces, joined)):
            ids, prefix = encoding.ids, contexts[i].ids if i in contexts else []
            if ids[:len(prefix)] != prefix:
                ids, prefix = self.hf.encode(text, add_special_tokens=False).ids, []
            out.append(np.asarray(ids[len(prefix):], dtype=np.int64))
        return out

    def clean(self, before: str, after: str) -> bool:
        """Whether the tokenizer cuts ``before + after`` between the two: the tokens of ``before`` are the start
        of those of ``before + after``."""
        alone = self.hf.encode(before, add_special_tokens=False).ids
        return self.hf.encode(before + after, add_special_tokens=False).ids[:len(alone)] == alone


def load_tokenizer(name: str | os.PathLike[str]) -> TextTokenizer:
    """``--tokenizer``: ``"bytes"``, or a Hugging Face ``tokenizer.json`` (or a directory holding one).

    Truncation and padding that the file sets are turned off: a piece of text is far longer than a model's
    context, and every token of it is kept.

    Args:
        name: ``"bytes"`` or the path.

    Raises:
        DatasetError: the library is missing, or the file is missing or does not load.
    """
    if str(name) == BYTES:
        return TextTokenizer(BYTES, 256)
    path = Path(name)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    _check_regular_file(path, "--tokenizer", missing="; give a tokenizer.json or 'bytes'",
                        directory=" without a tokenizer.json")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DatasetError(f"--tokenizer {path} needs the tokenizers library, which is not installed: "
                           "pip install 'hpcnet[hf]'") from None
    try:
        hf = Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a plain Exception for every file it cannot load
        reason = " ".join(str(exc).split())
        raise DatasetError(f"{path} (--tokenizer): not a Hugging Face tokenizer.json ({reason})") from None
    hf.no_truncation()
    hf.no_padding()
    vocab = hf.get_vocab(with_added_tokens=True)
    vocab_size = max(hf.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
    if vocab_size < 1:
        raise DatasetError(f"{path} (--tokenizer): the tokenizer has an empty vocabulary")
    end = next((token for token in END_OF_TEXT if token in vocab), None)
    return TextTokenizer(str(path), vocab_size, end, None if end is None else vocab[end], hf)


def _check_regular_file(path: Path, option: str, *, missing: str = "", directory: str = "") -> None:
    """Raise DatasetError naming ``path`` and ``option`` unless it is a regular file (``file_kind``: never opened);
    ``missing`` and ``directory`` end the message where it is absent or a directory."""
    kind = file_kind(path)
    if kind == "missing":
        raise DatasetError(f"{path} ({option}): no such file{missing}")
    if kind == "directory":
        raise DatasetError(f"{path} ({option}) is a directory{directory}")
    if kind != "file":
        raise DatasetError(f"{path} ({option}) is a {kind}, not a regular file")


# ---------------------------------------------------------------------------
# reading the files in pieces


def check_text_files(files: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """``--text``: each file exists, is a regular file and can be opened, before any is read.

    Raises:
        DatasetError: naming the first file that is not.
    """
    if not files:
        raise DatasetError("--text needs at least one file")
    paths = [Path(f) for f in files]
    for path in paths:
        # A pipe would be read once, and opening one here could wait for its writer.
        _check_regular_file(path, "--text", directory=f"; give the text files in it (e.g. {path}/*.txt)")
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise DatasetError(f"{path} (--text): cannot read it ({exc.strerror or exc})") from None
    return paths


def _candidates(piece: bytes) -> Iterator[int]:
    """Where a piece of a file that goes on may end, all in its second half (so each piece is at least half of
    ``piece_bytes``), from four kinds, taken in turn so that no kind uses up the tries (``CUT_TRIES``) of the
    others: between two lines, the first ending and the next starting in a character that is not a space (no word,
    run of blank lines or indentation is cut); after any other line end; before a space that follows a word (where
    a SentencePiece-style tokenizer starts a token); between two UTF-8 characters."""
    half = len(piece) // 2

    def line_ends(clean: bool) -> Iterator[int]:
        end = len(piece) - 1 if clean else len(piece)
        while (i := piece.rfind(b"\n", half, end)) >= (1 if clean else 0):
            between_words = i > 0 and piece[i - 1] not in _SPACE and i + 1 < len(piece) and piece[i + 1] not in _SPACE
            if between_words == clean:
                yield i + 1
            end = i

    def before_spaces() -> Iterator[int]:
        end = len(piece)
        while (i := piece.rfind(b" ", half, end)) > 0:
            if piece[i - 1] not in _SPACE:
                yield i
            end = i

    def characters() -> Iterator[int]:
        for i in range(len(piece) - 1, half, -1):
            if piece[i] & 0xC0 != 0x80:  # not a continuation byte: a character starts here
                yield i

    kinds = [line_ends(True), line_ends(False), before_spaces(), characters()]
    seen: set[int] = set()
    while kinds:
        for kind in list(kinds):
            at = next(kind, None)
            if at is None:
                kinds.remove(kind)
            elif at not in seen:
                seen.add(at)
                yield at


def _cut(buffer: bytes, piece_bytes: int, clean: Callable[[str, str], bool]) -> int:
    """Where a piece that starts a buffer of a file ends: the first of ``_candidates`` of its first
    ``piece_bytes`` (at most ``CUT_TRIES`` of them) that the tokenizer treats as a cut between tokens
    (``clean(text before, text after)``, the after read on into the rest of ``buffer``), else the first of all."""
    first = None
    for tries, at in enumerate(_candidates(buffer[:piece_bytes])):
        before = buffer[max(0, at - _CONTEXT_BYTES):at].decode("utf-8", "ignore")[-CONTEXT_CHARS:]
        if clean(before, buffer[at:at + _CONTEXT_BYTES].decode("utf-8", "ignore")[:CONTEXT_CHARS]):
            return at
        first = at if first is None else first
        if tries + 1 == CUT_TRIES:
            break
    return piece_bytes if first is None else first  # None: not UTF-8 near the end; decoding names the byte


def _pieces(path: Path, piece_bytes: int, clean: Callable[[str, str], bool] | None) -> Iterator[tuple[int, bytes]]:
    """``(offset in the file, bytes)`` of consecutive pieces of ``path`` of at most ``piece_bytes``: cut by ``_cut``
    with ``clean`` (at least half a piece each; the file is read ``_CONTEXT_BYTES`` ahead for it), or at
    ``piece_bytes`` when it is None."""
    ahead = 0 if clean is None else _CONTEXT_BYTES
    try:
        with open(path, "rb") as f:
            offset, carry = 0, b""
            while True:
                buffer = carry + f.read(piece_bytes + ahead - len(carry))
                if len(buffer) < piece_bytes + ahead and len(buffer) <= piece_bytes:  # the end of the file
                    if buffer:
                        yield offset, buffer
                    return
                end = piece_bytes if clean is None else _cut(buffer, piece_bytes, clean)
                yield offset, buffer[:end]
                offset, carry = offset + end, buffer[end:]
    except FileNotFoundError:
        raise DatasetError(f"{path} (--text): no such file (it was removed during the conversion)") from None
    except OSError as exc:
        raise DatasetError(f"{path} (--text): cannot read it ({exc.strerror or exc})") from None


def _file_tokens(path: Path, tokenizer: TextTokenizer, piece_bytes: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(bytes read, token ids)`` for consecutive pieces of ``path``."""
    if tokenizer.hf is None:
        for _, piece in _pieces(path, piece_bytes, None):
            yield len(piece), np.frombuffer(piece, dtype=np.uint8)
        return
    batch: list[tuple[str, str]] = []
    sizes: list[int] = []
    context = ""
    for offset, piece in _pieces(path, piece_bytes, tokenizer.clean):
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DatasetError(f"{path} (--text): not UTF-8 at byte {offset + exc.start} ({exc.reason}); a "
                               "--tokenizer reads UTF-8 text (--tokenizer bytes takes any bytes)") from None
        batch.append((context, text))
        sizes.append(len(piece))
        context = text[-CONTEXT_CHARS:]
        if len(batch) == PIECES_PER_BATCH:
            yield from zip(sizes, tokenizer.encode(batch))
            batch, sizes = [], []
    if batch:
        yield from zip(sizes, tokenizer.encode(batch))


class _Progress:
    """A line on stderr every ``PROGRESS_INTERVAL_S`` while a long tokenization runs; silent for short ones."""

    def __init__(self, total_bytes: int, quiet: bool) -> None:
        self.total, self.done, self.tokens, self.quiet = total_bytes, 0, 0, quiet
        self.start = self.last = time.monotonic()

    def advance(self, num_bytes: int, num_tokens: int) -> None:
        self.done += num_bytes
        self.tokens += num_tokens
        now = time.monotonic()
        if not self.quiet and now - self.last >= PROGRESS_INTERVAL_S and self.total:
            self.last = now
            rate = self.done / (now - self.start)
            print(f"tokenizing: {self.done / 2**20:.0f}/{self.total / 2**20:.0f} MiB "
                  f"({100 * self.done / self.total:.0f}%), {self.tokens:,} tokens, "
                  f"{(self.total - self.done) / max(rate, 1e-9):.0f} s left", file=sys.stderr, flush=True)


def _write_tokens(files: Sequence[Path], tokenizer: TextTokenizer, spill: BinaryIO, piece_bytes: int,
                  progress: _Progress) -> int:
    """Write the token stream of ``files`` to ``spill`` in ``token_dtype``; return how many tokens it holds."""
    dtype = token_dtype(tokenizer.vocab_size)
    count = 0
    for number, path in enumerate(files):
        if number and tokenizer.end_of_text_id is not None:
            spill.write(np.array([tokenizer.end_of_text_id], dtype).tobytes())
            count += 1
        for num_bytes, ids in _file_tokens(path, tokenizer, piece_bytes):
            spill.write(ids.astype(dtype, copy=False).tobytes())
            count += len(ids)
            progress.advance(num_bytes, len(ids))
    return count


@contextlib.contextmanager
def token_stream(files: Sequence[Path], tokenizer: TextTokenizer, near: Path, *, quiet: bool = True,
                 piece_bytes: int | None = None) -> Iterator[np.ndarray]:
    """Tokenize ``files`` into a temporary file beside ``near``; yield its tokens, memory-mapped, 1-D.

    The temporary file (``.<near's name>.<pid>.<random>.tokens.tmp``, in ``token_dtype``) is removed when the
    context ends, whatever happens.

    Args:
        files: the text files (``check_text_files``), joined in this order.
        tokenizer: what makes tokens of them.
        near: the output file: the tokens go in its directory, which is made if missing.
        quiet: False prints progress lines to stderr during long tokenizations.
        piece_bytes: the size of the pieces read; None is ``PIECE_BYTES``.
    """
    piece_bytes = piece_bytes or PIECE_BYTES
    near.parent.mkdir(parents=True, exist_ok=True)
    spill_path = near.parent / f".{near.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tokens.tmp"
    progress = _Progress(sum(path.stat().st_size for path in files), quiet)
    try:
        with open(spill_path, "wb") as spill:
            count = _write_tokens(files, tokenizer, spill, piece_bytes, progress)
        dtype = token_dtype(tokenizer.vocab_size)
        yield np.memmap(spill_path, dtype=dtype, mode="r", shape=(count,)) if count else np.empty(0, dtype)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(spill_path)


def token_rows(tokens: np.ndarray, seq_len: int, name: str) -> Arrays:
    """Rows of next-token prediction from a stream: consecutive, non-overlapping windows of ``seq_len + 1``
    tokens; the inputs are the first ``seq_len`` of each, the targets the last ``seq_len`` (shifted by one). The
    tail shorter than a window is left out. Views of ``tokens``: nothing is copied.

    Args:
        tokens: the stream, 1-D.
        seq_len: tokens per row.
        name: what the rows came from, for messages.
    """
    window = seq_len + 1
    rows = tokens[:len(tokens) // window * window].reshape(-1, window)
    return Arrays(rows[:, :-1], rows[:, 1:], f"{name}: inputs", f"{name}: targets")
