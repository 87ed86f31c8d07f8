"""Tests of hpcnet.data.convert: round trips through open_split, every bad input's message, the command line,
and the worked example of docs/data.md."""

import re
import shlex
import subprocess
import sys
import zipfile

import h5py
import numpy as np
import pytest

from hpcnet.data import convert as convert_module
from hpcnet.data.convert import CHUNK_BYTES, convert, load_npy_pair, load_npz, main
from hpcnet.data.h5 import open_split
from hpcnet.data.info import DatasetInfo
from hpcnet.errors import DatasetError
from tests.helpers.launch import ROOT, clean_env


def _blobs(n=100, shape=(1, 4, 4), classes=4, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = (rng.standard_normal((n, *shape)) + y.reshape(-1, *[1] * len(shape))).astype(np.float32)
    return x, y


def _read_all(path, split):
    with open_split(path, split) as s:
        x, y = s.read(np.arange(len(s)))
        return x.numpy(), y.numpy(), s.info


def _leftovers(directory):
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------
# round trips


def test_npz_round_trip_holds_out_the_last_rows(tmp_path, capsys):
    x, y = _blobs(100)
    np.savez(tmp_path / "data.npz", images=x, labels=y)
    out = tmp_path / "data.h5"
    assert main(["convert", "--npz", str(tmp_path / "data.npz"), "--inputs", "images", "--targets", "labels",
                 "--out", str(out)]) == 0
    assert "90 train / 10 eval rows" in capsys.readouterr().out
    xt, yt, info = _read_all(out, "train")
    xe, ye, _ = _read_all(out, "eval")
    assert info == DatasetInfo("image", (1, 4, 4), int(y.max()) + 1)
    assert np.array_equal(xt, x[:90]) and np.array_equal(yt, y[:90])
    assert np.array_equal(xe, x[90:]) and np.array_equal(ye, y[90:])
    with h5py.File(out, "r") as f:
        assert f.attrs["generator"] == "hpcnet.data.convert"
        chunk = f["train/inputs"].chunks
        assert chunk[1:] == (1, 4, 4) and 1 < chunk[0] and chunk[0] * 64 <= CHUNK_BYTES
    assert _leftovers(tmp_path) == []


def test_npy_tokens_with_eval_files_keep_their_integer_dtype(tmp_path):
    rng = np.random.default_rng(1)
    seq = rng.integers(0, 50, (40, 9)).astype(np.int32)
    eval_seq = rng.integers(0, 60, (7, 9)).astype(np.int32)
    for name, a in (("x", seq[:, :-1]), ("y", seq[:, 1:]), ("ex", eval_seq[:, :-1]), ("ey", eval_seq[:, 1:])):
        np.save(tmp_path / f"{name}.npy", a)
    done = convert(tmp_path / "tok.h5", load_npy_pair(tmp_path / "x.npy", tmp_path / "y.npy"),
                   load_npy_pair(tmp_path / "ex.npy", tmp_path / "ey.npy"))
    assert (done.kind, done.train_rows, done.eval_rows) == ("tokens", 40, 7)
    assert done.num_classes == max(seq.max(), eval_seq.max()) + 1  # inputs count for the vocabulary too
    xt, yt, info = _read_all(done.path, "train")
    xe, ye, _ = _read_all(done.path, "eval")
    assert info == DatasetInfo("tokens", (8,), done.num_classes)
    assert np.array_equal(xt, seq[:, :-1]) and np.array_equal(yt, seq[:, 1:])
    assert np.array_equal(xe, eval_seq[:, :-1]) and np.array_equal(ye, eval_seq[:, 1:])
    with h5py.File(done.path, "r") as f:
        assert f["train/inputs"].dtype == np.int32


def test_shuffled_split_in_many_blocks_is_a_seeded_permutation(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_module, "BLOCK_BYTES", 1)  # one chunk a block: many blocks
    x, y = _blobs(300, shape=(3, 8, 8))  # 768 B rows: 21 rows a chunk
    np.savez_compressed(tmp_path / "z.npz", x=x, y=y)  # compressed members are read whole, not mapped
    assert not isinstance(load_npz(tmp_path / "z.npz", "x", "y").inputs, np.memmap)
    done = convert(tmp_path / "s.h5", load_npz(tmp_path / "z.npz", "x", "y"), eval_fraction=0.25, shuffle=True,
                   seed=7, num_classes=6)
    assert (done.train_rows, done.eval_rows, done.num_classes) == (225, 75, 6)
    perm = np.random.default_rng(7).permutation(300)
    xt, yt, _ = _read_all(done.path, "train")
    xe, ye, info = _read_all(done.path, "eval")
    assert info.num_classes == 6
    assert np.array_equal(xt, x[perm[:225]]) and np.array_equal(yt, y[perm[:225]])
    assert np.array_equal(xe, x[perm[225:]]) and np.array_equal(ye, y[perm[225:]])
    # The same from np.savez: memory-mapped members, each row's CRC-32 taken as it is gathered.
    np.savez(tmp_path / "u.npz", x=x, y=y)
    stored = convert(tmp_path / "u.h5", load_npz(tmp_path / "u.npz", "x", "y"), eval_fraction=0.25, shuffle=True,
                     seed=7, num_classes=6)
    assert np.array_equal(_read_all(stored.path, "train")[0], xt)
    assert np.array_equal(_read_all(stored.path, "eval")[1], ye)


def test_fortran_order_members_are_read_whole_and_checked(tmp_path):
    """A Fortran-order member cannot be read a block of rows at a time in file order: it is read whole, like a
    compressed one, and zipfile checks its CRC-32."""
    x, y = _blobs(50)
    np.savez(tmp_path / "f.npz", x=np.asfortranarray(x), y=y)
    arrays = load_npz(tmp_path / "f.npz", "x", "y")
    assert not isinstance(arrays.inputs, np.memmap) and arrays.checks[0] is None
    done = convert(tmp_path / "f.h5", arrays)
    assert np.array_equal(_read_all(done.path, "train")[0], x[:45])


def test_uncompressed_npz_is_memory_mapped_and_conversions_follow_the_rules(tmp_path):
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (30, 5, 6, 3), dtype=np.uint8)  # uint8 images, channels last
    y = rng.integers(0, 3, 30).astype(np.float64)  # whole-number float labels
    np.savez(tmp_path / "u.npz", x=x, y=y)
    arrays = load_npz(tmp_path / "u.npz", "x", "y")
    assert isinstance(arrays.inputs, np.memmap) and np.array_equal(arrays.inputs, x)
    out = tmp_path / "u.h5"
    assert main(["convert", "--npz", str(tmp_path / "u.npz"), "--inputs", "x", "--targets", "y", "--out", str(out),
                 "--channels-last", "--eval-fraction", "0.2"]) == 0
    xt, yt, info = _read_all(out, "train")
    assert info == DatasetInfo("image", (3, 5, 6), int(y.max()) + 1)
    assert np.array_equal(xt, x[:24].transpose(0, 3, 1, 2).astype(np.float32))
    assert np.array_equal(yt, y[:24].astype(np.int64))
    with h5py.File(out, "r") as f:
        assert f["train/inputs"].dtype == np.float32 and f["train/targets"].dtype == np.int64


def test_force_replaces_and_a_failed_conversion_leaves_the_old_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(convert_module, "BLOCK_BYTES", 1)
    x, y = _blobs(200)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    args = ["convert", "--inputs-npy", str(tmp_path / "x.npy"), "--targets-npy", str(tmp_path / "y.npy"),
            "--out", str(tmp_path / "d.h5")]
    assert main(args) == 0
    before = (tmp_path / "d.h5").read_bytes()
    y[150] = 99  # found only after some blocks were written
    np.save(tmp_path / "y.npy", y)
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--force", "--num-classes", "4"])
    assert exit_info.value.code == 2
    assert "y.npy holds 99 (row 150), outside [0, 4) given by --num-classes" in capsys.readouterr().err
    assert (tmp_path / "d.h5").read_bytes() == before and _leftovers(tmp_path) == []
    assert main([*args, "--force"]) == 0
    assert _read_all(tmp_path / "d.h5", "train")[2].num_classes == 100


# ---------------------------------------------------------------------------
# bad inputs: one line naming what is wrong, exit status 2, nothing written


def _write_bad(tmp_path):
    x, y = _blobs(20)
    np.savez(tmp_path / "ok.npz", x=x, y=y)
    np.savez(tmp_path / "short.npz", x=x, y=y[:19])
    np.savez(tmp_path / "frac.npz", x=x, y=np.where(np.arange(20) == 5, 1.5, y))
    np.savez(tmp_path / "neg.npz", x=x, y=np.where(np.arange(20) == 3, -1, y))
    np.savez(tmp_path / "huge.npz", x=x, y=np.where(np.arange(20) == 3, 1e20, y))
    np.savez(tmp_path / "far.npz", x=x, y=np.where(np.arange(20) == 7, 10**9, y))
    np.savez(tmp_path / "bool.npz", x=x > 0, y=y)
    np.savez(tmp_path / "text.npz", x=x, y=np.array(["cat"] * 20))
    np.savez(tmp_path / "empty.npz", x=x[:0], y=y[:0])
    np.savez(tmp_path / "col.npz", x=x, y=y[:, None])
    np.savez(tmp_path / "flat.npz", x=x.reshape(20, -1), y=y)
    x_nan = x.copy()
    x_nan[12, 0, 1, 1] = np.nan
    np.savez(tmp_path / "nan.npz", x=x_nan, y=y)
    np.savez(tmp_path / "other.npz", x=_blobs(5, shape=(1, 5, 5))[0], y=y[:5])
    np.savez(tmp_path / "obj.npz", x=np.array([{"a": 1}] * 20, dtype=object), y=y)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    (tmp_path / "junk.npy").write_text("not numpy")
    (tmp_path / "junk.npz").write_text("not a zip")


BAD = [
    (["--npz", "ok.npz", "--inputs", "images", "--targets", "y"],
     "ok.npz: no array named 'images' (--inputs); the file holds 'x', 'y'"),
    (["--npz", "ok.npz", "--inputs", "x"], "--npz needs --targets: the names of the arrays in"),
    (["--npz", "short.npz", "--inputs", "x", "--targets", "y"],
     "short.npz: array 'x' has 20 rows but", "short.npz: array 'y' has 19"),
    (["--npz", "frac.npz", "--inputs", "x", "--targets", "y"],
     "frac.npz: array 'y' holds 1.5 at row 5; labels must be whole numbers"),
    (["--npz", "neg.npz", "--inputs", "x", "--targets", "y"],
     "neg.npz: array 'y' holds -1 (row 3); labels must be >= 0"),
    (["--npz", "huge.npz", "--inputs", "x", "--targets", "y"],
     "huge.npz: array 'y' holds 1e+20 (row 3); labels must be below 2**63 - 1"),
    (["--npz", "huge.npz", "--inputs", "x", "--targets", "y", "--num-classes", str(2**62)],
     "huge.npz: array 'y' holds 1e+20 (row 3), outside [0, 4611686018427387904) given by --num-classes"),
    (["--npz", "far.npz", "--inputs", "x", "--targets", "y"],
     "far.npz: array 'y' holds 1000000000 (row 7)", "give --num-classes 1000000001 if that is meant"),
    (["--npz", "ok.npz", "--inputs", "x", "--targets", "y", "--num-classes", str(2**63)],
     "--num-classes must be a positive integer below 2**63, got 9223372036854775808"),
    (["--npz", "ok.npz", "--inputs", "x", "--targets", "y", "--num-classes", "2"],
     "ok.npz: array 'y' holds 3 (row", "outside [0, 2) given by --num-classes"),
    (["--npz", "bool.npz", "--inputs", "x", "--targets", "y"], "bool.npz: array 'x' has dtype bool; expected numbers"),
    (["--npz", "text.npz", "--inputs", "x", "--targets", "y"], "text.npz: array 'y' has dtype <U3; expected numbers"),
    (["--npz", "obj.npz", "--inputs", "x", "--targets", "y"],
     "obj.npz: member 'x.npy' (array 'x') cannot be read without pickle"),
    (["--npz", "empty.npz", "--inputs", "x", "--targets", "y"], "empty.npz: array 'x' is empty (shape [0, 1, 4, 4])"),
    (["--npz", "col.npz", "--inputs", "x", "--targets", "y"],
     "col.npz: array 'y' has shape [20, 1]; image targets must be one class per row, [N]"),
    (["--npz", "nan.npz", "--inputs", "x", "--targets", "y"], "nan.npz: array 'x' holds a non-finite value", "row 12"),
    (["--npz", "ok.npz", "--inputs", "x", "--targets", "y", "--kind", "tokens"],
     "ok.npz: array 'x' has dtype float32; token inputs must be integers"),
    (["--npz", "ok.npz", "--inputs", "x", "--targets", "y", "--eval-npz", "other.npz"],
     "other.npz: array 'x' has rows of shape [1, 5, 5] but", "ok.npz: array 'x' has [1, 4, 4]"),
    (["--npz", "ok.npz", "--inputs", "x", "--targets", "y", "--eval-fraction", "0"],
     "--eval-fraction must be between 0 and 1 (exclusive), got 0.0"),
    (["--npz", "ok.npz", "--inputs", "x", "--targets", "y", "--eval-fraction", "1.5"],
     "--eval-fraction must be between"),
    (["--npz", "ok.npz", "--inputs", "x", "--targets", "y", "--eval-fraction", "0.01"],
     "--eval-fraction 0.01 of 20 rows leaves no eval rows"),
    (["--npz", "ok.npz", "--inputs", "x", "--targets", "y", "--eval-fraction", "0.2", "--eval-npz", "ok.npz"],
     "give one of --eval-fraction or --eval-npz, not both"),
    (["--npz", "ok.npz", "--inputs", "x", "--targets", "y", "--seed", "3"], "--seed is the seed of --shuffle"),
    (["--npz", "ok.npz", "--inputs", "x", "--targets", "y", "--shuffle", "--eval-npz", "ok.npz"],
     "--shuffle only decides which rows --eval-fraction holds out"),
    (["--npz", "ok.npz", "--inputs", "x", "--targets", "y", "--num-classes", "0"],
     "--num-classes must be a positive integer below 2**63, got 0"),
    (["--npz", "missing.npz", "--inputs", "x", "--targets", "y"], "missing.npz: no such file"),
    (["--npz", "junk.npz", "--inputs", "x", "--targets", "y"], "junk.npz: not an .npz archive"),
    (["--inputs-npy", "junk.npy", "--targets-npy", "y.npy"], "junk.npy (--inputs-npy): not a .npy file of numbers"),
    (["--inputs-npy", "ok.npz", "--targets-npy", "y.npy"],
     "ok.npz (--inputs-npy) is an .npz archive; pass it as --npz"),
    (["--inputs-npy", "x.npy"], "--inputs-npy and --targets-npy go together"),
    (["--inputs-npy", "x.npy", "--targets-npy", "y.npy", "--npz", "ok.npz"],
     "give --npz or --inputs-npy/--targets-npy"),
    ([], "no data: give --npz FILE --inputs NAME --targets NAME, or --inputs-npy FILE --targets-npy FILE"),
    (["--npz", "flat.npz", "--inputs", "x", "--targets", "y", "--channels-last"],
     "flat.npz: array 'x' has shape [20, 16]; --channels-last needs [N, H, W, C]"),
    (["--npz", "ok.npz", "--inputs", "x", "--targets", "y", "--out", "."], "--out . is a directory"),
]


@pytest.mark.parametrize("args", [case[0] for case in BAD], ids=[" ".join(case[0]) or "nothing" for case in BAD])
def test_each_bad_input_is_one_line_naming_it(args, tmp_path, capsys, monkeypatch):
    _write_bad(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    expected = next(case[1:] for case in BAD if case[0] == args)
    if "--out" not in args:
        args = [*args, "--out", "out.h5"]
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("python -m hpcnet.data convert: error: ") and err.count("\n") == 1, err
    for part in expected:
        assert part in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temporary left


def _refused(args, capsys):
    """Run the converter on ``args`` (with ``--out out.h5``): its one-line error, after checking status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", *args, "--out", "out.h5"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.startswith("python -m hpcnet.data convert: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("shuffle", [[], ["--shuffle"]], ids=["in-order", "shuffled"])
@pytest.mark.parametrize("member,byte,bit", [("x", 0, 0), ("y", 7, 7)], ids=["input-mantissa", "label-sign"])
def test_a_flipped_bit_in_a_member_is_refused_naming_it(member, byte, bit, shuffle, tmp_path, capsys, monkeypatch):
    """One bit of a stored member flipped (numpy's np.load refuses it: "Bad CRC-32"): the CRC-32 the archive
    records is checked as the rows are converted, read in order or shuffled, in one or many blocks; a label
    turned negative by the flip is reported as the damage it is, not as a bad label."""
    monkeypatch.setattr(convert_module, "BLOCK_BYTES", 1)  # many blocks
    monkeypatch.chdir(tmp_path)
    x, y = _blobs(300)
    np.savez("d.npz", x=x, y=y)
    raw = bytearray((tmp_path / "d.npz").read_bytes())
    array = {"x": x, "y": y}[member]
    at = raw.index(array.tobytes()) + 5 * array[0].nbytes + byte  # row 5 of the member
    raw[at] ^= 1 << bit
    (tmp_path / "d.npz").write_bytes(bytes(raw))
    with pytest.raises(zipfile.BadZipFile, match="Bad CRC-32"):
        np.load("d.npz")[member]  # numpy's verdict on the same file
    err = _refused(["--npz", "d.npz", "--inputs", "x", "--targets", "y", *shuffle], capsys)
    assert f"d.npz: member '{member}.npy' (array '{member}') is damaged: CRC-32" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.npz"]


@pytest.mark.parametrize("member,old,new,says", [
    ("y", b"(300,)", b"(900,)", "its .npy header says [900] int64"),  # more rows: past the end of the file
    ("x", b"(300, 1, 4, 4)", b"(300, 1, 4, 5)", "its .npy header says [300, 1, 4, 5] float32"),  # wider rows
    ("x", b"(300, 1, 4, 4)", b"(100, 1, 4, 4)", "its .npy header says [100, 1, 4, 4] float32"),  # fewer rows
], ids=["more-rows", "wider-rows", "fewer-rows"])
def test_a_header_that_disagrees_with_the_member_size_is_refused(member, old, new, says, tmp_path, capsys,
                                                                monkeypatch):
    """An .npy header edited to claim more rows, wider rows or fewer rows than its member holds is refused
    before anything is mapped (it used to read into the next member, or past the end of the file)."""
    monkeypatch.chdir(tmp_path)
    x, y = _blobs(300)
    np.savez("d.npz", x=x, y=y)
    raw = (tmp_path / "d.npz").read_bytes()
    assert raw.count(old) == 1
    (tmp_path / "d.npz").write_bytes(raw.replace(old, new))
    err = _refused(["--npz", "d.npz", "--inputs", "x", "--targets", "y"], capsys)
    assert f"d.npz: member '{member}.npy' (array '{member}') is damaged: {says}" in err, err
    assert "bytes with the header), but the archive holds" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.npz"]


def test_compressed_members_are_checked_and_bounded(tmp_path, capsys, monkeypatch):
    """``np.savez_compressed`` members are read whole: up to a bound on what they inflate to, checked against
    the CRC-32 the archive records (a damaged deflate stream is a message naming the member, not zlib's
    traceback)."""
    from hpcnet.data import arrays as arrays_module

    monkeypatch.chdir(tmp_path)
    x, y = _blobs(300)
    np.savez_compressed("z.npz", x=x, y=y)
    raw = bytearray((tmp_path / "z.npz").read_bytes())
    with zipfile.ZipFile("z.npz") as z:
        info = z.getinfo("x.npy")
    raw[info.header_offset + 30 + len("x.npy") + info.compress_size // 2] ^= 0x10  # inside x's deflate stream
    (tmp_path / "bad.npz").write_bytes(bytes(raw))
    err = _refused(["--npz", "bad.npz", "--inputs", "x", "--targets", "y"], capsys)
    assert "bad.npz: member 'x.npy' (array 'x') is damaged" in err, err
    # A bomb: 64 MiB of zeros compress to a few KiB; a member may inflate to at most the bound.
    np.savez_compressed("bomb.npz", x=np.zeros((4096, 1, 64, 64), np.float32), y=np.zeros(4096, np.int64))
    assert (tmp_path / "bomb.npz").stat().st_size < 1 << 20
    monkeypatch.setattr(arrays_module, "whole_member_limit_bytes", lambda: 16 << 20)
    err = _refused(["--npz", "bomb.npz", "--inputs", "x", "--targets", "y"], capsys)
    assert ("bomb.npz: member 'x.npy' (array 'x') is compressed and inflates to 64.0 MiB, more than the "
            "16.0 MiB a compressed member may take") in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz", "bomb.npz", "z.npz"]
    monkeypatch.setattr(arrays_module, "whole_member_limit_bytes", lambda: 64 << 20)
    assert main(["convert", "--npz", "bomb.npz", "--inputs", "x", "--targets", "y", "--out", "b.h5",
                 "--num-classes", "2"]) == 0


def test_far_labels_need_num_classes_given(tmp_path):
    """A label of 1e9 makes ``num_classes`` 1,000,000,001 only when asked for with ``--num-classes``."""
    x, y = _blobs(20)
    y[7] = 10**9
    np.savez(tmp_path / "far.npz", x=x, y=y)
    with pytest.raises(DatasetError, match=r"holds 1000000000 \(row 7\); num_classes would be 1000000001"):
        convert(tmp_path / "a.h5", load_npz(tmp_path / "far.npz", "x", "y"))
    done = convert(tmp_path / "b.h5", load_npz(tmp_path / "far.npz", "x", "y"), num_classes=10**9 + 1)
    assert done.num_classes == 10**9 + 1 and _read_all(done.path, "train")[1][7] == 10**9


def test_existing_out_needs_force(tmp_path, capsys):
    x, y = _blobs(20)
    np.savez(tmp_path / "ok.npz", x=x, y=y)
    (tmp_path / "out.h5").write_text("someone's file")
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--npz", str(tmp_path / "ok.npz"), "--inputs", "x", "--targets", "y",
              "--out", str(tmp_path / "out.h5")])
    assert exit_info.value.code == 2
    assert f"--out {tmp_path / 'out.h5'} exists; pass --force to replace it" in capsys.readouterr().err
    assert (tmp_path / "out.h5").read_text() == "someone's file"


def test_python_api_raises_dataset_error(tmp_path):
    x, y = _blobs(20)
    np.savez(tmp_path / "ok.npz", x=x, y=y)
    with pytest.raises(DatasetError, match="--kind must be one of image, tokens"):
        convert(tmp_path / "o.h5", load_npz(tmp_path / "ok.npz", "x", "y"), kind="audio")
    with zipfile.ZipFile(tmp_path / "ok.npz") as z:
        assert sorted(z.namelist()) == ["x.npy", "y.npy"]


# ---------------------------------------------------------------------------
# the command line as a user runs it


def test_module_command_line_in_a_subprocess(tmp_path):
    x, y = _blobs(50)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    cmd = [sys.executable, "-m", "hpcnet.data", "convert", "--inputs-npy", "x.npy", "--targets-npy", "y.npy",
           "--out", "d.h5", "--eval-fraction", "0.2", "--shuffle", "--seed", "1"]
    env = clean_env(PYTHONPATH=str(ROOT))
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "wrote d.h5: image, num_classes 4, 40 train / 10 eval rows" in out.stdout
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert again.stderr == "python -m hpcnet.data convert: error: --out d.h5 exists; pass --force to replace it\n"
    # The converter starts without torch: h5.py imports it only to read.
    imports = subprocess.run([sys.executable, "-c", "import sys, hpcnet.data.convert, hpcnet.data.__main__; "
                              "print('torch' in sys.modules)"], env=env, capture_output=True, text=True, timeout=120)
    assert imports.stdout.strip() == "False", imports.stderr


@pytest.mark.launch
def test_readme_worked_example(launch, tmp_path):
    """The conversion example of docs/data.md runs as written: make arrays, convert, train."""
    page = (ROOT / "docs" / "data.md").read_text()
    section = page[page.index("### Converting your own arrays"):]
    script = re.search(r"```python\n# make_blobs.py\n(.*?)```", section, re.S).group(1)
    (tmp_path / "make_blobs.py").write_text(script)
    shell = re.search(r"```bash\n(mkdir -p data\n.*?)```", section, re.S).group(1)
    commands = [shlex.split(line) for line in shell.replace("\\\n", " ").splitlines() if line.strip()]
    assert [c[0] for c in commands] == ["mkdir", "python", "python", "mpirun"], commands
    (tmp_path / commands[0][-1]).mkdir()
    commands = commands[1:]
    env = clean_env(PYTHONPATH=str(ROOT))
    for command in commands[:2]:
        out = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=180)
        assert out.returncode == 0, out.stderr
    assert open_split(tmp_path / "data" / "blobs.h5", "eval").info == DatasetInfo("image", (1, 8, 8), 4)
    mpirun = commands[2]
    assert mpirun[:7] == ["mpirun", "-np", "2", "python", "-m", "mpi4py", "-m"] and mpirun[7] == "hpcnet.train"
    out = launch(2, *mpirun[8:], "train.steps=20", "train.eval_every=20", f"run.dir={tmp_path / 'runs'}",
                 env={"PYTHONPATH": str(ROOT)}, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "eval at step 20" in out.stderr and "1800 train / 200 eval samples" in out.stderr
