"""Tests of ``python -m hpcnet.data convert --text`` (hpcnet.data.text, convert_text): round trips through
open_split with bytes and with tokenizers built here, pieces that tokenize as the whole file, every bad input's
message, nothing left by a failure, and a short training on the converted file."""

import math
import os
import random
import sys

import h5py
import numpy as np
import pytest

from hpcnet.data import convert as convert_module
from hpcnet.data import text as text_module
from hpcnet.data.convert import convert_text, main
from hpcnet.data.h5 import open_split
from hpcnet.data.info import DatasetInfo
from hpcnet.errors import DatasetError

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog;", "naïve", "café", "東京", "ünïcödé",
         "it's", "we'll", "123", "4567", "--", "!!", "?", "tokens", "rows", "split", "piece"]


def _text(lines=300, seed=0):
    """Lines of words with what tokenizers treat specially: blank lines, indentation, trailing spaces, UTF-8."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 12)))
        if rng.random() < 0.2:
            line = "    " + line
        if rng.random() < 0.1:
            line += "  "
        out.append(line)
        if rng.random() < 0.2:
            out.append("")
    return "\n".join(out) + "\n"


def _stream(path, split="train"):
    """The rows of a split as (inputs, targets, info), read through open_split."""
    with open_split(path, split) as s:
        x, y = s.read(np.arange(len(s)))
        return x.numpy(), y.numpy(), s.info


def _windows(path):
    """Every row of both splits (train first) as windows of T + 1 tokens, after checking targets are the inputs
    shifted by one."""
    rows = []
    for split in ("train", "eval"):
        x, y, _ = _stream(path, split)
        assert np.array_equal(x[:, 1:], y[:, :-1])  # next-token targets
        rows.append(np.concatenate([x, y[:, -1:]], axis=1))
    return np.concatenate(rows)


def _leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Three tokenizer.json files trained on ``_text()``: GPT-2 style byte-level BPE (``<|endoftext|>``), a
    SentencePiece-style BPE (words start with a marker, the input's first word too; ``</s>``) and a WordLevel
    one over whitespace-split words (``[SEP]``)."""
    tk = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    corpus = [_text(), _text(seed=1)]
    directory = tmp_path_factory.mktemp("tokenizers")
    made = {}
    byte_level = tk.Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    made["byte-level"] = byte_level
    metaspace = tk.Tokenizer(models.BPE(unk_token="<unk>"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    metaspace.decoder = decoders.Metaspace(prepend_scheme="first")
    metaspace.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    made["metaspace"] = metaspace
    word_level = tk.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[SEP]"]))
    made["word-level"] = word_level
    paths = {}
    for name, tokenizer in made.items():
        paths[name] = directory / f"{name}.json"
        tokenizer.save(str(paths[name]))
    return paths


# ---------------------------------------------------------------------------
# round trips


def test_bytes_round_trip_is_the_files_bytes_in_order(tmp_path, capsys):
    data = _text().encode() + bytes(range(256))  # any bytes, not only UTF-8
    (tmp_path / "a.txt").write_bytes(data)
    out = tmp_path / "a.h5"
    assert main(["convert", "--text", str(tmp_path / "a.txt"), "--seq-len", "16", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    rows, left_out = divmod(len(data), 17)
    assert f"{len(data):,} tokens from 1 file(s) (--tokenizer bytes, vocabulary 256, nothing between files): " \
           f"{rows:,} rows of 16 + 1; the last {left_out} tokens, less than a row, are left out" in captured.err
    eval_rows = round(rows * 0.1)
    assert f"wrote {out}: tokens, num_classes 256, {rows - eval_rows} train / {eval_rows} eval rows, inputs " \
           "uint8[16], targets uint8" in captured.out
    windows = _windows(out)
    assert windows.astype(np.uint8).tobytes() == data[:rows * 17]  # the eval rows are the end of the stream
    assert _stream(out, "eval")[2] == DatasetInfo("tokens", (16,), 256)
    with h5py.File(out, "r") as f:
        assert f["train/inputs"].dtype == np.uint8
        assert (f.attrs["tokenizer"], f.attrs["seq_len"], f.attrs["source"]) == ("bytes", 16, str(tmp_path / "a.txt"))
    assert _leftovers(tmp_path) == []


def test_several_files_are_joined_in_order_and_shuffle_picks_eval_rows(tmp_path):
    parts = [b"first file\n", "second, ünïcödé\n".encode() * 20, b"third"]
    for i, part in enumerate(parts):
        (tmp_path / f"{i}.txt").write_bytes(part)
    files = [tmp_path / f"{i}.txt" for i in range(3)]
    done = convert_text(tmp_path / "j.h5", files, seq_len=7, eval_fraction=0.25)
    joined = b"".join(parts)
    rows = len(joined) // 8
    assert (done.kind, done.num_classes, done.train_rows + done.eval_rows) == ("tokens", 256, rows)
    assert _windows(done.path).astype(np.uint8).tobytes() == joined[:rows * 8]
    with h5py.File(done.path, "r") as f:
        assert f.attrs["source"] == "; ".join(map(str, files)) and f.attrs["end_of_text"] == ""
    many = convert_module._file_list([tmp_path / f"{i:05}.txt" for i in range(10_000)])  # an attribute: <= 64 KiB
    assert len(many) <= 4096 and many.startswith(f"{tmp_path / '00000.txt'}; ") and many.endswith(" more")
    shuffled = convert_text(tmp_path / "s.h5", files, seq_len=7, eval_fraction=0.25, shuffle=True, seed=3)
    order = np.random.default_rng(3).permutation(rows)
    in_order = np.frombuffer(joined[:rows * 8], np.uint8).reshape(rows, 8)
    assert np.array_equal(_windows(shuffled.path), in_order[order])


@pytest.mark.parametrize("name", ["byte-level", "metaspace", "word-level"])
def test_tokenizer_round_trip_with_end_of_text_between_files(name, tokenizers, tmp_path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizers[name]))
    texts = [_text(120, seed=2), _text(80, seed=3)]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text, encoding="utf-8")
    done = convert_text(tmp_path / "t.h5", [tmp_path / "0.txt", tmp_path / "1.txt"], seq_len=12,
                        tokenizer=tokenizers[name])
    end = {"byte-level": "<|endoftext|>", "metaspace": "</s>", "word-level": "[SEP]"}[name]
    stream = [*tokenizer.encode(texts[0], add_special_tokens=False).ids, tokenizer.token_to_id(end),
              *tokenizer.encode(texts[1], add_special_tokens=False).ids]
    rows = len(stream) // 13
    windows = _windows(done.path)
    assert done.num_classes == tokenizer.get_vocab_size() and len(windows) == rows
    assert windows.reshape(-1).tolist() == stream[:rows * 13]
    x, _, info = _stream(done.path, "train")
    assert info == DatasetInfo("tokens", (12,), tokenizer.get_vocab_size())
    for row, want in zip(x, np.asarray(stream[:rows * 13]).reshape(rows, 13)):  # decode row by row
        assert tokenizer.decode(row.tolist(), skip_special_tokens=False) == \
            tokenizer.decode(want[:-1].tolist(), skip_special_tokens=False)
    with h5py.File(done.path, "r") as f:
        assert f["train/inputs"].dtype == (np.uint8 if done.num_classes <= 256 else np.uint16)
        assert f.attrs["end_of_text"] == end
        assert f.attrs["tokenizer"] == str(tokenizers[name])


def test_truncation_and_padding_in_the_file_are_turned_off(tokenizers, tmp_path):
    """A tokenizer.json saved with truncation (a model's context) would drop most of every piece."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizers["byte-level"]))
    tokenizer.enable_truncation(max_length=8)
    tokenizer.enable_padding(length=8)
    tokenizer.save(str(tmp_path / "truncating.json"))
    (tmp_path / "a.txt").write_text(_text(50))
    done = convert_text(tmp_path / "a.h5", [tmp_path / "a.txt"], seq_len=4, tokenizer=tmp_path / "truncating.json")
    tokenizer.no_truncation()
    tokenizer.no_padding()
    assert done.train_rows + done.eval_rows == len(tokenizer.encode(_text(50)).ids) // 5


# ---------------------------------------------------------------------------
# reading in pieces


@pytest.mark.parametrize("piece_bytes", [48, 100, 333])
@pytest.mark.parametrize("name", ["bytes", "byte-level", "metaspace", "word-level"])
def test_a_file_read_in_many_pieces_converts_as_in_one(name, piece_bytes, tokenizers, tmp_path):
    """Small pieces (about 100 of them) give the rows that one piece gives: the cuts fall where the tokenizer
    itself splits the text, and the start of a piece is tokenized as in the middle of the file."""
    (tmp_path / "a.txt").write_text(_text(150, seed=5), encoding="utf-8")
    tokenizer = "bytes" if name == "bytes" else tokenizers[name]
    whole = convert_text(tmp_path / "whole.h5", [tmp_path / "a.txt"], seq_len=9, tokenizer=tokenizer)
    pieces = convert_text(tmp_path / "pieces.h5", [tmp_path / "a.txt"], seq_len=9, tokenizer=tokenizer,
                          piece_bytes=piece_bytes)
    assert np.array_equal(_windows(whole.path), _windows(pieces.path))


def test_pieces_with_more_line_ends_than_tries_still_cut_cleanly(tmp_path):
    """A SentencePiece-style tokenizer that marks every word (``Metaspace``, prepend 'always') over text of short
    lines: 16 KiB pieces hold more line ends than ``CUT_TRIES``, none of them clean (the word after a line end is
    marked as a word's start only when the piece starts there); the other kinds of cut are still tried."""
    tk = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    rng = random.Random(1)
    words = ["héllo", "wörld", "  ", "\n", "\n\n", "the", "cat", "日本語", "tab\t", "x" * 30, "🙂", "a.b", "--"]
    text = "".join(rng.choice(words) + rng.choice([" ", "", "\n", " "]) for _ in range(12000))
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    tokenizer = tk.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"]))
    tokenizer.save(str(tmp_path / "tok.json"))
    whole = convert_text(tmp_path / "whole.h5", [tmp_path / "a.txt"], seq_len=9, tokenizer=tmp_path / "tok.json")
    pieces = convert_text(tmp_path / "pieces.h5", [tmp_path / "a.txt"], seq_len=9, tokenizer=tmp_path / "tok.json",
                          piece_bytes=16 << 10)
    assert np.array_equal(_windows(whole.path), _windows(pieces.path))


@pytest.mark.parametrize("tokenize", [False, True], ids=["bytes", "tokenizer"])
def test_the_file_is_read_in_bounded_pieces(tokenize, tokenizers, tmp_path):
    """Every piece is at most ``piece_bytes`` (at least half of it but the last), the reads are bounded too,
    and the pieces are the file."""
    data = _text(200, seed=6).encode()
    (tmp_path / "a.txt").write_bytes(data)
    clean = text_module.load_tokenizer(tokenizers["byte-level"]).clean if tokenize else None
    reads = []
    real_open = open

    def counting_open(*args, **kwargs):
        f = real_open(*args, **kwargs)
        read = f.read
        f.read = lambda n=-1: reads.append(n) or read(n)
        return f

    with pytest.MonkeyPatch.context() as patch:  # the module's own name: only its reads are counted
        patch.setattr(text_module, "open", counting_open, raising=False)
        pieces = list(text_module._pieces(tmp_path / "a.txt", 200, clean))
    assert b"".join(p for _, p in pieces) == data and [o for o, _ in pieces] == \
        list(np.cumsum([0] + [len(p) for _, p in pieces[:-1]]))
    assert all(100 <= len(p) <= 200 for _, p in pieces[:-1]) and len(pieces) > len(data) // 200
    assert 0 < max(reads) <= 200 + (text_module._CONTEXT_BYTES if tokenize else 0)
    if tokenize:  # between two lines wherever the tokenizer allows it
        assert sum(p.endswith(b"\n") for _, p in pieces[:-1]) >= len(pieces) // 2


def test_not_utf8_names_the_byte_of_the_file_in_a_later_piece(tokenizers, tmp_path):
    data = _text(100).encode()
    at = len(data) - 40
    (tmp_path / "bad.txt").write_bytes(data[:at] + b"\xff" + data[at:])
    with pytest.raises(DatasetError, match=rf"bad.txt \(--text\): not UTF-8 at byte {at} \(invalid start byte\)"):
        convert_text(tmp_path / "o.h5", [tmp_path / "bad.txt"], seq_len=4, tokenizer=tokenizers["word-level"],
                     piece_bytes=64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt"]  # no output, no temporary token file
    done = convert_text(tmp_path / "o.h5", [tmp_path / "bad.txt"], seq_len=4)  # bytes take any bytes
    assert done.num_classes == 256


# ---------------------------------------------------------------------------
# bad inputs: one line naming what is wrong, exit status 2, nothing written


BAD = [
    (["--text", "missing.txt", "--seq-len", "4"], "missing.txt (--text): no such file"),
    (["--text", "a.txt", "adir", "--seq-len", "4"], "adir (--text) is a directory; give the text files in it"),
    (["--text", "a.txt", "pipe", "--seq-len", "4"], "pipe (--text) is a FIFO, not a regular file"),
    (["--text", "a.txt", "--seq-len", "0"], "--seq-len must be a positive integer, got 0"),
    (["--text", "a.txt"], "--text needs --seq-len T"),
    (["--text", "short.txt", "--seq-len", "8"],
     "--text short.txt gives 5 tokens (--tokenizer bytes), fewer than one row of --seq-len 8 takes: 9"),
    (["--text", "a.txt", "short.txt", "--seq-len", "4000"], "--text a.txt and 1 more gives"),
    (["--text", "latin1.txt", "--seq-len", "2", "--tokenizer", "WORDS"],
     "latin1.txt (--text): not UTF-8 at byte 3 (invalid continuation byte); a --tokenizer reads UTF-8 text"),
    (["--text", "a.txt", "--seq-len", "4", "--tokenizer", "junk.json"],
     "junk.json (--tokenizer): not a Hugging Face tokenizer.json (expected"),
    (["--text", "a.txt", "--seq-len", "4", "--tokenizer", "nope.json"],
     "nope.json (--tokenizer): no such file; give a tokenizer.json or 'bytes'"),
    (["--text", "a.txt", "--seq-len", "4", "--tokenizer", "adir"],
     "adir (--tokenizer) is a directory without a tokenizer.json"),
    (["--text", "a.txt", "--seq-len", "4", "--tokenizer", "pipe"], "pipe (--tokenizer) is a FIFO, not a regular file"),
    (["--text", "a.txt", "--seq-len", "4", "--npz", "a.npz", "--inputs", "x", "--targets", "y"],
     "give --text or --npz, not both: --text makes the rows from text files"),
    (["--text", "a.txt", "--seq-len", "4", "--inputs-npy", "x.npy"], "give --text or --inputs-npy, not both"),
    (["--text", "a.txt", "--seq-len", "4", "--num-classes", "300"], "--num-classes comes from --tokenizer"),
    (["--text", "a.txt", "--seq-len", "4", "--kind", "image"], "--kind image does not apply"),
    (["--text", "a.txt", "--seq-len", "4", "--eval-fraction", "1"], "--eval-fraction must be between 0 and 1"),
    (["--text", "short.txt", "--seq-len", "4"], "--eval-fraction 0.1 of 1 rows leaves no eval rows"),
    (["--npz", "a.npz", "--inputs", "x", "--targets", "y", "--seq-len", "4"], "--seq-len goes with --text FILE"),
    (["--npz", "a.npz", "--inputs", "x", "--targets", "y", "--tokenizer", "bytes"], "--tokenizer goes with --text"),
]


@pytest.mark.parametrize("args,expected", BAD, ids=[" ".join(case[0]) for case in BAD])
def test_each_bad_input_is_one_line_naming_it(args, expected, tokenizers, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text(_text(20))
    (tmp_path / "short.txt").write_text("hello")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1") + b"\n")
    (tmp_path / "junk.json").write_text("not a tokenizer")
    (tmp_path / "adir").mkdir()
    os.mkfifo(tmp_path / "pipe")  # never opened: opening it would wait for a writer
    np.savez(tmp_path / "a.npz", x=np.zeros((4, 2), np.int64), y=np.zeros((4, 2), np.int64))
    before = sorted(p.name for p in tmp_path.iterdir())
    args = [str(tokenizers["word-level"]) if a == "WORDS" else a for a in args]
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", *args, "--out", "out.h5"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.startswith("python -m hpcnet.data convert: error: ") and err.count("\n") == 1, err
    assert expected in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temporary left


def test_without_the_tokenizers_library_the_message_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers raises ImportError
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(DatasetError, match=r"needs the tokenizers library, which is not installed: "
                                           r"pip install 'hpcnet\[hf\]'"):
        convert_text(tmp_path / "o.h5", [tmp_path / "a.txt"], seq_len=2, tokenizer=tmp_path)  # the directory's file


def test_existing_out_needs_force_and_a_failure_mid_way_leaves_the_old_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "a.txt").write_text(_text(300))
    args = ["convert", "--text", str(tmp_path / "a.txt"), "--seq-len", "4", "--out", str(tmp_path / "a.h5")]
    (tmp_path / "a.h5").write_text("someone's file")
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert f"--out {tmp_path / 'a.h5'} exists; pass --force to replace it" in capsys.readouterr().err
    # Stopped (Ctrl-C) after some blocks of rows were written: the old file stays, no temporary is left.
    monkeypatch.setattr(convert_module, "CHUNK_BYTES", 64)  # 16 rows a chunk
    monkeypatch.setattr(convert_module, "BLOCK_BYTES", 1)  # a chunk a block
    calls = []

    def stop_at_the_third_block(self, rows):
        calls.append(rows)
        if len(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(convert_module._Progress, "advance", stop_at_the_third_block)
    with pytest.raises(KeyboardInterrupt):
        main([*args, "--force"])
    assert (tmp_path / "a.h5").read_text() == "someone's file"
    assert _leftovers(tmp_path) == [] and len(calls) == 3
    (tmp_path / "a.h5").unlink()
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        main(args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


# ---------------------------------------------------------------------------
# training on it


def test_the_transformer_trains_on_converted_text(tmp_path):
    from mpi4py import MPI

    from hpcnet.train import run
    from tests.helpers.train import train_config

    (tmp_path / "a.txt").write_text(_text(100))
    done = convert_text(tmp_path / "text.h5", [tmp_path / "a.txt"], seq_len=16)
    result = run(train_config(tmp_path, done.path, "text", "model.name=transformer", "model.options.d_model=16",
                              "model.options.n_layers=1", "model.options.n_heads=2", "train.steps=4",
                              "optim.warmup_steps=1", "checkpoint.at_end=false"), MPI.COMM_SELF)
    assert result.summary["steps"] == 4
    assert math.isfinite(result.summary["final_loss"]) and result.summary["final_loss"] < math.log(256) + 1
